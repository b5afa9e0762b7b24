"""Where one message's time goes on the JetStream store at 1 in flight: a mesh in this process (its store on
a nats-server with file storage, every write fsynced), a sender and a receiver of the Python client in
the same process, one message at a time (send, wait for its delivery, ack it). The store's steps are
timed where the mesh calls them (wrapped, not changed), and the client's three legs around them. The
mesh and the client share one event loop here, so the client's legs hold some of each other's gRPC work;
the store's steps are what the path waits for one after the other (docs/benchmarks.md, "The floor of
p50 at 1 in flight on JetStream").

    .venv/bin/python bench/jetstream_path.py [--messages 300]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.nats import NatsNode  # noqa: E402
from inboxmesh.client.mesh import MeshClient  # noqa: E402
from services.config import MeshConfig  # noqa: E402
from services.server import Mesh  # noqa: E402
from services.store.jetstream import kv  # noqa: E402
from services.store.jetstream.store import JetStreamStore  # noqa: E402

TOKEN = "bench-admin-token-0123456789abcdef"
STEPS = [  # (what the step is, the object, its method): in the order a message meets them
    ("send: the sender's frontier (read)", lambda s: s.inbox, "frontier"),
    ("send: the sender as NATS has it now (read)", lambda s: s.inbox.agents, "fresh"),
    ("send: the publish (write)", lambda s: s.inbox.messages, "publish_many"),
    ("send: settle, target and count (reads)", lambda s: s.inbox.messages, "settle"),
    ("send: idempotency records (write, with the settle; other key writes too)", lambda s: kv, "write_many"),
    ("events (write): a send's sent and stored", lambda s: s.inbox.events, "emit"),
    ("send: the whole append", lambda s: s.inbox, "append_many"),
    ("deliver: the messages (read)", lambda s: s.inbox.messages, "read"),
    ("deliver: which have state entries (read)", lambda s: s.inbox._has_state, "get"),
    ("deliver: the whole store part", lambda s: s.inbox, "next_deliveries"),
    ("ack: consumed states (write)", lambda s: s.inbox, "_consume_many"),
    ("ack: the delete (with the consumed event and the frontier)", lambda s: s.inbox.messages, "delete_many"),
    ("ack: the whole store part", lambda s: s.inbox, "ack_many"),
]


def _timed(owner: Any, name: str, into: list[float]) -> None:
    real: Callable[..., Any] = getattr(owner, name)

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await real(*args, **kwargs)
        finally:
            into.append((time.perf_counter() - started) * 1000)

    setattr(owner, name, wrapper)


async def run(messages: int, node: NatsNode, path: Path) -> dict[str, list[float]]:
    config = MeshConfig(port=0, store=node.store_config(nats_namespace="path", path=path / "mesh.db"),
                        admin_token=TOKEN, heartbeat_interval_s=60)
    times: dict[str, list[float]] = collections.defaultdict(list)
    async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=TOKEN) as client:
        store = mesh.store
        assert isinstance(store, JetStreamStore)
        lead = await client.register("lead")
        sender, receiver = await lead.spawn("sender"), await lead.spawn("receiver")
        for label, owner, name in STEPS:
            _timed(owner(store), name, times[label])
        delivered: asyncio.Queue[float] = asyncio.Queue()

        async def consume() -> None:
            async for response in receiver.subscribe(64):
                if response.WhichOneof("event") == "deliveries":
                    at = time.perf_counter()
                    await receiver.ack(m.sequence for m in response.deliveries.messages)
                    times["client: ack call"].append((time.perf_counter() - at) * 1000)
                    delivered.put_nowait(at)

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        for i in range(messages):
            started = time.perf_counter()
            await sender.send(receiver.agent_id, f"m{i}")
            receipt = time.perf_counter()
            at = await delivered.get()
            times["client: send -> receipt"].append((receipt - started) * 1000)
            times["client: receipt -> delivered"].append((at - receipt) * 1000)
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inboxmesh-path-") as tmp, NatsNode(Path(tmp) / "nats") as node:
        times = asyncio.run(run(args.messages, node, Path(tmp)))
    skip = args.messages // 10  # the first ones warm the caches
    print(f"{args.messages} messages one at a time, the first {skip} not counted; p50 ms of each step")
    for label, found in times.items():
        kept = found[skip:] or found
        print(f"  {label:<74} {statistics.median(kept):6.2f}  (n={len(kept)})")


if __name__ == "__main__":
    main()
