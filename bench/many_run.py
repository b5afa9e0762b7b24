"""Many agents on one host: every setup of bench/many_bench.py, each once,
written into docs/benchmarks.md between the many-agent markers. bench/run.py
runs it after the two-agent comparison (so the ratios against the pair come
from the same run); alone:

    .venv/bin/python bench/many_run.py                 # the whole suite (about 13 minutes)
    .venv/bin/python bench/many_run.py --quick --no-doc  # N = 10 and 100, few messages (a smoke run)
    .venv/bin/python bench/many_run.py --only "sqlite N=1,000"   # setups whose name contains this
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

from bench.common import python_env, read_result  # noqa: E402
from bench.many_bench import ManyConfig  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- many:start -->", "<!-- many:end -->"

SUITE = [
    ManyConfig(agents=10, messages=3000, messages_1=300),
    ManyConfig(agents=1000, messages=3000, messages_1=300),
    ManyConfig(agents=1000, messages=3000, messages_1=300, uvloop=True),
    ManyConfig(agents=1000, streams="per-agent", messages=3000, messages_1=300),
    ManyConfig(agents=10_000, messages=2000, messages_1=200),
    ManyConfig(agents=10_000, streams="per-agent", messages=2000, messages_1=200),
    ManyConfig(agents=1000, store="jetstream", messages=1000, messages_1=150),
    ManyConfig(agents=10, host="agent_host", messages=1000, messages_1=150),
    ManyConfig(agents=1000, host="agent_host", messages=1000, messages_1=150),
]
"""Each setup once; message counts sized so that the suite takes about 13 minutes here."""
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
        what = "agent_host.Host (a stream per agent)"
    else:
        what = "one stream" if c["streams"] == "one" else "a stream per agent"
    return f"{c['store']}, {what}" + (", uvloop" if c["uvloop"] else "")


def _baseline(r: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The same setup at N = 10, else SQLite with one stream at N = 10."""
    def key(x: dict[str, Any]) -> tuple[Any, ...]:
        c = x["config"]
        return c["store"], c["streams"], c["uvloop"], c["host"]

    at_10 = [x for x in results if x["config"]["agents"] == 10]
    same = [x for x in at_10 if key(x) == key(r)]
    if same:
        return same[0]
    plain = [x for x in at_10 if key(x) == ("sqlite", "one", False, "client")]
    return plain[0] if plain else None


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else ""


def tables(results: list[dict[str, Any]], pair: dict[int, float]) -> str:
    throughput = [
        "| setup | N | msgs/s, 64 in flight | p50 / p99 ms | vs N = 10 | vs two-agent pair | CPU us/msg mesh / host"
        " | msgs/s, 1 in flight | p50 / p99 ms | vs two-agent pair |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
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
        throughput.append(
            f"| {_setup(r)} | {n:,} | {l64['msgs_per_s']:,.0f} | {l64['p50_ms']:,.1f} / {l64['p99_ms']:,.1f} |"
            f" {versus_10} | {_ratio(l64['msgs_per_s'], pair.get(64))} | {cpu_text} | {l1['msgs_per_s']:,.0f} |"
            f" {l1['p50_ms']:,.1f} / {l1['p99_ms']:,.1f} | {_ratio(l1['msgs_per_s'], pair.get(1))} |")
        wake, kb, idle = r["wake"], r["kb_per_agent"], r["idle_cpu_percent"]
        kb_text = (f"{kb['mesh']:.1f} | {kb['host']:.1f}" if n >= 1000 else "- | -")  # at N = 10 one page is noise
        attach = "(in registration)" if c["host"] == "agent_host" else f"{r['attach']['seconds']:.2f}"
        idle_text = f"{idle['mesh']:.1f} / {idle['host']:.1f}" + (f" (NATS {idle['nats']:.1f})" if "nats" in idle
                                                                   else "")
        agents.append(
            f"| {_setup(r)} | {n:,} | {r['registration']['agents_per_s']:,.0f} | {attach} |"
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
    parts = [f"{m64:,} messages at 64 in flight and {m1:,} at 1 for {', '.join(names)}"
             for (m64, m1), names in groups.items()]
    return (f"{'; '.join(parts)}; in each, {c['warmup']} warm-up messages, a {c['idle_seconds']:.0f} s quiet window"
            f" and {c['wakes']} wakes spread over {c['wake_seconds']:.0f} s")


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    if START not in doc or END not in doc:
        doc += f"\n## Many agents on one host\n\n{START}\n{END}\n"
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def run_suite(configs: list[ManyConfig], pair: dict[int, float], command: str, write: bool) -> list[dict[str, Any]]:
    """Run every setup, print its line, write the tables (unless not `write`); the results."""
    started = time.monotonic()
    results = []
    for config in configs:
        result = run_one(config)
        results.append(result)
        l64, wake = result["load_64"], result["wake"]
        print(f"many {config.name:<40} {l64['msgs_per_s']:>7,.0f} msgs/s p99 {l64['p99_ms']:,.0f} ms, wake p99"
              f" {wake['from_receipt_p99_ms']:.1f} ms, registration {result['registration']['agents_per_s']:,.0f}"
              f" agents/s", flush=True)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"Measured {stamp} by `{command}` (each setup once, {time.monotonic() - started:.0f} s in all; "
            f"{counts(results)}).\n\n" + tables(results, pair))
    print("\n" + text)
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / f"many-{datetime.now(UTC):%Y%m%dT%H%M%S}.json").write_text(json.dumps(
        {"pair_msgs_per_s": pair, "results": results, "configs": [asdict(c) for c in configs]}, indent=2))
    if write:
        write_doc(text)
        print(f"\nwritten to {DOC.relative_to(ROOT)}")
    return results



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 10 and 100 with few messages (a smoke run)")
    parser.add_argument("--only", default="", help="only the setups whose name contains this")
    parser.add_argument("--pair-64", type=float, default=0.0, help="the two-agent pair's msgs/s at 64 in flight")
    parser.add_argument("--pair-1", type=float, default=0.0, help="the two-agent pair's msgs/s at 1 in flight")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args()
    configs = [c for c in (QUICK if args.quick else SUITE) if args.only in c.name]
    pair = {k: v for k, v in ((64, args.pair_64), (1, args.pair_1)) if v}
    run_suite(configs, pair, "python bench/many_run.py" + (" --quick" if args.quick else ""), not args.no_doc)


if __name__ == "__main__":
    main()
