"""Per-pair order across IOA (docs/ioa.md, "Order"): what one local agent sends to one IOA agent is stored in
the far inbox in the order it was sent, whatever the network does on the way (reorder, delay, duplicate,
dropped connections) and across a restart of either relay. A sending relay names, on each message, the
pair's message before it that has no receipt yet (`inboxmesh-after`); the receiving relay holds a message
until that one is answered, or stores it without it once its resequence wait is over (IOA_GAP)."""

import asyncio

import grpc
import pytest

from inboxmesh.client.mesh import envelope
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.ioa.v1 import network_pb2_grpc, relay_pb2, relay_pb2_grpc
from services.ioa.relay import AFTER, RECEIPTS_MEDIA_TYPE
from tests.fixtures import eventually
from tests.ioa_nodes import NodeClient, start_node
from tests.streams import Collector

RAW = "ioa:raw/me"
"""The address a raw node's messages come from (tests.ioa_nodes.NodeClient names its agent `me`)."""


async def _team(node, name):
    return await (await node.client.register(f"lead-{name}")).spawn(name)


async def _send_in_order(agent, to: str, ids: list[str]) -> list[pb.Receipt]:
    """One SendStream, a request a message, all written at once: the requests go out without waiting for
    each other's receipts (pipelined), in this order."""
    call = agent.send_stream()
    for mid in ids:
        await call.write(pb.SendRequest(messages=[envelope(to, mid, message_id=mid)]))
    await call.done_writing()
    return [r async for response in call for r in response.receipts]


async def _inbox(agent, count: int) -> list[str]:
    """The texts of the agent's first `count` messages, in inbox order (consumed)."""
    sub = Collector(agent, auto_ack=True)
    try:
        got = await sub.wait_for(count)
        await asyncio.sleep(0.2)  # one more would show up here
        assert len(sub.messages) == count, [m.content.text for m in sub.messages]
        return [m.content.text for m in got]
    finally:
        await sub.stop()


async def _fault(network, kind, **fields) -> None:
    async with grpc.aio.insecure_channel(network.address) as channel:
        await network_pb2_grpc.IoaNetworkStub(channel).InjectFault(
            net.InjectFaultRequest(node_id="beta", kind=kind, **fields))


async def _kinds(node, agent_id: str, message_id: str) -> list[int]:
    return [e.kind for e in await node.client.admin_events(agent_id=agent_id) if e.message_id == message_id]


async def test_a_pairs_order_holds_through_reorder_delay_duplicate_and_dropped_connections(nodes, network):
    alpha, beta = nodes
    a, b = await _team(alpha, "a"), await _team(beta, "b")
    await _fault(network, net.FAULT_KIND_REORDER, count=12)
    await _fault(network, net.FAULT_KIND_DUPLICATE, count=8)
    await _fault(network, net.FAULT_KIND_DELAY, count=6, delay_ms=20)
    ids = [f"m{i:02d}" for i in range(60)]
    sending = asyncio.create_task(_send_in_order(a, beta.address(b), ids))
    await eventually(lambda: beta.relay.counts["received"] >= 20, message="the first messages arrived")
    await _fault(network, net.FAULT_KIND_DROP_CONNECTION)  # beta's recent messages come again after it
    receipts = await sending
    assert [r.message_id for r in receipts] == ids
    assert {r.status for r in receipts} == {pb.RECEIPT_STATUS_ACCEPTED}, receipts
    assert [r.sequence for r in receipts] == sorted(r.sequence for r in receipts), "the far inbox in send order"
    assert await _inbox(b, len(ids)) == ids, "stored and delivered once each, in the order sent"
    assert beta.relay.counts["held"] >= 1, "the network's reorder made the relay hold a message"
    events = await beta.client.admin_events(agent_id=b.agent_id)
    held = [e for e in events if e.kind == ev.EVENT_KIND_IOA_HELD]
    assert held and all(e.detail.startswith("waits for alpha:") for e in held), held
    assert not [e for e in events if e.kind == ev.EVENT_KIND_IOA_GAP], "no gap: every predecessor came"
    for event in held:  # held, then stored once its predecessor was: the record shows each step in order
        kinds = await _kinds(beta, b.agent_id, event.message_id)
        assert kinds.index(ev.EVENT_KIND_IOA_HELD) < kinds.index(ev.EVENT_KIND_MESSAGE_STORED), kinds
        assert kinds.count(ev.EVENT_KIND_MESSAGE_STORED) == 1


async def test_without_the_order_header_the_reorder_fault_reorders(nodes, network):
    """What the test above would see without per-pair order: a raw node's messages carry no
    `inboxmesh-after`, and the network's reorder swaps two of them in the far inbox."""
    _, beta = nodes
    b = await _team(beta, "b")
    await _fault(network, net.FAULT_KIND_REORDER, count=1)
    async with grpc.aio.insecure_channel(network.address) as channel:
        raw = NodeClient(channel, "raw")
        await raw.connect()
        for mid in ("r1", "r2"):
            assert (await raw.publish(mid, to=("beta", b.agent_id), text=mid)).status == net.PUBLISH_STATUS_OK
        assert await _inbox(b, 2) == ["r2", "r1"]
        raw.close()


async def test_a_predecessor_that_never_comes_is_a_gap_after_the_resequence_wait(network, tmp_path):
    beta = await start_node(network, tmp_path, "beta", resequence_wait_s=1.0)
    try:
        b = await _team(beta, "b")
        async with grpc.aio.insecure_channel(network.address) as channel:
            raw = NodeClient(channel, "raw")
            await raw.connect()
            headers = {"inboxmesh-relay": "raw/x", AFTER: "r1"}
            await raw.publish("r2", to=("beta", b.agent_id), text="r2", headers=headers)
            await eventually(lambda: beta.relay.counts["held"] == 1, message="r2 held for r1")
            assert await beta.mesh.store.get_message_by_sender(RAW, "r2") is None, "not stored while held"
            receipt = await raw.next("message", timeout=10)  # stored once the wait is over: its receipt
            assert receipt.media_type == RECEIPTS_MEDIA_TYPE and b'"accepted"' in receipt.data
            raw.close()
        kinds = await _kinds(beta, b.agent_id, "r2")
        assert kinds[:4] == [ev.EVENT_KIND_IOA_RECEIVED, ev.EVENT_KIND_IOA_HELD, ev.EVENT_KIND_IOA_GAP,
                             ev.EVENT_KIND_MESSAGE_SENT], kinds
        gap = next(e for e in await beta.client.admin_events(agent_id=b.agent_id) if e.kind == ev.EVENT_KIND_IOA_GAP)
        assert gap.detail == "stored without r1: not answered within 1s"
        async with grpc.aio.insecure_channel(beta.mesh.address) as channel:
            status = await relay_pb2_grpc.IoaRelayServiceStub(channel).RelayStatus(relay_pb2.RelayStatusRequest(),
                                                                                   metadata=b.metadata)
        assert (status.held, status.holding, status.gaps) == (1, 0, 1), status
    finally:
        await beta.stop()


async def test_past_the_hold_limit_a_message_is_neither_stored_nor_answered(network, tmp_path):
    beta = await start_node(network, tmp_path, "beta", hold_limit=1, resequence_wait_s=30)
    try:
        b = await _team(beta, "b")
        async with grpc.aio.insecure_channel(network.address) as channel:
            raw = NodeClient(channel, "raw")
            await raw.connect()
            for mid, after in (("r2", "r1"), ("r3", "r2")):
                await raw.publish(mid, to=("beta", b.agent_id), text=mid,
                                  headers={"inboxmesh-relay": "raw/x", AFTER: after})
            await eventually(lambda: beta.relay.counts["hold_full"] == 1, message="r3 past the hold")
            assert beta.relay.counts["held"] == 1
            await raw.publish("r1", to=("beta", b.agent_id), text="r1", headers={"inboxmesh-relay": "raw/x"})
            assert await _inbox(b, 2) == ["r1", "r2"], "r3 was not stored: its sender publishes it again"
            await raw.publish("r3", to=("beta", b.agent_id), text="r3",
                              headers={"inboxmesh-relay": "raw/x", AFTER: "r2"})
            assert await _inbox(b, 1) == ["r3"]
            raw.close()
        gap = [e for e in await beta.client.admin_events(agent_id=b.agent_id) if e.kind == ev.EVENT_KIND_IOA_GAP]
        assert [(e.message_id, e.detail) for e in gap] == [
            ("r3", "the hold is full (1 messages): neither stored nor answered now; its sender publishes it again")]
    finally:
        await beta.stop()


async def test_held_messages_and_stored_predecessors_across_a_restart_of_the_receiving_relay(network, tmp_path):
    beta = await start_node(network, tmp_path, "beta")
    try:
        b = await _team(beta, "b")
        info, credential = b.info, b.credential
        async with grpc.aio.insecure_channel(network.address) as channel:
            raw = NodeClient(channel, "raw")
            await raw.connect()
            relay = {"inboxmesh-relay": "raw/x"}
            await raw.publish("r2", to=("beta", b.agent_id), text="r2", headers={**relay, AFTER: "r1"})
            await eventually(lambda: beta.relay.counts["held"] == 1, message="r2 held for r1")
            await beta.stop()  # what it held is lost with it; the network gives it r2 again on reconnect
            beta = await start_node(network, tmp_path, "beta")
            await eventually(lambda: beta.relay.counts["held"] == 1, message="r2 held again after the restart")
            await raw.publish("r1", to=("beta", b.agent_id), text="r1", headers=relay)
            b = beta.client.agent(info, credential)
            assert await _inbox(b, 2) == ["r1", "r2"]
            await beta.stop()  # its memory of what it answered is gone: the store says r2 was stored
            beta = await start_node(network, tmp_path, "beta")
            await raw.publish("r3", to=("beta", b.agent_id), text="r3", headers={**relay, AFTER: "r2"})
            b = beta.client.agent(info, credential)
            assert await _inbox(b, 1) == ["r3"]
            assert beta.relay.counts["held"] == 0, "a predecessor the store holds is not waited for"
            raw.close()
    finally:
        await beta.stop()


async def test_a_pairs_order_holds_across_a_restart_of_the_sending_relay(network, tmp_path):
    alpha = await start_node(network, tmp_path, "alpha")
    beta = await start_node(network, tmp_path, "beta")
    try:
        a, b = await _team(alpha, "a"), await _team(beta, "b")
        info, credential = a.info, a.credential
        await _fault(network, net.FAULT_KIND_REORDER, count=10)
        await _fault(network, net.FAULT_KIND_DELAY, count=20, delay_ms=100)  # 2 s for the 20 to arrive
        ids = [f"m{i:02d}" for i in range(30)]
        sending = asyncio.create_task(_send_in_order(a, beta.address(b), ids[:20]))
        await eventually(lambda: beta.relay.counts["received"] >= 3, message="the first messages arrived")
        await alpha.stop()  # mid-stream: what it had published goes on arriving at beta, unanswered
        with pytest.raises(grpc.aio.AioRpcError):  # the stream broke with its mesh
            await sending
        alpha = await start_node(network, tmp_path, "alpha")
        a = alpha.client.agent(info, credential)
        receipts = await _send_in_order(a, beta.address(b), ids)  # the client resends all, in order, same ids
        assert [r.message_id for r in receipts] == ids
        assert {r.status for r in receipts} <= {pb.RECEIPT_STATUS_ACCEPTED, pb.RECEIPT_STATUS_DUPLICATE}
        assert [r.sequence for r in receipts] == sorted(r.sequence for r in receipts), "the far inbox in send order"
        assert await _inbox(b, len(ids)) == ids
    finally:
        for node in (alpha, beta):
            await node.stop()

