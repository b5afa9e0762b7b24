"""The mesh workload (bench/mesh_bench.py) on each store: embedded SQLite,
JetStream with one mesh process, JetStream with two (sender on one,
receiver on the other), and the two on a three-node NATS cluster (every
stream on all three nodes, each fsyncing every write; all on the same 2
cores), interleaved, three rounds, medians; written into docs/benchmarks.md
between the store markers.

    .venv/bin/python bench/store_run.py            # (bash scripts/bench.sh runs it too)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_section  # noqa: E402
from bench.run import DOC, METRICS, ROOT, run_one  # noqa: E402

START, END = "<!-- stores:start -->", "<!-- stores:end -->"
SETUPS = [
    ("sqlite", ("--store", "sqlite")),
    ("jetstream, 1 mesh process", ("--store", "jetstream")),
    ("jetstream, 2 mesh processes", ("--store", "jetstream", "--replicas", "2")),
    ("jetstream, 2 mesh processes, 3 NATS nodes", ("--store", "jetstream", "--replicas", "2", "--nats-nodes", "3")),
]
MESSAGES = {1: 300, 64: 2000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args()
    raw: dict[tuple[str, int], list[dict]] = {}
    started = time.monotonic()
    for round_no in range(1, args.rounds + 1):
        for concurrency in (1, 64):
            for name, extra in SETUPS:
                result = run_one("mesh_bench.py", Path(sys.executable), MESSAGES[concurrency], concurrency, extra)
                raw.setdefault((name, concurrency), []).append(result)
                print(f"round {round_no} {name:<44} c={concurrency:<3} {result['msgs_per_s']:>8,.0f} msgs/s "
                      f"p50 {result['p50_ms']:.2f} ms cpu {result['cpu_us_per_msg']:,.0f} us/msg", flush=True)
    lines = ["| store | in flight | msgs/s | p50 ms | p99 ms | CPU us/msg (all processes, NATS included) |"
             " vs one JetStream process |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for concurrency in (1, 64):
        one = statistics.median(r["msgs_per_s"] for r in raw[(SETUPS[1][0], concurrency)])
        for name, _ in SETUPS:
            m = {k: statistics.median(r[k] for r in raw[(name, concurrency)]) for k in METRICS}
            versus = f"{m['msgs_per_s'] / one:.2f}x" if name.startswith("jetstream") else ""
            lines.append(f"| {name} | {concurrency} | {m['msgs_per_s']:,.0f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} |"
                         f" {m['cpu_us_per_msg']:,.0f} | {versus} |")
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"Measured {stamp} by `.venv/bin/python bench/store_run.py` ({args.rounds} rounds, medians,"
            f" {time.monotonic() - started:.0f} s in all; nats-server with file storage on the same 2 cores).\n\n"
            + "\n".join(lines))
    print("\n" + text)
    if not args.no_doc:
        write_section(DOC, (START, END), text, heading="## Stores: SQLite and JetStream")
        print(f"written to {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
