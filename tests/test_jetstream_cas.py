"""A compare-and-set on JetStream is won or lost; a request that fails is neither. Against a real
nats-server: a stale revision loses, and a write NATS refuses (a stream limit an operator lowered) or
cannot answer (the server is gone) is raised, and reaches the store's callers as Unavailable
(STORE_UNAVAILABLE). The store used to take any exception of a conditional write for a lost race: it
retried a refused run update a hundred times and then reported contention, and a run it could not
read because NATS was down was reported as no run at all."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import KeyValueConfig

from harness.nats import NatsNode
from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.runs.v1 import runs_pb2
from services import auth
from services.clock import now_us
from services.store.base import AGENT_OPEN, AgentRecord, RunRecord, SpawnLimits
from services.store.jetstream import JetStreamStore
from services.store.jetstream.kv import CasResult, write
from tests.fixtures import eventually

pytestmark = pytest.mark.store_independent


@pytest.fixture
def node(tmp_path) -> Iterator[NatsNode]:
    node = NatsNode(tmp_path / "nats").start()
    try:
        yield node
    finally:
        node.kill()


@pytest.fixture
async def store(node) -> AsyncIterator[JetStreamStore]:
    s = JetStreamStore(node.store_config(nats_timeout_s=1.0, nats_namespace=f"cas{uuid.uuid4().hex[:12]}"))
    await s.start()
    try:
        yield s
    finally:
        if node.proc is None or node.proc.poll() is not None:
            node.start()  # the same port: the store reconnects, then drains
            await eventually(lambda: s.conn.nc.is_connected, timeout=30, interval=0.05, message="reconnected")
        await s.close()


async def _limit_messages(store: JetStreamStore, bucket: str, max_msg_size: int) -> None:
    """What an operator does to the stream behind a bucket: cap the size of its messages."""
    js = store.conn.js
    info = await js.stream_info(store.conn.kv_stream(bucket))
    info.config.max_msg_size = max_msg_size
    await js.update_stream(info.config)


async def _child_with_run(store: JetStreamStore) -> RunRecord:
    at = now_us()
    lead_id, child_id = auth.new_agent_id(), auth.new_agent_id()
    lead = AgentRecord(agent_id=lead_id, name="lead", mode=1, parent_id="", scope_id=lead_id, depth=0,
                       state=AGENT_OPEN, metadata={}, inbox_capacity=10, created_at_us=at,
                       credential_hash=auth.credential_hash("x"))
    await store.create_agent(lead)
    child = AgentRecord(agent_id=child_id, name="worker", mode=1, parent_id=lead_id, scope_id=lead_id, depth=1,
                        state=AGENT_OPEN, metadata={}, inbox_capacity=10, created_at_us=at,
                        credential_hash=auth.credential_hash("y"))
    run = RunRecord(run_id=f"run-{uuid.uuid4().hex[:8]}", child_id=child_id, requester_id=lead_id,
                    task="a task long enough to make the record bigger than the limit set below",
                    task_message_id="task-1", status=runs_pb2.RUN_STATUS_RUNNING,
                    announce_state=runs_pb2.ANNOUNCE_STATE_WAITING, created_at_us=at)
    await store.create_child(child, run, SpawnLimits(max_depth=3, max_active_children=10))
    return run


async def test_a_conditional_write_is_lost_only_to_another_write(node):
    nc = await nats.connect(node.url)
    try:
        kv = await nc.jetstream(timeout=2).create_key_value(KeyValueConfig(bucket="cas_results", history=1))
        revision = await kv.create("k", b"1")
        assert await write(kv, "k", b"2", revision) is CasResult.WON
        assert await write(kv, "k", b"3", revision) is CasResult.LOST, "the revision read is stale"
        assert await write(kv, "k", b"4", 0) is CasResult.LOST, "a create of a key that exists"
        assert await write(kv, "fresh", b"1", 0) is CasResult.WON
        assert (await kv.get("k")).value == b"2"
    finally:
        await nc.close()


async def test_a_conditional_write_whose_request_fails_is_raised_not_lost(node):
    nc = await nats.connect(node.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        js = nc.jetstream(timeout=1)
        kv = await js.create_key_value(KeyValueConfig(bucket="cas_failures", history=1))
        revision = await kv.create("k", b"1")
        info = await js.stream_info("KV_cas_failures")
        info.config.max_msg_size = 4
        await js.update_stream(info.config)
        with pytest.raises(nats.js.errors.APIError) as refused:
            await write(kv, "k", b"a value over the limit", revision)
        assert not isinstance(refused.value, nats.js.errors.KeyWrongLastSequenceError)
        node.kill()
        with pytest.raises((nats.errors.Error, TimeoutError)):
            await write(kv, "k", b"2", revision)
    finally:
        node.start()
        await nc.close()


async def test_a_run_update_nats_refuses_is_unavailable_not_contention(store):
    run = await _child_with_run(store)
    await _limit_messages(store, "runs", 16)
    with pytest.raises(errors.Unavailable) as caught:
        await store.end_run(run.run_id, runs_pb2.RUN_STATUS_OK, "done", now_us())
    assert caught.value.reason == Reason.STORE_UNAVAILABLE, caught.value
    await _limit_messages(store, "runs", -1)
    ended, already_ended = await store.end_run(run.run_id, runs_pb2.RUN_STATUS_OK, "done", now_us())
    assert not already_ended, "the refused update changed nothing"
    assert ended.status == runs_pb2.RUN_STATUS_OK


async def test_a_run_read_while_nats_is_down_is_unavailable_not_missing(node, store):
    run = await _child_with_run(store)
    assert (await store.get_run(run_id=run.run_id)) is not None
    node.kill()
    with pytest.raises(errors.Unavailable) as caught:
        await store.get_run(run_id=run.run_id)
    assert caught.value.reason == Reason.STORE_UNAVAILABLE, caught.value


async def test_pipelined_publishes_get_each_refusal_as_an_answer(store):
    """JetStreamConnection.publish_each answers each publish with its PubAck or the APIError JetStream
    answered: an inbox at its limit (10077) beside a message it took. It used nats-py's publish_async,
    whose reply handler raises an error answer into the connection's error callback and leaves the
    publish's future unresolved: the whole call waited for its deadline and failed (TimeoutError), and
    under two replicas every copy of an event another process was storing (10158) cost 5 s."""
    conn = store.conn
    subject = f"{conn.ns}.inbox.full-{uuid.uuid4().hex[:8]}"
    js = conn.js
    info = await js.stream_info(conn.inbox_stream)
    info.config.max_msgs_per_subject = 1  # what a capacity of one does to its subject
    await js.update_stream(info.config)
    acks = await conn.publish_each([(subject, b"first", {}), (subject, b"second", {})])
    assert not isinstance(acks[0], BaseException) and acks[0].seq > 0, "the first is stored"
    assert isinstance(acks[1], nats.js.errors.APIError) and acks[1].err_code == 10077, \
        "the second is refused, and says why"
