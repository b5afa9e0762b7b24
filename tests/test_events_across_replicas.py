"""The event record seen through two mesh processes on one store (two Mesh objects on the same SQLite
file, or the same NATS namespace): a page of an agent's events holds every event about it in id order,
whichever subject or process it came from, and a watcher on one process sees every event the other
records, in order, once each, while both are busy."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from inboxmesh.client.mesh import MeshClient, envelope
from inboxmesh.events.v1 import events_pb2 as ev
from services.config import RunsConfig
from services.server import Mesh
from services.store.jetstream import inbox as inbox_module
from services.store.jetstream.store import JetStreamStore
from tests.fixtures import ADMIN_TOKEN, STORE, consumed_event_ids, eventually, make_config

pytestmark = pytest.mark.timeout(240)
CONSUMED = ev.EVENT_KIND_MESSAGE_CONSUMED


async def test_a_page_of_an_agents_events_holds_those_it_sent_and_those_it_received_in_id_order(tmp_path):
    """An agent is in an event as its subject (received, registered) or as its sender: the page after an id
    is the first events of either kind, however many of one kind follow."""
    async with Mesh(make_config(tmp_path)) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")
        x, y = await lead.spawn("x"), await lead.spawn("y")
        for i in range(3):
            await x.send(y.agent_id, f"x to y {i}")
        await lead.send_batch([envelope(x.agent_id, f"lead to x {i}") for i in range(30)])
        every = await client.admin_events(limit=1000)
        expected = [e.event_id for e in every if x.agent_id in (e.agent_id, e.sender)]
        pages: list[int] = []
        after = 0
        while True:
            page = await client.agent(lead.info, lead.credential).events(agent_id=x.agent_id, after=after, limit=10)
            if not page:
                break
            pages += [e.event_id for e in page]
            after = page[-1].event_id
        assert pages == expected, "pages of 10 give every event of x, in id order"


async def test_a_watcher_sees_every_consumption_while_the_other_process_records_its_sends(tmp_path):
    """The layout of the JetStream benchmark that hung: the receiver consumes through replica A and the
    sender watches those consumptions through A, while the sender sends through replica B, so A's own
    CONSUMED events interleave with B's SENT and STORED events. Every CONSUMED event must arrive, in id
    order, each once. On a busy machine a watcher's store read is overtaken by the events recorded while
    it runs; each read here answers only after A has recorded another event of its own (the real read,
    its answer held back), which makes that race happen on every read instead of now and then."""
    count = 400
    config = replace(make_config(tmp_path, default_capacity=10_000), runs=RunsConfig(max_active_children=100))
    async with Mesh(config) as a, Mesh(config) as b, MeshClient(a.address, admin_token=ADMIN_TOKEN) as on_a, \
            MeshClient(b.address, admin_token=ADMIN_TOKEN) as on_b:
        lead = await on_a.register("lead")
        sender, receiver = await lead.spawn("sender"), await lead.spawn("receiver")
        read, recorded = a.store.list_events, asyncio.Event()
        a.store.add_commit_listener(lambda first_id, rows: recorded.set())

        async def overtaken(query):
            found = await read(query)
            recorded.clear()  # the answer waits for an event recorded after the read: one it cannot hold
            with contextlib.suppress(TimeoutError):  # at the end nothing more comes: answer anyway
                await asyncio.wait_for(recorded.wait(), 0.5)
            return found

        a.store.list_events = overtaken  # type: ignore[method-assign]  # what the events service reads (the mesh's own store object)
        seen: list[int] = []

        async def watch() -> None:
            async for event in sender.watch_events(agent_id=receiver.agent_id, kinds=[CONSUMED], from_now=True):
                seen.append(event.event_id)

        async def consume() -> None:  # the receiver, on A
            async for response in receiver.subscribe(64):
                if response.WhichOneof("event") == "deliveries":
                    await receiver.ack(m.sequence for m in response.deliveries.messages)

        async def send() -> None:  # the sender, on B
            me = on_b.agent(sender.info, sender.credential)
            for i in range(count):
                await me.send(receiver.agent_id, f"m{i}")

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.3)  # the watch starts at "now"
        consumer = asyncio.create_task(consume())
        try:
            await send()
            lead_on_b = on_b.agent(lead.info, lead.credential)
            consumed = await eventually(lambda: consumed_event_ids(lead_on_b, receiver.agent_id, count),
                                        timeout=120, interval=0.5,
                                        message="every message consumed")
            await eventually(lambda: len(seen) >= len(consumed), timeout=30, interval=0.2,
                             message=f"the watcher on A saw {len(seen)} of {count} consumptions")
            assert seen == sorted(consumed), "every consumption once, in id order"
        finally:
            for task in (consumer, watcher):
                task.cancel()
            await asyncio.gather(consumer, watcher, return_exceptions=True)
            await asyncio.sleep(0.6)  # a read held back above (0.5 s at most) ends before the meshes stop


@pytest.mark.counts  # a busy machine may delay the receiver's read past the sender's next append (copies of it)
async def test_a_delivery_in_the_other_process_publishes_no_copies_of_events_recorded_before_it_was_told(tmp_path):
    """A message stored through B and delivered through A: B tells A of it once its sent and stored events
    are recorded, naming it, so A's first delivery publishes no copies of them (on JetStream a copy is a
    request each, dropped as a duplicate: two more a message where the sender and the receiver use
    different processes). The record keeps its causal order: each message's stored event before its
    delivered one, each once."""
    if STORE != "jetstream":
        pytest.skip("JetStream only: it counts the copies of events a delivery in another process publishes,"
                    " which the SQLite store never makes (the JetStream pass runs it)")
    count = 40
    config = replace(make_config(tmp_path), heartbeat_interval_s=60)  # a beat's safety read finds untold ones
    async with Mesh(config) as a, Mesh(config) as b, MeshClient(a.address, admin_token=ADMIN_TOKEN) as on_a, \
            MeshClient(b.address, admin_token=ADMIN_TOKEN) as on_b:
        lead = await on_a.register("lead")
        sender, receiver = await lead.spawn("sender"), await lead.spawn("receiver")
        assert isinstance(a.store, JetStreamStore)
        events = a.store.inbox.events
        publish = events.publish
        copies: list[str] = []

        async def counted(rows, **kwargs):
            if kwargs.get("copies"):
                copies.extend(row.message_id for row in rows)
            return await publish(rows, **kwargs)

        events.publish = counted  # type: ignore[method-assign]
        delivered: list[str] = []

        async def consume() -> None:  # the receiver, on A
            async for response in receiver.subscribe(64):
                if response.WhichOneof("event") == "deliveries":
                    delivered.extend(m.message_id for m in response.deliveries.messages)
                    await receiver.ack(m.sequence for m in response.deliveries.messages)

        consumer = asyncio.create_task(consume())
        try:
            me = on_b.agent(sender.info, sender.credential)
            await asyncio.sleep(0.3)  # subscribed and idle: what it delivers, it learns of from B's notices
            sent = [(await me.send(receiver.agent_id, f"m{i}")).message_id for i in range(count)]
            await eventually(lambda: len(delivered) >= count, timeout=30, message="every message delivered")
        finally:
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
            del events.publish
        assert delivered == sent
        assert copies == [], f"copies of {len(set(copies))} messages' events published"

        async def recorded() -> list[ev.Event] | None:  # a first delivery's event is recorded with its
            # consumption or 50 ms after the delivery (the last acks may have been cut short above)
            found = [e for e in await on_a.admin_events(limit=1000) if e.recipient == receiver.agent_id]
            return found if sum(e.kind == ev.EVENT_KIND_MESSAGE_DELIVERED for e in found) >= count else None

        record = await eventually(recorded, message="every delivery on record")
        for message_id in sent:
            kinds = [e.kind for e in record if e.message_id == message_id]
            assert kinds[:3] == [ev.EVENT_KIND_MESSAGE_SENT, ev.EVENT_KIND_MESSAGE_STORED,
                                 ev.EVENT_KIND_MESSAGE_DELIVERED], (message_id, kinds)


def _jetstream_only(what: str) -> None:
    if STORE != "jetstream":
        pytest.skip(f"JetStream only: {what}, which the SQLite store, one process's file, never needs"
                    " (the JetStream pass runs it)")


@contextlib.asynccontextmanager
async def _two_meshes(tmp_path) -> AsyncIterator[tuple[Mesh, Mesh, MeshClient, MeshClient]]:
    """Two mesh processes on one store, and an operator's client of each. B's watchers read the store once a
    minute instead of once a second (their safety net for events nobody told them of), so a test sees what
    the notices and the gaps do alone."""
    async with Mesh(make_config(tmp_path)) as a, Mesh(make_config(tmp_path)) as b, \
            MeshClient(a.address, admin_token=ADMIN_TOKEN) as on_a, \
            MeshClient(b.address, admin_token=ADMIN_TOKEN) as on_b:
        b.services.events._poll_interval_s = 60
        yield a, b, on_a, on_b


async def test_a_watcher_gets_the_events_another_process_records_without_reading_the_store(tmp_path):
    """On JetStream each mesh process tells the others of the events it records (core NATS notices that
    carry them): a watcher on B gets what A records as it is recorded, in id order, once each, with no read
    of the store after its first. Before, B learnt of A's events only from a gap in the ids of its own next
    event, or from its once-a-second read, and each such read was three requests to NATS (two mesh
    processes at 64 in flight, `bench/mesh_bench.py --store jetstream --replicas 2`: 733-869 msgs/s
    before, 1,067-1,113 after)."""
    _jetstream_only("it counts the reads of the event record one process makes for another's events")
    count = 30
    async with _two_meshes(tmp_path) as (a, b, on_a, on_b):
        lead = await on_a.register("lead")
        x, y = await lead.spawn("x"), await lead.spawn("y")
        read = b.store.list_events
        reads: list[int] = []

        async def counted(query):
            reads.append(query.after_event_id)
            return await read(query)

        b.store.list_events = counted  # type: ignore[method-assign]
        seen: list[ev.Event] = []

        async def watch() -> None:
            async for event in on_b.agent(y.info, y.credential).watch_events(agent_id=y.agent_id, from_now=True):
                seen.append(event)

        watcher = asyncio.create_task(watch())
        try:
            await eventually(lambda: len(reads) >= 1, timeout=10, message="the watch's first read")
            await asyncio.sleep(0.2)
            first_reads = len(reads)
            sent = [(await x.send(y.agent_id, f"m{i}")).message_id for i in range(count)]
            await eventually(lambda: len(seen) >= 2 * count, timeout=10,
                             message=f"the watcher on B got {len(seen)} of A's {2 * count} events (sent, stored)")
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        ids = [e.event_id for e in seen]
        assert ids == sorted(set(ids)), "in id order, once each"
        assert [e.message_id for e in seen if e.kind == ev.EVENT_KIND_MESSAGE_STORED] == sent
        record = [e.event_id for e in await on_a.admin_events(limit=1000) if y.agent_id in (e.agent_id, e.sender)]
        assert ids == [i for i in record if i >= ids[0]][:len(ids)], "every event of y from the first one seen on"
        assert len(reads) == first_reads, f"{len(reads) - first_reads} reads of the store for events it was told of"
        assert b.services.events.gaps_read == 0


async def test_a_watcher_reads_the_store_for_events_nobody_told_it_of(tmp_path):
    """A process that records events and tells nobody (a notice lost, a process killed between its write and
    its notice; here A's notices are switched off): the next event B is handed shows a gap in the ids; after
    waiting a moment for it to fill, B's watcher reads the store, and gets every event in id order, A's
    before B's own."""
    _jetstream_only("it switches off the notices one JetStream mesh process sends the others")
    async with _two_meshes(tmp_path) as (a, b, on_a, on_b):
        assert isinstance(a.store, JetStreamStore)

        async def untold(events) -> None:
            return None

        a.store.events._tell_others = untold  # type: ignore[method-assign]
        lead = await on_b.register("lead")  # B records events of its own first: its next one shows the gap
        x, y, z = await lead.spawn("x"), await lead.spawn("y"), await lead.spawn("z")
        seen: list[ev.Event] = []

        async def watch() -> None:
            async for event in on_b.agent(y.info, y.credential).watch_events(
                    agent_id=y.agent_id, kinds=[ev.EVENT_KIND_MESSAGE_STORED], from_now=True):
                seen.append(event)

        watcher = asyncio.create_task(watch())
        try:
            await asyncio.sleep(0.3)
            x_on_a = on_a.agent(x.info, x.credential)
            untold_ids = [(await x_on_a.send(y.agent_id, f"from A {i}")).message_id for i in range(3)]
            await asyncio.sleep(0.3)
            assert seen == [], "nobody told B, and its read of the store comes once a minute here"
            told = (await z.send(y.agent_id, "from B")).message_id
            await eventually(lambda: len(seen) >= 4, timeout=10,
                             message=f"the watcher on B got {len(seen)} of 4 stored events")
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        assert [e.message_id for e in seen] == [*untold_ids, told]
        assert b.services.events.gaps_read >= 1


async def test_the_keeper_is_told_of_every_event_and_publishes_no_copies_without_reading_the_record(tmp_path):
    """The keeper (one mesh process at a time) rolls every message state forward and publishes the events
    a state implies that it was not told of lately. Told of its own process's events as they are recorded and
    of the other's from their notices, it publishes none where both processes recorded theirs, and reads
    nothing of the events stream (before, it read every event back: about a tenth of a mesh process's CPU
    at 64 in flight)."""
    _jetstream_only("it counts what the JetStream store's keeper reads and publishes")
    count = 20
    async with _two_meshes(tmp_path) as (a, b, on_a, on_b):
        stores = [s for s in (a.store, b.store) if isinstance(s, JetStreamStore)]
        assert len(stores) == 2
        event_reads: list[str] = []
        copies: list[str] = []
        for store in stores:
            direct_batch, unrecorded = store.conn.direct_batch, store.keeper._unrecorded

            async def read(stream, *args, _direct_batch=direct_batch, **kwargs):
                if stream == stores[0].conn.event_stream:
                    event_reads.append(stream)
                return await _direct_batch(stream, *args, **kwargs)

            def unrecorded_rows(rows, _unrecorded=unrecorded):
                found = _unrecorded(rows)
                copies.extend(f"{row.kind}:{row.message_id}" for row in found)
                return found

            store.conn.direct_batch = read  # type: ignore[method-assign]
            store.keeper._unrecorded = unrecorded_rows  # type: ignore[method-assign]
        await eventually(lambda: any(s.keeper._holding for s in stores), timeout=15, message="a keeper holds the lease")
        lead = await on_a.register("lead")
        x, y = await lead.spawn("x"), await lead.spawn("y")
        y_on_b = on_b.agent(y.info, y.credential)
        for i in range(count):  # stored through A, consumed through B
            await x.send(y.agent_id, f"m{i}")
        consumed = 0
        async for response in y_on_b.subscribe(64):
            if response.WhichOneof("event") == "deliveries":
                acks = await y_on_b.ack(m.sequence for m in response.deliveries.messages)
                consumed += len(acks)
                if consumed >= count:
                    break
        rolled = sum(s.keeper.replayed for s in stores)
        await eventually(lambda: sum(s.keeper.replayed for s in stores) >= rolled + count, timeout=15,
                         message="the keeper rolled the consumptions forward")
        assert copies == [], f"the keeper published {len(copies)} events again"
        assert event_reads == [], f"{len(event_reads)} reads of the events stream"


async def test_a_first_deliverys_event_rides_with_the_consumption_and_stays_before_it(tmp_path, monkeypatch):
    """On JetStream a first delivery's delivered event is not written before the message goes out: it is
    recorded with the consumed event when the ack comes through the same process before the delivery's
    state entry is written (one write for both), else with that entry. Acks through the other process keep
    the order too: one before the entry is written finds no delivery, and the delivering process records
    none after the consumption; one after it records a copy of the delivered event first. Every message:
    sent, stored, at most one delivered, then one consumed, in that order."""
    _jetstream_only("it checks when the delivered events of first deliveries are written")
    monkeypatch.setattr(inbox_module, "MARK_DELAY_S", 4.0)  # long enough that no early ack below is late by chance
    async with _two_meshes(tmp_path) as (a, b, on_a, on_b):
        lead = await on_a.register("lead")
        receiver = await lead.spawn("receiver")
        assert isinstance(a.store, JetStreamStore)
        events = a.store.inbox.events
        publish = events.publish
        calls: list[list[tuple[str, int]]] = []

        async def counted(rows, **kwargs):
            calls.append([(row.message_id, row.kind) for row in rows])
            return await publish(rows, **kwargs)

        events.publish = counted  # type: ignore[method-assign]
        here, early, late = ([f"{part}{i}" for i in range(5)] for part in ("here", "early", "late"))
        got: dict[str, int] = {}
        subscription = receiver.subscribe(64)
        try:
            async def until(ids: list[str]) -> None:
                while not all(i in got for i in ids):
                    response = await subscription.read()
                    if response.WhichOneof("event") == "deliveries":
                        got.update((m.message_id, m.sequence) for m in response.deliveries.messages)

            over_b = on_b.agent(receiver.info, receiver.credential)
            await lead.send_batch([envelope(receiver.agent_id, i, message_id=i) for i in here])
            await asyncio.wait_for(until(here), 30)
            await receiver.ack(got[i] for i in here)  # through A, which delivered them
            await lead.send_batch([envelope(receiver.agent_id, i, message_id=i) for i in early + late])
            await asyncio.wait_for(until(early + late), 30)
            await over_b.ack(got[i] for i in early)  # through B, before A writes the deliveries
            await asyncio.sleep(4.5)  # A writes the deliveries of `late` (and loses those of `early`)
            await over_b.ack(got[i] for i in late)  # through B, after
            await asyncio.sleep(0.3)
        finally:
            subscription.cancel()
            del events.publish
        D, C = ev.EVENT_KIND_MESSAGE_DELIVERED, ev.EVENT_KIND_MESSAGE_CONSUMED
        for message_id in here:  # its delivered event went with its consumed one, in one write
            assert [(message_id, D), (message_id, C)] in [[r for r in call if r[0] == message_id] for call in calls]
        record = [e for e in await on_a.admin_events(limit=1000) if e.recipient == receiver.agent_id]
        for message_id in here + early + late:
            kinds = [e.kind for e in record if e.message_id == message_id]
            expected = [ev.EVENT_KIND_MESSAGE_SENT, ev.EVENT_KIND_MESSAGE_STORED] + ([] if message_id in early
                                                                                   else [D]) + [C]
            assert kinds == expected, (message_id, kinds)
