"""NATS messages the JetStream store sends per message (requests included: they go through publish), by
kind, for messages sent, delivered and acked between two agents of one mesh process (an in-process mesh
on a nats-server of its own, fsyncing every write). Counted at the store's connection; a request (a
message with a reply subject: a JetStream publish, a key-value write, a read) is a round trip, the rest
(notices on core NATS) are not waited for.

    .venv/bin/python bench/nats_requests.py --messages 200                  # one at a time
    .venv/bin/python bench/nats_requests.py --messages 640 --in-flight 64   # 64 sends at once, then one ack
    .venv/bin/python bench/nats_requests.py --messages 640 --in-flight 64 --pairs  # 64 pairs at once

With --in-flight K, K sends are made at once, their deliveries read and acked in one ack, and again: the
store's work amortised over batches of K, as at K in flight. With --pairs, the K sends at once are those
of K different senders to K different recipients (each acks its own), as in the many-agent benchmark:
nothing of one message's path is shared with another's but what the store shares across keys.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.nats import NatsNode  # noqa: E402
from inboxmesh.client.mesh import MeshClient  # noqa: E402
from services.config import MeshConfig, RunsConfig, StoreConfig  # noqa: E402
from services.server import Mesh  # noqa: E402
from services.store.jetstream.store import JetStreamStore  # noqa: E402

ADMIN = "bench-admin"


def kind(subject: str, ns: str) -> str:
    """What a subject is for, without the agent or key it names."""
    parts = subject.split(".")
    if subject.startswith("$KV."):
        return f"key-value write {parts[1].removeprefix(ns + '_')} {parts[2]}"
    if subject.startswith("$JS.API.DIRECT.GET."):
        stream = parts[4]
        return "direct get " + (stream.removeprefix(f"KV_{ns}_") if stream.startswith("KV_") else
                                stream.rsplit("_", 1)[-1].lower())
    if subject.startswith("$JS.API."):
        words = [p for p in parts[2:] if p in {"STREAM", "CONSUMER", "MSG", "DELETE", "INFO", "NEXT", "GET"}]
        return "JetStream API " + " ".join(words)
    if subject.startswith(f"{ns}."):
        return {"inbox": "publish inbox message", "ev": "publish event",
                "appended": "appended notice (core NATS, no answer)"}.get(parts[1], parts[1])
    return parts[0]


async def wait_delivery(stream) -> list[int]:
    async for response in stream:
        if response.WhichOneof("event") == "deliveries" and response.deliveries.messages:
            return [m.sequence for m in response.deliveries.messages]
    raise RuntimeError("the subscription ended")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--in-flight", type=int, default=1, help="sends made at once, then acked together")
    parser.add_argument("--pairs", action="store_true", help="the sends at once from as many senders to as many"
                                                             " recipients")
    args = parser.parse_args()
    k = max(1, args.in_flight)
    with tempfile.TemporaryDirectory(prefix="nats-requests-") as tmp, NatsNode(Path(tmp) / "nats") as node:
        store: StoreConfig = node.store_config(nats_namespace=f"b{uuid.uuid4().hex[:8]}", path=Path(tmp) / "mesh.db")
        config = replace(MeshConfig(port=0, store=store, admin_token=ADMIN), heartbeat_interval_s=60,
                         runs=RunsConfig(max_active_children=2 * k + 2))
        async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN) as client:
            assert isinstance(mesh.store, JetStreamStore)
            nc, ns = mesh.store.conn.nc, mesh.store.conn.ns
            lead = await client.register("lead")
            a, b = await lead.spawn("a"), await lead.spawn("b")
            stream = b.subscribe(max_in_flight=1).__aiter__()
            await a.send(b.agent_id, "warm-up")
            await b.ack(await wait_delivery(stream))
            await asyncio.sleep(1.5)  # the first delivery's deferred state write, the keeper's first pass
            if args.pairs:
                senders = [await lead.spawn(f"s{i}") for i in range(k)]
                sinks = [await lead.spawn(f"r{i}") for i in range(k)]
                sink_streams = [sink.subscribe(max_in_flight=1).__aiter__() for sink in sinks]
            elif k > 1:
                await stream.aclose()
                stream = b.subscribe(max_in_flight=k).__aiter__()
            sent: collections.Counter[str] = collections.Counter()
            asked: collections.Counter[str] = collections.Counter()
            publish = nc.publish

            async def counting(subject, payload=b"", reply="", headers=None):
                sent[kind(subject, ns)] += 1
                asked[kind(subject, ns)] += bool(reply)
                return await publish(subject, payload, reply=reply, headers=headers)

            nc.publish = counting
            started = time.monotonic()
            rounds = max(1, args.messages // k)
            for r in range(rounds):
                if args.pairs:
                    await asyncio.gather(*(s.send(t.agent_id, f"m{r}") for s, t in zip(senders, sinks)))
                    got = await asyncio.gather(*(wait_delivery(st) for st in sink_streams))
                    await asyncio.gather(*(t.ack(seqs) for t, seqs in zip(sinks, got)))
                    continue
                await asyncio.gather(*(a.send(b.agent_id, f"m{r}-{i}") for i in range(k)))
                delivered: list[int] = []
                while len(delivered) < k:
                    delivered += await wait_delivery(stream)
                await b.ack(delivered)
            took = time.monotonic() - started
            nc.publish = publish
    n = rounds * k
    how = ("one at a time" if k == 1 else f"{k} pairs at once, each acking its own" if args.pairs
           else f"{k} sent at once, then acked together")
    print(f"{n} messages, {how}, in {took:.2f} s; {sum(sent.values()) / n:.2f} NATS messages per message,"
          f" of which {sum(asked.values()) / n:.2f} requests (round trips); by kind, messages (requests):")
    for name, count in sent.most_common():
        print(f"  {count / n:6.2f} ({asked[name] / n:5.2f})  {name}")


if __name__ == "__main__":
    asyncio.run(main())
