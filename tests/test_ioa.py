"""The IOA relay between two meshes on one reference IOA network: identity,
receipts, reply correlation, siblings on one node, reconnect duplicates,
loops, relays that go away, spaces, and the evidence of each hop."""

import asyncio
import json

import grpc
import pytest

from inboxmesh.client import errors
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.ioa.v1 import network_pb2_grpc, relay_pb2, relay_pb2_grpc
from services.ioa.relay import RECEIPTS_MEDIA_TYPE, RELAY_AGENT
from services.ioa.wire import H
from services.ioa_network.server import NetworkConfig, NetworkServer
from tests.fixtures import eventually
from tests.ioa_nodes import NodeClient, start_node
from tests.streams import Collector


async def _team(node, *names):
    lead = await node.client.register("lead")
    return [lead] + [await lead.spawn(n) for n in names]


async def test_a_message_crosses_nodes_with_identity_and_reply_correlation(nodes):
    alpha, beta = nodes
    _, a = await _team(alpha, "a")
    _, b = await _team(beta, "b")
    receipt = await a.send(beta.address(b), "hello across", conversation_id="conv-x")
    assert receipt.status == pb.RECEIPT_STATUS_ACCEPTED and receipt.sequence == 1, "beta's own receipt"
    sub_b = Collector(b, auto_ack=True)
    try:
        (got,) = await sub_b.wait_for(1)
    finally:
        await sub_b.stop()
    assert got.sender == alpha.address(a) and got.recipient == b.agent_id
    assert got.origin.kind == env_pb.ORIGIN_KIND_IOA and got.origin.ioa_node == "alpha"
    assert got.content.text == "hello across" and got.conversation_id == "conv-x" and got.hop_count == 1
    answer = await b.reply(got, "hello back")
    assert answer.status == pb.RECEIPT_STATUS_ACCEPTED
    sub_a = Collector(a, auto_ack=True)
    try:
        (back,) = await sub_a.wait_for(1)
    finally:
        await sub_a.stop()
    assert back.sender == beta.address(b) and back.kind == env_pb.MESSAGE_KIND_REPLY
    assert back.in_reply_to == receipt.message_id, "the reply names a's own message id"
    assert back.conversation_id == "conv-x"


async def test_siblings_on_one_node_hear_each_other_through_the_network(nodes):
    alpha, _ = nodes
    _, a, b = await _team(alpha, "a", "b")
    receipt = await a.send(alpha.address(b), "via the network, same node")
    assert receipt.status == pb.RECEIPT_STATUS_ACCEPTED
    status = await b.inbox_status(receipt.sequence)
    assert status.envelope.sender == alpha.address(a), "not filtered as 'our own node'"
    assert status.envelope.origin.kind == env_pb.ORIGIN_KIND_IOA


async def test_unknown_closed_and_full_targets_look_as_they_do_locally(nodes):
    alpha, beta = nodes
    _, a = await _team(alpha, "a")
    lead_b, b = await _team(beta, "b")
    tiny = await lead_b.spawn("tiny", inbox_capacity=1)
    receipts = [await a.send(target, "x") for target in (
        "ioa:nowhere/agt_x", "ioa:beta/agt_nobody", beta.address(tiny), beta.address(tiny))]
    await lead_b.close(b.agent_id)
    receipts.append(await a.send(beta.address(b), "too late"))
    assert [r.status for r in receipts] == [
        pb.RECEIPT_STATUS_UNKNOWN_TARGET, pb.RECEIPT_STATUS_UNKNOWN_TARGET, pb.RECEIPT_STATUS_ACCEPTED,
        pb.RECEIPT_STATUS_INBOX_FULL, pb.RECEIPT_STATUS_TARGET_CLOSED]
    assert "no IOA node 'nowhere'" in receipts[0].detail and "capacity 1" in receipts[3].detail
    with pytest.raises(errors.InvalidArgument, match="not an IOA address"):
        await a.send("ioa:missing-slash", "x")


async def test_a_redelivered_message_is_recognised_and_consumed_once(nodes, network):
    alpha, beta = nodes
    _, a = await _team(alpha, "a")
    _, b = await _team(beta, "b")
    sent = [await a.send(beta.address(b), f"m{i}") for i in range(3)]
    assert all(r.status == pb.RECEIPT_STATUS_ACCEPTED for r in sent)
    async with grpc.aio.insecure_channel(network.address) as channel:
        stub = network_pb2_grpc.IoaNetworkStub(channel)
        await stub.InjectFault(net.InjectFaultRequest(node_id="beta", kind=net.FAULT_KIND_DROP_CONNECTION))
    await eventually(lambda: beta.relay.reconnects >= 1 and beta.relay.connected.is_set())
    await eventually(lambda: beta.relay.counts["duplicates"] >= 3, message="the recent messages came again")
    async with grpc.aio.insecure_channel(network.address) as channel:
        stub = network_pb2_grpc.IoaNetworkStub(channel)
        await stub.InjectFault(net.InjectFaultRequest(node_id="beta", kind=net.FAULT_KIND_DUPLICATE, count=1))
    extra = await a.send(beta.address(b), "sent twice by the network")
    assert extra.status == pb.RECEIPT_STATUS_ACCEPTED and extra.sequence == 4
    await eventually(lambda: beta.relay.counts["duplicates"] >= 4)
    sub = Collector(b, auto_ack=True)
    try:
        await sub.wait_for(4)
        await eventually(lambda: len(sub.consumed) == 4)
        await asyncio.sleep(0.1)  # a fifth delivery would show up here; there must be none
        assert [m.content.text for m in sub.messages] == ["m0", "m1", "m2", "sent twice by the network"]
    finally:
        await sub.stop()
    duplicates = await beta.client.admin_events(agent_id=b.agent_id)
    assert len([e for e in duplicates if e.kind == ev.EVENT_KIND_IOA_DUPLICATE]) >= 4


async def test_hop_limits_stop_loops_and_inbound_messages_are_never_sent_back(nodes):
    alpha, beta = nodes
    _, a = await _team(alpha, "a")
    _, b = await _team(beta, "b")
    looping = await a.send(beta.address(b), "x", hop_count=32)
    assert looping.status == pb.RECEIPT_STATUS_NOT_PERMITTED and "hop_count" in looping.detail
    # an agent bouncing what it receives back and forth: each crossing adds a hop, the chain ends
    receipt = await a.send(beta.address(b), "ping", hop_count=28)
    got = (await b.inbox_status(receipt.sequence)).envelope
    hops = got.hop_count
    assert hops == 29, "the crossing added one"
    bounced = await b.reply(got, "pong", hop_count=hops)
    assert bounced.status == pb.RECEIPT_STATUS_ACCEPTED
    back = (await a.inbox_status(bounced.sequence)).envelope
    assert back.hop_count >= hops + 1, "the reply continues the chain and crossed once more"
    last = await a.reply(back, "ping", hop_count=back.hop_count + 2)
    assert last.status == pb.RECEIPT_STATUS_NOT_PERMITTED
    # an IOA-origin envelope cannot be sent on by an agent (only the relay makes them)
    claim = env_pb.Envelope(message_id="m", recipient=beta.address(b),
                            origin=env_pb.Origin(kind=env_pb.ORIGIN_KIND_IOA))
    with pytest.raises(errors.PermissionDenied):
        await a.send_batch([claim])


async def test_a_relay_that_goes_away_loses_nothing_that_was_accepted(network, tmp_path):
    alpha = await start_node(network, tmp_path, "alpha")
    beta = await start_node(network, tmp_path, "beta")
    try:
        _, a = await _team(alpha, "a")
        _, b = await _team(beta, "b")
        before = [await a.send(beta.address(b), f"before {i}") for i in range(3)]
        b_agent, b_credential = b.info, b.credential
        await beta.client.close()
        await beta.mesh.stop(grace=0.2)
        with pytest.raises(errors.Unavailable, match="not connected"):
            await a.send(beta.address(b), "while down", message_id="while-down")
        beta = await start_node(network, tmp_path, "beta")
        retried = await a.send(beta.address(b), "while down", message_id="while-down")
        assert retried.status == pb.RECEIPT_STATUS_ACCEPTED and retried.sequence == 4
        b = beta.client.agent(b_agent, b_credential)
        sub = Collector(b, auto_ack=True)
        try:
            got = await sub.wait_for(4)
        finally:
            await sub.stop()
        assert [m.content.text for m in got] == ["before 0", "before 1", "before 2", "while down"]
        assert [m.sequence for m in got] == [r.sequence for r in before] + [4]
    finally:
        for node in (alpha, beta):
            await node.client.close()
            await node.mesh.stop(grace=0.2)


async def _restart_network(first: NetworkServer, second: NetworkServer, node) -> None:
    """Stop the network `first` and start `second` on its port; return once `node`'s relay is connected again."""
    reconnects = node.relay.reconnects
    await first.stop(grace=0.1)
    await second.start()
    await eventually(lambda: node.relay.reconnects > reconnects and node.relay.connected.is_set(),
                     message=f"{node.relay.node_id} connected to the restarted network")


async def _received(agent, count: int) -> list[str]:
    """The texts of the first `count` messages the agent's inbox delivers (acked)."""
    sub = Collector(agent, auto_ack=True)
    try:
        got = await sub.wait_for(count)
    finally:
        await sub.stop()
    return [m.content.text for m in got]


async def test_a_node_the_restarted_network_does_not_know_yet_is_unavailable_not_unknown(tmp_path):
    """A network that restarted knows a node again only once it has reconnected: a send meanwhile to a node
    the relay has heard from is UNAVAILABLE (retry), not the final UNKNOWN_TARGET; the retry is accepted
    once the node is back. On a network with no grace after its start, a node the relay never heard from is
    still UNKNOWN_TARGET (the chaos soak's far senders lost every message to this before; the next test has
    the grace)."""
    first = NetworkServer(NetworkConfig(history=20, reconnect_grace_s=0))
    port = await first.start()
    second = NetworkServer(NetworkConfig(history=20, port=port, reconnect_grace_s=0))  # the relay's own rule
    alpha = await start_node(first, tmp_path, "alpha")
    beta = await start_node(first, tmp_path, "beta")
    try:
        _, a = await _team(alpha, "a")
        _, b = await _team(beta, "b")
        assert (await a.send(beta.address(b), "before")).status == pb.RECEIPT_STATUS_ACCEPTED  # beta's receipt
        b_agent, b_credential = b.info, b.credential
        await beta.stop()
        await _restart_network(first, second, alpha)
        with pytest.raises(errors.Unavailable) as raised:
            await a.send(beta.address(b), "meanwhile", message_id="meanwhile")
        assert raised.value.reason == errors.Reason.IOA_PUBLISH_STATUS_UNKNOWN_NODE, raised.value
        assert "retry" in raised.value.message
        never = await a.send("ioa:nowhere/x", "to nobody")
        assert never.status == pb.RECEIPT_STATUS_UNKNOWN_TARGET and "no IOA node 'nowhere'" in never.detail
        beta = await start_node(second, tmp_path, "beta")
        retried = await a.send(beta.address(b), "meanwhile", message_id="meanwhile")
        assert retried.status == pb.RECEIPT_STATUS_ACCEPTED and retried.sequence == 2
        assert await _received(beta.client.agent(b_agent, b_credential), 2) == ["before", "meanwhile"]
    finally:
        for node in (alpha, beta):
            await node.stop()
        await first.stop(grace=0.1)
        await second.stop(grace=0.1)


async def test_a_node_no_relay_heard_from_is_unavailable_while_the_restarted_network_waits_for_its_nodes(tmp_path):
    """For reconnect_grace_s after it starts, the network answers a message to a node it does not know "not
    connected" (NODE_OFFLINE), not "no such node": a relay that never heard from that node (so its own rule
    cannot tell) answers UNAVAILABLE, retry, not the final UNKNOWN_TARGET, and the retry is accepted once the
    node is back. The chaos soak's far senders lost 18 of 100 messages so: the network restarted before
    their relay had heard from the near node, which was still reconnecting."""
    first = NetworkServer(NetworkConfig(history=20, reconnect_grace_s=0))
    port = await first.start()
    second = NetworkServer(NetworkConfig(history=20, port=port, reconnect_grace_s=600))
    alpha = await start_node(first, tmp_path, "alpha")
    beta = await start_node(first, tmp_path, "beta")
    try:
        _, a = await _team(alpha, "a")
        _, b = await _team(beta, "b")  # alpha has not heard from beta: nothing went between them yet
        b_agent, b_credential = b.info, b.credential
        await beta.stop()
        await _restart_network(first, second, alpha)
        with pytest.raises(errors.Unavailable) as raised:
            await a.send(beta.address(b), "meanwhile", message_id="meanwhile")
        assert raised.value.reason == errors.Reason.IOA_PUBLISH_STATUS_NODE_OFFLINE, raised.value
        assert "may still be reconnecting" in raised.value.message and "retry" in raised.value.message
        with pytest.raises(errors.Unavailable):  # within the grace, any node it does not know
            await a.send("ioa:nowhere/x", "to nobody")
        beta = await start_node(second, tmp_path, "beta")
        retried = await a.send(beta.address(b), "meanwhile", message_id="meanwhile")
        assert retried.status == pb.RECEIPT_STATUS_ACCEPTED and retried.sequence == 1
        assert await _received(beta.client.agent(b_agent, b_credential), 1) == ["meanwhile"]
    finally:
        for node in (alpha, beta):
            await node.stop()
        await first.stop(grace=0.1)
        await second.stop(grace=0.1)


async def test_a_connection_the_relay_cancelled_itself_is_made_again(nodes):
    """A publish whose write fails cancels the connection's call (IoaRelay._write_publishes), and its
    reader then ends with asyncio's CancelledError, not an RpcError: the relay connects again all the same.
    (It did not, and stayed away for good: the chaos soak's far senders got UNAVAILABLE IOA_DISCONNECTED
    until the run's end.)"""
    alpha, beta = nodes
    _, a = await _team(alpha, "a")
    _, b = await _team(beta, "b")
    reconnects = alpha.relay.reconnects
    alpha.relay._call.cancel()  # what a failed write does to the call
    await eventually(lambda: alpha.relay.reconnects > reconnects and alpha.relay.connected.is_set(),
                     message="alpha connected again")
    receipt = await a.send(beta.address(b), "after the cancel")
    assert receipt.status == pb.RECEIPT_STATUS_ACCEPTED, receipt


async def test_a_peers_malformed_receipts_are_ignored_and_the_relay_stays_connected(nodes, network):
    """Receipts from another node are read with care: JSON nested too deep, and a receipt for a real
    attempt whose status is not a string, are ignored (one of them ended the relay's connection task,
    disconnecting it for good); the proper receipt that follows answers the send."""
    alpha, _ = nodes
    _, a = await _team(alpha, "a")
    reconnects = alpha.relay.reconnects
    async with grpc.aio.insecure_channel(network.address) as channel:
        raw = NodeClient(channel, "raw")
        await raw.connect()
        sending = asyncio.create_task(a.send("ioa:raw/x", "to a raw node", message_id="m1"))
        got = await raw.next("message", timeout=10)
        attempt = got.headers[H + "attempt"]

        async def answer(data: bytes) -> None:
            message = net.IoaMessage(ioa_message_id=f"receipts-{raw.publish_id}", media_type=RECEIPTS_MEDIA_TYPE,
                                     data=data)
            message.direct.CopyFrom(net.Address(node="alpha", agent=RELAY_AGENT))
            raw.publish_id += 1
            await raw.call.write(net.NodeFrame(publish=net.Publish(message=message, publish_id=raw.publish_id)))
            assert (await raw.next("result")).status == net.PUBLISH_STATUS_OK

        def receipt(status: object) -> bytes:
            return json.dumps([{"for": got.ioa_message_id, "attempt": attempt, "status": status, "sequence": 7,
                                "stored_at_us": 1, "detail": ""}]).encode()

        await answer(b"[" * 5000)
        await answer(receipt(["accepted"]))
        await answer(receipt("accepted"))
        answered = await asyncio.wait_for(sending, 10)
        raw.close()
    assert (answered.status, answered.sequence) == (pb.RECEIPT_STATUS_ACCEPTED, 7), answered
    assert alpha.relay.reconnects == reconnects and alpha.relay.connected.is_set(), "the connection stayed"


async def test_spaces_are_read_explicitly_and_siblings_see_each_other(nodes):
    alpha, beta = nodes
    _, a, b = await _team(alpha, "a", "b")
    _, c = await _team(beta, "c")
    for agent, text in ((a, "a posts"), (b, "b posts"), (c, "c posts")):
        stub = relay_pb2_grpc.IoaRelayServiceStub(agent.client.channel)
        sent = await stub.SpaceSend(relay_pb2.SpaceSendRequest(space="lobby", text=text), metadata=agent.metadata,
                                    timeout=5)
        assert sent.status == net.PUBLISH_STATUS_OK
    stub = relay_pb2_grpc.IoaRelayServiceStub(b.client.channel)
    read = await stub.SpaceRead(relay_pb2.SpaceReadRequest(space="lobby"), metadata=b.metadata, timeout=5)
    assert [(getattr(m, "from").node, getattr(m, "from").agent, m.text) for m in read.messages] == [
        ("alpha", a.agent_id, "a posts"), ("alpha", b.agent_id, "b posts"), ("beta", c.agent_id, "c posts")]
    later = await stub.SpaceRead(relay_pb2.SpaceReadRequest(space="lobby", after_seq=2), metadata=b.metadata,
                                 timeout=5)
    assert [m.text for m in later.messages] == ["c posts"]
    mapped = await stub.MapAddress(relay_pb2.MapAddressRequest(agent_id=a.agent_id), metadata=b.metadata, timeout=5)
    assert mapped.address == alpha.address(a) and mapped.local_agent_id == a.agent_id


async def test_one_trace_and_the_event_record_show_every_hop(nodes, spans):
    alpha, beta = nodes
    _, a = await _team(alpha, "a")
    _, b = await _team(beta, "b")
    receipt = await a.send(beta.address(b), "traced across")
    sub = Collector(b)
    try:
        (got,) = await sub.wait_for(1)
        await b.ack([got.sequence])
        answer = await b.reply(got, "traced back")
    finally:
        await sub.stop()
    finished = spans.get_finished_spans()
    send = next(s for s in finished
                if s.name == "send" and s.attributes.get("messaging.message.id") == receipt.message_id)
    in_trace = [s.name for s in finished if s.context.trace_id == send.context.trace_id]
    for name in ("send", "ioa.publish", "ioa.receive", "enqueue", "deliver", "ack"):
        assert name in in_trace, (name, in_trace)
    alpha_events = await alpha.client.admin_events(agent_id=a.agent_id)
    kinds_a = [(e.kind, e.detail.split()[0] if e.detail else "")
               for e in alpha_events if e.message_id == receipt.message_id]
    assert (ev.EVENT_KIND_IOA_PUBLISHED, f"alpha:{a.agent_id}:{receipt.message_id}") in kinds_a
    assert (ev.EVENT_KIND_MESSAGE_SENT, "accepted") in kinds_a
    beta_events = [e for e in await beta.client.admin_events(agent_id=b.agent_id) if e.message_id == got.message_id]
    assert [e.kind for e in beta_events] == [ev.EVENT_KIND_IOA_RECEIVED, ev.EVENT_KIND_MESSAGE_SENT,
                                            ev.EVENT_KIND_MESSAGE_STORED, ev.EVENT_KIND_MESSAGE_DELIVERED,
                                            ev.EVENT_KIND_MESSAGE_CONSUMED]
    reply_events = await beta.client.admin_events(sender=b.agent_id)
    assert any(e.kind == ev.EVENT_KIND_IOA_PUBLISHED and e.message_id == answer.message_id for e in reply_events)
