"""Every send outcome over real gRPC, identity enforcement, and bad input."""

import grpc
import pytest

from inboxmesh.client import errors
from inboxmesh.client.mesh import MeshClient, envelope
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, contiguous_sequences, make_config

ACCEPTED, DUPLICATE = pb.RECEIPT_STATUS_ACCEPTED, pb.RECEIPT_STATUS_DUPLICATE


@pytest.fixture
async def family(client):
    lead = await client.register("lead")
    a = await lead.spawn("a")
    b = await lead.spawn("b")
    return lead, a, b


async def test_accepted_messages_get_inbox_sequences(family):
    lead, a, b = family
    receipts = [await a.send(b.agent_id, f"m{i}") for i in range(3)]
    assert [r.status for r in receipts] == [ACCEPTED] * 3
    assert [r.sequence for r in receipts] == [1, 2, 3]
    assert all(r.stored_at_us > 0 and r.recipient == b.agent_id for r in receipts)
    other = await lead.send(b.agent_id, "from lead")
    assert other.sequence == 4  # one total order per inbox, across senders
    status = await a.status(receipts[0].message_id)
    assert status.state == pb.MESSAGE_STATE_QUEUED
    assert status.envelope.sender == a.agent_id and status.envelope.content.text == "m0"
    assert status.envelope.origin.kind == env_pb.ORIGIN_KIND_LOCAL


async def test_duplicate_returns_the_original_sequence(family):
    _, a, b = family
    first = await a.send(b.agent_id, "once", message_id="fixed-id")
    await a.send(b.agent_id, "another")
    again = await a.send(b.agent_id, "once (retried)", message_id="fixed-id")
    assert (again.status, again.sequence, again.recipient) == (DUPLICATE, first.sequence, b.agent_id)
    assert (await a.status("fixed-id")).envelope.content.text == "once"
    # the idempotency key is per sender: b may use the same id
    assert (await b.send(a.agent_id, "mine", message_id="fixed-id")).status == ACCEPTED
    # duplicates inside one batch
    receipts = await a.send_batch([envelope(b.agent_id, "x", message_id="twice"),
                                   envelope(b.agent_id, "x", message_id="twice")])
    assert [r.status for r in receipts] == [ACCEPTED, DUPLICATE]
    assert receipts[0].sequence == receipts[1].sequence


async def test_unknown_and_closed_targets(family):
    lead, a, b = family
    unknown = await a.send("agt_nobody", "hello?")
    assert unknown.status == pb.RECEIPT_STATUS_UNKNOWN_TARGET and "agt_nobody" in unknown.detail
    await lead.close(b.agent_id, reason="finished")
    closed = await a.send(b.agent_id, "too late")
    assert closed.status == pb.RECEIPT_STATUS_TARGET_CLOSED and b.agent_id in closed.detail
    with pytest.raises(errors.NotFound):
        await a.status(closed.message_id)  # nothing was stored


async def test_not_permitted_outside_scope_from_closed_sender_and_over_hop_limit(client, family):
    lead, a, b = family
    stranger = await client.register("stranger")
    cross = await stranger.send(a.agent_id, "hi from outside")
    assert cross.status == pb.RECEIPT_STATUS_NOT_PERMITTED and "scope" in cross.detail
    hops = await a.send(b.agent_id, "looping", hop_count=33)
    assert hops.status == pb.RECEIPT_STATUS_NOT_PERMITTED and "hop_count" in hops.detail
    await lead.close(a.agent_id)
    from_closed = await a.send(b.agent_id, "ghost")
    assert from_closed.status == pb.RECEIPT_STATUS_NOT_PERMITTED and "closed" in from_closed.detail


async def test_cross_scope_allowed_by_configuration(tmp_path):
    async with Mesh(make_config(tmp_path, allow_cross_scope=True)) as mesh:
        async with MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            x, y = await client.register("x"), await client.register("y")
            assert (await x.send(y.agent_id, "allowed")).status == ACCEPTED


async def test_full_inbox_rejects_new_and_never_evicts(client):
    lead = await client.register("lead")
    small = await lead.spawn("small", inbox_capacity=3)
    sender = await lead.spawn("sender")
    receipts = [await sender.send(small.agent_id, f"m{i}") for i in range(5)]
    assert [r.status for r in receipts] == [ACCEPTED] * 3 + [pb.RECEIPT_STATUS_INBOX_FULL] * 2
    assert "capacity 3" in receipts[3].detail
    for r in receipts[:3]:
        assert (await sender.status(r.message_id)).state == pb.MESSAGE_STATE_QUEUED
    assert [r.status for r in await small.ack([1])] == [pb.ACK_STATUS_CONSUMED]
    retry = await sender.send(small.agent_id, "m3", message_id=receipts[3].message_id)
    assert retry.status == ACCEPTED and retry.sequence > receipts[2].sequence
    assert retry.sequence == 4 or not contiguous_sequences()
    assert (await sender.send(small.agent_id, "overflow")).status == pb.RECEIPT_STATUS_INBOX_FULL


async def test_every_outcome_is_in_the_event_record(family):
    _, a, b = family
    ok = await a.send(b.agent_id, "ok")
    dup = await a.send(b.agent_id, "ok", message_id=ok.message_id)
    unknown = await a.send("agt_nobody", "?")
    events = await a.events(sender=a.agent_id, kinds=[ev.EVENT_KIND_MESSAGE_SENT, ev.EVENT_KIND_MESSAGE_STORED])
    seen = [(e.kind, e.message_id, e.detail) for e in events]
    assert seen == [
        (ev.EVENT_KIND_MESSAGE_SENT, ok.message_id, "accepted"),
        (ev.EVENT_KIND_MESSAGE_STORED, ok.message_id, ""),
        (ev.EVENT_KIND_MESSAGE_SENT, dup.message_id, "duplicate"),
        (ev.EVENT_KIND_MESSAGE_SENT, unknown.message_id, "unknown_target"),
    ]


async def test_impersonation_is_refused_and_nothing_is_stored(family):
    lead, a, b = family
    honest = envelope(b.agent_id, "fine")
    forged = envelope(b.agent_id, "I am the lead")
    forged.sender = lead.agent_id
    with pytest.raises(errors.PermissionDenied) as caught:
        await a.send_batch([honest, forged])
    assert caught.value.reason == "SENDER_MISMATCH"
    assert lead.agent_id in caught.value.message and a.agent_id in caught.value.message
    with pytest.raises(errors.NotFound):
        await a.status(honest.message_id)
    own = envelope(b.agent_id, "naming myself is fine")
    own.sender = a.agent_id
    assert (await a.send_batch([own]))[0].status == ACCEPTED


async def test_missing_and_bad_credentials_are_refused(client, family):
    _, a, b = family
    request = pb.SendRequest(messages=[envelope(b.agent_id, "anonymous")])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.inbox.Send(request, timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.inbox.Send(request, metadata=(("authorization", f"Bearer {a.agent_id}.wrong"),), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.inbox.Send(request, metadata=(("authorization", "Basic abc"),), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda e: e.ClearField("message_id"), "MISSING_FIELD"),
        (lambda e: e.ClearField("recipient"), "MISSING_FIELD"),
        (lambda e: setattr(e, "kind", env_pb.MESSAGE_KIND_REPLY), "MISSING_FIELD"),
        (lambda e: setattr(e, "message_id", "x" * 129), "FIELD_TOO_LONG"),
        (lambda e: setattr(e, "conversation_id", "bad\nid"), "BAD_CHARACTERS"),
        (lambda e: setattr(e, "kind", 42), "BAD_KIND"),
        (lambda e: e.content.__setattr__("data", b"x" * (256 * 1024 + 1)), "MESSAGE_TOO_LARGE"),
    ],
)
async def test_malformed_messages_fail_the_whole_request(family, mutate, reason):
    _, a, b = family
    good = envelope(b.agent_id, "good")
    bad = envelope(b.agent_id, "bad")
    mutate(bad)
    with pytest.raises(errors.InvalidArgument) as caught:
        await a.send_batch([good, bad])
    assert caught.value.reason == reason
    assert "message 1" in caught.value.message
    with pytest.raises(errors.NotFound):
        await a.status(good.message_id)


async def test_ioa_origin_cannot_be_claimed(family):
    _, a, b = family
    claim = envelope(b.agent_id, "from the network, honest")
    claim.origin.kind = env_pb.ORIGIN_KIND_IOA
    with pytest.raises(errors.PermissionDenied, match="IOA relay"):
        await a.send_batch([claim])


async def test_empty_and_oversized_requests(family):
    _, a, b = family
    with pytest.raises(errors.InvalidArgument, match="no messages"):
        await a.send_batch([])
    with pytest.raises(errors.InvalidArgument, match="at most 1000"):
        await a.send_batch([envelope(b.agent_id, "x") for _ in range(1001)])
    huge = [envelope(b.agent_id, "y" * 200_000) for _ in range(50)]  # ~10 MB, over the gRPC limit
    with pytest.raises(errors.ResourceExhausted):
        await a.send_batch(huge)
    assert (await a.send(b.agent_id, "still serving")).status == ACCEPTED


async def test_send_stream_answers_each_request_in_order(family):
    _, a, b = family
    call = a.send_stream()
    batches = [[envelope(b.agent_id, f"{i}-{j}") for j in range(10)] for i in range(5)]
    for batch in batches:
        await call.write(pb.SendRequest(messages=batch))
    await call.done_writing()
    responses = [r async for r in call]
    sequences = [r.sequence for resp in responses for r in resp.receipts]
    assert sequences == list(range(1, 51))
    assert [r.message_id for resp in responses for r in resp.receipts] == [
        e.message_id for batch in batches for e in batch]
