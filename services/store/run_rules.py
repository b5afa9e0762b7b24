"""Run-record transitions shared by the stores: ending a run, settling its
announce, the announce message itself, and the events each step records.
The stores make each transition atomic their own way (a transaction, a
compare-and-set)."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from inboxmesh.client.tracing import trace_id_of
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.registry.v1 import registry_pb2
from inboxmesh.runs.v1 import runs_pb2
from services.store.base import ACCEPTED, ANNOUNCE_PENDING, ANNOUNCED, RECEIPT_NAME, EventRow, RunRecord

_MESH_ORIGIN = envelope_pb2.Origin(kind=envelope_pb2.ORIGIN_KIND_MESH)
STATUS_NAME = {v: runs_pb2.RunStatus.Name(v).removeprefix("RUN_STATUS_").lower() for v in runs_pb2.RunStatus.values()}


def run_event(events: list[EventRow], run: RunRecord, kind: int, at_us: int, detail: str = "", seq: int = 0) -> None:
    events.append(EventRow(at_us, kind, run.child_id, message_id=run.run_id, sender=run.requester_id,
                           recipient=run.requester_id, seq=seq, detail=detail,
                           trace_id=trace_id_of(run.traceparent), conversation_id=run.conversation_id))


def end(events: list[EventRow], run: RunRecord, status: int, result: str, at_us: int) -> None:
    run.status = cast(runs_pb2.RunStatus, status)  # the store keeps enums as ints
    run.result = result
    run.ended_at_us = at_us
    run.announce_state = ANNOUNCE_PENDING
    run.archive_at_us = at_us + run.archive_after_us
    run_event(events, run, ev.EVENT_KIND_RUN_ENDED, at_us, detail=STATUS_NAME[status])


def announce_text(run: RunRecord) -> str:
    if run.status == runs_pb2.RUN_STATUS_OK:
        return run.result
    if run.status == runs_pb2.RUN_STATUS_ERROR:
        return f"The task failed: {run.result}"
    if run.status == runs_pb2.RUN_STATUS_TIMEOUT:
        return f"The task did not end in time: {run.result}"
    return f"The subagent was closed before its task ended: {run.result}"


def announce_envelope(run: RunRecord, at_us: int) -> envelope_pb2.Envelope:
    """The announce: the run's result as a COMPLETION from the child, with
    the run's stable message id."""
    return envelope_pb2.Envelope(
        message_id=run.announce_message_id, sender=run.child_id, recipient=run.requester_id,
        kind=envelope_pb2.MESSAGE_KIND_COMPLETION, content=envelope_pb2.Content(text=announce_text(run)),
        in_reply_to=run.task_message_id, conversation_id=run.conversation_id,
        trace=envelope_pb2.TraceContext(traceparent=run.traceparent), origin=_MESH_ORIGIN,
        headers={"inboxmesh-run": run.run_id, "inboxmesh-run-status": STATUS_NAME[run.status]},
        created_at_us=at_us)


def announce_events(run: RunRecord, seq: int, at_us: int) -> list[EventRow]:
    """The sent and stored events of an announce stored at `seq`."""
    sent = EventRow(at_us, ev.EVENT_KIND_MESSAGE_SENT, run.requester_id, message_id=run.announce_message_id,
                    sender=run.child_id, recipient=run.requester_id, seq=seq, detail=RECEIPT_NAME[ACCEPTED],
                    trace_id=trace_id_of(run.traceparent), in_reply_to=run.task_message_id,
                    conversation_id=run.conversation_id)
    return [sent, replace(sent, kind=ev.EVENT_KIND_MESSAGE_STORED, detail="")]


def settle(events: list[EventRow], run: RunRecord, state: int, at_us: int, detail: str, seq: int = 0) -> None:
    run.announce_state = cast(runs_pb2.AnnounceState, state)
    run.announce_detail = detail
    run.announced_at_us = at_us
    run.announce_sequence = seq
    kind = ev.EVENT_KIND_RUN_ANNOUNCED if state == ANNOUNCED else ev.EVENT_KIND_RUN_REQUESTER_GONE
    run_event(events, run, kind, at_us, detail=detail, seq=seq)


def keep_if_kept(events: list[EventRow], run: RunRecord, at_us: int) -> None:
    """cleanup KEEP: nothing to clean up once the announce is settled."""
    if run.cleanup != registry_pb2.RUN_CLEANUP_DELETE:
        run.cleaned_up_at_us = at_us
        run_event(events, run, ev.EVENT_KIND_RUN_CLEANED_UP, at_us, detail="kept")
