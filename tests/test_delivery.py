"""Streaming delivery, acks (consumption), resume, takeover, dead letters."""

import asyncio

import grpc
import pytest

from inboxmesh.client import errors
from inboxmesh.client.mesh import MeshClient, envelope
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.clock import now_us
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, eventually, make_config
from tests.streams import Collector


@pytest.fixture
async def family(client):
    lead = await client.register("lead")
    return lead, await lead.spawn("a"), await lead.spawn("b")


async def test_delivery_in_order_then_consumed_once(family):
    _, a, b = family
    sub = Collector(b)
    try:
        await sub.wait_event(pb.SUBSCRIPTION_EVENT_KIND_ATTACHED)
        sent = [await a.send(b.agent_id, f"m{i}") for i in range(5)]
        got = await sub.wait_for(5)
        assert [m.content.text for m in got] == [f"m{i}" for i in range(5)]
        assert [m.sequence for m in got] == [1, 2, 3, 4, 5]
        assert all(m.sender == a.agent_id and m.delivery_attempt == 1 for m in got)
        await eventually(lambda: _state(a, sent[0].message_id, pb.MESSAGE_STATE_DELIVERED))
        first = await b.ack([1, 2, 3, 4, 5])
        assert [r.status for r in first] == [pb.ACK_STATUS_CONSUMED] * 5
        assert [r.message_id for r in first] == [r.message_id for r in sent]
        again = await b.ack([1, 6])
        assert [r.status for r in again] == [pb.ACK_STATUS_ALREADY_CONSUMED, pb.ACK_STATUS_NOT_FOUND]
        status = await a.status(sent[0].message_id)
        assert status.state == pb.MESSAGE_STATE_CONSUMED
        assert status.stored_at_us <= status.delivered_at_us <= status.consumed_at_us
        kinds = [e.kind for e in await a.events(message_id=sent[0].message_id)]
        assert kinds == [ev.EVENT_KIND_MESSAGE_SENT, ev.EVENT_KIND_MESSAGE_STORED, ev.EVENT_KIND_MESSAGE_DELIVERED,
                         ev.EVENT_KIND_MESSAGE_CONSUMED]
    finally:
        await sub.stop()


async def _state(agent, message_id, state):
    return (await agent.status(message_id)).state == state


async def test_messages_queued_before_subscribing_are_delivered(family):
    _, a, b = family
    for i in range(30):
        await a.send(b.agent_id, f"early{i}")
    sub = Collector(b, auto_ack=True)
    try:
        await sub.wait_for(30)
        assert sub.texts() == [f"early{i}" for i in range(30)]
        await eventually(lambda: len(sub.consumed) == 30)
    finally:
        await sub.stop()


async def test_disconnect_and_resume_loses_nothing_and_consumes_nothing_twice(family):
    _, a, b = family
    sent = [await a.send(b.agent_id, f"m{i}") for i in range(20)]
    first = Collector(b)
    await first.wait_for(20)
    results = await b.ack(range(1, 11))  # consumed the first ten, then the host "crashes"
    assert all(r.status == pb.ACK_STATUS_CONSUMED for r in results)
    await first.stop()
    for i in range(20, 25):
        await a.send(b.agent_id, f"m{i}")
    second = Collector(b, auto_ack=True)
    try:
        got = await second.wait_for(15)
        assert [m.sequence for m in got] == list(range(11, 26))
        assert [m.delivery_attempt for m in got] == [2] * 10 + [1] * 5
        await eventually(lambda: len(second.consumed) == 15)
        consumed_events = await a.events(sender=a.agent_id, kinds=[ev.EVENT_KIND_MESSAGE_CONSUMED])
        ids = [e.message_id for e in consumed_events]
        assert len(ids) == 25 and len(set(ids)) == 25
        assert set(ids) >= {r.message_id for r in sent}
    finally:
        await second.stop()


async def test_newer_subscription_takes_over(family):
    _, a, b = family
    old = Collector(b)
    await old.wait_event(pb.SUBSCRIPTION_EVENT_KIND_ATTACHED)
    await a.send(b.agent_id, "one")
    await old.wait_for(1)
    new = Collector(b)
    try:
        superseded = await old.wait_event(pb.SUBSCRIPTION_EVENT_KIND_SUPERSEDED)
        assert superseded.agent_id == b.agent_id
        await asyncio.wait_for(old.ended.wait(), 5)  # its only agent left: the stream ends
        assert old.error is None
        got = await new.wait_for(1)  # the unacked message moves to the new subscriber
        assert got[0].content.text == "one" and got[0].delivery_attempt == 2
        await a.send(b.agent_id, "two")
        await new.wait_for(2)
        assert old.texts() == ["one"]
    finally:
        await new.stop()


async def test_one_stream_for_several_agents(family):
    lead, a, b = family
    sub = Collector(a, extra=[b, lead])
    try:
        await lead.send(a.agent_id, "to a")
        await lead.send(b.agent_id, "to b")
        await a.send(lead.agent_id, "to lead")
        got = await sub.wait_for(3)
        assert {(m.recipient, m.content.text) for m in got} == {
            (a.agent_id, "to a"), (b.agent_id, "to b"), (lead.agent_id, "to lead")}
    finally:
        await sub.stop()


async def test_flow_control_holds_back_until_acked(family):
    _, a, b = family
    for i in range(12):
        await a.send(b.agent_id, f"m{i}")
    sub = Collector(b, max_in_flight=5)
    try:
        await sub.wait_for(5)
        await asyncio.sleep(0.2)  # give an unbounded stream the chance to overrun (it must not)
        assert len(sub.messages) == 5
        await b.ack([1, 2])
        await sub.wait_for(7)
        assert [m.sequence for m in sub.messages] == list(range(1, 8))
    finally:
        await sub.stop()


async def test_fast_path_overflow_falls_back_to_the_store_in_order(family):
    _, a, b = family
    sub = Collector(b, max_in_flight=1, auto_ack=True)
    try:
        await sub.wait_event(pb.SUBSCRIPTION_EVENT_KIND_ATTACHED)
        call = a.send_stream()
        for i in range(10):
            await call.write(pb.SendRequest(messages=[envelope(b.agent_id, f"{i}-{j}") for j in range(50)]))
        await call.done_writing()
        assert sum([len(r.receipts) async for r in call]) == 500
        await sub.wait_for(500, timeout=30)
        assert [m.sequence for m in sub.messages] == list(range(1, 501))
    finally:
        await sub.stop()


async def test_close_dead_letters_queued_messages_and_ends_the_stream(family):
    lead, a, b = family
    sub = Collector(b)
    try:
        sent = [await a.send(b.agent_id, f"m{i}") for i in range(3)]
        await sub.wait_for(3)
        await b.ack([1])
        closed = await lead.close(b.agent_id, reason="task done")
        assert closed.dead_lettered == 2
        event = await sub.wait_event(pb.SUBSCRIPTION_EVENT_KIND_CLOSED)
        assert "task done" in event.detail
        assert [r.status for r in await b.ack([1, 2])] == [pb.ACK_STATUS_ALREADY_CONSUMED,
                                                          pb.ACK_STATUS_DEAD_LETTERED]
        status = await a.status(sent[2].message_id)
        assert status.state == pb.MESSAGE_STATE_DEAD_LETTERED and status.dead_letter_reason == "recipient closed"
        by_sender = await a.dead_letters(sender=a.agent_id)
        assert [m.envelope.message_id for m in by_sender] == [sent[1].message_id, sent[2].message_id]
        by_recipient = await lead.dead_letters(recipient=b.agent_id)
        assert len(by_recipient) == 2
        dead_events = await a.events(sender=a.agent_id, kinds=[ev.EVENT_KIND_MESSAGE_DEAD_LETTERED])
        assert {e.message_id for e in dead_events} == {sent[1].message_id, sent[2].message_id}
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await b.subscribe().read()
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "closed" in caught.value.details()
    finally:
        await sub.stop()


async def test_too_many_delivery_attempts_dead_letters(tmp_path):
    async with Mesh(make_config(tmp_path, max_delivery_attempts=2)) as mesh:
        async with MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            b = await lead.spawn("b")
            receipt = await lead.send(b.agent_id, "poison")
            await lead.send(b.agent_id, "fine")
            for attempt in (1, 2):
                sub = Collector(b)
                got = await sub.wait_for(2)
                assert got[0].delivery_attempt == attempt
                await sub.stop()
            sub = Collector(b)
            try:
                await sub.wait_event(pb.SUBSCRIPTION_EVENT_KIND_ATTACHED)
                await eventually(lambda: _state(lead, receipt.message_id, pb.MESSAGE_STATE_DEAD_LETTERED))
                status = await lead.status(receipt.message_id)
                assert status.dead_letter_reason == "too many delivery attempts"
                assert status.delivery_attempts == 2
            finally:
                await sub.stop()


async def test_expired_messages_are_dead_lettered_not_delivered(family):
    _, a, b = family
    stale = await a.send(b.agent_id, "stale", expires_at_us=now_us() - 1)
    fresh = await a.send(b.agent_id, "fresh", expires_at_us=now_us() + 60_000_000)
    sub = Collector(b)
    try:
        got = await sub.wait_for(1)
        assert got[0].message_id == fresh.message_id
        status = await a.status(stale.message_id)
        assert status.state == pb.MESSAGE_STATE_DEAD_LETTERED and status.dead_letter_reason == "expired"
    finally:
        await sub.stop()


async def test_acks_only_for_ones_own_inbox(family):
    _, a, b = family
    await a.send(b.agent_id, "for b")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await a.client.inbox.Ack(pb.AckRequest(agent_id=b.agent_id, sequences=[1]), metadata=a.metadata, timeout=5)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED and "own inbox" in caught.value.details()
    assert [r.status for r in await a.ack([1])] == [pb.ACK_STATUS_NOT_FOUND]  # a's own inbox has no seq 1
    assert (await a.status((await b.inbox_status(1)).envelope.message_id)).state == pb.MESSAGE_STATE_QUEUED


async def test_senders_are_told_when_their_messages_are_dead_lettered(client):
    lead = await client.register("lead")
    a, b = await lead.spawn("a"), await lead.spawn("b")
    tiny = await lead.spawn("tiny", inbox_capacity=1)
    sent = await a.send(b.agent_id, "will die", conversation_id="conv-1")
    from_tiny = [await tiny.send(b.agent_id, f"t{i}") for i in range(2)]
    await lead.send(tiny.agent_id, "fills tiny's inbox")
    await lead.close(b.agent_id, reason="finished early")
    [stored] = [e for e in await lead.events(agent_id=a.agent_id, kinds=[ev.EVENT_KIND_MESSAGE_STORED])
                if e.recipient == a.agent_id]  # the notice: the only message stored in a's inbox
    status = await a.inbox_status(stored.sequence)
    notice = status.envelope
    assert notice.kind == env_pb.MESSAGE_KIND_CONTROL and notice.origin.kind == env_pb.ORIGIN_KIND_MESH
    assert notice.sender == b.agent_id and notice.in_reply_to == sent.message_id
    assert notice.conversation_id == "conv-1"
    assert notice.headers["inboxmesh-notice"] == "dead-lettered"
    assert notice.headers["inboxmesh-reason"] == "recipient closed"
    assert sent.message_id in notice.content.text
    sub = Collector(a, auto_ack=True)
    try:
        got = await sub.wait_for(1)
        assert got[0].message_id == notice.message_id
    finally:
        await sub.stop()
    undelivered = await lead.events(agent_id=tiny.agent_id, kinds=[ev.EVENT_KIND_NOTICE_UNDELIVERED])
    assert len(undelivered) == 2 and all("inbox full" in e.detail for e in undelivered)
    assert {e.detail.split()[2] for e in undelivered} == {r.message_id for r in from_tiny}


async def test_the_mesh_owns_its_reserved_message_ids(family):
    _, a, b = family
    with pytest.raises(errors.InvalidArgument) as caught:
        await a.send(b.agent_id, "x", message_id="inboxmesh:notice:fake")
    assert caught.value.reason == "RESERVED_ID"
