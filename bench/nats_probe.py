"""What the engine alone does on this machine, with the settings the mesh runs it with: a nats-server
from harness/nats.py (file storage, `sync_interval: always`, so every write is fsynced before its
acknowledgement), driven by nats-py, the client the mesh uses. The limits the JetStream store's figures
are read against (docs/benchmarks.md, "Stores: SQLite and JetStream"):

- the latency of one request at a time, and this client's CPU a request: a key-value read, an fsynced
  publish, an fsynced key-value create, a batched direct get, and one publish through the store's own
  JetStreamConnection;
- the rate of fsynced publishes with 64 in flight, into one stream and spread over three streams (the
  store writes to three: the inboxes, the message states, the events);
- atomic batches (nats-server 2.12+) against the same messages published one at a time, pipelined,
  through the store's own JetStreamConnection: the latency of one call, and messages/s with 1 and 8 calls
  in flight, for 2, 8, 32, 128 and 400 messages a call (why the store batches only from BATCH_MIN messages
  up, and what a batch costs whatever its size);
- the capacity count of 64 inboxes at once: a batched direct get each against the JetStream API's stream
  info (why the store counts by direct get with one replica);
- fast batches (nats-server 2.14+, `allow_batched`: not atomic, the server acking every N messages and the
  commit) against atomic batches and pipelined publishes, raw nats-py on a stream of its own: why the store
  does not use them (on a one-replica file stream each message is still written and fsynced on its own,
  while an atomic batch is staged whole and written with one sync, after setting up a staging store of
  its own: nats-server's newBatchStore, a file store for each batch, the batch's floor).

    .venv/bin/python bench/nats_probe.py [--count 2000] [--lazy-fsync]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.nats import NatsNode  # noqa: E402

PAYLOAD = b"x" * 400
"""About the size of a small envelope or a message state."""


async def _latency(n: int, call: Any) -> dict[str, float]:
    """One call at a time, n of them: p50 and p99 of each, and this client's CPU a call (what a request one
    after the other costs the mesh's side of it: every turn of the event loop, nats-py's tasks, the system
    calls)."""
    took = []
    cpu = time.process_time()
    for i in range(n):
        started = time.perf_counter()
        await call(i)
        took.append((time.perf_counter() - started) * 1000)
    cpu_us = (time.process_time() - cpu) / n * 1e6
    took.sort()
    return {"p50_ms": round(statistics.median(took), 3), "p99_ms": round(took[int(len(took) * 0.99) - 1], 3),
            "client_cpu_us": round(cpu_us)}


async def _rate(js: Any, subjects: list[str], count: int, in_flight: int) -> float:
    """Fsynced publishes per second, `in_flight` at a time, round robin over `subjects`."""
    window = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with window:
            await js.publish(subjects[i % len(subjects)], PAYLOAD)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    return round(count / (time.perf_counter() - started), 1)


async def probe(url: str, count: int) -> dict[str, Any]:
    import nats
    from nats.js.api import KeyValueConfig, StorageType, StreamConfig

    nc = await nats.connect(url)
    js = nc.jetstream()
    try:
        for name in ("P1", "P2", "P3"):
            await js.add_stream(StreamConfig(name=name, subjects=[f"{name.lower()}.*"], storage=StorageType.FILE,
                                             allow_direct=True))
        bucket = await js.create_key_value(KeyValueConfig(bucket="probe", history=1, storage=StorageType.FILE))
        await bucket.put("read", PAYLOAD)
        serial = max(200, count // 10)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)

        async def direct_batch(_: int) -> None:
            await nc.publish("$JS.API.DIRECT.GET.P1", json.dumps({"seq": 1, "next_by_subj": "p1.a",
                                                                  "batch": 64}).encode(), reply=inbox)
            while True:
                msg = await sub.next_msg(timeout=5)
                if msg.headers and msg.headers.get("Status") in ("204", "404"):
                    return

        result: dict[str, Any] = {
            "kv get": await _latency(serial, lambda i: bucket.get("read")),
            "publish (fsynced)": await _latency(serial, lambda i: js.publish("p1.a", PAYLOAD)),
            "kv create (fsynced)": await _latency(serial, lambda i: bucket.create(f"k{i}", PAYLOAD)),
            "direct get, batch of 64": await _latency(serial, direct_batch),
        }
        await sub.unsubscribe()
        result["publishes/s, 64 in flight, 1 stream"] = await _rate(js, ["p1.a"], count, 64)
        result["publishes/s, 64 in flight, 3 streams"] = await _rate(js, ["p1.a", "p2.a", "p3.a"], count, 64)
        result["publishes/s, 1 in flight"] = await _rate(js, ["p1.a"], serial, 1)
        return result
    finally:
        await nc.close()


async def atomic_batches(node: NatsNode, data: Path, seconds: float = 2.0) -> dict[str, Any]:
    """Atomic batches against pipelined single publishes, with the store's own connection."""
    from services.store.jetstream.connection import JetStreamConnection

    conn = JetStreamConnection(node.store_config(nats_namespace="probe", path=data / "probe.db",
                                                 nats_accept_lazy_fsync=not node.durable))
    await conn.open()
    result: dict[str, Any] = {}
    try:
        async def rate(call: Any, size: int, in_flight: int) -> float:
            done = 0
            end = time.perf_counter() + seconds

            async def worker() -> None:
                nonlocal done
                while time.perf_counter() < end:
                    await call(done)
                    done += 1

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(in_flight)))
            return round(done * size / (time.perf_counter() - started))

        # one request, as the store makes most of its requests at 1 in flight (its own reply subscription)
        result["1 message through the store's connection (publish_each): one call"] = await _latency(
            1000, lambda i: conn.publish_each([("probe.ev.one.b", PAYLOAD, {})]))
        for size in (2, 8, 32, 128, 400):
            def messages(i: int, size: int = size) -> list[tuple[str, bytes, dict[str, str]]]:
                return [(f"probe.ev.a{i % 50}.b", PAYLOAD, {})] * size

            ways = {"atomic batch": lambda i, m=messages: conn.publish_batch(m(i)),
                    "one at a time, pipelined": lambda i, m=messages: conn.publish_each(m(i))}
            for way, call in ways.items():
                result[f"{size} messages, {way}: one call"] = await _latency(100, call)
                for in_flight in (1, 8):
                    result[f"{size} messages, {way}: msgs/s, {in_flight} calls in flight"] = \
                        await rate(call, size, in_flight)
    finally:
        await conn.close()
    return result


async def capacity_counts(node: NatsNode, data: Path, rounds: int = 30) -> dict[str, Any]:
    """The store's capacity count (InboxMessages.unconsumed) of 64 inboxes at once, in an inbox stream of 1,000
    inboxes holding 3 messages each: one batched direct get each (the inbox's first message and how many
    follow it; what the store does with one replica) against the JetStream API's stream info with a subject
    filter (what it does with more, and did always before): the time for all 64, and this client's CPU a
    count."""
    from services.store.jetstream.connection import JetStreamConnection

    conn = JetStreamConnection(node.store_config(nats_namespace="count", path=data / "count.db",
                                                 nats_accept_lazy_fsync=not node.durable))
    await conn.open()
    result: dict[str, Any] = {}
    try:
        subjects = [f"count.inbox.a{i}" for i in range(1000)]
        await asyncio.gather(*(conn.publish_each([(subject, PAYLOAD, {})] * 3) for subject in subjects))
        wanted = subjects[::15][:64]

        async def by_direct_get(subject: str) -> int:
            first, following = await conn.direct_batch(conn.inbox_stream, subject, 1, 1)
            return len(first) + following

        async def by_stream_info(subject: str) -> int:
            info = await conn.js.stream_info(conn.inbox_stream, subjects_filter=subject)
            return int((info.state.subjects or {}).get(subject, 0))

        for way, count in (("direct get", by_direct_get), ("stream info", by_stream_info)):
            took = []
            cpu = time.process_time()
            for _ in range(rounds):
                started = time.perf_counter()
                counts = await asyncio.gather(*(count(subject) for subject in wanted))
                took.append((time.perf_counter() - started) * 1000)
                assert counts == [3] * len(wanted), counts
            result[f"64 capacity counts at once, {way}"] = {
                "p50_ms": round(statistics.median(took), 2),
                "client_cpu_us_a_count": round((time.process_time() - cpu) / rounds / len(wanted) * 1e6)}
    finally:
        await conn.close()
    return result


async def fast_batches(url: str) -> dict[str, Any]:
    """One call's latency (median of 15) for a fast batch (gap mode "fail", committed by its last message,
    answered once all are stored), an atomic batch and pipelined publishes, of 2 to 128 messages."""
    import nats

    nc = await nats.connect(url)
    try:
        made = await nc.request("$JS.API.STREAM.CREATE.FB", json.dumps({
            "name": "FB", "subjects": ["fb.*"], "storage": "file", "allow_atomic": True,
            "allow_batched": True}).encode())
        if b'"error"' in made.data:
            return {"fast batches": f"not supported here: {made.data[:160]!r}"}
        answers: dict[str, asyncio.Future[dict[str, Any]]] = {}

        async def on_reply(msg: Any) -> None:  # flow acks ("type": "ack") come every N; the commit's pub ack
            data = json.loads(msg.data) if msg.data else {}
            waiting = answers.get(msg.subject.split(".")[1])
            if data.get("type") is None and waiting is not None and not waiting.done():
                waiting.set_result(data)

        await nc.subscribe("_FB.>", cb=on_reply)
        tokens = iter(range(1, 1 << 62))

        async def fast(n: int) -> None:
            batch = f"f{next(tokens)}"
            answers[batch] = waiting = asyncio.get_running_loop().create_future()
            for i in range(1, n + 1):  # reply: <prefix>.<id>.<flow>.<gap mode>.<sequence>.<operation>.$FI
                operation = 0 if i == 1 else 2 if i == n else 1  # start, append, commit
                await nc.publish("fb.a", PAYLOAD, reply=f"_FB.{batch}.{n}.fail.{i}.{operation}.$FI")
            try:
                answer = await asyncio.wait_for(waiting, 10)
            finally:
                answers.pop(batch, None)
            assert answer.get("count") == n, answer

        async def atomic(n: int) -> None:
            batch = f"a{next(tokens)}"
            for i in range(1, n):
                await nc.publish("fb.a", PAYLOAD, headers={"Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(i)})
            answer = await nc.request("fb.a", PAYLOAD, headers={"Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(n),
                                                                "Nats-Batch-Commit": "1"})
            assert json.loads(answer.data).get("count") == n, answer.data

        js = nc.jetstream()

        async def pipelined(n: int) -> None:
            await asyncio.gather(*(js.publish("fb.a", PAYLOAD) for _ in range(n)))

        result: dict[str, Any] = {}
        for size in (2, 32, 128):
            for way, call in (("fast batch", fast), ("atomic batch", atomic), ("pipelined", pipelined)):
                result[f"{size} messages, {way} (raw): one call"] = await _latency(15, lambda i, c=call, n=size: c(n))
        return result
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=2000, help="publishes per rate measurement")
    parser.add_argument("--lazy-fsync", action="store_true",
                        help="the server at its default (an fsync every two minutes) instead: what fsync costs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="natsprobe") as data, \
            NatsNode(Path(data) / "nats", durable=not args.lazy_fsync) as node:
        result = asyncio.run(probe(node.url, args.count))
        result.update(asyncio.run(atomic_batches(node, Path(data))))
        result.update(asyncio.run(capacity_counts(node, Path(data))))
        result.update(asyncio.run(fast_batches(node.url)))
    for name, value in result.items():
        print(f"{name:<40} {value}")


if __name__ == "__main__":
    main()
