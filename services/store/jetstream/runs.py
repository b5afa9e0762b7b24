"""Subagent runs on JetStream: the run record (bucket runs, key `r.<run_id>`, the SubagentRun protobuf)
changed by compare-and-set, its index entries (by child, by requester), its place among the sweeper's
work (bucket runwork) and a requester's slots for running children (bucket misc). The transitions
themselves are services.store.run_rules, shared with SQLite."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.runs.v1 import runs_pb2
from services.store.base import (
    ANNOUNCE_PENDING,
    ANNOUNCED,
    REQUESTER_GONE,
    AgentRecord,
    AnnounceOutcome,
    EventRow,
    RunRecord,
    RunWork,
)
from services.store.jetstream import kv
from services.store.jetstream.connection import JetStreamConnection
from services.store.jetstream.events import EventLog
from services.store.jetstream.inbox import Announce, InboxLog
from services.store.jetstream.kv import CasResult, Codec
from services.store.run_rules import (
    STATUS_NAME,
    announce_envelope,
    announce_events,
    end,
    keep_if_kept,
    run_event,
    settle,
)

RUN: Codec[RunRecord] = Codec(RunRecord.FromString, lambda run: run.SerializeToString())
_REMEMBERED_STARTS = 100_000
RunChange = Callable[[RunRecord, list[EventRow]], bool]
"""Changes a run in place and appends the events of the change; False leaves the run as it was."""


def _run_key(run_id: str) -> str:
    return f"r.{kv.token(run_id)}"


def _not_found(run_id: str) -> errors.NotFound:
    return errors.NotFound(f"no run {run_id}", reason=Reason.RUN_NOT_FOUND, metadata={"run_id": run_id})


class Runs:
    def __init__(self, conn: JetStreamConnection, events: EventLog, inbox: InboxLog):
        self.conn = conn
        self.events = events
        self.inbox = inbox
        self._settled_starts: set[str] = set()
        """Agents whose run has started, or that have none (or one without a task message): acks need no
        run lookup."""
        self._tasks: dict[str, tuple[str, str]] = {}
        """Child -> (run id, task message id) of runs not known to have started: an ack that does not
        consume the task needs no run lookup either (a run's task message id never changes)."""

    async def _change(self, run_id: str, change: RunChange) -> RunRecord:
        """Apply `change` by compare-and-set; emit the events of the change that won."""
        for _ in range(kv.MAX_CAS_TRIES):
            found = await kv.get(self.conn.runs, _run_key(run_id), RUN)
            if found is None:
                raise _not_found(run_id)
            run = found.value
            rows: list[EventRow] = []
            if not change(run, rows):
                return run
            if await kv.write(self.conn.runs, _run_key(run_id), RUN.encode(run), found.revision) is CasResult.LOST:
                continue
            await self.events.emit(rows)
            return run
        raise errors.Unavailable(f"too much contention on run {run_id}", reason=Reason.CONTENTION)

    # -- a run's slot, record and indexes --------------------------------------------
    async def take_slot(self, record: AgentRecord, max_active_children: int) -> int | None:
        """Count the child among its parent's running children; None when it fits (or was counted by an
        earlier attempt), else how many are running."""
        refused: list[int] = []

        def take(current: list[str] | None) -> list[str] | None:
            active = current or []
            if record.agent_id in active:
                return None  # taken by an earlier attempt
            if len(active) >= max_active_children:
                refused.append(len(active))
                return None
            return [*active, record.agent_id]

        await kv.cas(self.conn.misc, f"active.{kv.token(record.parent_id)}", take, kv.JSON)
        return refused[-1] if refused else None

    async def release_slot(self, parent_id: str, child_id: str) -> None:
        await kv.cas(self.conn.misc, f"active.{kv.token(parent_id)}",
                     lambda cur: [c for c in cur if c != child_id] if cur and child_id in cur else None, kv.JSON)

    async def create(self, run: RunRecord) -> None:
        """Store the run of a child that is stored; can be repeated."""
        created, = await kv.write_many(self.conn, "runs", [(_run_key(run.run_id), RUN.encode(run), 0)])
        self._note_run(run)
        await self._index(run)
        if created:
            rows: list[EventRow] = []
            run_event(rows, run, ev.EVENT_KIND_RUN_CREATED, run.created_at_us, detail=run.label or run.task[:200])
            await self.events.emit(rows)

    async def _index(self, run: RunRecord) -> None:
        """The run's index entries (by child, created if absent; by requester) and, until it is archived, its
        place among the sweeper's work; each can be repeated. All at once, each write shared with the other
        writes into its bucket at that moment (one atomic batch when there are many: shared_writes.py)."""
        await asyncio.gather(
            kv.write_many(self.conn, "runs", [(f"c.{kv.token(run.child_id)}", kv.JSON.encode(run.run_id), 0)]),
            kv.index_add(self.conn, "runs", [(f"q.{kv.token(run.requester_id)}", run.run_id)]),
            kv.put_many(self.conn, "runwork", [] if run.archived_at_us else [(kv.token(run.run_id), b"")]))

    async def roll_forward(self, run_id: str) -> list[EventRow]:
        """Finish what writing this run record started (the keeper): its
        index entries and its place among the sweeper's work; the events its
        state stands for."""
        run = await self.get(run_id=run_id)
        if run is None:
            return []
        await self._index(run)
        rows: list[EventRow] = []
        run_event(rows, run, ev.EVENT_KIND_RUN_CREATED, run.created_at_us, detail=run.label or run.task[:200])
        if run.started_at_us:
            run_event(rows, run, ev.EVENT_KIND_RUN_STARTED, run.started_at_us)
        if run.ended_at_us:
            run_event(rows, run, ev.EVENT_KIND_RUN_ENDED, run.ended_at_us, detail=STATUS_NAME[run.status])
        if run.announce_state == ANNOUNCED:
            run_event(rows, run, ev.EVENT_KIND_RUN_ANNOUNCED, run.announced_at_us, detail=run.announce_detail,
                      seq=run.announce_sequence)
        elif run.announce_state == REQUESTER_GONE:
            run_event(rows, run, ev.EVENT_KIND_RUN_REQUESTER_GONE, run.announced_at_us, detail=run.announce_detail)
        if run.cleaned_up_at_us:
            run_event(rows, run, ev.EVENT_KIND_RUN_CLEANED_UP, run.cleaned_up_at_us)
        if run.archived_at_us:
            run_event(rows, run, ev.EVENT_KIND_RUN_ARCHIVED, run.archived_at_us)
        return rows

    # -- reads -------------------------------------------------------------------------
    async def get(self, *, run_id: str = "", child_id: str = "") -> RunRecord | None:
        if not run_id:
            by_child = await kv.get(self.conn.runs, f"c.{kv.token(child_id)}", kv.JSON)
            if by_child is None:
                return None
            run_id = by_child.value
        found = await kv.get(self.conn.runs, _run_key(run_id), RUN)
        return found.value if found else None

    async def list_runs(self, requester_id: str, include_archived: bool, after_key: str,
                        limit: int) -> list[RunRecord]:
        ids = await kv.index_members(self.conn, "runs", f"q.{kv.token(requester_id)}")
        if after_key:
            if after_key not in ids:
                raise errors.InvalidArgument(f"page_token {after_key!r} is not valid", reason=Reason.BAD_PAGE_TOKEN)
            ids = ids[ids.index(after_key) + 1:]
        return [r for r in await self._read_runs(ids) if include_archived or not r.archived_at_us][:limit]

    async def _read_runs(self, run_ids: list[str]) -> list[RunRecord]:
        """The runs that exist of these, as the bucket holds them now, in this order: with one replica in
        batched direct gets (kv.last_many, 1,024 runs a request); with more, one read of the leader a run (a
        follower may answer a direct get a moment behind it). One request a run, as before 2026-12-08, made a
        sweeper pass over 2,000 runs cost the mesh 0.7-0.9 s of CPU and 2,000 requests, and a pass runs after
        every close of a child; a page of ListRuns read every run of the requester after the page token so."""
        if self.conn.config.nats_replicas != 1:
            return [r for r in await asyncio.gather(*(self.get(run_id=i) for i in run_ids)) if r is not None]
        entries = await kv.last_many(self.conn, "runs", [_run_key(i) for i in run_ids])
        return [RUN.decode(entries[key].value) for i in run_ids if (key := _run_key(i)) in entries]

    async def work(self, now_us: int, limit: int) -> RunWork:
        runs = [r for r in await self._read_runs(await kv.list_keys(self.conn, "runwork")) if not r.archived_at_us]
        runs.sort(key=lambda r: r.created_at_us)
        settled = (ANNOUNCED, REQUESTER_GONE)
        return RunWork(
            overdue=[r.run_id for r in runs if r.status == runs_pb2.RUN_STATUS_RUNNING and r.deadline_us
                     and r.deadline_us <= now_us][:limit],
            pending=[r.run_id for r in runs if r.announce_state == ANNOUNCE_PENDING][:limit],
            cleanup=[r.run_id for r in runs if r.announce_state in settled and not r.cleaned_up_at_us][:limit],
            archivable=[r.run_id for r in runs if r.announce_state in settled and r.cleaned_up_at_us
                        and r.archive_at_us <= now_us][:limit],
        )

    # -- transitions -----------------------------------------------------------------------
    async def end(self, run_id: str, status: int, result: str, at_us: int,
                  traceparent: str = "") -> tuple[RunRecord, bool]:
        already = False

        def change(run: RunRecord, rows: list[EventRow]) -> bool:
            nonlocal already
            if run.status != runs_pb2.RUN_STATUS_RUNNING:
                already = True
                return False
            if traceparent:
                run.traceparent = traceparent
            end(rows, run, status, result, at_us)
            return True

        run = await self._change(run_id, change)
        if not already:
            await self.release_slot(run.requester_id, run.child_id)
        return run, already

    async def end_runs_of_closed(self, closed: list[AgentRecord], at_us: int) -> None:
        """Runs of agents closed before their task ended end as CLOSED."""
        for agent in closed:
            run = await self.get(child_id=agent.agent_id)
            if run is not None and run.status == runs_pb2.RUN_STATUS_RUNNING:
                await self.end(run.run_id, runs_pb2.RUN_STATUS_CLOSED, agent.close_reason, at_us)

    async def mark_started(self, recipient: str, message_ids: list[str], at_us: int) -> None:
        """The child consumed its task: the run has started."""
        if recipient in self._settled_starts:
            return
        task = self._tasks.get(recipient)
        if task is None:
            run = await self.get(child_id=recipient)  # runs are created with their child: no run now is no run ever
            if run is None:
                self._remember(recipient, None)
                return
            task = self._note_run(run)
            if task is None:
                return
        run_id, task_message_id = task
        if task_message_id not in message_ids:
            return
        self._remember(recipient, None)

        def change(run: RunRecord, rows: list[EventRow]) -> bool:
            if run.started_at_us:
                return False
            run.started_at_us = at_us
            run_event(rows, run, ev.EVENT_KIND_RUN_STARTED, at_us)
            return True

        await self._change(run_id, change)

    def _note_run(self, run: RunRecord) -> tuple[str, str] | None:
        """Remember what acks of the run's child need to know of it: (run id, task message id) while its
        task may still be consumed, else None (settled)."""
        task = None if run.started_at_us or not run.task_message_id else (run.run_id, run.task_message_id)
        self._remember(run.child_id, task)
        return task

    def _remember(self, agent_id: str, task: tuple[str, str] | None) -> None:
        if len(self._settled_starts) + len(self._tasks) > _REMEMBERED_STARTS:
            self._settled_starts.clear()
            self._tasks.clear()
        if task is None:
            self._tasks.pop(agent_id, None)
            self._settled_starts.add(agent_id)
        else:
            self._tasks[agent_id] = task

    async def announce(self, run_id: str, at_us: int) -> AnnounceOutcome:
        run = await self.get(run_id=run_id)
        if run is None:
            raise _not_found(run_id)
        if run.announce_state != ANNOUNCE_PENDING:
            return AnnounceOutcome(run)
        stored = await self.inbox.store_announce(run, announce_envelope(run, at_us), at_us)
        fresh = False

        def change(current: RunRecord, rows: list[EventRow]) -> bool:
            nonlocal fresh
            if current.announce_state != ANNOUNCE_PENDING:
                return False
            if stored.outcome is Announce.FULL:
                if current.announce_detail == stored.detail:
                    return False
                current.announce_detail = stored.detail
                run_event(rows, current, ev.EVENT_KIND_RUN_ANNOUNCE_DEFERRED, at_us, detail=stored.detail)
                return True
            if stored.outcome is Announce.STORED:
                rows += announce_events(current, stored.seq, at_us)
                settle(rows, current, ANNOUNCED, at_us, stored.detail, stored.seq)
                fresh = stored.detail == "accepted"
            else:
                settle(rows, current, REQUESTER_GONE, at_us, stored.detail)
            keep_if_kept(rows, current, at_us)
            return True

        run = await self._change(run_id, change)
        if stored.outcome is Announce.FULL:
            return AnnounceOutcome(run, retry=True)
        envelope = await self.inbox.messages.envelope_at(run.requester_id, stored.seq) if fresh else None
        return AnnounceOutcome(run, envelope)

    async def finish_cleanup(self, run_id: str, detail: str, at_us: int) -> RunRecord:
        def change(run: RunRecord, rows: list[EventRow]) -> bool:
            if run.cleaned_up_at_us:
                return False
            run.cleaned_up_at_us = at_us
            run_event(rows, run, ev.EVENT_KIND_RUN_CLEANED_UP, at_us, detail=detail)
            return True

        return await self._change(run_id, change)

    async def archive(self, run_id: str, at_us: int) -> RunRecord:
        def change(run: RunRecord, rows: list[EventRow]) -> bool:
            if run.archived_at_us:
                return False
            run.archived_at_us = at_us
            run_event(rows, run, ev.EVENT_KIND_RUN_ARCHIVED, at_us)
            return True

        run = await self._change(run_id, change)
        await self.conn.runwork.delete(kv.token(run_id))
        return run
