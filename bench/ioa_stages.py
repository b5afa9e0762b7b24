"""Where a message's time goes at 1 in flight, local and across IOA (issue 15's 1-in-flight target): two
SQLite meshes (nodes `near` and `far`) on an `inboxmesh ioa-server`, each its own process, and a client
process that sends one message at a time and takes it with an acking InboxStream before the next. Each
message's stages come from both meshes' event records (one wall clock: every process is on this machine)
and the client's own times; each process's CPU over the measured messages (utime + stime), in us a
message, says how much work the path costs beside how long it takes. Local: a sender and a receiver on
`far`; across IOA: the sender on `near`, the receiver on `far`. Rounds alternate local and IOA; the
first WARMUP messages of each are left out.

    .venv/bin/python bench/ioa_stages.py [--messages 300] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cpu_seconds, python_env  # noqa: E402
from bench.procs import Child  # noqa: E402
from inboxmesh.client.mesh import MeshClient  # noqa: E402
from inboxmesh.client.stream import InboxStream  # noqa: E402
from inboxmesh.events.v1 import events_pb2 as ev  # noqa: E402

WARMUP = 50
LOCAL = ["MESSAGE_SENT", "MESSAGE_DELIVERED", "MESSAGE_CONSUMED"]
IOA = ["IOA_PUBLISHED", "IOA_RECEIVED", *LOCAL]
"""The recorded stages, in order; `MESSAGE_SENT` across IOA is the far mesh's (the message stored there)."""


def _now_us() -> int:
    return time.time_ns() // 1000


async def _events(client: MeshClient) -> list[ev.Event]:
    found: list[ev.Event] = []
    after = 0
    while True:
        page = await client.admin_events(after=after, limit=1000)
        found += page
        if len(page) < 1000:
            return found
        after = page[-1].event_id


async def _round(sending: str, receiving: str, token: dict[str, str], ioa: bool, tag: str, count: int,
                 cpu: Callable[[], dict[str, float]]) -> tuple[list[dict[str, int]], dict[str, int]]:
    """Per measured message: when it was sent and its ack answered (client), and each stage's at_us; and
    each process's CPU a measured message, in us."""
    async with MeshClient(sending, admin_token=token[sending]) as near, \
            MeshClient(receiving, admin_token=token[receiving]) as far:
        lead = await near.register(f"lead-{tag}")
        sender = await lead.spawn("sender")
        receiver = await (await far.register(f"lead-{tag}-far") if ioa else lead).spawn("receiver")
        target = f"ioa:far/{receiver.agent_id}" if ioa else receiver.agent_id
        stream = InboxStream([receiver])
        taken: asyncio.Queue[tuple[str, int]] = asyncio.Queue()

        async def take() -> None:
            async for item in stream:
                if item.messages:
                    await stream.consume(receiver.agent_id, item.messages)
                    for message in item.messages:  # an IOA message's id is `near:<sender>:<id>`
                        taken.put_nowait((message.message_id.rpartition(":")[2], _now_us()))

        taking = asyncio.create_task(take())
        times: dict[str, dict[str, int]] = {}
        try:
            for i in range(WARMUP + count):
                if i == WARMUP:
                    before = cpu()
                message_id = f"{tag}-{i}"
                times[message_id] = {"send": _now_us()}
                await sender.send(target, "x" * 200, message_id=message_id)
                while True:
                    got, at = await taken.get()
                    times.setdefault(got, {})["acked"] = at
                    if got == message_id:
                        break
            after = cpu()
        finally:
            stream.stop()
            taking.cancel()
        await asyncio.sleep(0.2)  # the lazily recorded events (IOA_PUBLISHED) are committed by then
        for client in (far, near):  # the far mesh's MESSAGE_SENT first: the near one's is the receipt's
            for event in await _events(client):
                stage = times.get(event.message_id.rpartition(":")[2])
                if stage is not None:
                    stage.setdefault(ev.EventKind.Name(event.kind).removeprefix("EVENT_KIND_"), event.at_us)
        used = {name: round((after[name] - before[name]) * 1e6 / count) for name in after}
        used["all"] = sum(used.values())
        return [times[f"{tag}-{i}"] for i in range(WARMUP, WARMUP + count)], used


def _p50_ms(values: list[int]) -> float:
    return round(statistics.median(values) / 1000, 3)


def stages(rows: list[dict[str, int]], chain: list[str]) -> dict[str, Any]:
    """p50 of the whole cycle (send -> ack answered) and of each step of the chain between."""
    steps = ["send", *chain, "acked"]
    found: dict[str, Any] = {"cycle_ms": _p50_ms([r["acked"] - r["send"] for r in rows])}
    for before, after in zip(steps, steps[1:]):
        found[f"{before} -> {after}"] = _p50_ms([r[after] - r[before] for r in rows if before in r and after in r])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cli = [sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "warning"]
    env = python_env()
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="ioastages") as data:
        try:
            network = Child("ioa-server", [*cli, "ioa-server", "--port", "0"], env)
            children.append(network)
            address = network.expect("ioa network listening on ")
            meshes = {}
            for node in ("near", "far"):
                mesh = Child(node, [*cli, "up", "--port", "0", "--no-demo", "--data-dir", f"{data}/{node}",
                                    "--ioa-network", address, "--node-id", node], env)
                children.append(mesh)
                meshes[node] = mesh.expect("inboxmesh listening on ").split()[0]
            token = {at: json.loads(Path(f"{data}/{node}/mesh.json").read_text())["admin_token"]
                     for node, at in meshes.items()}

            def cpu() -> dict[str, float]:
                return {"client": cpu_seconds(), **{child.name: child.cpu() for child in children}}

            for k in range(args.rounds):
                local, local_cpu = asyncio.run(_round(meshes["far"], meshes["far"], token, False, f"l{k}",
                                                      args.messages, cpu))
                across, ioa_cpu = asyncio.run(_round(meshes["near"], meshes["far"], token, True, f"i{k}",
                                                     args.messages, cpu))
                local_stages, ioa_stages = stages(local, LOCAL), stages(across, IOA)
                print(json.dumps({"round": k, "local": local_stages, "ioa": ioa_stages,
                                  "ratio": round(local_stages["cycle_ms"] / ioa_stages["cycle_ms"], 2),
                                  "cpu_us_a_message": {"local": local_cpu, "ioa": ioa_cpu}}), flush=True)
        finally:
            for child in reversed(children):
                child.close()


if __name__ == "__main__":
    main()
