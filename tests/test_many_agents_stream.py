"""Many agents of one host on one inbox stream and one send stream: per-agent FIFO with hundreds of agents
under concurrent multi-sender sends, one ack request for many agents, attach and detach on an open stream,
resume after a mesh restart with 1,000 agents, and the pipelined multi-sender SendStream."""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import replace

import grpc
import pytest

from inboxmesh.client import errors
from inboxmesh.client.mesh import AgentHandle, MeshClient, envelope
from inboxmesh.client.status import error_info
from inboxmesh.client.stream import InboxStream
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.config import MeshConfig, RunsConfig
from services.server import Mesh
from services.store.base import DELIVERED
from services.store.sqlite.store import SqliteStore
from tests.fixtures import ADMIN_TOKEN, STORE, eventually, make_config, store_args, store_config, stream_senders
from tests.processes import MeshProcess

ACCEPTED = pb.RECEIPT_STATUS_ACCEPTED
CHILDREN = 2000
"""Running children one lead may have on these meshes (the default is 8)."""


def crowd_config(tmp_path, **changes) -> MeshConfig:
    return replace(make_config(tmp_path), runs=RunsConfig(max_active_children=CHILDREN), **changes)


@pytest.fixture
def mesh_config(tmp_path) -> MeshConfig:
    return crowd_config(tmp_path)


async def spawn_many(lead: AgentHandle, count: int, prefix: str = "c") -> list[AgentHandle]:
    agents: list[AgentHandle] = []
    for start in range(0, count, 50):
        agents += await asyncio.gather(*(lead.spawn(f"{prefix}{i}") for i in range(start, min(count, start + 50))))
    return agents


class Host:
    """One InboxStream for many agents, consumed the way a host of many agents does: whatever is pending,
    of every agent, in one consume_many. Records what was delivered and what each agent won."""

    def __init__(self, stream: InboxStream):
        self.stream = stream
        self.delivered: dict[str, list] = {}
        self.won: dict[str, list] = {}
        self.taken: dict[str, set[tuple[str, str]]] = {}
        self.events: list[pb.SubscriptionEvent] = []
        self.refused: dict[str, errors.MeshError] = {}
        self.lost_acks = 0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        unacked: dict[str, list] = {}
        """Messages whose ack was lost with the stream, written again with what comes next (as agent_host's
        runner keeps them pending, docs/delivery-contract.md, "Consumption"): the mesh may have recorded that
        ack, and then they never come again, and the ack written again finds them ALREADY_CONSUMED, won by
        this host (`taken`, naming every agent of the ack). Dropped, 40 consumed messages were never
        counted once (CI, 2026-12-05: the mesh killed after its commit, before its answer). The stream
        reconnects only while it is iterated."""
        async for item in self.stream:
            if item.agent_event is not None:
                self.events.append(item.agent_event)
            by_agent, unacked = unacked, {}
            for message in item.messages:
                self.delivered.setdefault(message.recipient, []).append(message)
                mine = by_agent.setdefault(message.recipient, [])
                if all(m.sequence != message.sequence for m in mine):  # not one whose ack was lost, again
                    mine.append(message)
            if not by_agent:
                continue
            try:
                done = await self.stream.consume_many(by_agent, taken={a: self.taken.get(a, set()) for a in by_agent})
            except errors.Unavailable:
                self.lost_acks += 1
                unacked = by_agent
                continue
            self.refused.update(done.refused)
            for agent_id, won in done.messages.items():
                self.won.setdefault(agent_id, []).extend(won)
                self.taken.setdefault(agent_id, set()).update((m.sender, m.message_id) for m in won)

    def won_count(self) -> int:
        return sum(len(w) for w in self.won.values())

    def events_of(self, agent_id: str) -> list[int]:
        return [e.kind for e in self.events if e.agent_id == agent_id]

    async def stop(self) -> None:
        self.stream.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def _commits(mesh: Mesh) -> int:
    """Commits of the mesh's SQLite writer so far (0 on JetStream, which has none)."""
    return mesh.store.writer.commits if isinstance(mesh.store, SqliteStore) else 0


async def _consumed_events(client: MeshClient) -> dict[tuple[str, str], int]:
    """(sender, message_id) -> how many MESSAGE_CONSUMED events the mesh recorded for it."""
    counts: dict[tuple[str, str], int] = {}
    after = 0
    while True:
        page = await client.admin_events(after=after, limit=1000)
        if not page:
            return counts
        for event in page:
            if event.kind == ev.EVENT_KIND_MESSAGE_CONSUMED:
                key = (event.sender, event.message_id)
                counts[key] = counts.get(key, 0) + 1
        after = page[-1].event_id


# -- per-agent FIFO with many agents on one stream ---------------------------------------------------------
async def test_per_agent_fifo_with_hundreds_of_agents_on_one_stream_under_multi_sender_sends(client):
    agents_count, per_sender, streams = 210, 6, 3
    lead = await client.register("lead")
    agents = await spawn_many(lead, agents_count)
    host = Host(InboxStream(agents[:-10], max_failures=0))
    try:
        await eventually(lambda: len(host.events) >= agents_count - 10, message="every agent attached")
        await host.stream.attach(agents[-10:])  # ten more join the open stream
        rng = random.Random(13)
        plan = {a.agent_id: [rng.choice(agents).agent_id for _ in range(per_sender)] for a in agents}
        senders = [client.send_stream(lead) for _ in range(streams)]
        # every sender's messages written in order without waiting for answers, all senders at once
        sends = [asyncio.ensure_future(senders[i % streams].send(a, [envelope(to, f"{a.agent_id}:{k}",
                                                                               message_id=f"{a.agent_id}-{k}")]))
                 for k in range(per_sender) for i, a in enumerate(agents) for to in [plan[a.agent_id][k]]]
        receipts = [r for batch in await asyncio.gather(*sends) for r in batch]
        for stream in senders:
            await stream.close()
        assert all(r.status == ACCEPTED for r in receipts), {r.detail for r in receipts if r.status != ACCEPTED}
        total = agents_count * per_sender
        await eventually(lambda: host.task.done() or host.won_count() >= total, 60, message="all consumed")
        assert not host.task.done(), host.task
        assert not host.refused
        for agent in agents:
            delivered = host.delivered.get(agent.agent_id, [])
            sequences = [m.sequence for m in delivered]
            assert sequences == sorted(sequences), f"{agent.agent_id}: delivered out of inbox order"
            by_sender: dict[str, list[int]] = {}
            for message in host.won.get(agent.agent_id, []):
                sender, _, k = message.content.text.partition(":")
                by_sender.setdefault(sender, []).append(int(k))
            for sender, ks in by_sender.items():
                assert ks == sorted(ks), f"{sender} -> {agent.agent_id}: consumed out of send order {ks}"
        won = [(m.sender, m.message_id) for w in host.won.values() for m in w]
        assert len(won) == len(set(won)) == total
        assert set(won) == {(m.split("-")[0], m) for m in (r.message_id for r in receipts)}
    finally:
        await host.stop()


# -- one ack request for many agents -------------------------------------------------------------------------
async def test_one_ack_request_for_many_agents_consumes_each_message_exactly_once(client, mesh):
    lead = await client.register("lead")
    agents = await spawn_many(lead, 60)
    outsider = await client.register("outsider")  # an agent of another host
    host_stream = InboxStream(agents)
    items = host_stream.__aiter__()
    try:
        attached = [(await items.__anext__()).agent_event for _ in agents]
        assert {e.agent_id for e in attached if e is not None} == {a.agent_id for a in agents}
        receipts = await lead.send_batch([envelope(a.agent_id, f"for {a.agent_id}", message_id=f"m-{i}")
                                          for i, a in enumerate(agents)])
        delivered: dict[str, list] = {}
        while sum(len(v) for v in delivered.values()) < len(agents):
            for message in (await items.__anext__()).messages:
                delivered.setdefault(message.recipient, []).append(message)
        if STORE == "sqlite":
            async def marked() -> bool:  # the lazy delivered markers are written: they ride on no later commit
                records = [await mesh.store.get_message_by_inbox(m.recipient, m.sequence)
                           for batch in delivered.values() for m in batch]
                return all(r is not None and r.state == DELIVERED for r in records)

            await eventually(marked, message="delivery recorded")
        commits = _commits(mesh)
        acks = {a: [m.sequence for m in batch] for a, batch in delivered.items()}
        acks[outsider.agent_id] = [1]  # not an agent of this stream: that entry alone is refused
        answers = await host_stream.ack_many(acks, turns={a.agent_id: 7 for a in agents})
        if STORE == "sqlite":
            assert _commits(mesh) - commits == 1, "one commit for the 60 acks, not one per ack"
        refusal = answers.pop(outsider.agent_id)
        assert isinstance(refusal, errors.PermissionDenied) and refusal.reason == "AGENT_MISMATCH"
        assert {a: [r.status for r in results] if isinstance(results, list) else results
                for a, results in answers.items()} == {a.agent_id: [pb.ACK_STATUS_CONSUMED] for a in agents}
        again = await host_stream.consume_many(delivered)
        assert again.messages == {a.agent_id: [] for a in agents} and not again.refused
        counts = await _consumed_events(client)
        assert {key: n for key, n in counts.items() if key[1].startswith("m-")} == {
            (lead.agent_id, r.message_id): 1 for r in receipts}
        consumed = await client.admin_events(message_id="m-0")
        assert [e.turn for e in consumed if e.kind == ev.EVENT_KIND_MESSAGE_CONSUMED] == [7]
    finally:
        host_stream.stop()
        await items.aclose()


async def test_an_ack_request_for_many_agents_refused_as_a_whole_records_nothing(client):
    lead = await client.register("lead")
    a, b = await lead.spawn("a"), await lead.spawn("b")
    call = a.client.inbox.Consume()
    await call.write(pb.ConsumeRequest(subscribe=pb.SubscribeRequest(credentials=[a.credential, b.credential])))
    receipt = await lead.send(a.agent_id, "keep")
    too_many = pb.AckRequest(agent_id=b.agent_id, sequences=range(1, 10_001))
    await call.write(pb.ConsumeRequest(ack_many=pb.AckManyRequest(request_id=5, acks=[
        pb.AckRequest(agent_id=a.agent_id, sequences=[receipt.sequence]), too_many])))
    await call.write(pb.ConsumeRequest(ack_many=pb.AckManyRequest(request_id=6)))
    answers: dict[int, pb.AckManyResponse] = {}
    async with asyncio.timeout(10):
        while len(answers) < 2:
            response = await call.read()
            if response.WhichOneof("event") == "acked_many":
                answers[response.acked_many.request_id] = response.acked_many
    assert (answers[5].error.reason, answers[5].error.code, list(answers[5].acks)) == (
        "BATCH_TOO_LARGE", grpc.StatusCode.INVALID_ARGUMENT.value[0], [])
    assert (answers[6].error.reason, answers[6].error.metadata["field"]) == ("MISSING_FIELD", "acks")
    assert (await a.inbox_status(receipt.sequence)).state != pb.MESSAGE_STATE_CONSUMED
    call.cancel()


# -- attach and detach on an open stream ---------------------------------------------------------------------
async def test_attach_and_detach_on_an_open_stream(client):
    lead = await client.register("lead")
    a, b, c = await lead.spawn("a"), await lead.spawn("b"), await lead.spawn("c")
    host = Host(InboxStream([a], max_failures=0))
    elsewhere: Host | None = None
    try:
        await eventually(lambda: host.events_of(a.agent_id) == [pb.SUBSCRIPTION_EVENT_KIND_ATTACHED])
        unacked = await lead.send(b.agent_id, "b before attach")
        await host.stream.attach([b, c])
        assert host.events_of(b.agent_id) == [pb.SUBSCRIPTION_EVENT_KIND_ATTACHED]
        await eventually(lambda: [m.message_id for m in host.won.get(b.agent_id, [])] == [unacked.message_id])
        # c's feed ends on a close; a and b stay attached
        await lead.close(c.agent_id, reason="done")
        await eventually(lambda: pb.SUBSCRIPTION_EVENT_KIND_CLOSED in host.events_of(c.agent_id))
        for agent in (a, b):
            await lead.send(agent.agent_id, "after c closed", message_id=f"after-close-{agent.agent_id}")
        await eventually(lambda: all(any(m.message_id == f"after-close-{x.agent_id}" for m in host.won.get(
            x.agent_id, [])) for x in (a, b)), message="a and b still delivered")
        # detach b: nothing more for it on this stream; it subscribes elsewhere and gets what is sent to it
        await host.stream.detach([b.agent_id])
        assert host.events_of(b.agent_id)[-1] == pb.SUBSCRIPTION_EVENT_KIND_DETACHED
        assert b.agent_id not in host.stream.agents
        delivered_to_b = len(host.delivered[b.agent_id])
        await lead.send(b.agent_id, "b after detach", message_id="b-after-detach")
        await lead.send(a.agent_id, "a after detach", message_id="a-after-detach")
        elsewhere = Host(InboxStream([b], max_failures=0))
        await eventually(lambda: [m.message_id for m in elsewhere.won.get(b.agent_id, [])] == ["b-after-detach"])
        await eventually(lambda: any(m.message_id == "a-after-detach" for m in host.won[a.agent_id]))
        assert len(host.delivered[b.agent_id]) == delivered_to_b, "b got a delivery after its detach"
        assert pb.SUBSCRIPTION_EVENT_KIND_SUPERSEDED not in host.events_of(b.agent_id), "b was still here"
        events = await lead.events(agent_id=b.agent_id, kinds=[ev.EVENT_KIND_SUBSCRIBED,
                                                                 ev.EVENT_KIND_UNSUBSCRIBED])
        assert [e.kind for e in events][:2] == [ev.EVENT_KIND_SUBSCRIBED, ev.EVENT_KIND_UNSUBSCRIBED]
        assert "detached" in events[1].detail
        assert not host.task.done() and host.stream.reconnects == 0
    finally:
        await host.stop()
        if elsewhere is not None:
            await elsewhere.stop()


async def test_detaching_the_last_agent_ends_the_stream_cleanly(client):
    lead = await client.register("lead")
    a = await lead.spawn("a")
    host = Host(InboxStream([a], max_failures=0))
    await eventually(lambda: host.events_of(a.agent_id) == [pb.SUBSCRIPTION_EVENT_KIND_ATTACHED])
    await host.stream.detach([a.agent_id])
    await asyncio.wait_for(host.task, 10)  # the iteration ended: no agent left, no error
    assert host.events_of(a.agent_id)[-1] == pb.SUBSCRIPTION_EVENT_KIND_DETACHED
    assert host.stream.reconnects == 0
    with pytest.raises(errors.Unavailable):
        await host.stream.attach([a])  # the stream is over
    await lead.send(a.agent_id, "for the next subscriber", message_id="next")
    again = Host(InboxStream([a], max_failures=0))
    try:
        await eventually(lambda: [m.message_id for m in again.won.get(a.agent_id, [])] == ["next"])
    finally:
        await again.stop()


async def test_an_attach_proves_its_credentials_and_is_refused_whole(client):
    lead = await client.register("lead")
    a, b, closed = await lead.spawn("a"), await lead.spawn("b"), await lead.spawn("closed")
    await lead.close(closed.agent_id)
    stream = InboxStream([a], max_failures=0)
    items = stream.__aiter__()
    try:
        await items.__anext__()
        forged = client.agent(b.agent_id, b.agent_id + ".not-the-secret")
        with pytest.raises(errors.Unauthenticated) as caught:
            await stream.attach([forged])
        assert caught.value.reason == "BAD_CREDENTIAL"
        with pytest.raises(errors.FailedPrecondition) as closed_caught:
            await stream.attach([b, closed])
        assert closed_caught.value.reason == "AGENT_CLOSED"
        assert list(stream.agents) == [a.agent_id]  # neither b nor the closed agent joined
        await lead.send(b.agent_id, "not for this stream")
        await lead.send(a.agent_id, "for a")
        assert [m.content.text for m in (await items.__anext__()).messages] == ["for a"]
        with pytest.raises(errors.PermissionDenied):
            await stream.ack(b.agent_id, [1])  # b's credential was never proven on this stream
    finally:
        stream.stop()
        await items.aclose()


async def test_an_agent_closed_before_the_stream_subscribes_ends_alone(client):
    """The (re)subscribe of a stream of several agents names one closed meanwhile: that agent alone ends
    (a CLOSED item) and the others are subscribed at once."""
    lead = await client.register("lead")
    a, b, gone = await lead.spawn("a"), await lead.spawn("b"), await lead.spawn("gone")
    await lead.close(gone.agent_id, reason="closed while the host was away")
    host = Host(InboxStream([a, gone, b], max_failures=0))
    try:
        await eventually(lambda: host.events_of(gone.agent_id) == [pb.SUBSCRIPTION_EVENT_KIND_CLOSED])
        await eventually(lambda: all(host.events_of(x.agent_id) == [pb.SUBSCRIPTION_EVENT_KIND_ATTACHED]
                                     for x in (a, b)))
        await lead.send(b.agent_id, "still here", message_id="still-here")
        await eventually(lambda: [m.message_id for m in host.won.get(b.agent_id, [])] == ["still-here"])
        assert list(host.stream.agents) == [a.agent_id, b.agent_id]
    finally:
        await host.stop()


# -- resume after a restart with 1,000 agents on the stream ---------------------------------------------------
@pytest.mark.timeout(300)  # 1,000 registrations take a while on JetStream
async def test_resume_after_a_mesh_restart_with_a_thousand_agents_loses_and_repeats_nothing(tmp_path):
    store = store_config(tmp_path)
    mesh_args = (*store_args(store), "--max-active-children", str(CHILDREN))
    agents_count, per_agent, batch = 1000, 2, 40
    with MeshProcess(tmp_path / "mesh", *mesh_args) as first:
        port = int(first.address.rpartition(":")[2])
        async with MeshClient(first.address, timeout=30, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            agents = await spawn_many(lead, agents_count)
            host = Host(InboxStream(agents, min_backoff=0.05, max_backoff=0.5))
            messages = [envelope(a.agent_id, f"{k}", message_id=f"{a.agent_id}-{k}")
                        for k in range(per_agent) for a in agents]
            receipts: dict[str, int] = {}

            async def send_all() -> None:
                """Batch after batch, each sent again with the same ids until it is answered (the mesh
                is away for a while): what was stored comes back DUPLICATE."""
                for start in range(0, len(messages), batch):
                    while True:
                        try:
                            answer = await lead.send_batch(messages[start:start + batch])
                            break
                        except (errors.Unavailable, errors.DeadlineExceeded):
                            continue
                    receipts.update((r.message_id, r.status) for r in answer)

            try:
                await eventually(lambda: len(host.events) >= agents_count, 60, message="all attached")
                sending = asyncio.create_task(send_all())
                await eventually(lambda: host.won_count() >= 300, 60, message="consumption under way")
                first.kill()  # mid-stream: sends, deliveries and acks on the wire
                with MeshProcess(tmp_path / "mesh", *mesh_args, "--port", str(port)):
                    await sending
                    assert set(receipts.values()) <= {ACCEPTED, pb.RECEIPT_STATUS_DUPLICATE}
                    assert len(receipts) == len(messages)
                    await eventually(lambda: host.task.done() or host.won_count() >= len(messages), 120,
                                     message="every accepted message consumed")
                    assert not host.task.done(), host.task
                    assert host.stream.reconnects >= 1
                    won = [(m.sender, m.message_id) for w in host.won.values() for m in w]
                    assert len(won) == len(set(won)), "a message was taken in twice"
                    assert set(won) == {(lead.agent_id, m.message_id) for m in messages}
                    counts = await _consumed_events(client)
                    assert {k: n for k, n in counts.items() if k[0] == lead.agent_id} == dict.fromkeys(won, 1)
            finally:
                await host.stop()


# -- the pipelined SendStream for many senders ---------------------------------------------------------------
async def test_a_pipelined_send_stream_answers_in_order_for_many_senders(client):
    lead = await client.register("lead")
    senders = await spawn_many(lead, 20, "s")
    targets = await spawn_many(lead, 5, "t")
    stranger = await lead.spawn("stranger")  # its credential never rides on the stream
    call = client.inbox.SendStream(metadata=[("authorization", f"Bearer {lead.credential}")])
    rng = random.Random(7)
    # the first request only proves ten senders (answered without receipts); the others prove with their
    # first send; then requests of random senders; the last names a sender the stream holds no credential of
    requests = [pb.SendRequest(credentials=[s.credential for s in senders[:10]])]
    plan: list[AgentHandle] = [lead]
    for index in range(130):
        sender = senders[10 + index] if index < 10 else rng.choice(senders)
        messages = [envelope(rng.choice(targets).agent_id, f"{index}.{k}", message_id=f"r{index}.{k}")
                    for k in range(rng.randint(1, 3))]
        requests.append(pb.SendRequest(messages=messages, sender=sender.agent_id,
                                       credentials=[sender.credential] if index < 10 else []))
        plan.append(sender)
    refused = pb.SendRequest(messages=[envelope(targets[0].agent_id, "never", message_id="never")],
                             sender=stranger.agent_id)
    for request in [*requests, refused]:  # all written before any answer is read
        await call.write(request)
    answers = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async with asyncio.timeout(20):
            while (answer := await call.read()) is not grpc.aio.EOF:
                answers.append(answer)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert stranger.agent_id in caught.value.details()
    info = error_info(caught.value)
    assert info is not None and info.reason == "SENDER_NOT_PROVEN"
    assert len(answers) == len(requests)
    assert list(answers[0].receipts) == []
    for sender, request, answer in zip(plan[1:], requests[1:], answers[1:]):
        assert [(r.message_id, r.recipient, r.status) for r in answer.receipts] == [
            (m.message_id, m.recipient, ACCEPTED) for m in request.messages]
        for receipt in answer.receipts:
            status = await lead.inbox_status(receipt.sequence, recipient=receipt.recipient)
            assert (status.envelope.sender, status.envelope.message_id) == (sender.agent_id, receipt.message_id)
    with pytest.raises(errors.NotFound):  # nothing of the refused request was stored
        await lead.status("never", sender=stranger.agent_id)
    per_target: dict[str, list[int]] = {}  # each inbox holds the stream's messages in request order
    for answer in answers:
        for receipt in answer.receipts:
            per_target.setdefault(receipt.recipient, []).append(receipt.sequence)
    assert all(seqs == sorted(seqs) for seqs in per_target.values())


async def test_the_client_send_stream_proves_each_sender_once_and_keeps_the_single_sender_form(client):
    lead = await client.register("lead")
    a, b, target = await lead.spawn("a"), await lead.spawn("b"), await lead.spawn("target")
    async with client.send_stream() as stream:  # the admin token authenticates the call; every sender proves
        receipts = await asyncio.gather(*(stream.send(x, [envelope(target.agent_id, f"{x.agent_id} {k}")])
                                          for k in range(5) for x in (a, b)))
    assert [r[0].status for r in receipts] == [ACCEPTED] * 10
    assert [(r[0].sequence) for r in receipts] == sorted(r[0].sequence for r in receipts)
    old = a.send_stream()  # one agent, its credential in the metadata, no sender named: as before
    await old.write(pb.SendRequest(messages=[envelope(target.agent_id, "old form")]))
    (receipt,) = (await old.read()).receipts
    assert receipt.status == ACCEPTED
    assert (await a.status(receipt.message_id)).envelope.sender == a.agent_id
    await old.done_writing()
    old.cancel()


async def test_one_request_carries_the_messages_of_many_senders(client):
    """A message's `sender` may name any agent whose credential the call holds: one request carries the sends
    of many agents, each stored as its own sender, answered in message order. Naming an agent the call holds
    no credential of refuses the whole request (SENDER_MISMATCH) and stores nothing of it."""
    lead = await client.register("lead")
    senders = await spawn_many(lead, 6, "s")
    target = await lead.spawn("target")
    stranger = await lead.spawn("stranger")
    call = client.inbox.SendStream(metadata=[("authorization", f"Bearer {lead.credential}")])
    plan = [lead, senders[0], senders[0], senders[3], lead, senders[5], senders[1], senders[0]]
    messages = [envelope(target.agent_id, f"m{i}", message_id=f"mix{i}") for i in range(len(plan))]
    for message, sender in zip(messages, plan):
        if sender is not lead:  # the lead's messages leave it empty: the request's sender
            message.sender = sender.agent_id
    await call.write(pb.SendRequest(messages=messages, credentials=[s.credential for s in senders]))
    answer = await call.read()
    assert [(r.message_id, r.status) for r in answer.receipts] == [(m.message_id, ACCEPTED) for m in messages]
    assert [r.sequence for r in answer.receipts] == list(range(1, len(plan) + 1))
    for receipt, sender in zip(answer.receipts, plan):
        stored = await lead.inbox_status(receipt.sequence, recipient=target.agent_id)
        assert stored.envelope.sender == sender.agent_id
    spoof = [envelope(target.agent_id, "fine", message_id="fine"), envelope(target.agent_id, "x", message_id="spoof")]
    spoof[0].sender = senders[2].agent_id
    spoof[1].sender = stranger.agent_id
    await call.write(pb.SendRequest(messages=spoof))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    info = error_info(caught.value)
    assert info is not None and info.reason == "SENDER_MISMATCH" and info.metadata["index"] == "1"
    for sender, message_id in ((senders[2], "fine"), (stranger, "spoof")):
        with pytest.raises(errors.NotFound):  # nothing of the refused request was stored
            await lead.status(message_id, sender=sender.agent_id)


async def test_the_client_send_stream_coalesces_concurrent_sends_into_few_requests(client):
    """Sends of many agents made at once go out in few requests (each message naming its sender), and every
    send still gets its own receipts, each message stored as its sender's, per-inbox order kept."""
    lead = await client.register("lead")
    senders = await spawn_many(lead, 40, "s")
    targets = await spawn_many(lead, 4, "t")
    rng = random.Random(3)
    plan = [(rng.choice(senders), [envelope(rng.choice(targets).agent_id, f"{i}.{k}", message_id=f"c{i}.{k}")
                                   for k in range(rng.randint(1, 3))]) for i in range(200)]
    async with client.send_stream(owner=lead) as stream:
        written = []
        original = stream._request

        def counting(batch):
            written.append(len(batch))
            return original(batch)

        stream._request = counting
        answers = await asyncio.gather(*(stream.send(sender, messages) for sender, messages in plan))
    assert sum(written) == len(plan) and len(written) < len(plan) / 4, written
    per_target: dict[str, list[int]] = {}
    for (_sender, messages), receipts in zip(plan, answers):
        assert [(r.message_id, r.status) for r in receipts] == [(m.message_id, ACCEPTED) for m in messages]
        for receipt in receipts:
            per_target.setdefault(receipt.recipient, []).append(receipt.sequence)
    for sender, messages in plan[::17]:
        for message in messages:
            assert (await lead.status(message.message_id, sender=sender.agent_id)).envelope.sender == sender.agent_id
    assert all(seqs == sorted(seqs) for seqs in per_target.values())  # send order is inbox order


async def test_send_requests_read_together_are_one_commit(tmp_path):
    """The service the SendStream handler hands its read-ahead to stores requests that share no sender and
    no recipient in one commit (SQLite), answering in order."""
    if STORE != "sqlite":
        pytest.skip("SQLite only: it counts the SQLite writer's commits; JetStream has no commits to count"
                    " (its ordering is checked by the pipelined-order test on both stores)")
    config = crowd_config(tmp_path, heartbeat_interval_s=60)
    async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")
        pairs = list(zip(await spawn_many(lead, 30, "s"), await spawn_many(lead, 30, "t")))
        inbox = mesh.services.inbox
        senders = stream_senders(mesh)
        requests = [pb.SendRequest(messages=[envelope(t.agent_id, "x", message_id=f"p{i}")], sender=s.agent_id,
                                   credentials=[s.credential]) for i, (s, t) in enumerate(pairs)]
        commits = _commits(mesh)
        answered, failure = await inbox.send_requests(senders, requests)
        assert failure is None
        assert _commits(mesh) - commits == 1
        assert [[(o.message_id, o.status) for o in outcomes] for outcomes in answered] == [
            [(f"p{i}", ACCEPTED)] for i in range(len(pairs))]


async def test_the_frontiers_of_a_reads_senders_are_read_at_the_same_time(tmp_path):
    """Each message continues its sender's causal chain (its frontier, what it consumed last). A read of
    many senders' requests reads their frontiers at the same time, not each after the one before (on
    JetStream each is a store round trip: one after the other, the checks of a 64-sender read took 17 ms
    against 3, and bench/many_bench.py --agents 1000 went from 410 to 517 messages/s). The real
    get_frontier is wrapped; the wrapper yields before reading, so reads made one after the other could
    never overlap. Each message still gets its own sender's chain."""
    config = crowd_config(tmp_path, heartbeat_interval_s=60)
    async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")
        senders = await spawn_many(lead, 24, "s")
        target = await lead.spawn("target")
        first = await lead.send(senders[0].agent_id, "consumed first")
        (acked,) = await senders[0].ack([first.sequence])
        assert acked.status == pb.ACK_STATUS_CONSUMED
        store = mesh.services.inbox._store
        real = store.get_frontier
        reading = [0, 0]  # now, most at once

        async def counted(agent_id):
            reading[0] += 1
            reading[1] = max(reading)
            try:
                await asyncio.sleep(0.01)
                return await real(agent_id)
            finally:
                reading[0] -= 1

        store.get_frontier = counted  # type: ignore[method-assign]
        senders_of = stream_senders(mesh)
        requests = [pb.SendRequest(messages=[envelope(target.agent_id, "x", message_id=f"f{i}")], sender=s.agent_id,
                                   credentials=[s.credential]) for i, s in enumerate(senders)]
        try:
            answered, failure = await mesh.services.inbox.send_requests(senders_of, requests)
        finally:
            del store.get_frontier
        assert failure is None
        assert [o.status for outcomes in answered for o in outcomes] == [ACCEPTED] * len(senders)
        assert reading[1] >= len(senders) // 2, f"at most {reading[1]} of {len(senders)} frontiers read at once"
        for i, sender in enumerate(senders):
            stored = (await lead.status(f"f{i}", sender=sender.agent_id)).envelope
            chain = [lead.agent_id, sender.agent_id] if i == 0 else [sender.agent_id]
            assert (list(stored.trail), stored.hop_count) == (chain, len(chain) - 1), sender.agent_id

