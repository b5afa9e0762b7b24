"""Receipts and the loop guard's trail across IOA: a first send reads
ACCEPTED however often the network carried it (dropped connections on
either side, redeliveries, duplicates), a sender's own retry reads
DUPLICATE, and the trail crosses the network in network form and comes back
as local ids."""

import asyncio
import collections
import json

import grpc
import pytest

from inboxmesh.client import errors
from inboxmesh.client.mesh import envelope
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.ioa.v1 import network_pb2_grpc
from services.config import InboxLimits
from services.ioa import trail as trails
from services.ioa.relay import RECEIPTS_MEDIA_TYPE
from services.ioa_network.server import NetworkConfig, NetworkServer
from tests.fixtures import eventually
from tests.ioa_nodes import start_node
from tests.streams import Collector

MAX_HOPS = InboxLimits().max_hops


@pytest.fixture
async def network():
    async with NetworkServer(NetworkConfig(history=50)) as server:
        yield server


@pytest.fixture
async def nodes(network, tmp_path):
    made = []
    try:
        for node_id in ("north", "south"):
            made.append(await start_node(network, tmp_path, node_id))
        yield made
    finally:
        for node in made:
            await node.stop()


async def _fault(network, node_id: str, kind: net.FaultKind, count: int = 0) -> None:
    async with grpc.aio.insecure_channel(network.address) as channel:
        await network_pb2_grpc.IoaNetworkStub(channel).InjectFault(
            net.InjectFaultRequest(node_id=node_id, kind=kind, count=count))


async def _all_events(client, agent_id):
    events, after = [], 0
    while page := await client.admin_events(agent_id=agent_id, after=after):
        events += page
        after = page[-1].event_id
    return events


async def test_first_sends_read_accepted_through_drops_redeliveries_and_duplicates(nodes, network):
    north, south = nodes
    senders = [await north.client.register(f"s{i}") for i in range(10)]
    b = await (await south.client.register("lead")).spawn("b", inbox_capacity=1000)
    receipts: dict[str, pb.Receipt] = {}
    failures: list[str] = []

    async def send_twenty(agent, k):
        for i in range(20):
            text = f"m{k}-{i}"
            try:
                receipts[text] = await agent.send(south.address(b), text)  # one Send each, never retried here
            except errors.MeshError as exc:
                failures.append(f"{text}: {type(exc).__name__} {exc.reason}")

    async def faults():
        # while the sends run: the receiving and the sending relay lose their connection (the network
        # redelivers the receiver's recent messages when it is back) and the network delivers copies
        cycle = [("south", net.FAULT_KIND_DROP_CONNECTION, 0), ("north", net.FAULT_KIND_DROP_CONNECTION, 0),
                 ("south", net.FAULT_KIND_DUPLICATE, 5), ("north", net.FAULT_KIND_DUPLICATE, 5)]
        for step in range(20):
            answered = 10 * (step + 1)
            await eventually(lambda answered=answered: len(receipts) + len(failures) >= answered
                             or len(receipts) + len(failures) == 200, timeout=30, message=f"{answered} sends answered")
            node_id, kind, count = cycle[step % len(cycle)]
            await _fault(network, node_id, kind, count)

    await asyncio.gather(faults(), *(send_twenty(agent, k) for k, agent in enumerate(senders)))
    assert not failures, failures
    statuses = collections.Counter(pb.ReceiptStatus.Name(r.status) for r in receipts.values())
    assert statuses == {"RECEIPT_STATUS_ACCEPTED": 200}, statuses
    assert south.relay.reconnects >= 4 and north.relay.reconnects >= 4, "the connections did drop"
    assert south.relay.counts["duplicates"] > 0, "copies did arrive"
    sub = Collector(b, auto_ack=True)
    try:
        await sub.wait_for(200, timeout=30)
        await eventually(lambda: len(sub.consumed) == 200, timeout=30, message="200 consumed")
    finally:
        await sub.stop()
    assert sorted(m.content.text for m in sub.consumed) == sorted(receipts), "each message consumed once"
    by_sequence = {m.sequence: m.content.text for m in sub.consumed}
    assert {r.sequence: text for text, r in receipts.items()} == by_sequence, \
        "each receipt names the sequence its message was stored at"
    events = await _all_events(south.client, b.agent_id)
    stored = collections.Counter(e.message_id for e in events if e.kind == ev.EVENT_KIND_MESSAGE_STORED)
    consumed = collections.Counter(e.message_id for e in events if e.kind == ev.EVENT_KIND_MESSAGE_CONSUMED)
    assert len(stored) == 200 and set(stored.values()) == {1} and consumed == stored


async def test_a_senders_retry_reads_duplicate_with_the_original_sequence(nodes, network):
    north, south = nodes
    a = await (await north.client.register("lead")).spawn("a")
    b = await (await south.client.register("lead")).spawn("b")
    first = await a.send(south.address(b), "once", message_id="m-1")
    assert first.status == pb.RECEIPT_STATUS_ACCEPTED
    retry = await a.send(south.address(b), "once", message_id="m-1")
    assert (retry.status, retry.sequence) == (pb.RECEIPT_STATUS_DUPLICATE, first.sequence)
    # a retry stays a retry when the network carries it twice and when it redelivers the original
    await _fault(network, "south", net.FAULT_KIND_DUPLICATE, 2)
    again = await a.send(south.address(b), "once", message_id="m-1")
    assert (again.status, again.sequence) == (pb.RECEIPT_STATUS_DUPLICATE, first.sequence)
    reconnects = south.relay.reconnects
    await _fault(network, "south", net.FAULT_KIND_DROP_CONNECTION)
    await eventually(lambda: south.relay.reconnects > reconnects and south.relay.connected.is_set())
    late = await a.send(south.address(b), "once", message_id="m-1")
    assert (late.status, late.sequence) == (pb.RECEIPT_STATUS_DUPLICATE, first.sequence)
    fresh = await a.send(south.address(b), "new", message_id="m-2")
    assert fresh.status == pb.RECEIPT_STATUS_ACCEPTED and fresh.sequence > first.sequence


async def test_a_copy_of_a_refused_send_is_refused_again_not_stored_later(nodes, network):
    north, south = nodes
    a = await (await north.client.register("lead")).spawn("a")
    tiny = await (await south.client.register("lead")).spawn("tiny", inbox_capacity=1)
    kept = await a.send(south.address(tiny), "kept")
    full = await a.send(south.address(tiny), "refused")
    assert (kept.status, full.status) == (pb.RECEIPT_STATUS_ACCEPTED, pb.RECEIPT_STATUS_INBOX_FULL)
    await _consume_one(tiny)  # room again: a copy of "refused" would now fit
    received, reconnects = south.relay.counts["received"], south.relay.reconnects
    await _fault(network, "south", net.FAULT_KIND_DROP_CONNECTION)  # both come again on reconnect
    await eventually(lambda: south.relay.reconnects > reconnects and south.relay.counts["received"] >= received + 2,
                     message="the redelivered copies were handled")
    stored = [e for e in await _all_events(south.client, tiny.agent_id) if e.kind == ev.EVENT_KIND_MESSAGE_STORED]
    assert len(stored) == 1, "the sender was told INBOX_FULL: the copy is not stored behind its back"


async def _consume_one(agent) -> env_pb.Envelope:
    sub = Collector(agent, auto_ack=True)
    try:
        await sub.wait_for(1)
        await eventually(lambda: sub.consumed, message="consumed")
        return sub.consumed[0]
    finally:
        await sub.stop()


async def test_the_trail_crosses_in_network_form_and_comes_back_as_local_ids(nodes):
    north, south = nodes
    lead_n = await north.client.register("lead")
    x = await lead_n.spawn("x")
    y = await (await south.client.register("lead")).spawn("y")
    # lead -> x on north, then x -> y across, y -> x back: the chain lead, x, y, as each mesh names it
    await lead_n.send(x.agent_id, "task")
    task = await _consume_one(x)
    assert list(task.trail) == [lead_n.agent_id]
    out = await x.send(south.address(y), "to the south", trail=list(task.trail), conversation_id="c")
    assert out.status == pb.RECEIPT_STATUS_ACCEPTED
    got = await _consume_one(y)
    assert list(got.trail) == [north.address(lead_n), north.address(x)], "north's ids, qualified with its node"
    back = await y.reply(got, "back to the north", trail=list(got.trail))
    assert back.status == pb.RECEIPT_STATUS_ACCEPTED
    returned = (await x.inbox_status(back.sequence)).envelope
    assert list(returned.trail) == [lead_n.agent_id, x.agent_id, south.address(y)], \
        "north's own entries are plain local ids again; south's stay qualified"
    assert returned.hop_count > got.hop_count >= 1


async def test_a_trail_over_the_limits_is_refused_not_cut(nodes):
    north, south = nodes
    a = await (await north.client.register("lead")).spawn("a")
    b = await (await south.client.register("lead")).spawn("b")
    long = [f"agt_{i}" for i in range(MAX_HOPS)]  # with a as the last entry: one more than crosses
    wide = ["ioa:far/" + "x" * trails.MAX_ENTRY_CHARS]
    for trail, why in ((long, "agents long"), (wide, "characters")):
        (outcome,) = await north.relay.forward(a.agent_id, [envelope(south.address(b), "x", trail=trail)])
        assert outcome.status == pb.RECEIPT_STATUS_NOT_PERMITTED and why in outcome.detail, outcome
    within = [f"agt_{i}" for i in range(MAX_HOPS - 1)]
    (outcome,) = await north.relay.forward(a.agent_id, [envelope(south.address(b), "x", trail=within)])
    assert outcome.status == pb.RECEIPT_STATUS_ACCEPTED
    stored = (await b.inbox_status(outcome.sequence)).envelope
    assert len(stored.trail) == MAX_HOPS and stored.trail[-1] == north.address(a)


class RawNode:
    """A node on the network that is not an inboxmesh mesh: it writes frames itself."""

    def __init__(self, channel, node_id):
        self.call = network_pb2_grpc.IoaNetworkStub(channel).Connect()
        self.node_id = node_id
        self.frames: asyncio.Queue = asyncio.Queue()

    async def connect(self):
        await self.call.write(net.NodeFrame(hello=net.Hello(node_id=self.node_id)))
        self.reader = asyncio.create_task(self._read())

    async def _read(self):
        try:
            async for frame in self.call:
                await self.frames.put(frame)
        except grpc.aio.AioRpcError:
            pass

    async def send(self, ioa_id, to, headers):
        message = net.IoaMessage(ioa_message_id=ioa_id, text="hi", headers={"inboxmesh-relay": "raw/1", **headers},
                                 direct=net.Address(node=to[0], agent=to[1]))
        getattr(message, "from").CopyFrom(net.Address(node=self.node_id, agent="me"))  # `from` is a Python keyword
        await self.call.write(net.NodeFrame(publish=net.Publish(message=message, publish_id=1)))

    async def receipt(self, ioa_id, timeout=10):
        async with asyncio.timeout(timeout):
            while True:
                frame = await self.frames.get()
                if frame.WhichOneof("frame") == "message" and frame.message.media_type == RECEIPTS_MEDIA_TYPE:
                    for receipt in json.loads(frame.message.data):
                        if receipt["for"] == ioa_id:
                            return receipt

    async def close(self):
        self.call.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


async def test_inbound_trails_and_hop_counts_over_the_limits_are_refused(nodes, network):
    _, south = nodes
    b = await (await south.client.register("lead")).spawn("b")
    async with grpc.aio.insecure_channel(network.address) as channel:
        raw = RawNode(channel, "raw")
        await raw.connect()
        try:
            refused = {
                "too-many": {trails.HEADER: json.dumps([f"ioa:raw/a{i}" for i in range(MAX_HOPS + 1)])},
                "too-long": {trails.HEADER: json.dumps(["ioa:raw/" + "a" * 1000])},
                "not-a-list": {trails.HEADER: "a,b,c"},
                "huge": {trails.HEADER: "[" + "\"a\"," * 100_000 + "\"a\"]"},
                "bad-hops": {"inboxmesh-hops": "lots"},
            }
            for ioa_id, headers in refused.items():
                await raw.send(ioa_id, ("south", b.agent_id), headers)
                receipt = await raw.receipt(ioa_id)
                assert receipt["status"] == "not_permitted", (ioa_id, receipt)
                assert len(receipt["detail"]) < 200, "the refusal does not echo the header"
            # plain entries from another node are that node's ids; the sender ends the trail
            await raw.send("ok", ("south", b.agent_id),
                           {trails.HEADER: json.dumps(["helper", "ioa:south/" + b.agent_id])})
            receipt = await raw.receipt("ok")
            assert receipt["status"] == "accepted"
        finally:
            await raw.close()
    stored = (await b.inbox_status(receipt["sequence"])).envelope
    assert list(stored.trail) == ["ioa:raw/helper", b.agent_id, "ioa:raw/me"]
