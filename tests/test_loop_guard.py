"""The loop guard is the mesh's rule, not the clients': agents written against the generated stubs alone
(no project client code; they never copy hop_count or trail) that answer each other forever are refused at
the documented limit, on one mesh and across two meshes on an IOA network."""

from collections.abc import AsyncIterator

import grpc
import pytest

from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.inbox.v1 import inbox_pb2_grpc
from inboxmesh.registry.v1 import registry_pb2 as reg
from inboxmesh.registry.v1 import registry_pb2_grpc
from services.config import InboxLimits
from services.ioa_network.server import NetworkConfig, NetworkServer
from services.server import Mesh
from tests.fixtures import make_config
from tests.ioa_nodes import start_node

VISITS = InboxLimits().max_trail_visits
TIMEOUT = 10


class RawAgent:
    """One agent over the raw contract: a Subscribe stream for deliveries, unary Ack and Send."""

    def __init__(self, channel: grpc.aio.Channel, agent: reg.Agent, credential: str):
        self.agent, self.credential = agent, credential
        self.auth = (("authorization", f"Bearer {credential}"),)
        self.inbox = inbox_pb2_grpc.InboxServiceStub(channel)
        self.registry = registry_pb2_grpc.RegistryServiceStub(channel)
        self._deliveries: AsyncIterator[pb.SubscribeResponse] | None = None
        self._pending: list[env_pb.Envelope] = []
        self._count = 0

    @classmethod
    async def register(cls, channel, name: str, parent: "RawAgent | None" = None) -> "RawAgent":
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        request = reg.RegisterAgentRequest(name=name)
        metadata: tuple[tuple[str, str], ...] = ()
        if parent is not None:
            request.parent_id, request.mode = parent.agent.agent_id, reg.AGENT_MODE_ASYNC
            metadata = parent.auth
        response = await stub.RegisterAgent(request, metadata=metadata, timeout=TIMEOUT)
        return cls(channel, response.agent, response.credential)

    @property
    def agent_id(self) -> str:
        return self.agent.agent_id

    async def send(self, recipient: str, text: str, in_reply_to: str = "") -> pb.Receipt:
        self._count += 1
        env = env_pb.Envelope(message_id=f"{self.agent.name}-{self._count}", recipient=recipient,
                              content=env_pb.Content(text=text))
        if in_reply_to:
            env.kind, env.in_reply_to = env_pb.MESSAGE_KIND_REPLY, in_reply_to
        response = await self.inbox.Send(pb.SendRequest(messages=[env]), metadata=self.auth, timeout=TIMEOUT)
        return response.receipts[0]

    async def take(self) -> env_pb.Envelope:
        """The next delivered message, consumed (acked) before it is returned."""
        if self._deliveries is None:
            self._deliveries = self.inbox.Subscribe(pb.SubscribeRequest(credentials=[self.credential]),
                                                    timeout=60).__aiter__()
        while not self._pending:
            response = await anext(self._deliveries)
            if response.WhichOneof("event") == "deliveries":
                self._pending += response.deliveries.messages
        env = self._pending.pop(0)
        acked = await self.inbox.Ack(pb.AckRequest(sequences=[env.sequence]), metadata=self.auth, timeout=TIMEOUT)
        assert [r.status for r in acked.results] == [pb.ACK_STATUS_CONSUMED]
        return env


async def answer_forever(first: RawAgent, first_target: str, agents: dict[str, RawAgent],
                         forward: dict[str, str] | None = None) -> list[pb.Receipt]:
    """first sends to first_target; then whoever receives consumes and answers (a reply to the sender, or
    a plain message to forward[agent_id] when given), until the mesh refuses. Returns every receipt."""
    receipts = [await first.send(first_target, "ping")]
    holder = agents_key(receipts[0].recipient, agents)
    for _ in range(200):
        if receipts[-1].status != pb.RECEIPT_STATUS_ACCEPTED:
            break
        agent = agents[holder]
        got = await agent.take()
        if forward is None:
            receipts.append(await agent.send(got.sender, "pong", in_reply_to=got.message_id))
        else:
            receipts.append(await agent.send(forward[agent.agent_id], "on"))
        holder = receipts[-1].recipient if forward is None else forward[agent.agent_id]
        holder = agents_key(holder, agents)
    return receipts


def agents_key(address: str, agents: dict[str, RawAgent]) -> str:
    """The key in agents of an address (an agent id, or the IOA address of an agent of either mesh)."""
    return address if address in agents else address.rpartition("/")[2]


def assert_refused_by_the_loop_guard(receipts: list[pb.Receipt], expected_accepted: int) -> None:
    statuses = [pb.ReceiptStatus.Name(r.status) for r in receipts]
    assert statuses == ["RECEIPT_STATUS_ACCEPTED"] * expected_accepted + ["RECEIPT_STATUS_NOT_PERMITTED"], statuses
    assert "loop guard" in receipts[-1].detail, receipts[-1].detail


async def test_a_three_agent_ring_of_raw_clients_is_stopped(tmp_path):
    async with Mesh(make_config(tmp_path)) as mesh, grpc.aio.insecure_channel(mesh.address) as channel:
        lead = await RawAgent.register(channel, "lead")
        a, b, c = [await RawAgent.register(channel, n, parent=lead) for n in "abc"]
        ring = {a.agent_id: b.agent_id, b.agent_id: c.agent_id, c.agent_id: a.agent_id}
        receipts = await answer_forever(a, b.agent_id, {x.agent_id: x for x in (a, b, c)}, forward=ring)
    # message n carries a trail of n agents; the one whose recipient is in it VISITS times is refused
    assert_refused_by_the_loop_guard(receipts, 3 * VISITS - 1)


async def test_two_raw_clients_replying_to_each_other_on_one_mesh_are_stopped(tmp_path):
    async with Mesh(make_config(tmp_path)) as mesh, grpc.aio.insecure_channel(mesh.address) as channel:
        lead = await RawAgent.register(channel, "lead")
        a, b = [await RawAgent.register(channel, n, parent=lead) for n in "ab"]
        receipts = await answer_forever(a, b.agent_id, {a.agent_id: a, b.agent_id: b})
    assert_refused_by_the_loop_guard(receipts, 2 * VISITS - 1)


@pytest.fixture
async def two_meshes(tmp_path):
    async with NetworkServer(NetworkConfig(history=20)) as network:
        nodes = []
        try:
            for node_id in ("north", "south"):
                nodes.append(await start_node(network, tmp_path, node_id))
            yield [node.mesh for node in nodes]
        finally:
            for node in nodes:
                await node.stop()


async def test_two_raw_clients_replying_across_two_meshes_are_stopped(two_meshes):
    north, south = two_meshes
    async with grpc.aio.insecure_channel(north.address) as n_channel, \
            grpc.aio.insecure_channel(south.address) as s_channel:
        a = await RawAgent.register(n_channel, "a")
        b = await RawAgent.register(s_channel, "b")
        receipts = await answer_forever(a, f"ioa:south/{b.agent_id}", {a.agent_id: a, b.agent_id: b})
    # the same limit as on one mesh: the trail crosses the network with the message
    assert_refused_by_the_loop_guard(receipts, 2 * VISITS - 1)
