"""A real agent_host.Host follows all its agents on one inbox stream (agent_host/inbox_hub.py), on a real
mesh, and keeps the runtime's rules for each of them:

- 200 agents of one host on ONE Consume stream: the mesh's event record shows one subscribe for the host
  and every other agent attached on that stream (SUBSCRIBED "from <peer>" once, "attached from <peer>"
  for the rest), each agent still runs one loop (its turns strictly alternate started/ended), every
  message is consumed once by its recipient, and closing agents (by another agent, and through the host)
  leaves the others attached and receiving on that same stream;
- a stream whose last agent left ends, and the next agent opens a new one (also when the two happen at
  the same moment);
- an agent whose model holds its turn does not hold up the others' deliveries, and what waits for it is
  bounded by max_in_flight;
- after the mesh restarts, the one stream resubscribes everything attached and the runners carry on;
- agents closed before they attach (named in a new stream's subscribe, or in an attach with others)
  fail alone, with AGENT_CLOSED, and the others are attached;
- stopping the inbox of an agent that stays open detaches it alone;
- an agent's inbox on the host keeps each delivered message once and at most max_in_flight of them, and
  its first ATTACHED first (in memory: what the mesh would have to get wrong for it to matter).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from agent_host.config import Budget
from agent_host.inbox_hub import AgentInbox, InboxHub
from agent_host.models.scripted import say
from harness.evidence import K, Record
from harness.hosts import GatedModel, ScriptedHost, scripted_host
from inboxmesh.client import errors
from inboxmesh.client.mesh import AgentHandle, MeshClient, envelope
from inboxmesh.client.stream import StreamItem
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.config import MeshConfig, RunsConfig
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, eventually, make_config

pytestmark = pytest.mark.timeout(240)
AGENTS = 200
ROOMY = Budget(max_model_requests=100_000, max_wall_time_s=600)
"""One budget for a lead and all its children: enough for every turn of the tests."""


@pytest.fixture
def mesh_config(tmp_path) -> MeshConfig:
    return replace(make_config(tmp_path), runs=RunsConfig(max_active_children=1000))


async def _start_children(host: ScriptedHost, lead, count: int, prefix: str = "c") -> list[str]:
    """Host `count` children of `lead` (created 50 at a time, as a busy lead's spawns would be)."""
    ids: list[str] = []
    for start in range(0, count, 50):
        records = await asyncio.gather(*(
            host.start_child(lead.record, name=f"{prefix}{i}", task="stay", mode="async", history=[],
                             budget=lead.budget)
            for i in range(start, min(count, start + 50))))
        ids += [r.agent_id for r in records]
    return ids


async def _send_to_all(sender: AgentHandle, recipients: list[str], per_agent: int, tag: str) -> list[pb.Receipt]:
    envelopes = [envelope(r, f"{tag}-{n}", message_id=f"{tag}-{n}-{r}") for n in range(per_agent) for r in recipients]
    receipts: list[pb.Receipt] = []
    for start in range(0, len(envelopes), 50):  # each batch well within the call deadline on a busy JetStream
        receipts += await sender.send_batch(envelopes[start:start + 50])
    return receipts


def _consumed_here(host: ScriptedHost) -> set[str]:
    """Message ids the host's runners consumed (their "consumed" observations)."""
    return {e.detail.split(" ", 1)[0] for e in host.log if e.kind == "consumed"}


def _subscribes(record: Record, agent_ids: set[str]) -> list[str]:
    """The details of the SUBSCRIBED events of these agents: "from <peer>" for an agent named in a
    stream's subscribe, "attached from <peer>" for one attached on an open stream."""
    return [e.detail for e in record.of(K.EVENT_KIND_SUBSCRIBED) if e.agent_id in agent_ids]


async def test_a_host_of_200_agents_follows_them_on_one_inbox_stream(mesh, client, tmp_path):
    async with scripted_host(mesh.address, tmp_path / "host", {}, budget=ROOMY) as host:
        lead = await host.start_task("lead", "Answer whoever writes.")
        hosted = [lead.agent_id, *await _start_children(host, lead, AGENTS - 1)]
        assert len(host.runners) == AGENTS
        poker = await lead.handle.spawn("poker")  # registered, not hosted: sends from outside the host
        receipts = await _send_to_all(poker, hosted, 3, "first")
        assert all(r.status == pb.RECEIPT_STATUS_ACCEPTED for r in receipts)
        sent = {r.message_id for r in receipts}
        await eventually(lambda: sent <= _consumed_here(host), timeout=120, message="every message consumed")
        await eventually(lambda: all(r.state == "idle" for r in host.runners.values()), timeout=30)
        record = await Record.read(client)

        subscribes = _subscribes(record, set(hosted))
        assert len(subscribes) == AGENTS, "each agent subscribed once"
        opened = [d for d in subscribes if d.startswith("from ")]
        assert len(opened) == 1, f"one Consume stream for the host's {AGENTS} agents, not {len(opened)}"
        peer = opened[0].removeprefix("from ")
        assert all(d in (f"from {peer}", f"attached from {peer}") for d in subscribes)
        assert host.inbox.streams_opened == 1

        for agent_id in hosted:
            assert record.turns_alternate(agent_id), f"one loop for {agent_id}"
            assert host.runners[agent_id].max_runs_active == 1
        consumed = record.of(K.EVENT_KIND_MESSAGE_CONSUMED, sender=poker.agent_id)
        assert sorted(e.message_id for e in consumed) == sorted(sent), "each message consumed exactly once"
        assert all(e.message_id.endswith(e.agent_id) for e in consumed), "by its recipient"

        # closing agents on the shared stream: one by another agent (the mesh ends its feed: CLOSED), one
        # through the host (its runner stops and detaches it)
        by_lead, by_host = hosted[1], hosted[2]
        await lead.handle.close(by_lead, reason="closed by its parent")
        await host.close(by_host, reason="closed through the host")
        await eventually(lambda: by_lead not in host.runners and by_host not in host.runners)
        staying = [a for a in hosted if a not in (by_lead, by_host)]
        receipts = await _send_to_all(poker, [*staying, by_lead, by_host], 1, "second")
        status = {r.message_id.split("-", 2)[2]: r.status for r in receipts}
        assert status[by_lead] == status[by_host] == pb.RECEIPT_STATUS_TARGET_CLOSED
        assert all(status[a] == pb.RECEIPT_STATUS_ACCEPTED for a in staying)
        sent = {r.message_id for r in receipts if r.status == pb.RECEIPT_STATUS_ACCEPTED}
        await eventually(lambda: sent <= _consumed_here(host), timeout=120, message="the others still receive")
        record = await Record.read(client)
        assert len(_subscribes(record, set(hosted))) == AGENTS, "nobody subscribed again"
        assert host.inbox.streams_opened == 1 and len(host.inbox.streams) == 1, "still the one stream"
        for agent_id in staying:
            assert record.turns_alternate(agent_id)


async def test_the_next_agent_opens_a_new_stream_once_the_last_one_left(mesh, client, tmp_path):
    async with scripted_host(mesh.address, tmp_path / "host", {}, budget=ROOMY) as host:
        first = await host.start_task("first", "Answer whoever writes.")
        await host.close(first.agent_id, reason="done")
        await eventually(lambda: not host.inbox.streams, message="the stream of no agents ended")
        second = await host.start_task("second", "Answer whoever writes.")
        assert host.inbox.streams_opened == 2
        # the last agent leaving and the next one coming at the same moment: it attaches on one or the other
        third, _ = await asyncio.gather(host.start_task("third", "Answer whoever writes."),
                                        host.close(second.agent_id, reason="done"))
        poker = await third.handle.spawn("poker")
        receipt = await poker.send(third.agent_id, "still there?")
        await eventually(lambda: receipt.message_id in _consumed_here(host), message="the newest agent receives")
    record = await Record.read(client)
    assert [d.startswith("from ") for d in _subscribes(record, {first.agent_id, second.agent_id})] == [True, True]
    assert record.turns_alternate(third.agent_id)


async def test_an_agent_holding_its_turn_does_not_hold_up_the_others(mesh, client, tmp_path):
    gate = asyncio.Event()
    slow_model = GatedModel(lambda view: say("thought about it"), {1: gate})  # the turn its first message wakes
    async with scripted_host(mesh.address, tmp_path / "host", {"slow": slow_model}, budget=ROOMY,
                              max_in_flight=8) as host:
        lead = await host.start_task("lead", "Answer whoever writes.")
        slow = host.runners[(await host.start_child(lead.record, name="slow", task="think", mode="async",
                                                    history=[], budget=lead.budget)).agent_id]
        others = await _start_children(host, lead, 20, prefix="quick")
        poker = await lead.handle.spawn("poker")
        first = await poker.send(slow.agent_id, "the message that wakes it")
        await asyncio.wait_for(slow_model.waiting.wait(), 30)  # its turn is in its model call, held there
        backlog = await _send_to_all(poker, [slow.agent_id], 40, "backlog")
        receipts = await _send_to_all(poker, others, 3, "quick")
        sent = {r.message_id for r in receipts}
        await eventually(lambda: sent <= _consumed_here(host), timeout=60, message="the others' messages consumed")
        inbox = slow.stream
        assert isinstance(inbox, AgentInbox)
        assert len(slow.pending) + inbox.held <= 8, "what waits for it is bounded by max_in_flight"
        assert len(slow.pending) == 8, "as much as max_in_flight lets the mesh deliver"
        assert inbox.dropped == 0
        gate.set()
        waiting = {first.message_id} | {r.message_id for r in backlog}
        await eventually(lambda: waiting <= _consumed_here(host), timeout=60, message="the slow agent's backlog")
    record = await Record.read(client)
    assert record.turns_alternate(slow.agent_id) and slow.max_runs_active == 1


async def test_the_one_stream_resubscribes_every_agent_after_a_mesh_restart(tmp_path):
    config = replace(make_config(tmp_path), runs=RunsConfig(max_active_children=1000))
    mesh = Mesh(config)
    port = await mesh.start()
    config = replace(config, port=port)
    try:
        async with scripted_host(f"127.0.0.1:{port}", tmp_path / "host", {}, budget=ROOMY) as host:
            lead = await host.start_task("lead", "Answer whoever writes.")
            hosted = [lead.agent_id, *await _start_children(host, lead, 49)]
            poker = await lead.handle.spawn("poker")
            before = {r.message_id for r in await _send_to_all(poker, hosted, 1, "before")}
            await eventually(lambda: before <= _consumed_here(host), timeout=60, message="before the restart")
            await eventually(lambda: all(r.state == "idle" for r in host.runners.values()), timeout=30)
            await mesh.stop(grace=0.2)
            mesh = Mesh(config)
            await mesh.start()
            after = {r.message_id for r in await _send_to_all(poker, hosted, 2, "after")}
            await eventually(lambda: after <= _consumed_here(host), timeout=60, message="after the restart")
            assert host.inbox.streams_opened == 1 and host.inbox.streams[0].reconnects >= 1
            inboxes = [r.stream for r in host.runners.values()]
            assert all(isinstance(i, AgentInbox) and i.reconnects >= 1 for i in inboxes)
        async with MeshClient(f"127.0.0.1:{port}", admin_token=ADMIN_TOKEN) as admin:
            record = await Record.read(admin)
        consumed = record.of(K.EVENT_KIND_MESSAGE_CONSUMED, sender=poker.agent_id)
        assert sorted(e.message_id for e in consumed) == sorted(before | after), "nothing lost, nothing twice"
        for agent_id in hosted:
            assert record.turns_alternate(agent_id)
    finally:
        await mesh.stop()


async def test_an_agents_inbox_holds_each_message_once_and_at_most_max_in_flight(client):
    hub = InboxHub(max_in_flight=4)
    inbox = hub.inbox_of(client.agent("agt_a", "agt_a.secret"))
    attached = StreamItem(agent_event=pb.SubscriptionEvent(agent_id="agt_a", kind=pb.SUBSCRIPTION_EVENT_KIND_ATTACHED))

    def delivery(*sequences: int) -> StreamItem:
        return StreamItem(messages=[env_pb.Envelope(recipient="agt_a", sequence=s, message_id=f"m{s}")
                                    for s in sequences])

    inbox._put(attached)
    inbox._put(delivery(1, 2))
    inbox._put(attached)  # a reconnect before the runner read anything: the mesh delivers 1 and 2 again
    inbox._put(delivery(1, 2, 3))
    assert inbox.held == 3 and inbox.dropped == 0
    inbox._put(delivery(4, 5, 6))  # more than max_in_flight delivered and unacked: the mesh broke its bound
    assert inbox.held == 4 and inbox.dropped == 2
    inbox._end()
    items = [item async for item in inbox]
    assert items[0].agent_event is not None and items[0].agent_event.kind == pb.SUBSCRIPTION_EVENT_KIND_ATTACHED
    assert [m.sequence for item in items[1:] for m in item.messages] == [1, 2, 3, 4]
    assert all(item.agent_event is None for item in items[1:]), "one ATTACHED while one waits"
    assert inbox.held == 0
    await hub.close()


async def _first(inbox: AgentInbox) -> StreamItem:
    return await anext(inbox.__aiter__())


async def test_an_agent_closed_before_it_attaches_fails_alone(client, mesh):
    lead = await client.register("lead")
    agents = [await lead.spawn(f"a{i}") for i in range(6)]
    await lead.close(agents[1].agent_id, reason="closed before it subscribes")
    await lead.close(agents[4].agent_id, reason="closed before it attaches")
    hub = InboxHub(max_in_flight=8)
    try:
        inboxes = [hub.inbox_of(a) for a in agents]
        # a new stream's subscribe names 0, 1 and 2; then 3, 4 and 5 in one attach on the open stream
        for group in (inboxes[:3], inboxes[3:]):
            firsts = await asyncio.gather(*(_first(i) for i in group), return_exceptions=True)
            for inbox, first in zip(group, firsts):
                if inbox.agent_id in (agents[1].agent_id, agents[4].agent_id):
                    assert isinstance(first, errors.FailedPrecondition) and first.reason == errors.Reason.AGENT_CLOSED
                else:
                    assert isinstance(first, StreamItem) and first.agent_event is not None
                    assert first.agent_event.kind == pb.SUBSCRIPTION_EVENT_KIND_ATTACHED, inbox
        assert hub.streams_opened == 1
        open_ones = [a for i, a in enumerate(agents) if i not in (1, 4)]
        assert sorted(hub.streams[0].agents) == sorted(a.agent_id for a in open_ones)
    finally:
        await hub.close()


async def test_a_restarted_host_resumes_its_agents_together_on_one_stream(mesh, client, tmp_path):
    async with scripted_host(mesh.address, tmp_path / "host", {}, budget=ROOMY) as host:
        lead = await host.start_task("lead", "Answer whoever writes.")
        hosted = [lead.agent_id, *await _start_children(host, lead, 29)]
        poker = await lead.handle.spawn("poker")
        sent = {r.message_id for r in await _send_to_all(poker, hosted, 1, "before")}
        await eventually(lambda: sent <= _consumed_here(host), timeout=60)
    poker = client.agent(poker.agent_id, poker.credential)  # the host's client is closed with it
    await client.agent(lead.agent_id, lead.record.credential).close(hosted[5], reason="closed while its host"
                                                                                      " was away")
    async with scripted_host(mesh.address, tmp_path / "host", {}, budget=ROOMY) as host:
        assert sorted(host.runners) == sorted(a for a in hosted if a != hosted[5])
        assert host.inbox.streams_opened == 1
        sent = {r.message_id for r in await _send_to_all(poker, list(host.runners), 1, "after")}
        await eventually(lambda: sent <= _consumed_here(host), timeout=60, message="the resumed agents receive")
    record = await Record.read(client)
    subscribes = [e for e in record.of(K.EVENT_KIND_SUBSCRIBED) if e.agent_id in hosted]
    resumed = [e for e in subscribes if e.event_id > subscribes[len(hosted) - 1].event_id]
    assert len(resumed) == len(hosted) - 1 and all(e.detail.startswith("from ") for e in resumed)
    assert len({e.at_us for e in resumed}) == 1, "the resumed host's agents in one subscribe (recorded at once)"


async def test_stopping_an_open_agents_inbox_detaches_it_and_leaves_the_others(client, mesh):
    lead = await client.register("lead")
    a, b = await lead.spawn("a"), await lead.spawn("b")
    hub = InboxHub(max_in_flight=8)
    try:
        inbox_a, inbox_b = hub.inbox_of(a), hub.inbox_of(b)
        items_a = inbox_a.__aiter__()
        await asyncio.gather(anext(items_a), _first(inbox_b))
        inbox_b.stop()

        async def detached() -> Record | None:
            record = await Record.read(client)
            return record if record.of(K.EVENT_KIND_UNSUBSCRIBED, agent_id=b.agent_id) else None

        record = await eventually(detached, message="b detached")
        assert record.one(K.EVENT_KIND_UNSUBSCRIBED, agent_id=b.agent_id).detail.startswith("detached from ")
        to_b = await lead.send(b.agent_id, "nobody follows b here now")
        to_a = await lead.send(a.agent_id, "a still follows")
        item = await asyncio.wait_for(anext(items_a), 10)
        assert [m.message_id for m in item.messages] == [to_a.message_id]
        assert [m.message_id for m in await inbox_a.consume(a.agent_id, item.messages, turn=1)] == [to_a.message_id]
        assert (await lead.status(to_b.message_id)).state == pb.MESSAGE_STATE_QUEUED, "not delivered to the hub"
        assert hub.streams_opened == 1 and sorted(hub.streams[0].agents) == [a.agent_id]
    finally:
        await hub.close()


async def test_an_observer_that_fails_does_not_stop_the_agent(mesh, client, tmp_path):
    """An observer of the host's live log that raises (the command line's printer when its stdout is gone:
    BrokenPipeError) is logged; the agent's loop goes on and answers (it ended the loop before)."""

    def gone(event) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    async with scripted_host(mesh.address, tmp_path / "host", {"echo": lambda view: say("heard")},
                             budget=ROOMY) as host:
        host.observers.insert(0, gone)
        agent = await host.start_task("echo", "Answer whoever writes.")
        poker = await agent.handle.spawn("poker")
        for text in ("one", "two"):
            receipt = await poker.send(agent.agent_id, text)
            await eventually(lambda mid=receipt.message_id: mid in _consumed_here(host), message=f"{text} consumed")
        assert any(e.kind == "consumed" for e in host.log), "the observers after the failing one still hear"
