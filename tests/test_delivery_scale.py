"""Delivery with many agents on one stream: what a heartbeat, a delivery and a close cost the mesh in
store reads and in feeds touched, fairness between the feeds of one stream, closes made by another
client or another mesh process, attach and detach on an open subscription.

Costs are counted, never timed: the real store object's `next_deliveries` is wrapped by a counting
function (CountedReads), and the feeds touched are counted by wrapping the real `Feed.room` property
(every visit of a feed asks for its room first). Heartbeats are those the stream received.

The crowd (a lead and 1,110 children on one mesh, heartbeat every 0.5 s) is registered once for the
module; each test uses its own agents of it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass, replace

import grpc
import pytest
import pytest_asyncio

from inboxmesh.client.mesh import AgentHandle, MeshClient, envelope
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.config import RunsConfig
from services.inbox import delivery
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, eventually, make_config, store_args
from tests.processes import MeshProcess

pytestmark = [pytest.mark.timeout(240), pytest.mark.counts]
module_loop = pytest.mark.asyncio(loop_scope="module")

BIG = 1000
"""Agents on the stream of the cost tests."""
PER_BEAT = 64
"""Store reads a heartbeat may cost the whole mesh (the hub's safety slice, delivery.SAFETY_SLICE, is 64)."""
SETTLING = 8
"""Reads the settling itself may still cause after a count is reset: the probe's ack re-reads its feed,
and on JetStream notices of appends arrive asynchronously (the 1,000 agents' feeds would be 1,000)."""
TOUCHES_PER_BEAT = 6 * PER_BEAT
"""Feed touches (Feed.room reads) a heartbeat may cost: its slice's feeds, each visited once."""
SLOW, FAIR, SPARE = range(BIG, BIG + 51), range(BIG + 51, BIG + 102), range(BIG + 102, BIG + 110)
ROUND = range(SPARE.stop, SPARE.stop + 12)
"""The crowd's children (by index) that the smaller tests use; 0..BIG-1 are the big stream's."""


@dataclass
class Crowd:
    mesh: Mesh
    client: MeshClient
    lead: AgentHandle
    kids: list[AgentHandle]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def crowd(tmp_path_factory):
    config = make_config(tmp_path_factory.mktemp("crowd"))
    mesh = Mesh(replace(config, runs=RunsConfig(max_active_children=2 * BIG)))
    await mesh.start()
    try:
        async with MeshClient(mesh.address, timeout=30.0, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            spawning = asyncio.Semaphore(32)

            async def spawn(i: int) -> AgentHandle:
                async with spawning:
                    return await lead.spawn(f"c{i}")

            kids = list(await asyncio.gather(*(spawn(i) for i in range(ROUND.stop))))
            yield Crowd(mesh, client, lead, kids)
    finally:
        await mesh.stop(grace=0.5)


class CountedReads:
    """Counts the store reads of delivery: the real store object's next_deliveries, wrapped."""

    def __init__(self, store):
        self.store = store
        self.real = store.next_deliveries
        self.by_agent: collections.Counter[str] = collections.Counter()
        store.next_deliveries = self._counted

    async def _counted(self, recipient, *args, **kwargs):
        self.by_agent[recipient] += 1
        return await self.real(recipient, *args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.by_agent.values())

    def reset(self) -> None:
        self.by_agent.clear()

    def restore(self) -> None:
        del self.store.next_deliveries


@pytest.fixture
def reads(crowd):
    counted = CountedReads(crowd.mesh.store)
    try:
        yield counted
    finally:
        counted.restore()


@pytest.fixture
def touches(monkeypatch):
    """Feeds touched, by agent: every read of the real Feed.room property."""
    counted: collections.Counter[str] = collections.Counter()
    real: property = delivery.Feed.__dict__["room"]

    def room(feed):
        counted[feed.agent_id] += 1
        assert real.fget is not None
        return real.fget(feed)

    monkeypatch.setattr(delivery.Feed, "room", property(room))
    return counted


class Stream:
    """A raw Subscribe call for many agents, read in a task: every delivery in stream order, texts per
    agent, subscription events, heartbeats. It acks what it gets (each agent with its own credential),
    except for the agents in `slow`, which never ack."""

    def __init__(self, agents: list[AgentHandle], *, max_in_flight: int = 0, slow: set[str] | None = None):
        self.handles = {a.agent_id: a for a in agents}
        self.slow = slow or set()
        self.call = agents[0].subscribe(max_in_flight, extra=agents[1:])
        self.order: list[envelope_pb2.Envelope] = []
        self.texts: dict[str, list[str]] = collections.defaultdict(list)
        self.events: list[tuple[str, int]] = []
        self.heartbeats = 0
        self.error: grpc.aio.AioRpcError | None = None
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            async for response in self.call:
                which = response.WhichOneof("event")
                if which == "deliveries":
                    by_agent: dict[str, list[int]] = collections.defaultdict(list)
                    for m in response.deliveries.messages:
                        self.order.append(m)
                        self.texts[m.recipient].append(m.content.text)
                        by_agent[m.recipient].append(m.sequence)
                    for agent_id, sequences in by_agent.items():
                        if agent_id not in self.slow:
                            await self.handles[agent_id].ack(sequences)
                elif which == "subscription":
                    self.events.append((response.subscription.agent_id, response.subscription.kind))
                else:
                    self.heartbeats += 1
        except grpc.aio.AioRpcError as exc:
            self.error = exc

    def attached(self) -> int:
        return sum(kind == pb.SUBSCRIPTION_EVENT_KIND_ATTACHED for _, kind in self.events)

    def ends(self) -> list[tuple[str, int]]:
        return [(a, kind) for a, kind in self.events if kind != pb.SUBSCRIPTION_EVENT_KIND_ATTACHED]

    async def beats(self, count: int) -> None:
        """Wait for `count` more heartbeats."""
        until = self.heartbeats + count
        await eventually(lambda: self.heartbeats >= until, message=f"{count} heartbeats")

    async def stop(self) -> None:
        self.call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def hub_beats(crowd: Crowd) -> int:
    """Heartbeats the mesh's delivery hub has made: the measure of the per-beat bounds. (The stream's count
    lags behind it on a busy machine: a heartbeat still on its way was already paid for.)"""
    return crowd.mesh.services.inbox.hub.beats


async def _settled(crowd: Crowd, stream: Stream, reads: CountedReads, agents: list[AgentHandle]) -> None:
    """Wait until the stream announced every agent and its feeds made their first store reads, then for
    a probe message sent after them (so the round that read them is over)."""
    await eventually(lambda: stream.attached() == len(agents), message="every agent attached")
    await eventually(lambda: all(reads.by_agent[a.agent_id] for a in agents), timeout=60,
                     message="every feed's first store read")
    probe = agents[-1].agent_id
    await crowd.lead.send(probe, "probe")
    await eventually(lambda: "probe" in stream.texts[probe], message="the probe")


@module_loop
async def test_a_heartbeat_and_a_delivery_cost_bounded_work_with_1000_agents_on_one_stream(crowd, reads, touches):
    agents = crowd.kids[:BIG]
    stream = Stream(agents)
    try:
        await _settled(crowd, stream, reads, agents)
        reads.reset()
        start = hub_beats(crowd)
        await stream.beats(4)
        beats = hub_beats(crowd) - start + 1  # and the one that may have been under way at the reset
        assert reads.total <= beats * PER_BEAT + SETTLING, (
            f"{reads.total} store reads in {beats} heartbeats, {len(agents)} agents")

        reads.reset()
        touches.clear()
        before = hub_beats(crowd)
        targets = [agents[(i * 37) % BIG] for i in range(20)]
        for i, target in enumerate(targets):
            await crowd.lead.send(target.agent_id, f"one {i}")
            await eventually(lambda t=target, i=i: f"one {i}" in stream.texts[t.agent_id], message=f"delivery {i}")
        beats = hub_beats(crowd) - before + 1  # and the one whose slice may be read after `before`
        assert reads.total <= 3 * len(targets) + beats * PER_BEAT, f"{reads.total} reads for 20 deliveries"
        touched = sum(touches.values())
        assert touched <= 20 * len(targets) + beats * TOUCHES_PER_BEAT, (
            f"{touched} feed touches for 20 deliveries (and their acks) to single agents, {beats} beats")
        assert stream.ends() == [] and stream.error is None
    finally:
        await stream.stop()


@module_loop
async def test_closing_one_agent_of_a_shared_stream_leaves_the_others_attached(crowd, reads, touches):
    agents = crowd.kids[:BIG]
    closed = agents[500]
    stream = Stream(agents)
    try:
        await _settled(crowd, stream, reads, agents)
        touches.clear()
        before = hub_beats(crowd)
        async with MeshClient(crowd.mesh.address, timeout=30.0, admin_token=ADMIN_TOKEN) as other:
            await other.agent(crowd.lead.info, crowd.lead.credential).close(closed.agent_id, reason="done")
        await eventually(lambda: stream.ends() != [], message="the close on the stream")
        beats = hub_beats(crowd) - before + 1
        assert stream.ends() == [(closed.agent_id, pb.SUBSCRIPTION_EVENT_KIND_CLOSED)]
        touched = sum(touches.values())
        assert touched <= 20 + beats * TOUCHES_PER_BEAT, f"{touched} feed touches for one close, {beats} beats"

        others = [a for a in agents[::50] if a is not closed]
        await crowd.lead.send_batch([envelope(a.agent_id, "after the close") for a in others])
        await eventually(lambda: all("after the close" in stream.texts[a.agent_id] for a in others),
                         message="the others' messages after the close")
        assert stream.ends() == [(closed.agent_id, pb.SUBSCRIPTION_EVENT_KIND_CLOSED)]
        assert stream.error is None and not stream.task.done()
    finally:
        await stream.stop()


@module_loop
async def test_a_slow_agent_stops_at_max_in_flight_and_costs_nothing_while_the_others_go_on(crowd, reads, touches):
    agents = [crowd.kids[i] for i in SLOW]
    slow, others = agents[0], agents[1:]
    backlog = [f"backlog {i}" for i in range(8)]
    await crowd.lead.send_batch([envelope(slow.agent_id, text) for text in backlog])
    stream = Stream(agents, max_in_flight=4, slow={slow.agent_id})
    try:
        await eventually(lambda: len(stream.texts[slow.agent_id]) == 4, message="the slow agent's first 4")
        touches.clear()
        before = hub_beats(crowd)
        rounds = [f"m{i}" for i in range(10)]
        for n, text in enumerate(rounds):  # a round at a time: each wakes the stream anew
            await crowd.lead.send_batch([envelope(a.agent_id, text) for a in others])
            await eventually(lambda n=n: all(stream.texts[a.agent_id] == rounds[:n + 1] for a in others),
                             message=f"every other agent's messages up to {text}, in order")
        beats = hub_beats(crowd) - before + 1
        assert stream.texts[slow.agent_id] == backlog[:4], "no more than max_in_flight unacked"
        # a beat's safety slice may touch it once, and so may the wake of each append to it (JetStream
        # tells of its backlog's appends asynchronously, maybe after the stream opened)
        assert touches[slow.agent_id] <= beats + len(backlog), (
            f"the full feed was touched {touches[slow.agent_id]} times while the others got 500 messages")
        assert stream.ends() == [] and stream.error is None
    finally:
        await stream.stop()


@module_loop
async def test_a_backlog_takes_its_share_per_round_and_does_not_hold_back_the_other_agents(crowd, reads):
    agents = [crowd.kids[i] for i in FAIR]
    busy, others = agents[0], agents[1:]
    await crowd.lead.send_batch([envelope(busy.agent_id, f"backlog {i}") for i in range(300)])
    await crowd.lead.send_batch([envelope(a.agent_id, f"m{i}") for a in others for i in range(2)])
    stream = Stream(agents)  # the busy agent first: its feed is read first
    try:
        await eventually(lambda: len(stream.order) == 300 + 2 * len(others), timeout=30, message="everything")
        position = {(m.recipient, m.content.text): n for n, m in enumerate(stream.order)}
        last_other = max(position[a.agent_id, f"m{i}"] for a in others for i in range(2))
        assert last_other < position[busy.agent_id, "backlog 64"], (
            f"the other agents' messages came up to {last_other}, after the busy agent's 65th")
        assert stream.texts[busy.agent_id] == [f"backlog {i}" for i in range(300)]
        assert all(stream.texts[a.agent_id] == ["m0", "m1"] for a in others)
    finally:
        await stream.stop()


@module_loop
async def test_the_feeds_of_a_round_are_read_at_the_same_time(crowd):
    """A round's store reads of its feeds start together, not each after the one before (on JetStream a
    read is several round trips: one after the other, a stream of many agents with a message each
    waited for all of them in turn, 362 against 509 messages/s at N = 1,000 in bench/many_bench.py).
    The real next_deliveries is wrapped; the wrapper yields once before reading, so a hub that awaited
    each read before starting the next could never have two in flight."""
    agents = [crowd.kids[i] for i in ROUND]
    await crowd.lead.send_batch([envelope(a.agent_id, "waiting") for a in agents])
    store = crowd.mesh.store
    real = store.next_deliveries
    reading = [0, 0]  # now, most at once

    async def counted(recipient, *args, **kwargs):
        reading[0] += 1
        reading[1] = max(reading)
        try:
            await asyncio.sleep(0.01)
            return await real(recipient, *args, **kwargs)
        finally:
            reading[0] -= 1

    store.next_deliveries = counted
    stream = Stream(agents)  # every feed reads the store at attach: the first round reads all of them
    try:
        await eventually(lambda: all(stream.texts[a.agent_id] == ["waiting"] for a in agents),
                         message="every agent's message")
        assert reading[1] >= len(agents) // 2, f"at most {reading[1]} of {len(agents)} feeds read at once"
    finally:
        await stream.stop()
        del store.next_deliveries


def _other_process(crowd: Crowd) -> MeshProcess:
    """A registry-only mesh process on the crowd's store (its SQLite file, or its NATS namespace)."""
    store = crowd.mesh.config.store
    return MeshProcess(store.path.parent, "--services", "registry", *store_args(store))


@module_loop
async def test_a_close_made_by_another_mesh_process_is_noticed_within_a_few_beats(crowd, reads):
    agents = crowd.kids[:300]
    closed = agents[200]
    stream = Stream(agents)
    try:
        await _settled(crowd, stream, reads, agents)
        with _other_process(crowd) as process:
            async with MeshClient(process.address, timeout=30.0, admin_token=ADMIN_TOKEN) as elsewhere:
                reads.reset()
                before = hub_beats(crowd)
                await elsewhere.agent(crowd.lead.info, crowd.lead.credential).close(closed.agent_id,
                                                                                    reason="closed elsewhere")
                await eventually(lambda: stream.ends() != [], timeout=30, message="the close on the stream")
        beats = hub_beats(crowd) - before
        assert stream.ends() == [(closed.agent_id, pb.SUBSCRIPTION_EVENT_KIND_CLOSED)]
        assert beats <= 4, f"noticed after {beats} heartbeats"
        assert reads.total <= (beats + 2) * PER_BEAT, f"{reads.total} store reads in {beats} heartbeats"
        await crowd.lead.send(agents[0].agent_id, "after")
        await eventually(lambda: "after" in stream.texts[agents[0].agent_id], message="a delivery after")
    finally:
        await stream.stop()


class Drain:
    """Runs a Subscription's responses() in a task and records them."""

    def __init__(self, subscription: delivery.Subscription):
        self.subscription = subscription
        self.texts: dict[str, list[str]] = collections.defaultdict(list)
        self.events: list[tuple[str, int]] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for response in self.subscription.responses():
            which = response.WhichOneof("event")
            if which == "deliveries":
                for m in response.deliveries.messages:
                    self.texts[m.recipient].append(m.content.text)
            elif which == "subscription":
                self.events.append((response.subscription.agent_id, response.subscription.kind))

    async def stop(self) -> None:
        self.subscription.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@module_loop
async def test_attach_and_detach_on_an_open_subscription(crowd):
    hub = crowd.mesh.services.hub
    a, b, c = (crowd.kids[i] for i in SPARE[:3])
    subscription = hub.open([a.agent_id], 0, "test")
    drain = Drain(subscription)
    attached = pb.SUBSCRIPTION_EVENT_KIND_ATTACHED
    try:
        await eventually(lambda: (a.agent_id, attached) in drain.events)
        await crowd.lead.send(b.agent_id, "before attach")
        hub.attach(subscription, [b.agent_id, a.agent_id], 0)
        await eventually(lambda: drain.texts[b.agent_id] == ["before attach"], message="b's first message")
        assert drain.events == [(a.agent_id, attached), (b.agent_id, attached), (a.agent_id, attached)]
        await crowd.lead.send(b.agent_id, "after attach")
        await eventually(lambda: drain.texts[b.agent_id] == ["before attach", "after attach"])

        assert hub.detach(subscription, [b.agent_id, c.agent_id]) == [b.agent_id]
        await crowd.lead.send(b.agent_id, "after detach")
        await crowd.lead.send(a.agent_id, "to a")
        await eventually(lambda: drain.texts[a.agent_id] == ["to a"])
        assert drain.texts[b.agent_id] == ["before attach", "after attach"]
        assert hub.detach(subscription, [b.agent_id]) == []

        hub.attach(subscription, [b.agent_id], 0)  # again: what it did not ack comes again, then the new one
        await eventually(lambda: drain.texts[b.agent_id][2:] == ["before attach", "after attach", "after detach"])
        assert drain.events[-1] == (b.agent_id, attached)
        assert not [e for e in drain.events if e[1] != attached]
    finally:
        await drain.stop()
        hub.release(subscription)


@module_loop
async def test_closes_since_a_cursor_pages_through_the_closes_any_process_made(crowd):
    store = crowd.mesh.store
    first, second = (crowd.kids[i] for i in SPARE[3:5])
    start = await store.closes_since(None, 10)
    assert start.closed == [] and not start.more
    await crowd.lead.close(first.agent_id, reason="one")
    await crowd.lead.spawn("newcomer")  # an agent written, not closed: not among the closes
    await crowd.lead.close(second.agent_id, reason="two")
    page = await store.closes_since(start.cursor, 1)
    assert page.closed == [(first.agent_id, "one")] and page.more
    # on JetStream a read is a pull fetch with a short wait, which may come back empty before the server
    # has handed the records over; the hub reads again on its next beat, and so does this
    rest = await store.closes_since(page.cursor, 10)
    for _ in range(50):
        if rest.closed:
            break
        await asyncio.sleep(0.1)
        rest = await store.closes_since(page.cursor, 10)
    assert rest.closed == [(second.agent_id, "two")] and not rest.more
    assert (await store.closes_since(rest.cursor, 10)).closed == []
    assert (await store.closes_since(None, 10)).cursor >= rest.cursor
