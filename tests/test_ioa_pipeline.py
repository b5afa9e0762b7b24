"""A SendStream's requests to IOA recipients are published one after the other without each waiting for
the receipts of the one before (InboxService.send_requests, IoaRelay.start_forward): the receipts still
come in request order, the far inbox holds the messages in that order, and a request whose IOA send fails
ends the stream with nothing after it stored."""

import asyncio

import grpc

from inboxmesh.client.mesh import envelope
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.ioa.v1 import network_pb2_grpc
from services.inbox.grpc_handler import _ReadAhead
from tests.fixtures import eventually
from tests.streams import Collector, receipts_until_error


def _count_in_flight(node) -> list[int]:
    """[now, most] IOA forwards of the node's inbox service waiting for their receipts at once."""
    service = node.mesh.services.inbox
    start = service._forward_to_ioa
    counts = [0, 0]

    async def counted(sender_id, envelopes, outbox=None):
        forwarding = await start(sender_id, envelopes, outbox)
        counts[0] += 1
        counts[1] = max(counts)

        def answered(_):
            counts[0] -= 1

        forwarding.answers.add_done_callback(answered)
        return forwarding

    service._forward_to_ioa = counted
    return counts


async def test_requests_to_ioa_go_out_without_waiting_and_keep_their_order(nodes):
    alpha, beta = nodes
    a = await (await alpha.client.register("lead-a")).spawn("a")
    b = await (await beta.client.register("lead-b")).spawn("b")
    counts = _count_in_flight(alpha)
    ids = [f"m{i}" for i in range(40)]
    call = a.send_stream()
    for mid in ids:  # all written at once: the mesh reads them ahead and sends them on together
        await call.write(pb.SendRequest(messages=[envelope(beta.address(b), mid, message_id=mid)]))
    await call.done_writing()
    receipts = [r async for response in call for r in response.receipts]
    assert [r.message_id for r in receipts] == ids, "receipts in request order"
    assert all(r.status == pb.RECEIPT_STATUS_ACCEPTED for r in receipts), receipts
    assert [r.sequence for r in receipts] == sorted(r.sequence for r in receipts), "the far inbox in request order"
    assert counts[1] > 1, "requests were published while earlier ones waited for their receipts"
    held = Collector(b, auto_ack=True)
    try:
        delivered = await held.wait_for(len(ids))
        assert [m.content.text for m in delivered] == ids
    finally:
        await held.stop()


async def _beta_gone_after_a_first_message(alpha, beta):
    """Agents a and local on alpha, b on beta; a's first message reached b (alpha knows beta), then beta
    stopped: the network knows beta, not connected, so nothing can reach it."""
    lead = await alpha.client.register("lead-a")
    a, local = await lead.spawn("a"), await lead.spawn("local")
    b = await (await beta.client.register("lead-b")).spawn("b")
    assert (await a.send(beta.address(b), "first")).status == pb.RECEIPT_STATUS_ACCEPTED
    await beta.stop()
    return a, local, b


async def _only_before_stored(alpha, a, call) -> None:
    """The stream ended UNAVAILABLE (the IOA request "lost" failed) with only "before" answered: "before"
    is stored, "after" is not."""
    receipts, error = await receipts_until_error(call)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert [r.message_id for r in receipts] == ["before"]
    await asyncio.sleep(0.2)
    assert await alpha.mesh.store.get_message_by_sender(a.agent_id, "before") is not None
    assert await alpha.mesh.store.get_message_by_sender(a.agent_id, "after") is None, "stored after a failure"


async def test_a_failed_ioa_request_stores_nothing_after_it(nodes):
    alpha, beta = nodes
    a, local, b = await _beta_gone_after_a_first_message(alpha, beta)
    call = a.send_stream()
    await call.write(pb.SendRequest(messages=[envelope(local.agent_id, "before", message_id="before")]))
    await call.write(pb.SendRequest(messages=[envelope(beta.address(b), "lost", message_id="lost")]))
    await call.write(pb.SendRequest(messages=[envelope(local.agent_id, "after", message_id="after")]))
    await call.done_writing()
    await _only_before_stored(alpha, a, call)


async def _delay_deliveries_to(network, node_id: str, delay_ms: int) -> None:
    async with grpc.aio.insecure_channel(network.address) as channel:
        await network_pb2_grpc.IoaNetworkStub(channel).InjectFault(
            net.InjectFaultRequest(node_id=node_id, kind=net.FAULT_KIND_DELAY, count=1, delay_ms=delay_ms))


async def test_a_later_read_of_the_stream_goes_out_while_an_earlier_one_waits_for_its_receipts(nodes, network):
    """The handler takes the stream's next requests while those it took before wait for their receipts
    (grpc_handler._SendPipeline): a request written after the first was published is published before the
    first's receipt is back, and the answers still come in request order."""
    alpha, beta = nodes
    a = await (await alpha.client.register("lead-a")).spawn("a")
    b = await (await beta.client.register("lead-b")).spawn("b")
    assert (await a.send(beta.address(b), "hello")).status == pb.RECEIPT_STATUS_ACCEPTED
    counts = _count_in_flight(alpha)
    await _delay_deliveries_to(network, "beta", 600)  # the first message's way to beta, and so its receipt
    call = a.send_stream()
    await call.write(pb.SendRequest(messages=[envelope(beta.address(b), "one", message_id="one")]))
    await eventually(lambda: counts[0] == 1, message="the first request published, its receipt awaited")
    await call.write(pb.SendRequest(messages=[envelope(beta.address(b), "two", message_id="two")]))
    await eventually(lambda: counts[1] == 2, timeout=0.5,
                     message="the second request published while the first waited for its receipt")
    await call.done_writing()
    receipts = [r async for response in call for r in response.receipts]
    assert [(r.message_id, r.status) for r in receipts] == [("one", pb.RECEIPT_STATUS_ACCEPTED),
                                                            ("two", pb.RECEIPT_STATUS_ACCEPTED)]
    assert receipts[0].sequence < receipts[1].sequence, "the far inbox in request order"


async def test_a_request_after_a_failed_read_is_not_stored(nodes):
    """A local request taken while an earlier IOA read still waits for its receipts waits for them, and
    is not stored when they fail."""
    alpha, beta = nodes
    a, local, b = await _beta_gone_after_a_first_message(alpha, beta)
    counts = _count_in_flight(alpha)
    call = a.send_stream()
    await call.write(pb.SendRequest(messages=[envelope(beta.address(b), "lost", message_id="lost")]))
    await eventually(lambda: counts[0] == 1, message="the IOA request published, its receipt awaited")
    await call.write(pb.SendRequest(messages=[envelope(local.agent_id, "after", message_id="after")]))
    await call.done_writing()
    receipts, error = await receipts_until_error(call)
    assert not receipts, receipts
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    await asyncio.sleep(0.2)
    assert await alpha.mesh.store.get_message_by_sender(a.agent_id, "after") is None, "stored after a failure"


async def test_a_read_holding_a_local_request_and_a_failing_ioa_request_stops_the_stream(nodes, monkeypatch):
    """A read that holds a local request and then an IOA request whose receipt fails: the local one is
    stored and answered, and nothing of the next read is stored, even when its answers are handed out
    before the pipeline looks at them (_SendPipeline keeps the failure, not only the read's answers)."""
    alpha, beta = nodes
    a, local, b = await _beta_gone_after_a_first_message(alpha, beta)
    take = _ReadAhead.take
    first_taken = asyncio.Event()

    async def together(self: _ReadAhead, max_messages: int) -> list[pb.SendRequest]:
        if not first_taken.is_set():  # the first read holds "before" and "lost"
            async with self._changed:
                await self._changed.wait_for(lambda: len(self._waiting) >= 2)
        taken = await take(self, max_messages)
        first_taken.set()
        return taken

    monkeypatch.setattr(_ReadAhead, "take", together)
    call = a.send_stream()
    await call.write(pb.SendRequest(messages=[envelope(local.agent_id, "before", message_id="before")]))
    await call.write(pb.SendRequest(messages=[envelope(beta.address(b), "lost", message_id="lost")]))
    await first_taken.wait()
    await call.write(pb.SendRequest(messages=[envelope(local.agent_id, "after", message_id="after")]))
    await call.done_writing()
    await _only_before_stored(alpha, a, call)
