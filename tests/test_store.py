"""The SQLite store on its own: atomicity under concurrency, group commit,
isolation of a failing operation."""

import asyncio

import pytest

from inboxmesh.client import errors
from inboxmesh.client.mesh import envelope
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services import auth
from services.clock import now_us
from services.config import StoreConfig
from services.store.base import ACCEPTED, AGENT_OPEN, TARGET_CLOSED, AgentRecord, AppendItem, EventQuery, EventRow
from services.store.sqlite import SqliteStore
from services.store.sqlite.writer import Writer, connect

pytestmark = pytest.mark.store_independent


@pytest.fixture
async def store(tmp_path):
    s = SqliteStore(StoreConfig(path=tmp_path / "store.db"))
    await s.start()
    try:
        yield s
    finally:
        await s.close()
        await s.close()


async def _agent(store, name, parent=None, capacity=1000):
    agent_id = auth.new_agent_id()
    record = AgentRecord(
        agent_id=agent_id, name=name, mode=1, parent_id=parent.agent_id if parent else "",
        scope_id=parent.scope_id if parent else agent_id, depth=0, state=AGENT_OPEN, metadata={},
        inbox_capacity=capacity, created_at_us=now_us(), credential_hash=auth.credential_hash("x"),
    )
    return await store.create_agent(record)


async def test_concurrent_appends_are_group_committed(store):
    lead = await _agent(store, "lead")
    b = await _agent(store, "b", lead)
    commits_before = store.writer.commits

    async def one(i):
        return await store.append(lead.agent_id, [AppendItem(envelope(b.agent_id, f"m{i}", message_id=f"m{i}"))],
                                  now_us())

    outcomes = await asyncio.gather(*(one(i) for i in range(200)))
    assert sorted(o[0].sequence for o in outcomes) == list(range(1, 201))
    assert all(o[0].status == ACCEPTED for o in outcomes)
    assert store.writer.commits - commits_before < 200, "operations queued together share a commit"


async def test_capacity_holds_under_concurrent_senders(store):
    lead = await _agent(store, "lead")
    small = await _agent(store, "small", lead, capacity=10)
    outcomes = await asyncio.gather(*(
        store.append(lead.agent_id, [AppendItem(envelope(small.agent_id, str(i)))], now_us()) for i in range(50)))
    statuses = [o[0].status for o in outcomes]
    assert statuses.count(ACCEPTED) == 10 and statuses.count(pb.RECEIPT_STATUS_INBOX_FULL) == 40


async def test_exactly_one_ack_wins(store):
    lead = await _agent(store, "lead")
    b = await _agent(store, "b", lead)
    await store.append(lead.agent_id, [AppendItem(envelope(b.agent_id, "once"))], now_us())
    results = await asyncio.gather(*(store.ack(b.agent_id, [1], now_us()) for _ in range(20)))
    statuses = [r[0].status for r in results]
    assert statuses.count(pb.ACK_STATUS_CONSUMED) == 1
    assert statuses.count(pb.ACK_STATUS_ALREADY_CONSUMED) == 19


async def test_sends_racing_a_close_are_accepted_then_dead_lettered_or_refused(store):
    lead = await _agent(store, "lead")
    b = await _agent(store, "b", lead)
    sends = [store.append(lead.agent_id, [AppendItem(envelope(b.agent_id, str(i), message_id=str(i)))], now_us())
             for i in range(100)]
    close = store.close_agent(b.agent_id, "racing", now_us())
    *outcomes, closed = await asyncio.gather(*sends[:50], close, *sends[50:])
    outcomes.append(closed)
    closed_outcome = outcomes.pop(50)
    send_outcomes = [o[0] for o in outcomes]
    accepted = {o.message_id for o in send_outcomes if o.status == ACCEPTED}
    refused = {o.message_id for o in send_outcomes if o.status == TARGET_CLOSED}
    assert len(accepted) + len(refused) == 100
    assert {r.envelope.message_id for r in closed_outcome.dead_lettered} == accepted
    for mid in accepted:
        assert (await store.get_message_by_sender(lead.agent_id, mid)).state == pb.MESSAGE_STATE_DEAD_LETTERED


async def test_a_failing_operation_does_not_sink_its_batch(store):
    await _agent(store, "lead")

    def boom(conn, events):
        conn.execute("INSERT INTO meta VALUES ('x', 'y')")
        events.append(EventRow(1, 1, "agt_boom", detail="must not be recorded"))
        raise errors.FailedPrecondition("deliberate")

    failing = store.writer.run(boom)
    fine = _agent(store, "fine")
    results = await asyncio.gather(failing, fine, return_exceptions=True)
    assert isinstance(results[0], errors.FailedPrecondition)
    assert isinstance(results[1], AgentRecord)
    assert (await store.get_agent(results[1].agent_id)).name == "fine"
    assert await store._read(lambda c: c.execute("SELECT count(*) FROM meta WHERE key='x'").fetchone()[0]) == 0
    assert not [e for e in await store.list_events(EventQuery(agent_id="agt_boom")) if e.detail]


async def test_an_event_the_table_cannot_hold_fails_its_operation_only(store):
    """An event value SQLite cannot bind (an int past 64 bits) used to escape the commit and leave the
    transaction open: every later write of the mesh then failed."""
    def overflowing(conn, events):
        conn.execute("INSERT INTO meta VALUES ('z', 'y')")
        events.append(EventRow(now_us(), 1, "agt_over", seq=2**64 - 1, detail="too big"))

    failing = store.writer.run(overflowing)
    fine = _agent(store, "fine")
    results = await asyncio.gather(failing, fine, return_exceptions=True)
    assert isinstance(results[0], errors.Internal), results[0]
    assert isinstance(results[1], AgentRecord)
    assert (await store.get_agent(results[1].agent_id)).name == "fine"
    assert await store._read(lambda c: c.execute("SELECT count(*) FROM meta WHERE key='z'").fetchone()[0]) == 0
    later = await _agent(store, "later")  # the writer goes on
    assert (await store.get_agent(later.agent_id)).name == "later"


async def test_child_of_closed_or_missing_parent_is_refused(store):
    lead = await _agent(store, "lead")
    await store.close_agent(lead.agent_id, "bye", now_us())
    with pytest.raises(errors.FailedPrecondition):
        await _agent(store, "late", lead)
    ghost = AgentRecord(**{**lead.__dict__, "agent_id": "agt_ghost"})
    with pytest.raises(errors.NotFound):
        await _agent(store, "orphan", ghost)


async def test_closed_store_refuses_calls_clearly(tmp_path):
    s = SqliteStore(StoreConfig(path=tmp_path / "x.db"))
    await s.start()
    await s.close()
    with pytest.raises(errors.Unavailable):
        await s.get_agent("agt_x")


async def test_a_savepoint_sqlite_fails_fails_the_batch_and_leaves_no_transaction_open(tmp_path):
    """sqlite failing a savepoint statement itself (here: its savepoint gone when an operation fails, as
    an I/O error can leave it) fails every operation of the batch with STORE_UNAVAILABLE and rolls the
    transaction back. It escaped the flush before: the batch's callers waited for ever, and the open
    transaction refused every later BEGIN."""
    conn = connect(tmp_path / "w.db", synchronous="FULL", busy_timeout_ms=1000)
    conn.execute("CREATE TABLE t (v INTEGER)")
    writer = Writer(conn, max_pending=16, max_ops_per_commit=16)
    writer.start()

    def insert(value):
        def op(c, events):
            c.execute("INSERT INTO t VALUES (?)", (value,))
        return op

    def breaks_its_savepoint(c, events):
        c.execute("RELEASE op")
        raise ValueError("and fails")

    first, broken = await writer.enqueue(insert(1)), await writer.enqueue(breaks_its_savepoint)
    for future in (first, broken):
        with pytest.raises(errors.Unavailable) as caught:
            await asyncio.wait_for(future, 5)
        assert caught.value.reason == errors.Reason.STORE_UNAVAILABLE
    assert await asyncio.wait_for(writer.run(insert(2)), 5) is None, "the next batch commits"
    assert [v for (v,) in conn.execute("SELECT v FROM t")] == [2], "the failed batch left nothing"
    await writer.close()
