"""The IOA outbox (docs/ioa.md, "The outbox"): a send to an IOA agent whose node cannot be reached, with the
outbox chosen (by the request or the mesh's configuration), is kept durably in the sending mesh's outbox
(receipt OUTBOXED), sent when the node is back, in order, and its outcome reported to the sender once, as
an IOA_OUTBOX_DONE event and a notice in its inbox. Bounded, with an expiry, and kept across a restart of
the sending mesh."""

import asyncio

import pytest

from inboxmesh.client import errors
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from tests.fixtures import eventually
from tests.ioa_nodes import start_node
from tests.streams import Collector

OUTBOX = pb.IOA_DELIVERY_OUTBOX


async def _team(node, name):
    return await (await node.client.register(f"lead-{name}")).spawn(name)


async def _texts(agent, count: int, timeout: float = 20) -> list[str]:
    """The texts of the agent's first `count` messages, in inbox order (consumed); no more come."""
    sub = Collector(agent, auto_ack=True)
    try:
        got = await sub.wait_for(count, timeout=timeout)
        await asyncio.sleep(0.3)
        assert len(sub.messages) == count, [m.content.text for m in sub.messages]
        return [m.content.text for m in got]
    finally:
        await sub.stop()


async def _notices(agent, count: int, timeout: float = 20) -> list[env_pb.Envelope]:
    sub = Collector(agent, auto_ack=True)
    try:
        got = await sub.wait_for(count, timeout=timeout)
        await asyncio.sleep(0.3)
        assert len(sub.messages) == count, [m.content.text for m in sub.messages]
        return got
    finally:
        await sub.stop()


async def _outbox_events(node, agent_id: str) -> list[ev.Event]:
    return [e for e in await node.client.admin_events(agent_id=agent_id)
            if e.kind in (ev.EVENT_KIND_IOA_OUTBOXED, ev.EVENT_KIND_IOA_OUTBOX_DONE)]


async def test_a_first_send_into_the_outbox_is_recorded_when_the_pump_lists_the_outbox_meanwhile(network, tmp_path):
    """The outbox's pump lists the outbox now and then and learns its entries from it; when it does so while a
    send's entry is being added, the send is still a first one, recorded IOA_OUTBOXED once (a CI run under
    load recorded none for m1: the relay took the entry the pump had just learned of for a retry's)."""
    alpha = await start_node(network, tmp_path, "alpha")
    beta = await start_node(network, tmp_path, "beta")
    try:
        a, b = await _team(alpha, "a"), await _team(beta, "b")
        to_b = beta.address(b)
        await beta.stop()
        relay = alpha.mesh.relay
        real_add = relay._outbox.outbox_add

        async def add_then_pump_lists(entries, limit):
            added = await real_add(entries, limit)
            await relay._pump_round()  # the pump's round, in the gap before the send goes on
            return added

        relay._outbox.outbox_add = add_then_pump_lists
        kept = await a.send(to_b, "m1", message_id="m1", ioa_delivery=OUTBOX)
        again = await a.send(to_b, "m1", message_id="m1", ioa_delivery=OUTBOX)
        assert (kept.status, again.status) == (pb.RECEIPT_STATUS_OUTBOXED,) * 2 and kept.sequence == again.sequence
        assert "kept in" in kept.detail and "already in" in again.detail
        events = await _outbox_events(alpha, a.agent_id)
        assert [(e.kind, e.message_id) for e in events] == [(ev.EVENT_KIND_IOA_OUTBOXED, "m1")], events
    finally:
        for node in (alpha, beta):
            await node.stop()


async def test_a_node_out_of_reach_gets_its_messages_from_the_outbox_in_order_and_the_sender_is_told(
        network, tmp_path):
    alpha = await start_node(network, tmp_path, "alpha")
    beta = await start_node(network, tmp_path, "beta")
    try:
        a, b = await _team(alpha, "a"), await _team(beta, "b")
        b_info, b_credential = b.info, b.credential
        to_b = beta.address(b)
        assert (await a.send(to_b, "m0", message_id="m0")).status == pb.RECEIPT_STATUS_ACCEPTED
        await beta.stop()
        with pytest.raises(errors.Unavailable):  # not chosen, not configured: nothing kept
            await a.send(to_b, "direct", message_id="direct")
        kept = [await a.send(to_b, f"m{i}", message_id=f"m{i}", ioa_delivery=OUTBOX) for i in (1, 2, 3)]
        assert [r.status for r in kept] == [pb.RECEIPT_STATUS_OUTBOXED] * 3, kept
        assert [r.sequence for r in kept] == sorted({r.sequence for r in kept}), "numbered in order"
        assert "outbox" in kept[0].detail
        again = await a.send(to_b, "m2", message_id="m2", ioa_delivery=OUTBOX)
        assert (again.status, again.sequence) == (pb.RECEIPT_STATUS_OUTBOXED, kept[1].sequence), "a retry: its entry"
        beta = await start_node(network, tmp_path, "beta")
        b = beta.client.agent(b_info, b_credential)
        assert await _texts(b, 4) == ["m0", "m1", "m2", "m3"], "sent when the node is back, in order, once"
        notices = await _notices(a, 3)
        assert [n.in_reply_to for n in notices] == ["m1", "m2", "m3"]
        for notice in notices:
            assert notice.kind == env_pb.MESSAGE_KIND_CONTROL and notice.sender == to_b
            assert notice.headers["inboxmesh-notice"] == "ioa-outbox"
            assert notice.headers["inboxmesh-outcome"] == "accepted"
            assert "was stored there (sequence" in notice.content.text
        events = await _outbox_events(alpha, a.agent_id)
        assert [(e.kind, e.message_id) for e in events] == [
            *[(ev.EVENT_KIND_IOA_OUTBOXED, f"m{i}") for i in (1, 2, 3)],
            *[(ev.EVENT_KIND_IOA_OUTBOX_DONE, f"m{i}") for i in (1, 2, 3)]], "each once, a retry adds nothing"
        assert all(e.detail == "accepted" for e in events if e.kind == ev.EVENT_KIND_IOA_OUTBOX_DONE)
        assert await alpha.mesh.store.outbox_list(0, 10) == []
    finally:
        for node in (alpha, beta):
            await node.stop()


async def test_the_outbox_survives_a_restart_of_the_sending_mesh_and_reports_refusals(network, tmp_path):
    alpha = await start_node(network, tmp_path, "alpha", outbox=True)  # chosen by configuration
    beta = await start_node(network, tmp_path, "beta")
    try:
        a, b, gone = await _team(alpha, "a"), await _team(beta, "b"), await _team(beta, "gone")
        a_info, a_credential, b_info, b_credential = a.info, a.credential, b.info, b.credential
        await gone.close()
        await beta.stop()
        with pytest.raises(errors.Unavailable):  # the request chooses direct: the configuration is overridden
            await a.send(beta.address(b), "direct", message_id="direct", ioa_delivery=pb.IOA_DELIVERY_DIRECT)
        first = await a.send(beta.address(b), "kept", message_id="kept")
        closed = await a.send(beta.address(gone), "to a closed agent", message_id="closed")
        assert {first.status, closed.status} == {pb.RECEIPT_STATUS_OUTBOXED}
        await alpha.stop()  # kill the sending mesh with its outbox full of work
        alpha = await start_node(network, tmp_path, "alpha", outbox=True)
        a = alpha.client.agent(a_info, a_credential)
        assert [e.envelope.message_id for e in await alpha.mesh.store.outbox_list(0, 10)] == ["kept", "closed"]
        beta = await start_node(network, tmp_path, "beta")
        b = beta.client.agent(b_info, b_credential)
        assert await _texts(b, 1) == ["kept"]
        notices = {n.in_reply_to: n for n in await _notices(a, 2)}
        assert notices["kept"].headers["inboxmesh-outcome"] == "accepted"
        assert notices["closed"].headers["inboxmesh-outcome"] == "target_closed"
        assert "was not stored there: target_closed" in notices["closed"].content.text
        done = {e.message_id: e.detail for e in await _outbox_events(alpha, a.agent_id)
                if e.kind == ev.EVENT_KIND_IOA_OUTBOX_DONE}
        assert done["kept"] == "accepted" and done["closed"].startswith("target_closed: ")
    finally:
        for node in (alpha, beta):
            await node.stop()


async def test_an_entry_expires_and_the_outbox_is_bounded(network, tmp_path):
    alpha = await start_node(network, tmp_path, "alpha", outbox=True, outbox_ttl_s=1.0, outbox_limit=2)
    beta = await start_node(network, tmp_path, "beta")
    try:
        a, b = await _team(alpha, "a"), await _team(beta, "b")
        b_info, b_credential = b.info, b.credential
        await beta.stop()
        assert (await a.send(beta.address(b), "old", message_id="old")).status == pb.RECEIPT_STATUS_OUTBOXED
        soon = env_pb.Envelope(recipient=beta.address(b), message_id="soon",
                               content=env_pb.Content(text="soon"))
        assert (await a.send_batch([soon]))[0].status == pb.RECEIPT_STATUS_OUTBOXED
        with pytest.raises(errors.Unavailable) as caught:
            await a.send(beta.address(b), "third", message_id="third")
        assert caught.value.reason == errors.Reason.IOA_OUTBOX_FULL and "limit of 2" in str(caught.value)
        notices = await _notices(a, 2, timeout=15)  # one second later: expired, unsent
        assert {n.in_reply_to: n.headers["inboxmesh-outcome"] for n in notices} == {"old": "expired",
                                                                                     "soon": "expired"}
        await eventually(lambda: alpha.relay.counts["outbox_done"] == 2)
        beta = await start_node(network, tmp_path, "beta")
        b = beta.client.agent(b_info, b_credential)
        assert (await a.send(beta.address(b), "later", message_id="later")).status == pb.RECEIPT_STATUS_ACCEPTED
        assert await _texts(b, 1) == ["later"], "what expired was never sent"
    finally:
        for node in (alpha, beta):
            await node.stop()


async def test_a_dead_letter_notice_crosses_back_to_the_ioa_sender_once(network, tmp_path):
    """b (on beta) is closed with a's messages unconsumed while alpha is away: beta keeps the notices in its
    outbox and sends them when alpha is back; a gets the notice a local sender gets, once each."""
    alpha = await start_node(network, tmp_path, "alpha")
    beta = await start_node(network, tmp_path, "beta")
    try:
        a, b = await _team(alpha, "a"), await _team(beta, "b")
        a_info, a_credential = a.info, a.credential
        sent = [await a.send(beta.address(b), f"m{i}", message_id=f"m{i}") for i in range(2)]
        assert {r.status for r in sent} == {pb.RECEIPT_STATUS_ACCEPTED}
        await alpha.stop()
        await b.close(reason="done here")
        kept = await beta.mesh.store.outbox_list(0, 10)
        assert [(e.sender, e.envelope.recipient, e.envelope.headers["inboxmesh-notice"]) for e in kept] == [
            (b.agent_id, f"ioa:alpha/{a.agent_id}", "dead-lettered")] * 2
        alpha = await start_node(network, tmp_path, "alpha")
        a = alpha.client.agent(a_info, a_credential)
        notices = await _notices(a, 2)
        assert [n.in_reply_to for n in notices] == ["m0", "m1"], "answered with a's own message ids"
        for notice in notices:
            assert notice.kind == env_pb.MESSAGE_KIND_CONTROL and notice.sender == beta.address(b)
            assert notice.headers["inboxmesh-notice"] == "dead-lettered"
            assert notice.headers["inboxmesh-reason"] == notice.content.text.split(": ", 1)[1].rstrip(".")
            assert notice.content.text.startswith(f"Your message alpha:{a.agent_id}:m")
        await eventually(lambda: beta.relay.counts["outbox_done"] == 2, message="both reported")
        assert await beta.mesh.store.outbox_list(0, 10) == []
        done = [e for e in await beta.client.admin_events(agent_id=b.agent_id)
                if e.kind == ev.EVENT_KIND_IOA_OUTBOX_DONE]
        assert [e.detail for e in done] == ["accepted", "accepted"]
        assert not [m for m in await _outbox_notices_of(beta, b.agent_id)], "no notice about a notice"
    finally:
        for node in (alpha, beta):
            await node.stop()


async def _outbox_notices_of(node, agent_id: str) -> list[ev.Event]:
    """Events of notices the relay stored in the agent's own inbox (there must be none for crossing ones)."""
    return [e for e in await node.client.admin_events(agent_id=agent_id)
            if e.kind == ev.EVENT_KIND_MESSAGE_STORED and e.message_id.startswith("inboxmesh:outbox:")]


async def test_the_outbox_goes_out_when_the_network_says_the_node_is_back_not_at_the_end_of_its_back_off(
        network, tmp_path, monkeypatch):
    """The network tells a relay whose publishes it refused that the node is connected again (NodeBack): the
    outbox is sent then. Its back-off here is a minute, longer than the wait below: without the word from
    the network the entry would still be waiting."""
    from services.ioa import relay as relay_module

    monkeypatch.setattr(relay_module, "OUTBOX_POLL_S", 60.0)
    monkeypatch.setattr(relay_module, "OUTBOX_BACKOFF_S", 60.0)
    alpha = await start_node(network, tmp_path, "alpha", outbox=True)
    beta = await start_node(network, tmp_path, "beta")
    try:
        a, b = await _team(alpha, "a"), await _team(beta, "b")
        b_info, b_credential, to_b = b.info, b.credential, beta.address(b)
        await beta.stop()
        assert (await a.send(to_b, "kept", message_id="kept")).status == pb.RECEIPT_STATUS_OUTBOXED
        await eventually(lambda: "alpha" in network.network.waiting.get("beta", ()), timeout=5,
                         message="the network remembers who published to beta while it was away")
        # the outbox's own round publishes again for OFFLINE_GRACE_S: over by then, so only the network's
        # word can wake it before its minute of back-off
        await asyncio.sleep(relay_module.OFFLINE_GRACE_S + 1.0)
        beta = await start_node(network, tmp_path, "beta")
        b = beta.client.agent(b_info, b_credential)
        assert await _texts(b, 1, timeout=15) == ["kept"]
        assert alpha.relay.counts["node_back"] == 1
        assert "beta" not in network.network.waiting, "told once"
    finally:
        for node in (alpha, beta):
            await node.stop()
