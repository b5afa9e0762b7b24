"""Run the whole comparison: the bare grpc.aio echo (floor), AutoGen's gRPC
runtime and this mesh (local delivery, and through its IOA relay and the
reference IOA network), at concurrency 1 and 64, interleaved, three rounds;
report medians and ratios against AutoGen, and write them into
docs/benchmarks.md between the result markers. Then the many-agent suite
(bench/many_run.py, N = 10 to 10,000 agents on one host), with its ratios
against this run's two-agent pair, between the many-agent markers.

    bash scripts/bench.sh            # sets up .venv and .venv-autogen, then runs this
    python bench/run.py --rounds 1   # quicker, noisier
    python bench/run.py --many none  # the two-agent comparison only
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import many_run  # noqa: E402
from bench.common import python_env, read_result, write_section  # noqa: E402

AUTOGEN_PYTHON = ROOT / ".venv-autogen" / "bin" / "python"
DOC = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"

# (system, script, interpreter, messages at concurrency 1, at 64, extra arguments)
SYSTEMS = [
    ("grpc-echo", "echo_bench.py", Path(sys.executable), 10_000, 20_000, ()),
    ("autogen", "autogen_bench.py", AUTOGEN_PYTHON, 3_000, 6_000, ()),
    ("inboxmesh", "mesh_bench.py", Path(sys.executable), 3_000, 10_000, ()),
    ("inboxmesh-ioa", "mesh_bench.py", Path(sys.executable), 1_500, 3_000, ("--via-ioa",)),
    # two meshes (nodes near and far) across the network, as IOA is used: each does one relay's work
    ("inboxmesh-ioa-2meshes", "mesh_bench.py", Path(sys.executable), 1_500, 3_000, ("--via-ioa", "--replicas", "2")),
]
METRICS = ("msgs_per_s", "p50_ms", "p99_ms", "cpu_us_per_msg")


def run_one(script: str, interpreter: Path, messages: int, concurrency: int, extra: tuple[str, ...]) -> dict:
    done = subprocess.run(
        [str(interpreter), str(ROOT / "bench" / script), "--messages", str(messages), "--concurrency",
         str(concurrency), *extra],
        capture_output=True, text=True, env=python_env(), cwd=ROOT, timeout=900,
    )
    if done.returncode != 0:
        raise SystemExit(f"{script} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return read_result(done.stdout)


def medians(results: list[dict]) -> dict:
    return {m: round(statistics.median(r[m] for r in results), 3) for m in METRICS}


def table(summary: dict) -> str:
    lines = [
        "| system | in flight | msgs/s | p50 ms | p99 ms | CPU us/msg (all processes) | throughput vs AutoGen |"
        " vs local mesh |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for concurrency in (1, 64):
        base = summary[("autogen", concurrency)]["msgs_per_s"]
        local = summary[("inboxmesh", concurrency)]["msgs_per_s"]
        for system, *_ in SYSTEMS:
            m = summary[(system, concurrency)]
            versus_local = f"{m['msgs_per_s'] / local:.2f}x" if system.startswith("inboxmesh") else ""
            lines.append(
                f"| {system} | {concurrency} | {m['msgs_per_s']:,.0f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | "
                f"{m['cpu_us_per_msg']:,.0f} | {m['msgs_per_s'] / base:.2f}x | {versus_local} |"
            )
    return "\n".join(lines)


def write_doc(text: str) -> None:
    write_section(DOC, (START, END), text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every message count")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument("--many", choices=["full", "quick", "none"], default="full",
                        help="the many-agent suite afterwards: all of it (about 10 minutes), a smoke run, or none")
    args = parser.parse_args()
    if not AUTOGEN_PYTHON.exists():
        raise SystemExit("no .venv-autogen: run `bash scripts/bench.sh`, which creates it")
    raw: dict[tuple[str, int], list[dict]] = {}
    started = time.monotonic()
    for round_no in range(1, args.rounds + 1):
        for concurrency in (1, 64):
            for system, script, interpreter, n1, n64, extra in SYSTEMS:
                n = int((n1 if concurrency == 1 else n64) * args.scale)
                result = run_one(script, interpreter, n, concurrency, extra)
                raw.setdefault((system, concurrency), []).append(result)
                print(f"round {round_no} {system:<10} c={concurrency:<3} {result['msgs_per_s']:>9,.0f} msgs/s "
                      f"p50 {result['p50_ms']:.2f} ms p99 {result['p99_ms']:.2f} ms "
                      f"cpu {result['cpu_us_per_msg']:,.0f} us/msg", flush=True)
    summary = {key: medians(results) for key, results in raw.items()}
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"Measured {stamp} by `bash scripts/bench.sh` ({args.rounds} rounds, medians; "
        f"{platform.python_version()}, {platform.machine()}, "
        f"{len(__import__('os').sched_getaffinity(0))} cores; {time.monotonic() - started:.0f} s in all).\n\n"
        + table(summary)
    )
    print("\n" + text)
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / f"{datetime.now(UTC):%Y%m%dT%H%M%S}.json").write_text(
        json.dumps({f"{s}/{c}": r for (s, c), r in raw.items()}, indent=2))
    if not args.no_doc:
        write_doc(text)
        print(f"\nwritten to {DOC.relative_to(ROOT)}")
    if args.many != "none":
        pair = {c: summary[("inboxmesh", c)]["msgs_per_s"] for c in (1, 64)}
        configs = many_run.QUICK if args.many == "quick" else many_run.SUITE
        many_run.run_suite(configs, pair, "bash scripts/bench.sh", write=not args.no_doc)


if __name__ == "__main__":
    main()
