"""Meshes joined by a reference IOA network, for tests: one Node per mesh, started by start_node."""

from __future__ import annotations

from dataclasses import replace

import pytest

from inboxmesh.client.mesh import MeshClient
from services.config import IoaConfig
from services.ioa_network.server import NetworkConfig, NetworkServer
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, make_config


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
    """A reference IOA network (recent history 20) for the test."""
    async with NetworkServer(NetworkConfig(history=20)) as server:
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
