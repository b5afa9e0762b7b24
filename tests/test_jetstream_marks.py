"""A first delivery's state entry is written a moment later (InboxLog._mark), and a delivery of the same
message meanwhile waits for that write. When the waiting delivery is cancelled (its subscription broke),
the write and every other delivery waiting for it go on: once, after a NATS node was killed and restarted
under load, a cancelled wait cancelled the write's shared future, the next subscription's delivery ended
as if cancelled itself, and nothing more was delivered for 240 s (tests/test_jetstream_faults.py,
test_a_restarted_nats_node_loses_nothing_accepted; the log said "first deliveries not written ...
InvalidStateError"). The same again later through an ack: the consumer's ack of those messages waited
for the write when its deadline passed, and the cancelled ack cancelled the future."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from inboxmesh.common.v1 import envelope_pb2
from services.store.jetstream import inbox as inbox_module
from services.store.jetstream.inbox import InboxLog
from services.store.jetstream.kv import MessageState

pytestmark = pytest.mark.store_independent


def _log_with_a_write_in_flight(monkeypatch) -> tuple[InboxLog, envelope_pb2.Envelope, asyncio.Event]:
    """An InboxLog whose first delivery of one message (agt_r, 7) is not written yet; its write, once
    started, waits for the event."""
    release = asyncio.Event()

    async def slow_write(conn, bucket, entries):  # the write in flight while deliveries wait for it
        await release.wait()
        return [1] * len(entries)

    async def nothing_stored(conn, bucket, keys):
        return {}

    monkeypatch.setattr(inbox_module.kv, "write_many", slow_write)
    monkeypatch.setattr(inbox_module.kv, "last_many", nothing_stored)
    log = InboxLog(conn=None, events=None, agents=SimpleNamespace(fresh=lambda *_: None))  # type: ignore[arg-type]
    envelope = envelope_pb2.Envelope(message_id="m-1", sequence=7)
    key = ("agt_r", 7)
    log._unmarked[key] = MessageState.first(envelope, inbox_module.DELIVERED).first_attempt(1)
    return log, envelope, release


async def _a_waiter_cancelled_while_the_write_is_in_flight(monkeypatch, waiter) -> None:
    """Start the write of the first delivery of (agt_r, 7), let `waiter(log, envelope)` wait for it and
    cancel it; then the next subscription's delivery of the message waits for the same write: the write
    ends without an InvalidStateError, and the delivery goes on."""
    log, envelope, release = _log_with_a_write_in_flight(monkeypatch)
    key = ("agt_r", 7)
    writer = asyncio.create_task(log._mark([key]))
    await asyncio.sleep(0)
    assert key in log._marking, "the write is in flight"

    broken = asyncio.create_task(waiter(log, envelope))
    await asyncio.sleep(0)
    broken.cancel()
    with pytest.raises(asyncio.CancelledError):
        await broken
    resumed = asyncio.create_task(log._first_deliveries("agt_r", [envelope], 3, 2))  # the next subscription's
    await asyncio.sleep(0)
    release.set()
    await writer  # no InvalidStateError: its future was not cancelled
    assert await asyncio.wait_for(resumed, 5) == [None], "the next delivery goes on (its entry was written)"
    assert not log._marking and not log._unmarked


async def test_a_cancelled_wait_for_a_first_deliverys_write_cancels_neither_the_write_nor_other_waiters(
        monkeypatch):
    # a delivery whose subscription broke while it waited for the write
    await _a_waiter_cancelled_while_the_write_is_in_flight(
        monkeypatch, lambda log, envelope: log._first_deliveries("agt_r", [envelope], 3, 2))


async def test_an_ack_cancelled_while_it_waits_for_a_first_deliverys_write_does_not_cancel_it(monkeypatch):
    """The ack of a message whose first delivery is being written waits for the write (the entry it then
    changes); the ack's deadline passes and the call is cancelled: the write goes on, and the next
    subscription's delivery of the message is not cancelled with it (it raised CancelledError)."""
    await _a_waiter_cancelled_while_the_write_is_in_flight(
        monkeypatch, lambda log, envelope: log._consume_many([("agt_r", 7, 1)], 3))
