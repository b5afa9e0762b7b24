"""The delivery contract on every store backend: the same scenarios against a
mesh on SQLite and on JetStream (a real nats-server). Sequences are read
from receipts, not assumed: they increase within an inbox on both backends,
and are contiguous from 1 only on SQLite (docs/jetstream.md)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import pytest

from harness.evidence import Record, announced_run
from harness.nats import NatsNode
from inboxmesh.client.mesh import MeshClient
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.registry.v1 import registry_pb2 as reg
from inboxmesh.runs.v1 import runs_pb2 as runs
from services.config import StoreConfig
from services.server import Mesh
from services.store.jetstream import JetStreamStore
from tests.fixtures import ADMIN_TOKEN, eventually, make_config
from tests.streams import Collector

ACCEPTED = pb.RECEIPT_STATUS_ACCEPTED


@pytest.fixture(scope="module")
def nats_node(tmp_path_factory):
    node = NatsNode(tmp_path_factory.mktemp("nats")).start()
    yield node
    node.kill()


@pytest.fixture(params=["sqlite", "jetstream"])
def backend(request):
    return request.param


@pytest.fixture
async def client(request, backend, tmp_path):
    config = make_config(tmp_path)
    if backend == "jetstream":
        node = request.getfixturevalue("nats_node")
        config = replace(config, store=node.store_config(nats_namespace=f"c{uuid.uuid4().hex[:12]}"))
    else:
        config = replace(config, store=StoreConfig(path=tmp_path / "mesh.db"))
    async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as c:
        yield c


async def test_send_deliver_ack_exactly_once_and_duplicates(client, backend):
    lead = await client.register("lead")
    a, b = await lead.spawn("a"), await lead.spawn("b")
    receipts = [await a.send(b.agent_id, f"m{i}", message_id=f"id-{i}") for i in range(5)]
    assert [r.status for r in receipts] == [ACCEPTED] * 5
    sequences = [r.sequence for r in receipts]
    assert sequences == sorted(sequences) and len(set(sequences)) == 5, "one order per inbox"
    if backend == "sqlite":
        assert sequences == [1, 2, 3, 4, 5]
    again = await a.send(b.agent_id, "m0", message_id="id-0")
    assert (again.status, again.sequence) == (pb.RECEIPT_STATUS_DUPLICATE, sequences[0])
    inbox = Collector(b)
    try:
        got = await inbox.wait_for(5)
        assert [m.content.text for m in got] == [f"m{i}" for i in range(5)], "FIFO per pair"
        first = await b.ack(m.sequence for m in got)
        second = await b.ack(m.sequence for m in got)
    finally:
        await inbox.stop()
    assert {r.status for r in first} == {pb.ACK_STATUS_CONSUMED}
    assert {r.status for r in second} == {pb.ACK_STATUS_ALREADY_CONSUMED}, "consumed once"
    assert (await a.status("id-3")).state == pb.MESSAGE_STATE_CONSUMED
    record = await Record.read(client)
    assert len(record.of(ev.EVENT_KIND_MESSAGE_CONSUMED, agent_id=b.agent_id)) == 5


async def test_tries_of_one_message_at_the_same_moment_store_it_once(client, caplog):
    """A client's retries racing its first try (several sends of one message id at once, some of them
    of messages already in the inbox): each message is stored once, every try answers its sequence, and
    the record has one accepted MESSAGE_SENT and one MESSAGE_STORED per message (on JetStream the sends
    that read no idempotency record go on without waiting for its creation: services/store/jetstream)."""
    lead = await client.register("lead")
    a, b = await lead.spawn("a"), await lead.spawn("b")
    earlier = await a.send(b.agent_id, "before", message_id="m-0")
    for round_ in range(4):
        tries = await asyncio.gather(*(a.send(b.agent_id, f"text {i}", message_id=f"m-{i}")
                                       for i in (round_, round_ + 1) for _ in range(3)))
        by_id: dict[str, set[int]] = {}
        for receipt in tries:
            assert receipt.status in (ACCEPTED, pb.RECEIPT_STATUS_DUPLICATE), receipt
            by_id.setdefault(receipt.message_id, set()).add(receipt.sequence)
        assert all(len(sequences) == 1 for sequences in by_id.values()), by_id
    record = await Record.read(client)
    stored = record.of(ev.EVENT_KIND_MESSAGE_STORED, agent_id=b.agent_id)
    assert sorted(e.message_id for e in stored) == [f"m-{i}" for i in range(5)], "each message stored once"
    accepted = [e for e in record.of(ev.EVENT_KIND_MESSAGE_SENT, sender=a.agent_id) if e.detail == "accepted"]
    assert sorted(e.message_id for e in accepted) == [f"m-{i}" for i in range(5)]
    assert next(e for e in stored if e.message_id == "m-0").sequence == earlier.sequence
    assert "stored twice" not in caplog.text


async def test_a_full_inbox_rejects_and_never_evicts(client):
    lead = await client.register("lead")
    small = await lead.spawn("small", inbox_capacity=3)
    sender = await lead.spawn("sender")
    receipts = [await sender.send(small.agent_id, f"m{i}") for i in range(5)]
    assert [r.status for r in receipts] == [ACCEPTED] * 3 + [pb.RECEIPT_STATUS_INBOX_FULL] * 2
    assert "capacity 3" in receipts[3].detail
    for r in receipts[:3]:
        assert (await sender.status(r.message_id)).state == pb.MESSAGE_STATE_QUEUED, "nothing evicted"
    assert [r.status for r in await small.ack([receipts[0].sequence])] == [pb.ACK_STATUS_CONSUMED]
    retry = await sender.send(small.agent_id, "m3", message_id=receipts[3].message_id)
    assert retry.status == ACCEPTED and retry.sequence > receipts[2].sequence, "room again after a consume"


async def test_close_dead_letters_tells_senders_and_refuses_new_sends(client):
    lead = await client.register("lead")
    a, b = await lead.spawn("a"), await lead.spawn("b")
    sent = await a.send(b.agent_id, "will die")
    await lead.close(b.agent_id, reason="finished early")
    status = await a.status(sent.message_id)
    assert (status.state, status.dead_letter_reason) == (pb.MESSAGE_STATE_DEAD_LETTERED, "recipient closed")
    inbox = Collector(a)
    try:
        [notice] = await inbox.wait_for(1)
    finally:
        await inbox.stop()
    assert notice.in_reply_to == sent.message_id and "recipient closed" in notice.content.text
    late = await a.send(b.agent_id, "too late")
    assert late.status == pb.RECEIPT_STATUS_TARGET_CLOSED
    dead = await a.dead_letters(sender=a.agent_id)
    assert [d.envelope.message_id for d in dead] == [sent.message_id]


async def test_concurrent_senders_keep_pair_fifo(client):
    lead = await client.register("lead")
    target = await lead.spawn("target")
    senders = [await lead.spawn(f"s{i}") for i in range(4)]

    async def blast(sender):
        for n in range(10):
            assert (await sender.send(target.agent_id, f"{sender.agent_id}:{n}")).status == ACCEPTED

    await asyncio.gather(*(blast(s) for s in senders))
    inbox = Collector(target, auto_ack=True)
    try:
        got = await inbox.wait_for(40, timeout=20)
    finally:
        await inbox.stop()
    assert [m.sequence for m in got] == sorted(m.sequence for m in got)
    for sender in senders:
        mine = [int(m.content.text.split(":")[1]) for m in got if m.sender == sender.agent_id]
        assert mine == list(range(10))


async def test_a_run_is_announced_exactly_once(client):
    lead = await client.register("lead")
    child = await lead.spawn("worker", run=reg.RunSpec(task="job", task_message_id="task-job"))
    results = await asyncio.gather(*(child.end_run(f"done {i}") for i in range(4)))
    assert sum(not r.already_ended for r in results) == 1
    run = await eventually(lambda: announced_run(client, child.run_id), message="announced")
    assert run.status == runs.RUN_STATUS_OK
    inbox = Collector(lead)
    try:
        [report] = await inbox.wait_for(1)
        await asyncio.sleep(0.3)
        assert len(inbox.messages) == 1
    finally:
        await inbox.stop()
    assert report.message_id == f"inboxmesh:announce:{child.run_id}" and report.in_reply_to == "task-job"



async def test_duplicates_are_found_after_jetstream_forgot_them(nats_node, tmp_path):
    """JetStream remembers a Nats-Msg-Id only within its duplicate window;
    the durable idempotency record answers after it: the same receipt
    (DUPLICATE, original sequence), one stored copy, also when the target
    has been closed since."""
    store = nats_node.store_config(nats_namespace=f"w{uuid.uuid4().hex[:12]}", nats_duplicate_window_s=0.5)
    config = replace(make_config(tmp_path), store=store)
    async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")
        a, b, c = await lead.spawn("a"), await lead.spawn("b"), await lead.spawn("c")
        first = await a.send(b.agent_id, "once", message_id="late-1")
        to_c = await a.send(c.agent_id, "once", message_id="late-2")
        assert first.status == to_c.status == ACCEPTED
        await asyncio.sleep(1.0)  # past the window: JetStream alone would store a second copy
        again = await a.send(b.agent_id, "once", message_id="late-1")
        assert (again.status, again.sequence) == (pb.RECEIPT_STATUS_DUPLICATE, first.sequence)
        await c.close()
        closed_since = await a.send(c.agent_id, "once", message_id="late-2")
        assert (closed_since.status, closed_since.sequence) == (pb.RECEIPT_STATUS_DUPLICATE, to_c.sequence)
        inbox = Collector(b)
        try:
            got = await inbox.wait_for(1)
            await asyncio.sleep(0.3)
            assert [m.message_id for m in inbox.messages] == ["late-1"], "one stored copy"
        finally:
            await inbox.stop()
        assert [m.message_id for m in got] == ["late-1"]


async def test_the_keeper_finds_nothing_to_restore_after_operations_that_finished(nats_node, tmp_path):
    """Every event the JetStream keeper derives from a write has the identity
    of the event the writing process published: after sends, deliveries,
    acks, a close with dead letters and a run announced, its replay adds
    no event (each is dropped as a copy) and the record holds each once."""
    config = replace(make_config(tmp_path), store=nats_node.store_config(nats_namespace=f"k{uuid.uuid4().hex[:12]}"))
    async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")
        a, b = await lead.spawn("a"), await lead.spawn("b")
        child = await lead.spawn("worker", run=reg.RunSpec(task="job", task_message_id="task-job"))
        receipts = [await a.send(b.agent_id, f"m{i}") for i in range(3)]
        inbox = Collector(b)
        try:
            got = await inbox.wait_for(3)
            await b.ack([got[0].sequence])
        finally:
            await inbox.stop()
        await lead.close(b.agent_id, "enough")  # two messages dead-lettered, notices to a
        await child.end_run("done")
        await eventually(lambda: announced_run(client, child.run_id), message="announced")
        assert isinstance(mesh.store, JetStreamStore)
        keeper = mesh.store.keeper
        # at least the final write of each key: 4 agents, 1 run, 3 message states (earlier ones may be
        # overwritten before the keeper, one second behind, reads them)
        await eventually(lambda: keeper.replayed >= 4 + 1 + len(receipts), timeout=30, interval=0.2,
                         message="the keeper replayed the writes")
        await asyncio.sleep(2.5)  # and whatever came last
        assert keeper.restored == 0, "the keeper's events were all copies of published ones"
        record = await Record.read(client)
        once: dict[tuple[int, str, str, int, str], int] = {}
        for event in record.events:
            key = (event.kind, event.agent_id, event.message_id, event.sequence, event.detail)
            once[key] = once.get(key, 0) + 1
        assert [k for k, n in once.items() if n > 1] == [], "no event recorded twice"
        assert len(record.of(ev.EVENT_KIND_MESSAGE_DEAD_LETTERED, agent_id=b.agent_id)) == 2
