"""Meshes joined by a reference IOA network, for tests: one Node per mesh, started by start_node."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from inboxmesh.client.mesh import MeshClient
from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.ioa.v1 import network_pb2_grpc
from services.config import IoaConfig
from services.ioa_network.server import NetworkConfig, NetworkServer
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, make_config


class NodeClient:
    """A raw node on the IOA network (no relay): what it publishes and receives, frame by frame."""

    def __init__(self, channel, node_id, batches=False):
        self.call = network_pb2_grpc.IoaNetworkStub(channel).Connect()
        self.node_id = node_id
        self.batches = batches
        self.frames: asyncio.Queue = asyncio.Queue()
        """Frames as the network would send them one by one (a Batch's items taken apart)."""
        self.batch_sizes: list[int] = []
        """The number of items of each Batch frame received."""
        self.publish_id = 0

    async def connect(self):
        await self.call.write(net.NodeFrame(hello=net.Hello(node_id=self.node_id, batches=self.batches)))
        self.reader = asyncio.create_task(self._read())
        return await self.next("welcome")

    async def _read(self):
        try:
            async for frame in self.call:
                if frame.WhichOneof("frame") != "batch":
                    await self.frames.put(frame)
                    continue
                self.batch_sizes.append(len(frame.batch.items))
                for item in frame.batch.items:
                    which = item.WhichOneof("item")
                    await self.frames.put(net.NetworkFrame(**{which: getattr(item, which)}))
        except grpc.aio.AioRpcError:
            pass

    async def next(self, kind, timeout=5):
        async with asyncio.timeout(timeout):
            while True:
                frame = await self.frames.get()
                if frame.WhichOneof("frame") == kind:
                    return getattr(frame, kind)

    async def publish(self, ioa_id, *, to=None, space=None, text="", headers=None):
        self.publish_id += 1
        message = net.IoaMessage(ioa_message_id=ioa_id, text=text, headers=headers or {})
        getattr(message, "from").CopyFrom(net.Address(node="spoofed", agent="me"))  # `from` is a Python keyword
        if to:
            message.direct.CopyFrom(net.Address(node=to[0], agent=to[1]))
        if space:
            message.space = space
        await self.call.write(net.NodeFrame(publish=net.Publish(message=message, publish_id=self.publish_id)))
        return await self.next("result")

    def close(self):
        self.call.cancel()


class Node:
    def __init__(self, mesh, client):
        self.mesh, self.client = mesh, client

    @property
    def relay(self):
        return self.mesh.relay

    def address(self, agent) -> str:
        return f"ioa:{self.relay.node_id}/{agent.agent_id}"

    async def stop(self) -> None:
        await self.client.close()
        await self.mesh.stop(grace=0.2)


async def start_node(network, tmp_path, node_id, **ioa) -> Node:
    """A mesh in tmp_path/node_id on the network as node_id, its relay connected, with an admin client."""
    config = replace(make_config(tmp_path / node_id), ioa=IoaConfig(node_id=node_id, network=network.address,
                                                                     receipt_timeout_s=5, **ioa))
    mesh = Mesh(config)
    await mesh.start()
    node = Node(mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN))
    try:
        assert mesh.relay is not None, "an IOA config gives the mesh a relay"
        await mesh.relay.wait_connected(10)
    except BaseException:
        await node.stop()
        raise
    return node


@pytest.fixture
async def network():
    """A reference IOA network (recent history 20) for the test, without the grace after its start in which an
    unknown node counts as not connected yet (tests/test_ioa.py tests that grace): a node that does not exist
    is UNKNOWN_TARGET at once."""
    async with NetworkServer(NetworkConfig(history=20, reconnect_grace_s=0)) as server:
        yield server


@pytest.fixture
async def nodes(network, tmp_path):
    """Two meshes on `network`, nodes alpha and beta."""
    made = [await start_node(network, tmp_path, "alpha"), await start_node(network, tmp_path, "beta")]
    try:
        yield made
    finally:
        for node in made:
            await node.stop()
