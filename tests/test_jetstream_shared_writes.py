"""Writes shared by concurrent callers (services/store/jetstream/shared_writes.py) on a real nats-server:
many callers at once go out in a few flushes, atomic batches among them, each caller's messages in its
order and the callers' in the order they came; a message JetStream refuses in a batch (a message id it
has stored) costs the batch, not the other callers' messages. And an ack that consumes the front of an
inbox removes it in one purge, never a message it did not consume."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import pytest
from nats.js.api import StorageType, StreamConfig

from harness.nats import NatsNode
from inboxmesh.client.mesh import MeshClient
from services.server import Mesh
from services.store.jetstream.connection import JetStreamConnection
from services.store.jetstream.shared_writes import BATCH_MIN
from services.store.jetstream.store import JetStreamStore
from tests.fixtures import ADMIN_TOKEN, make_config
from tests.streams import Collector

pytestmark = pytest.mark.store_independent


@pytest.fixture
async def conn(tmp_path):
    with NatsNode(tmp_path / "nats") as node:
        connection = JetStreamConnection(node.store_config(nats_namespace=f"w{uuid.uuid4().hex[:12]}"))
        await connection.open()
        await connection.js.add_stream(StreamConfig(name="W", subjects=["w.>"], storage=StorageType.FILE,
                                                    allow_atomic=True, duplicate_window=60))
        try:
            yield connection
        finally:
            await connection.close()


def _writes(conn: JetStreamConnection):
    # the class the store uses, on a stream of the test's own
    return type(conn.event_writes)("W", conn.publish_batch, conn.publish_each)


async def _stream_order(conn: JetStreamConnection) -> list[bytes]:
    last = (await conn.js.stream_info("W")).state.last_seq
    return [(await conn.js.get_msg("W", seq)).data for seq in range(1, last + 1)]


async def test_callers_at_once_share_flushes_and_keep_their_order(conn):
    writes = _writes(conn)
    callers = 64
    # each caller writes two messages; all start at once
    answers = await asyncio.gather(*(writes.publish([(f"w.{c}", f"{c}-0".encode(), {}),
                                                     (f"w.{c}", f"{c}-1".encode(), {})]) for c in range(callers)))
    assert writes.flushes < callers / 4, f"{writes.flushes} flushes for {callers} callers"
    assert writes.batches >= 1, "many messages waiting go as an atomic batch"
    seqs = [[ack.seq for ack in found] for found in answers]
    assert all(first + 1 == second for first, second in seqs), "a caller's messages follow each other"
    assert sorted(s for pair in seqs for s in pair) == list(range(1, 2 * callers + 1)), "every message stored once"
    order = await _stream_order(conn)
    assert order == [f"{c}-{i}".encode() for c in range(callers) for i in range(2)], "callers in the order they came"


async def test_a_lone_write_goes_at_once_one_message_at_a_time(conn):
    writes = _writes(conn)
    found = await writes.publish([("w.a", b"only", {})])
    assert [ack.seq for ack in found] == [1]
    assert (writes.flushes, writes.batches) == (1, 0)


async def test_a_refused_message_costs_the_batch_not_the_other_callers(conn):
    writes = _writes(conn)
    await writes.publish([("w.x", b"stored before", {"Nats-Msg-Id": "again"})])
    block = asyncio.Event()
    held = conn.publish_each

    async def slow_first(messages):  # the first flush waits, so everything after comes together
        await block.wait()
        return await held(messages)

    writes._publish_each = slow_first
    first = asyncio.ensure_future(writes.publish([("w.y", b"first", {})]))
    await asyncio.sleep(0.05)
    others = [asyncio.ensure_future(writes.publish([(f"w.{c}", f"m{c}".encode(), {"Nats-Msg-Id": f"id{c}"})]))
              for c in range(BATCH_MIN)]
    retry = asyncio.ensure_future(writes.publish([("w.x", b"a retry", {"Nats-Msg-Id": "again"})]))
    await asyncio.sleep(0.05)
    writes._publish_each = held
    block.set()
    await first
    answers = [(await task)[0] for task in others]
    assert all(not ack.duplicate and ack.seq > 0 for ack in answers), answers
    retried = (await retry)[0]
    assert retried.duplicate and retried.seq == 1, retried
    assert writes.batches == 0, "the batch with the retry in it was refused, then one at a time stored the rest"
    order = await _stream_order(conn)
    assert order == [b"stored before", b"first", *[f"m{c}".encode() for c in range(BATCH_MIN)]]


async def test_an_ack_of_the_front_purges_only_what_it_consumed(tmp_path):
    with NatsNode(tmp_path / "nats") as node:
        config = replace(make_config(tmp_path), store=node.store_config(nats_namespace=f"p{uuid.uuid4().hex[:12]}"))
        async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            assert isinstance(mesh.store, JetStreamStore)
            lead = await client.register("lead")
            sink = await lead.spawn("sink")
            receipts = [await lead.send(sink.agent_id, f"m{i}") for i in range(8)]
            sequences = [r.sequence for r in receipts]
            held = Collector(sink, max_in_flight=8)
            messages = mesh.store.inbox.messages
            purges: list[bool] = []
            purge_front = messages.purge_front

            async def counted(recipient, final):
                purges.append(await purge_front(recipient, final))
                return purges[-1]

            messages.purge_front = counted  # type: ignore[method-assign]  # counts what each call came to
            try:
                await held.wait_for(8)
                # the first one stays unacked: the others are not the front, one delete each
                await sink.ack(sequences[1:5])
                assert await messages.unconsumed(sink.agent_id) == 4
                assert purges == [False], "the read found an unconsumed message below them: no purge"
                assert (await messages.read(sink.agent_id, 1, 10))[0][0].sequence == sequences[0]
                # now the front: the first and the three after the acked ones (one purge below the last)
                await sink.ack([sequences[0], *sequences[5:7]])
                left = [env.sequence for env in (await messages.read(sink.agent_id, 1, 10))[0]]
                assert left == sequences[7:], "everything consumed is gone, the unconsumed last one stays"
                assert await messages.unconsumed(sink.agent_id) == 1
                assert purges == [False, True], "the front went in one purge"
                await sink.ack(sequences[7:])
                assert await messages.unconsumed(sink.agent_id) == 0
            finally:
                await held.stop()


async def test_a_write_whose_answer_is_settled_already_does_not_shift_the_answers_after_it(conn):
    """A flush hands each write its slice of the answers, in order. A write whose future is done before the
    flush ends (nothing does that today; a cancel would) is skipped, and the writes after it still get
    their own messages' sequences, not the slice of the one skipped."""
    writes = _writes(conn)
    queued = [writes.enqueue([(f"w.{c}", f"{c}-{i}".encode(), {}) for i in range(2)]) for c in range(3)]
    queued[1][0].done.cancel()
    last = await writes.answers(queued[2])
    assert [(await conn.js.get_msg("W", ack.seq)).data for ack in last] == [b"2-0", b"2-1"]
