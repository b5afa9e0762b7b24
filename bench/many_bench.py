"""Many agents on one host: one measurement. A mesh process (`inboxmesh up
--no-demo --port 0`, SQLite with synchronous=FULL by default, or JetStream on
a nats-server with file storage) and one host process (bench/many_host.py)
that registers one parent and N children, attaches all N, and then:

1. warm-up: a few messages between random pairs;
2. idle: first until every process is quiet (under 3 % of a core over a
   second: what registration left is done, `settle_seconds`), then nothing
   for `--idle-seconds`: CPU of the mesh and of the host;
3. wake: single messages to random idle agents, one at a time, spread over
   `--wake-seconds` (a heartbeat of the mesh falls inside): from the
   accepted receipt to the agent's wake at the host;
4. load: `--messages` between random pairs with 64 in flight, then
   `--messages-1` with 1 in flight: msgs/s, send->consume p50/p99, CPU per
   message of each process.

RSS per agent is (RSS after attaching N - RSS before attaching) / N, for the
mesh and for the host (for --host agent_host, before and after registering,
which subscribes each agent). CPU and RSS come from /proc; the mesh's
fsyncs per message during the load phases from Linux perf, where it can
count them.

    python bench/many_bench.py --agents 1000 --streams one
    python bench/many_bench.py --agents 1000 --streams per-agent --uvloop
    python bench/many_bench.py --agents 1000 --store jetstream
    python bench/many_bench.py --agents 1000 --host agent_host
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, python_env  # noqa: E402
from bench.many_client import SEND_MODES, STREAM_MODES  # noqa: E402
from bench.procs import Child, proc_cpu_seconds  # noqa: E402

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class ManyConfig:
    agents: int
    streams: str = "one"
    """one: one InboxStream for all agents; per-agent: one each (what agent_host did until it shared one stream)."""
    store: str = "sqlite"
    sends: str = "stream"
    """stream: one SendStream for all senders; unary: the unary Send per message (bench/many_client.py)."""
    uvloop: bool = False
    """The mesh process and the host process on uvloop."""
    host: str = "client"
    """client: the client-level host (bench/many_host.py); agent_host: a real agent_host.Host."""
    messages: int = 2000
    """Messages with 64 in flight."""
    messages_1: int = 200
    """Messages with 1 in flight."""
    wakes: int = 200
    wake_seconds: float = 12.0
    idle_seconds: float = 20.0
    window: int = 64
    """Registrations (and, per agent, subscriptions waiting for ATTACHED) at once."""
    warmup: int = 100

    @property
    def name(self) -> str:
        host = "agent_host" if self.host == "agent_host" else f"{self.streams} stream" + (
            "s" if self.streams == "per-agent" else "")
        return (f"{self.store} N={self.agents:,} {host}{' unary sends' if self.sends == 'unary' else ''}"
                f"{' uvloop' if self.uvloop else ''}")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise SystemExit(f"no VmRSS for process {pid}")


def on_uvloop(pid: int) -> bool:
    """Whether uvloop's extension is loaded in the process."""
    return "uvloop" in Path(f"/proc/{pid}/maps").read_text()


def _python(config: ManyConfig) -> list[str]:
    return [sys.executable, "-m", "bench.with_uvloop"] if config.uvloop else [sys.executable, "-m"]


class Profiler:
    """py-spy sampling processes during one phase (collapsed stacks, one file per process), and
    `perf trace -s` summing up each one's system calls (count and time per call), where perf can."""

    def __init__(self, folder: Path | None, pids: dict[str, int], phase: str) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        spy = Path(sys.executable).parent / "py-spy"
        for name, pid in pids.items():
            if name != "nats":
                self.procs.append(subprocess.Popen(
                    [str(spy), "record", "--pid", str(pid), "--format", "raw", "--rate", "200", "--nonblocking",
                     "--output", str(folder / f"{phase}-{name}.txt")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            if shutil.which("perf") is not None:
                self.procs.append(subprocess.Popen(
                    ["perf", "trace", "-s", "-p", str(pid), "-o", str(folder / f"{phase}-{name}-syscalls.txt")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)  # py-spy attaches

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            proc.wait(timeout=30)


class FsyncCounter:
    """The fsync and fdatasync calls of one process during a phase (Linux perf's syscall tracepoints,
    cheap enough not to change what they count); None where perf cannot count them here."""

    EVENTS = "syscalls:sys_enter_fsync,syscalls:sys_enter_fdatasync"

    def __init__(self, pid: int, folder: str) -> None:
        self.output = Path(folder) / f"fsyncs-{pid}-{time.monotonic_ns()}.csv"
        self.proc: subprocess.Popen[bytes] | None = None
        if shutil.which("perf") is None:
            return
        self.proc = subprocess.Popen(["perf", "stat", "-x", ",", "-o", str(self.output), "-e", self.EVENTS, "-p",
                                      str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)  # perf attaches

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGINT)  # perf prints its counts and exits by the signal
        self.proc.wait(timeout=30)
        if not self.output.exists():
            return None
        total = 0
        for line in self.output.read_text().splitlines():
            if "sys_enter_f" not in line:
                continue
            count = line.split(",")[0]
            if count.isdigit():
                total += int(count)
            elif count != "<not counted>":  # not counted: the process made no syscall while counted
                return None
        return total


SETTLED_CPU = 0.03
"""A process is settled when it used less than this share of a core over the last second."""


def _settle(cpu: Callable[[], dict[str, float]], limit_s: float = 120.0) -> float:
    """Wait (at least a second, at most limit_s) until every process used under SETTLED_CPU of a core over
    one second; the seconds waited."""
    started = time.monotonic()
    while True:
        before = cpu()
        time.sleep(1.0)
        after = cpu()
        if all(after[k] - before[k] < SETTLED_CPU for k in before) or time.monotonic() - started > limit_s:
            return round(time.monotonic() - started, 1)


def run(config: ManyConfig, profile: Path | None = None) -> dict[str, Any]:
    """One measurement; with `profile`, py-spy samples the mesh and the host during the load phases
    (collapsed stacks in that folder: bench/profile_top.py sums them up)."""
    env = python_env()
    n = config.agents
    with tempfile.TemporaryDirectory(prefix="manybench") as data:
        children: list[Child] = []
        nats_node = None
        extra: list[str] = []
        if config.store == "jetstream":
            from harness.nats import NatsNode

            nats_node = NatsNode(Path(data) / "nats").start()
            extra += nats_node.mesh_args()
        extra += ["--max-active-children", str(n + 1)]  # the N children of one parent stay open all along
        try:
            mesh = Child("mesh", [*_python(config), "inboxmesh.cli.main", "--log-level", "warning", "up", "--port",
                                  "0", "--no-demo", "--data-dir", f"{data}/mesh", *extra], env)
            children.append(mesh)
            address = mesh.expect("inboxmesh listening on ").split()[0]
            host = Child("host", [sys.executable, str(BENCH / "many_host.py"), "--address", address, "--host",
                                  config.host, "--sends", config.sends, *(["--uvloop"] if config.uvloop else [])],
                         env)
            children.append(host)
            host.expect("ready", others=children)
            pids = {"mesh": mesh.pid, "host": host.pid}
            if nats_node is not None and nats_node.proc is not None:
                pids["nats"] = nats_node.proc.pid

            def cpu() -> dict[str, float]:
                return {k: proc_cpu_seconds(p) for k, p in pids.items()}

            def rss() -> dict[str, int]:
                return {k: rss_kb(p) for k, p in pids.items()}

            def ask(command: str, answer: str, timeout: float) -> dict[str, Any]:
                host.send(command)
                result: dict[str, Any] = json.loads(host.expect(answer + " ", timeout=timeout, others=children))
                return result

            result: dict[str, Any] = {"config": asdict(config), "name": config.name,
                                      "load_average_before": os.getloadavg()[0]}
            rss_before_register = rss()
            fsyncs = FsyncCounter(mesh.pid, data)
            result["registration"] = ask(f"register {n} {config.window}", "registered", 120 + n / 20)
            synced = fsyncs.stop()
            result["registration"]["agents_per_s"] = round(n / result["registration"]["seconds"], 1)
            result["registration"]["mesh_fsyncs_per_agent"] = round(synced / n, 3) if synced is not None else None
            rss_before = rss() if config.host == "client" else rss_before_register
            result["attach"] = ask(f"attach {config.streams} {config.window}", "attached", 120 + n / 20)
            rss_after = rss()
            result["rss_kb"] = {"before_register": rss_before_register, "before_attach": rss_before,
                                "after_attach": rss_after}
            result["kb_per_agent"] = {k: round((rss_after[k] - rss_before[k]) / n, 2) for k in ("mesh", "host")}
            ask(f"load {config.warmup} 16 w", "loaded", 600)

            # Before the quiet window, the mesh ends what registration left it: on JetStream its keeper rolls
            # forward every agent and run written (about 5 s at 30 % of a core at N = 1,000), which fell in the
            # idle window and the load phases before (2026-12-07), counted as their CPU.
            result["settle_seconds"] = _settle(cpu)
            before = cpu()
            time.sleep(config.idle_seconds)
            after = cpu()
            result["idle_cpu_percent"] = {k: round((after[k] - before[k]) / config.idle_seconds * 100, 2)
                                          for k in before}
            result["rss_kb"]["after_idle"] = rss()

            result["wake"] = ask(f"wake {config.wakes} {config.wake_seconds}", "woken", 600 + config.wake_seconds)
            for in_flight, count in ((64, config.messages), (1, config.messages_1)):
                profiler = Profiler(profile, pids, f"load{in_flight}")
                fsyncs = FsyncCounter(mesh.pid, data)
                before = cpu()
                phase = ask(f"load {count} {in_flight} m{in_flight}-", "loaded", 1800)
                after = cpu()
                synced = fsyncs.stop()
                profiler.stop()
                phase["mesh_fsyncs_per_msg"] = round(synced / count, 3) if synced is not None else None
                phase["cpu_us_per_msg"] = {k: round((after[k] - before[k]) / count * 1e6, 1) for k in before}
                result[f"load_{in_flight}"] = phase
            result["on_uvloop"] = {k: on_uvloop(pids[k]) for k in ("mesh", "host")}
            result["load_average_after"] = os.getloadavg()[0]
            return result
        finally:
            for child in reversed(children):
                child.close()
            if nats_node is not None:
                nats_node.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = ManyConfig(agents=0)
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--streams", choices=STREAM_MODES, default=defaults.streams,
                        help="one InboxStream for all agents, or one per agent (agent_host before it shared one)")
    parser.add_argument("--store", choices=["sqlite", "jetstream"], default=defaults.store)
    parser.add_argument("--sends", choices=SEND_MODES, default=defaults.sends,
                        help="one SendStream for all senders, or the unary Send per message")
    parser.add_argument("--uvloop", action="store_true", help="run the mesh and the host process on uvloop")
    parser.add_argument("--host", choices=["client", "agent_host"], default=defaults.host,
                        help="the client-level host, or a real agent_host.Host with a scripted model")
    parser.add_argument("--messages", type=int, default=defaults.messages, help="messages with 64 in flight")
    parser.add_argument("--messages-1", type=int, default=defaults.messages_1, help="messages with 1 in flight")
    parser.add_argument("--wakes", type=int, default=defaults.wakes)
    parser.add_argument("--wake-seconds", type=float, default=defaults.wake_seconds)
    parser.add_argument("--idle-seconds", type=float, default=defaults.idle_seconds)
    parser.add_argument("--window", type=int, default=defaults.window)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--profile", type=Path, help="sample the load phases with py-spy into this folder")
    args = parser.parse_args()
    config = ManyConfig(agents=args.agents, streams=args.streams, store=args.store, sends=args.sends,
                        uvloop=args.uvloop,
                        host=args.host, messages=args.messages, messages_1=args.messages_1, wakes=args.wakes,
                        wake_seconds=args.wake_seconds, idle_seconds=args.idle_seconds, window=args.window,
                        warmup=args.warmup)
    emit(run(config, args.profile))


if __name__ == "__main__":
    main()
