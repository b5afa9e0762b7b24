"""A SendStream whose requests reach the mesh as several batches (read ahead, stored one after the other):
the receipts come in request order, an inbox's capacity is taken by the first messages in that order (none
accepted after one refused as full), and a refused request stores nothing of the requests after it, even
those the mesh had read already."""

from __future__ import annotations

import asyncio

import grpc

from inboxmesh.client.mesh import envelope
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from tests.streams import receipts_until_error


async def _write_spread(call, requests: list[pb.SendRequest]) -> None:
    """Write the requests a few at a time with short pauses, so they reach the mesh as several batches."""
    for start in range(0, len(requests), 3):
        for request in requests[start:start + 3]:
            await call.write(request)
        await asyncio.sleep(0.003)
    await call.done_writing()


async def test_batches_of_a_stream_answer_in_order_and_fill_a_small_inbox_in_order(client):
    lead = await client.register("lead")
    sink = await lead.spawn("sink", inbox_capacity=5)
    sender = await lead.spawn("sender")
    call = sender.send_stream()
    ids = [f"m{i}" for i in range(40)]
    writing = asyncio.create_task(_write_spread(call, [pb.SendRequest(messages=[envelope(sink.agent_id, mid,
                                                                                         message_id=mid)])
                                                       for mid in ids]))
    receipts = [r async for response in call for r in response.receipts]
    await writing
    assert [r.message_id for r in receipts] == ids, "receipts in request order"
    statuses = [r.status for r in receipts]
    assert statuses == [pb.RECEIPT_STATUS_ACCEPTED] * 5 + [pb.RECEIPT_STATUS_INBOX_FULL] * 35, \
        "the first five in request order take the inbox, none after a refused one is accepted"
    accepted = [r.sequence for r in receipts[:5]]
    assert accepted == sorted(accepted), "sequences follow the request order"


async def test_a_refused_request_stores_nothing_of_the_requests_after_it(mesh, client):
    lead = await client.register("lead")
    sink = await lead.spawn("sink")
    sender = await lead.spawn("sender")
    other = await lead.spawn("other")
    requests = [pb.SendRequest(messages=[envelope(sink.agent_id, f"m{i}", message_id=f"m{i}")]) for i in range(30)]
    bad = 12
    del requests[bad].messages[:]
    spoof = envelope(sink.agent_id, "as another", message_id="spoof")
    spoof.sender = other.agent_id  # a message naming a sender whose credential the stream does not hold
    requests[bad].messages.append(spoof)
    call = sender.send_stream()
    # all written at once, so that the mesh has read requests after the refused one ahead when it refuses;
    # the mesh reads what is still being written before it ends the call, so no write fails (in one event
    # loop with the mesh, the client's writes race the refusal: CI saw them fail with gRPC's INTERNAL)
    for request in requests:
        await call.write(request)
    await call.done_writing()
    receipts, error = await receipts_until_error(call)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert [r.message_id for r in receipts] == [f"m{i}" for i in range(bad)]
    assert all(r.status == pb.RECEIPT_STATUS_ACCEPTED for r in receipts)
    await asyncio.sleep(0.2)  # anything a later batch stored would be there by now
    for i in range(bad + 1, 30):
        assert await mesh.store.get_message_by_sender(sender.agent_id, f"m{i}") is None, f"m{i} was stored"


async def test_a_refusal_waits_for_writes_on_their_way_and_not_for_a_silent_client(mesh, client):
    """A client still writing after a refused request gets the refusal (its writes do not fail); one that
    neither writes nor half-closes gets it after the mesh's drain limit (2 s), not never."""
    import time

    lead = await client.register("lead")
    sink = await lead.spawn("sink")
    sender = await lead.spawn("sender")
    call = sender.send_stream()
    bad = envelope(sink.agent_id, "as another", message_id="spoof")
    bad.sender = lead.agent_id
    await call.write(pb.SendRequest(messages=[bad]))
    started = time.monotonic()
    for i in range(20):  # still writing while the refusal is decided: none of these writes fails
        await call.write(pb.SendRequest(messages=[envelope(sink.agent_id, f"late{i}", message_id=f"late{i}")]))
        await asyncio.sleep(0.01)
    _, error = await receipts_until_error(call)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert time.monotonic() - started < 10
    assert await mesh.store.get_message_by_sender(sender.agent_id, "late0") is None
