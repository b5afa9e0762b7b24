"""What the reference IOA network costs on its own, with no mesh: two raw nodes on an `inboxmesh
ioa-server` process, one publishing a message to the other, which answers with a message back (as a
receiving relay answers with a receipt), one at a time. The round trip is what any send through IOA
adds to a local send at 1 in flight, at least (the relay's own work, the far mesh's store, comes on top).

    .venv/bin/python bench/ioa_probe.py [--count 500]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import python_env  # noqa: E402
from bench.procs import Child  # noqa: E402
from inboxmesh.ioa.v1 import network_pb2 as net  # noqa: E402
from inboxmesh.ioa.v1 import network_pb2_grpc  # noqa: E402


async def _node(channel: grpc.aio.Channel, node_id: str):
    call = network_pb2_grpc.IoaNetworkStub(channel).Connect()
    await call.write(net.NodeFrame(hello=net.Hello(node_id=node_id)))
    async for frame in call:
        if frame.WhichOneof("frame") == "welcome":
            return call
    raise SystemExit(f"{node_id}: no welcome")


async def probe(address: str, count: int) -> list[float]:
    async with grpc.aio.insecure_channel(address) as channel:
        a, b = await _node(channel, "a"), await _node(channel, "b")

        async def answer() -> None:  # b: every message is answered with one back to a
            async for frame in b:
                if frame.WhichOneof("frame") == "message":
                    reply = net.IoaMessage(ioa_message_id="r" + frame.message.ioa_message_id,
                                           direct=net.Address(node="a", agent="x"))
                    await b.write(net.NodeFrame(publish=net.Publish(message=reply)))

        answering = asyncio.create_task(answer())
        took = []
        frames = a.__aiter__()
        for i in range(count):
            started = time.perf_counter()
            await a.write(net.NodeFrame(publish=net.Publish(
                message=net.IoaMessage(ioa_message_id=f"m{i}", direct=net.Address(node="b", agent="y"),
                                       text="x" * 200), publish_id=i)))
            while (await anext(frames)).WhichOneof("frame") != "message":
                pass  # a's publish result, then b's answer
            took.append((time.perf_counter() - started) * 1000)
        answering.cancel()
        a.cancel()
        b.cancel()
        return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=500)
    args = parser.parse_args()
    cli = [sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "warning"]
    network = Child("ioa-server", [*cli, "ioa-server", "--port", "0"], python_env())
    try:
        address = network.expect("ioa network listening on ")
        took = sorted(asyncio.run(probe(address, args.count))[20:])  # the first ones warm up
        print(f"message there and an answer back, one at a time ({len(took)}): p50 {statistics.median(took):.3f} ms,"
              f" p99 {took[int(len(took) * 0.99) - 1]:.3f} ms")
    finally:
        network.close()


if __name__ == "__main__":
    main()
