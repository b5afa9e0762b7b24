"""JetStream settles an inbox's capacity after publishing (a message over it is taken back by its
sender). Delivery must not race that: a message beyond the recipient's first `capacity` unconsumed ones is
not delivered, or the take-back fails and the inbox holds more than its capacity (seen under load as three
messages accepted into an inbox of two)."""

import asyncio
import uuid
from dataclasses import replace

import pytest

from harness.nats import NatsNode
from inboxmesh.client.mesh import MeshClient
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.clock import now_us
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, make_config
from tests.streams import Collector

pytestmark = pytest.mark.store_independent


@pytest.fixture
async def jetstream_mesh(tmp_path):
    with NatsNode(tmp_path / "nats") as node:
        config = replace(make_config(tmp_path), store=node.store_config(nats_namespace=f"c{uuid.uuid4().hex[:12]}"))
        async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            yield mesh, client


async def test_a_message_over_capacity_is_not_delivered_before_its_sender_settles_it(jetstream_mesh):
    mesh, client = jetstream_mesh
    lead = await client.register("lead")
    sink = await lead.spawn("sink", inbox_capacity=2)
    first = [await lead.send(sink.agent_id, f"m{i}") for i in range(2)]
    assert [r.status for r in first] == [pb.RECEIPT_STATUS_ACCEPTED] * 2
    held = Collector(sink)  # delivered, not acked: the inbox is at its capacity
    try:
        await held.wait_for(2)
        # a third sender is between its publish and its capacity check: the message is on the subject
        messages = mesh.store.inbox.messages
        third = env_pb.Envelope(message_id="third", sender=lead.agent_id, recipient=sink.agent_id,
                                content=env_pb.Content(text="over"), stored_at_us=now_us())
        ack = await mesh.store.conn.js.publish(messages.subject(sink.agent_id), third.SerializeToString())
        batch = await mesh.store.next_deliveries(sink.agent_id, max(r.sequence for r in first), 10, 5, now_us(),
                                                 in_flight=2)
        assert batch.messages == [] and batch.held_back, "nothing beyond the capacity is delivered"
        assert await messages.reject(sink.agent_id, ack.seq), "the sender can still take its message back"
        # a fresh subscriber (nothing in flight) gets the two accepted messages again, not the one taken back
        batch = await mesh.store.next_deliveries(sink.agent_id, 0, 10, 5, now_us(), in_flight=0)
        assert [m.sequence for m in batch.messages] == [r.sequence for r in first]
    finally:
        await held.stop()


async def test_sends_at_once_to_a_small_inbox_share_their_settle_and_fill_it_exactly(jetstream_mesh):
    """Many senders publish to one inbox of capacity 5 at once: the sends that come while a settle is in
    flight are settled together by the next (one read of the target and of its count for all of them,
    newest taken back first), so exactly 5 are accepted: none over capacity, none refused while there
    was room. The sends of one sender read its record and frontier as NATS holds them, shared too."""
    mesh, client = jetstream_mesh
    lead = await client.register("lead")
    sink = await lead.spawn("sink", inbox_capacity=5)
    senders = [await lead.spawn(f"s{i}") for i in range(7)]  # with the sink, the most children of one parent
    cache = mesh.store.agent_cache
    reads_before = cache._fresh.reads
    receipts = await asyncio.gather(*(s.send(sink.agent_id, f"from {s.agent_id}") for s in senders for _ in range(2)))
    statuses = [r.status for r in receipts]
    assert statuses.count(pb.RECEIPT_STATUS_ACCEPTED) == 5, statuses
    assert statuses.count(pb.RECEIPT_STATUS_INBOX_FULL) == len(receipts) - 5, statuses
    assert await mesh.store.inbox.messages.unconsumed(sink.agent_id) == 5
    # two reads per send at most (its sender before the publish, the target after): shared, far fewer
    assert cache._fresh.reads - reads_before < 2 * len(receipts), (cache._fresh.reads - reads_before, len(receipts))
    accepted = {r.message_id for r in receipts if r.status == pb.RECEIPT_STATUS_ACCEPTED}
    held = Collector(sink)
    try:
        delivered = await held.wait_for(5)
        assert {m.message_id for m in delivered} == accepted
    finally:
        await held.stop()


async def test_with_one_replica_the_capacity_count_is_a_direct_get_and_agrees_with_the_stream(jetstream_mesh,
                                                                                             monkeypatch):
    """The count a send into a limited inbox settles against comes from one batched direct get (the inbox's
    first message and how many follow it), not from the JetStream API's stream info; it is the stream's own
    count, empty, full, and after a message left the inbox."""
    mesh, client = jetstream_mesh
    lead = await client.register("lead")
    sink = await lead.spawn("sink", inbox_capacity=3)
    messages = mesh.store.inbox.messages
    js = mesh.store.conn.js

    async def stream_count(agent_id: str) -> int:
        info = await js.stream_info(mesh.store.conn.inbox_stream, subjects_filter=messages.subject(agent_id))
        return int((info.state.subjects or {}).get(messages.subject(agent_id), 0))

    assert await messages.unconsumed(sink.agent_id) == 0 == await stream_count(sink.agent_id)
    infos: list[object] = []
    real_info = js.stream_info

    async def counted_info(*args, **kwargs):
        infos.append(args)
        return await real_info(*args, **kwargs)

    monkeypatch.setattr(js, "stream_info", counted_info)
    receipts = [await lead.send(sink.agent_id, f"m{i}") for i in range(4)]
    assert [r.status for r in receipts] == [pb.RECEIPT_STATUS_ACCEPTED] * 3 + [pb.RECEIPT_STATUS_INBOX_FULL]
    assert infos == [], "the sends into a limited inbox asked the JetStream API for the count"
    monkeypatch.setattr(js, "stream_info", real_info)
    assert await messages.unconsumed(sink.agent_id) == 3 == await stream_count(sink.agent_id)
    await messages.delete(receipts[0].sequence)  # the front message leaves, as a consumed one does
    assert await messages.unconsumed(sink.agent_id) == 2 == await stream_count(sink.agent_id)
    assert (await lead.send(sink.agent_id, "room again")).status == pb.RECEIPT_STATUS_ACCEPTED
    assert await messages.unconsumed(sink.agent_id) == 3 == await stream_count(sink.agent_id)
