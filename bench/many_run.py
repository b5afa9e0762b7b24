"""Many agents on one host: every setup of bench/many_bench.py, each once,
written into docs/benchmarks.md between the many-agent markers. bench/run.py
runs it after the two-agent comparison (so the ratios against the pair come
from the same run); alone:

    .venv/bin/python bench/many_run.py                 # the whole suite (about 10 minutes here)
    .venv/bin/python bench/many_run.py --quick --no-doc  # N = 10 and 100, few messages (a smoke run)
    .venv/bin/python bench/many_run.py --only "sqlite N=1,000"   # setups whose name contains this
    .venv/bin/python bench/many_run.py --compare uvloop --rounds 3  # uvloop off and on alternately, N = 1,000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import python_env, read_result, write_section  # noqa: E402
from bench.many_bench import ManyConfig  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- many:start -->", "<!-- many:end -->"

SUITE = [
    ManyConfig(agents=10, messages=5000, messages_1=300),
    ManyConfig(agents=1000, messages=5000, messages_1=300),
    ManyConfig(agents=1000, messages=5000, messages_1=300, uvloop=True),
    ManyConfig(agents=1000, streams="per-agent", messages=5000, messages_1=300),
    ManyConfig(agents=1000, sends="unary", messages=2000, messages_1=200),
    ManyConfig(agents=10_000, messages=6000, messages_1=200),
    ManyConfig(agents=10_000, streams="per-agent", messages=3000, messages_1=200),
    ManyConfig(agents=1000, store="jetstream", messages=1000, messages_1=150),
    ManyConfig(agents=10, host="agent_host", messages=1000, messages_1=150),
    ManyConfig(agents=1000, host="agent_host", messages=1000, messages_1=150),
]
"""Each setup once (REPEATED ones three times); message counts sized so that the suite takes about 15 minutes
here."""
REPEATED = ("sqlite N=10 one stream", "sqlite N=10,000 one stream")
"""The setups the throughput targets compare: run RUNS times, the median run (by msgs/s at 64 in flight)
shown, with the spread. Single runs here move by 20-40 % from one to the next on a shared machine."""
RUNS = 3
QUICK = [replace(c, agents=min(c.agents, 100), messages=200, messages_1=30, wakes=20, wake_seconds=2.0,
                 idle_seconds=3.0, warmup=20) for c in SUITE if c.agents <= 1000]
"""A smoke run: the same setups at N = 10 and 100, few messages."""


def run_one(config: ManyConfig) -> dict[str, Any]:
    argv = [sys.executable, str(ROOT / "bench" / "many_bench.py")]
    for f in fields(ManyConfig):
        value = getattr(config, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    done = subprocess.run(argv, capture_output=True, text=True, env=python_env(), cwd=ROOT, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{config.name} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return read_result(done.stdout)


def _setup(r: dict[str, Any]) -> str:
    c = r["config"]
    if c["host"] == "agent_host":
        what = "agent_host.Host"
    else:
        what = "one stream" if c["streams"] == "one" else "a stream per agent"
    sends = ", unary sends" if c.get("sends") == "unary" else ""
    return f"{c['store']}, {what}{sends}" + (", uvloop" if c["uvloop"] else "")


def _baseline(r: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The same setup at N = 10, else SQLite with one stream at N = 10."""
    def key(x: dict[str, Any]) -> tuple[Any, ...]:
        c = x["config"]
        return c["store"], c["streams"], c["uvloop"], c["host"], c.get("sends", "stream")

    at_10 = [x for x in results if x["config"]["agents"] == 10]
    same = [x for x in at_10 if key(x) == key(r)]
    if same:
        return same[0]
    plain = [x for x in at_10 if key(x) == ("sqlite", "one", False, "client", "stream")]
    return plain[0] if plain else None


def _fsyncs(phase: dict[str, Any]) -> str:
    count = phase.get("mesh_fsyncs_per_msg")
    return "" if count is None else f"{count:.2f}"


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else ""


def _find(results: list[dict[str, Any]], agents: int, **config: Any) -> dict[str, Any] | None:
    plain = {"store": "sqlite", "streams": "one", "uvloop": False, "host": "client", "sends": "stream", **config}
    for r in results:
        if r["config"]["agents"] == agents and all(r["config"][k] == v for k, v in plain.items()):
            return r
    return None


def targets(results: list[dict[str, Any]]) -> str:
    """Issue 13's targets against this run: SQLite, one stream for all agents (the mechanics the
    targets are for), and where a row of a real agent_host.Host exists, its wake too."""
    at_10, at_10k = _find(results, 10), _find(results, 10_000)
    lines = ["| target (SQLite, every message on disk) | measured | met |", "| --- | --- | --- |"]

    def row(target: str, measured: str, met: bool) -> None:
        lines.append(f"| {target} | {measured} | {'yes' if met else 'no'} |")

    if at_10 and at_10k:
        ratio = at_10k["load_64"]["msgs_per_s"] / at_10["load_64"]["msgs_per_s"]
        row("N = 10,000: throughput at 64 in flight at least 0.8x N = 10's",
            f"{ratio:.2f}x ({at_10k['load_64']['msgs_per_s']:,.0f} against {at_10['load_64']['msgs_per_s']:,.0f}"
            " msgs/s)", ratio >= 0.8)
    if at_10k:
        rate = at_10k["load_64"]["msgs_per_s"]
        row("N = 10,000: at least 3,000 msgs/s with 64 in flight", f"{rate:,.0f} msgs/s", rate >= 3000)
    wakes = [(r["config"]["agents"], r) for r in results
             if _find(results, r["config"]["agents"]) is r]
    wakes += [(r["config"]["agents"], r) for r in results if r["config"]["host"] == "agent_host"]
    if wakes:
        shown = ", ".join(f"N = {n:,}{' (agent_host)' if r['config']['host'] == 'agent_host' else ''}:"
                          f" {r['wake']['from_receipt_p99_ms']:.1f}" for n, r in wakes)
        row("wake-up p99 under 10 ms at every N (accepted -> woken at the host)", f"{shown} ms",
            all(r["wake"]["from_receipt_p99_ms"] < 10 for _, r in wakes))
    if at_10k:
        idle = at_10k["idle_cpu_percent"]
        row("N = 10,000: idle CPU under 1 %", f"mesh {idle['mesh']:.1f} %, host {idle['host']:.1f} %",
            idle["mesh"] < 1 and idle["host"] < 1)
        kb = at_10k["kb_per_agent"]
        row("N = 10,000: mesh under 4 KB per idle agent", f"{kb['mesh']:.1f} KB", kb["mesh"] < 4)
        row("N = 10,000: host under 16 KB per idle agent (client-level host; agent_host below)",
            f"{kb['host']:.1f} KB", kb["host"] < 16)
        seconds = at_10k["registration"]["seconds"]
        row("registration of 10,000 children under 5 s", f"{seconds:.1f} s", seconds < 5)
    hosted = _find(results, 1000, host="agent_host")
    if hosted:
        kb = hosted["kb_per_agent"]["host"]
        row("agent_host.Host: under 16 KB per idle agent (N = 1,000, its system prompt included)", f"{kb:.1f} KB",
            kb < 16)
    return "\n".join(lines)


def tables(results: list[dict[str, Any]], pair: dict[int, float]) -> str:
    throughput = [
        "| setup | N | msgs/s, 64 in flight | p50 / p99 ms | stage p50s ms: send -> receipt / -> woken / woken ->"
        " consumed | vs N = 10 | vs two-agent pair | CPU us/msg mesh / host"
        " | mesh fsyncs/msg | msgs/s, 1 in flight | p50 / p99 ms | vs two-agent pair | mesh fsyncs/msg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    agents = [
        "| setup | N | registration, agents/s | attach, s | wake p50 / p99 ms (receipt -> woken) | wake p50 / p99 ms"
        " (send start -> woken) | mesh KB/agent | host KB/agent | idle CPU mesh / host, % of a core |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        c, base = r["config"], _baseline(r, results)
        n = c["agents"]
        l64, l1 = r["load_64"], r["load_1"]
        cpu = l64["cpu_us_per_msg"]
        cpu_text = f"{cpu['mesh']:,.0f} / {cpu['host']:,.0f}" + (f" (+ NATS {cpu['nats']:,.0f})" if "nats" in cpu
                                                                   else "")
        versus_10 = _ratio(l64["msgs_per_s"], base["load_64"]["msgs_per_s"]) if base and base is not r else ""
        spread = r.get("runs_msgs_per_s")
        rate = f"{l64['msgs_per_s']:,.0f}" + (f" (median of {len(spread)}: {min(spread):,.0f}-{max(spread):,.0f})"
                                               if spread else "")
        stages = l64.get("stages_p50_ms")
        stage_text = (f"{stages['send_to_receipt']:.1f} / {stages['send_to_woken']:.1f} /"
                      f" {stages['woken_to_consumed']:.1f}" if stages else "")
        throughput.append(
            f"| {_setup(r)} | {n:,} | {rate} | {l64['p50_ms']:,.1f} / {l64['p99_ms']:,.1f} | {stage_text} |"
            f" {versus_10} | {_ratio(l64['msgs_per_s'], pair.get(64))} | {cpu_text} | {_fsyncs(l64)} |"
            f" {l1['msgs_per_s']:,.0f} | {l1['p50_ms']:,.1f} / {l1['p99_ms']:,.1f} |"
            f" {_ratio(l1['msgs_per_s'], pair.get(1))} | {_fsyncs(l1)} |")
        wake, kb, idle = r["wake"], r["kb_per_agent"], r["idle_cpu_percent"]
        kb_text = (f"{kb['mesh']:.1f} | {kb['host']:.1f}" if n >= 1000 else "- | -")  # at N = 10 one page is noise
        attach = "(in registration)" if c["host"] == "agent_host" else f"{r['attach']['seconds']:.2f}"
        idle_text = f"{idle['mesh']:.1f} / {idle['host']:.1f}" + (f" (NATS {idle['nats']:.1f})" if "nats" in idle
                                                                   else "")
        per_registration = r["registration"].get("mesh_fsyncs_per_agent")
        registration = f"{r['registration']['agents_per_s']:,.0f}" + (
            f" ({per_registration:.2f} fsyncs each)" if per_registration is not None else "")
        agents.append(
            f"| {_setup(r)} | {n:,} | {registration} | {attach} |"
            f" {wake['from_receipt_p50_ms']:.2f} / {wake['from_receipt_p99_ms']:.2f} |"
            f" {wake['from_send_p50_ms']:.2f} / {wake['from_send_p99_ms']:.2f} | {kb_text} | {idle_text} |")
    return "\n".join(throughput) + "\n\n" + "\n".join(agents)


def counts(results: list[dict[str, Any]]) -> str:
    """The message counts, once per distinct pair of counts, with the setups that used it."""
    groups: dict[tuple[int, int], list[str]] = {}
    for r in results:
        c = r["config"]
        groups.setdefault((c["messages"], c["messages_1"]), []).append(f"{_setup(r)} at N = {c['agents']:,}")
    c = results[0]["config"]
    parts = [f"{m64:,} messages at 64 in flight and {m1:,} at 1 ({'; '.join(names)})"
             for (m64, m1), names in groups.items()]
    return (f"{', '.join(parts)}; in each, {c['warmup']} warm-up messages, a {c['idle_seconds']:.0f} s quiet window"
            f" and {c['wakes']} wakes spread over {c['wake_seconds']:.0f} s")


def write_doc(text: str) -> None:
    write_section(DOC, (START, END), text, heading="## Many agents on one host")


def commit() -> str:
    """The commit measured (short hash, '+' when the work tree differs from it), or '' outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=ROOT, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+" if dirty else "")


def report(run: dict[str, Any]) -> str:
    """The text between the markers, from a run as saved in bench/results/many-*.json."""
    results = run["results"]
    loads = [r[k] for r in results for k in ("load_average_before", "load_average_after") if k in r]
    busy = (f" The machine's 1-minute load average (this benchmark's processes included) went from"
            f" {min(loads):.1f} to {max(loads):.1f} during the run (2 cores, shared with other work)." if loads else "")
    at = f" at commit {run['commit']}" if run.get("commit") else ""
    repeated = " (the setups at N = 10 and 10,000 with one stream three times, the median run shown)" if any(
        "runs_msgs_per_s" in r for r in results) else ""
    return (f"Measured {run['stamp']}{at} by `{run['command']}` (each setup once{repeated},"
            f" {run['elapsed_s']:.0f} s in all;"
            f" {counts(results)}).{busy}\n\n"
            + tables(results, {int(k): v for k, v in run["pair_msgs_per_s"].items()})
            + "\n\nAgainst the targets of issue 13:\n\n" + targets(results))


def run_suite(configs: list[ManyConfig], pair: dict[int, float], command: str, write: bool) -> list[dict[str, Any]]:
    """Run every setup, print its line, write the tables (unless not `write`); the results."""
    started = time.monotonic()
    measured = commit()
    results = []
    for config in configs:
        runs = [run_one(config) for _ in range(RUNS if config.name in REPEATED else 1)]
        result = sorted(runs, key=lambda r: r["load_64"]["msgs_per_s"])[len(runs) // 2]
        if len(runs) > 1:
            result["runs_msgs_per_s"] = [r["load_64"]["msgs_per_s"] for r in runs]
        results.append(result)
        l64, wake = result["load_64"], result["wake"]
        print(f"many {config.name:<40} {l64['msgs_per_s']:>7,.0f} msgs/s p99 {l64['p99_ms']:,.0f} ms, wake p99"
              f" {wake['from_receipt_p99_ms']:.1f} ms, registration {result['registration']['agents_per_s']:,.0f}"
              f" agents/s", flush=True)
    run = {"stamp": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": measured, "command": command,
           "elapsed_s": round(time.monotonic() - started), "pair_msgs_per_s": pair, "results": results,
           "configs": [asdict(c) for c in configs]}
    text = report(run)
    print("\n" + text)
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / f"many-{datetime.now(UTC):%Y%m%dT%H%M%S}.json").write_text(json.dumps(run, indent=2))
    if write:
        write_doc(text)
        print(f"\nwritten to {DOC.relative_to(ROOT)}")
    return results


def compare(field: str, rounds: int, agents: int) -> None:
    """A/B of uvloop (the one setting `field` names so far) at N = `agents`: off and on alternately, `rounds`
    times, shorter phases (no quiet window to speak of); medians printed, nothing written."""
    import statistics

    base = ManyConfig(agents=agents, messages=3000, messages_1=200, wakes=50, wake_seconds=3.0, idle_seconds=2.0)
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for round_no in range(1, rounds + 1):
        for value in (False, True):
            result = run_one(replace(base, uvloop=value))  # the one setting --compare offers
            runs[value].append(result)
            print(f"round {round_no} {field}={value!s:<5} {result['load_64']['msgs_per_s']:>7,.0f} msgs/s at 64,"
                  f" {result['load_1']['msgs_per_s']:>5,.0f} at 1, mesh"
                  f" {result['load_64']['cpu_us_per_msg']['mesh']:,.0f} us/msg", flush=True)
    for value, results in runs.items():
        def median(path: tuple[str, ...], rs: list[dict[str, Any]] = results) -> float:
            values = []
            for r in rs:
                item: Any = r
                for key in path:
                    item = item[key]
                values.append(item)
            return statistics.median(values)

        print(f"{field}={value}: median of {len(results)}: {median(('load_64', 'msgs_per_s')):,.0f} msgs/s at 64"
              f" (p99 {median(('load_64', 'p99_ms')):,.0f} ms, CPU us/msg mesh"
              f" {median(('load_64', 'cpu_us_per_msg', 'mesh')):,.0f} host"
              f" {median(('load_64', 'cpu_us_per_msg', 'host')):,.0f}), {median(('load_1', 'msgs_per_s')):,.0f}"
              f" msgs/s at 1 (p50 {median(('load_1', 'p50_ms')):.2f} ms), wake p99"
              f" {median(('wake', 'from_receipt_p99_ms')):.2f} ms, registration"
              f" {median(('registration', 'agents_per_s')):,.0f} agents/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 10 and 100 with few messages (a smoke run)")
    parser.add_argument("--only", default="", help="only the setups whose name contains this")
    parser.add_argument("--pair-64", type=float, default=0.0, help="the two-agent pair's msgs/s at 64 in flight")
    parser.add_argument("--pair-1", type=float, default=0.0, help="the two-agent pair's msgs/s at 1 in flight")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument("--compare", choices=["uvloop"], help="instead: an A/B of this setting, printed only")
    parser.add_argument("--from-json", type=Path, help="instead: write the text of a saved run (bench/results/)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --compare")
    parser.add_argument("--agents", type=int, default=1000, help="N of --compare")
    args = parser.parse_args()
    if args.compare:
        compare(args.compare, args.rounds, args.agents)
        return
    if args.from_json:
        text = report(json.loads(args.from_json.read_text()))
        print(text)
        if not args.no_doc:
            write_doc(text)
        return
    configs = [c for c in (QUICK if args.quick else SUITE) if args.only in c.name]
    pair = {k: v for k, v in ((64, args.pair_64), (1, args.pair_1)) if v}
    run_suite(configs, pair, "python bench/many_run.py" + (" --quick" if args.quick else ""), not args.no_doc)


if __name__ == "__main__":
    main()
