"""What every benchmark in bench/ shares: the workload definition, clocks,
CPU accounting and the one-line JSON result format.

Workload: a sender agent and a receiver agent in two processes. The sender
sends N messages of PAYLOAD_BYTES each and keeps at most C of them in
flight, where "in flight" means sent but not yet consumed by the receiver.
Send-to-consume latency of a message is the time from the sender starting
to send it to the receiver having consumed it (for the mesh: the receiver's
ack came back CONSUMED, i.e. the consumption is on disk). Throughput is N
divided by the time from the first send to the last consumption.

Clocks: time.monotonic_ns() is CLOCK_MONOTONIC, one clock for every process
on the machine, so times taken in different processes can be subtracted.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

PAYLOAD_BYTES = 200


def now_ns() -> int:
    return time.monotonic_ns()


def payload(i: int) -> str:
    head = f"message {i} "
    return head + "x" * (PAYLOAD_BYTES - len(head))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summarize(system: str, concurrency: int, sent_ns: dict, consumed_ns: dict, cpu: dict[str, float]) -> dict:
    """The result line: throughput, latency percentiles and CPU per message."""
    missing = set(sent_ns) - set(consumed_ns)
    if missing:
        raise SystemExit(f"{system}: {len(missing)} messages were never consumed: {sorted(missing)[:10]}")
    latencies_ms = [(consumed_ns[k] - sent_ns[k]) / 1e6 for k in sent_ns]
    elapsed_s = (max(consumed_ns.values()) - min(sent_ns.values())) / 1e9
    n = len(sent_ns)
    total_cpu = sum(cpu.values())
    return {
        "system": system,
        "concurrency": concurrency,
        "messages": n,
        "elapsed_s": round(elapsed_s, 4),
        "msgs_per_s": round(n / elapsed_s, 1),
        "p50_ms": round(percentile(latencies_ms, 50), 3),
        "p99_ms": round(percentile(latencies_ms, 99), 3),
        "cpu_us_per_msg": round(total_cpu / n * 1e6, 1),
        "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
    }


def emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def read_result(output: str) -> dict:
    for line in output.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"no RESULT line in:\n{output[-3000:]}")


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


if __name__ == "__main__":
    sys.exit("bench/common.py is a library; run bench/run.py")


def write_section(doc: Path, markers: tuple[str, str], text: str, heading: str = "") -> None:
    """Put text between the two markers of doc (docs/benchmarks.md), keeping everything around them; when
    the markers are not there yet, they are added at the end (under heading, when given)."""
    start, end = markers
    content = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if start not in content or end not in content:
        content += (f"\n{heading}\n" if heading else "") + f"\n{start}\n{end}\n"
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{start}\n{text}\n{end}{tail}")

