"""The subagent run registry and the announce (docs/runs.md). Knows nothing
of gRPC.

Every child is registered together with its run record (one commit, limits
checked there). A run ends once: by its child (EndRun), by a close of the
child (in the close's own commit), or by its timeout. Its result is then
announced: stored in the requester's inbox as a COMPLETION message sent as
the child, with an id derived from the run, in the same commit that marks
the announce done. A crash anywhere leaves a state the sweeper resumes
(pending announce, pending cleanup), and a repeated attempt finds the stored
message instead of storing a second one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import Awaitable, Callable

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.tracing import context_of, traceparent, tracer
from inboxmesh.registry.v1 import registry_pb2 as reg_pb
from inboxmesh.runs.v1 import runs_pb2 as pb
from services.clock import now_us
from services.config import RunsConfig
from services.directory import Caller, Directory
from services.faults import crash_point
from services.inbox.delivery import DeliveryHub
from services.routing.config import AgentConfig, RoutingConfig
from services.store.base import (
    ANNOUNCE_ID_PREFIX,
    ANNOUNCE_WAITING,
    REQUESTER_GONE,
    AgentRecord,
    AgentStore,
    CloseOutcome,
    RunRecord,
    RunStore,
    SpawnLimits,
)
from services.validation import check_text, fitting, page_size

log = logging.getLogger(__name__)
AGENT_KEY = "inboxmesh-agent"
"""Agent metadata: the configured agent (routing `agents.list[].id`) it runs as."""
ORIGIN_PREFIX = "inboxmesh-route-"
"""Agent metadata copied into its children's runs as the requester origin."""
CLEANUP_REASON = "run {run_id} ended and was announced (cleanup: delete)"

CloseAgent = Callable[[str, str], Awaitable[CloseOutcome]]
"""(agent_id, reason) -> what was closed: closing an agent and its descendants as the mesh, without a
caller's permission check (services.registry.service.AgentCloser.close)."""


class RunService:
    def __init__(self, store: RunStore, agents: AgentStore, directory: Directory, hub: DeliveryHub,
                 config: RunsConfig, routing: RoutingConfig | None, close_agent: CloseAgent):
        self._store = store
        self._agents = agents
        self._directory = directory
        self._hub = hub
        self._config = config
        self._routing = routing
        """The mesh's routing config: configured agents' spawn policies (None: the mesh has none)."""
        self._close_agent = close_agent
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False

    def use_routing(self, routing: RoutingConfig) -> None:
        """A reloaded routing config: its spawn policies apply to the spawns from now on."""
        self._routing = routing

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        """Start the sweeper; its first pass restores what a restart left
        (pending announces and cleanups, overdue runs)."""
        self._task = asyncio.create_task(self._sweeper(), name="run-sweeper")

    async def stop(self) -> None:
        """Let the sweeper finish its current step and end (no cancel: a
        cancel racing the wake-up can be swallowed by wait_for)."""
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            self._wake.set()
            await asyncio.gather(task, return_exceptions=True)

    def on_closed(self, outcome: CloseOutcome) -> None:
        """Closed children may have ended runs (CLOSED): announce them soon.
        (A top-level agent has no run; its children are in the outcome.)"""
        if any(record.parent_id for record in outcome.closed):
            self._wake.set()

    # -- spawning ---------------------------------------------------------------
    def _policy(self, agent: AgentRecord) -> AgentConfig | None:
        if self._routing is None:
            return None
        return self._routing.agent(agent.metadata.get(AGENT_KEY, "") or self._routing.default_agent_id)

    def limits_for(self, parent: AgentRecord) -> SpawnLimits:
        policy = self._policy(parent)
        if policy is None:
            return SpawnLimits(self._config.max_spawn_depth, self._config.max_active_children)
        return SpawnLimits(policy.subagents.max_spawn_depth, policy.subagents.max_children_per_agent)

    def new_run(self, parent: AgentRecord, child: AgentRecord, spec: reg_pb.RunSpec,
                idempotent: bool = False) -> tuple[RunRecord, dict]:
        """The run record of a child being registered, and the metadata the
        child gets. Refuses a configured agent the parent may not spawn.
        `idempotent`: the child's id comes from a request_id, and so does the run's."""
        check_text("run.task", spec.task, max_len=64 * 1024, lines=True)
        check_text("run.label", spec.label, max_len=256)
        check_text("run.task_message_id", spec.task_message_id, max_len=128)
        parent_agent = parent.metadata.get(AGENT_KEY, "")
        target = spec.agent_config_id.strip().lower()
        metadata = dict(child.metadata)
        if self._routing is not None:
            parent_agent = parent_agent or self._routing.default_agent_id
            target = target or parent_agent
            if self._routing.agent(target) is None:
                raise errors.NotFound(f"run.agent_config_id {target!r} is not in agents.list",
                                      reason=Reason.AGENT_CONFIG_NOT_FOUND, metadata={"agent_config_id": target})
            if not self._routing.may_spawn(parent_agent, target):
                raise errors.PermissionDenied(
                    f"{parent_agent!r} may not spawn agent {target!r}: not in its subagents.allowAgents",
                    reason=Reason.AGENT_NOT_ALLOWED, metadata={"requester": parent_agent, "agent_config_id": target})
        elif target:
            raise errors.FailedPrecondition(f"run.agent_config_id {target!r} needs a routing config (none loaded)",
                                            reason=Reason.NO_ROUTING_CONFIG)
        if target:
            metadata[AGENT_KEY] = target
        # an idempotent registration's run is named by its child, so a retry names the same run
        run_id = f"run-{hashlib.sha256(child.agent_id.encode()).hexdigest()[:32]}" if idempotent \
            else f"run-{uuid.uuid4().hex}"
        origin = {k: v for k, v in parent.metadata.items() if k.startswith(ORIGIN_PREFIX)}
        run = RunRecord(
            run_id=run_id, child_id=child.agent_id, requester_id=parent.agent_id, requester_origin=origin,
            task=spec.task, task_message_id=spec.task_message_id,
            cleanup=spec.cleanup or reg_pb.RUN_CLEANUP_KEEP, label=spec.label, agent_config_id=target,
            conversation_id=spec.conversation_id, created_at_us=child.created_at_us, status=pb.RUN_STATUS_RUNNING,
            deadline_us=child.created_at_us + spec.run_timeout_s * 1_000_000 if spec.run_timeout_s else 0,
            announce_state=ANNOUNCE_WAITING, announce_message_id=ANNOUNCE_ID_PREFIX + run_id,
            archive_after_us=int(self._config.archive_after_s * 1_000_000),
        )
        return run, metadata

    # -- ending and announcing ----------------------------------------------------
    async def end(self, caller: Caller, run_id: str, failed: bool, result: str) -> tuple[RunRecord, bool]:
        check_text("result", result, max_len=128 * 1024, lines=True)
        run = await self.get(caller, run_id=run_id, child_id="" if run_id else caller.require_agent(
            "ending a run without naming it").agent_id)
        child = await self._directory.require(run.child_id)
        if not await self._directory.is_self_or_ancestor(caller, child):
            raise errors.PermissionDenied(f"{caller} may not end run {run.run_id}: only its child or an ancestor",
                                          reason=Reason.NOT_ANCESTOR, metadata={"run_id": run.run_id})
        status = pb.RUN_STATUS_ERROR if failed else pb.RUN_STATUS_OK
        with tracer.start_as_current_span("run end", attributes={"inboxmesh.run": run.run_id,
                                                                 "inboxmesh.agent": run.child_id}):
            ended, already = await self._store.end_run(run.run_id, status, result, now_us(), traceparent())
            if already:
                log.info("run %s had already ended (%s); this end changed nothing", run.run_id,
                         pb.RunStatus.Name(ended.status))
                if ended.announce_state == pb.ANNOUNCE_STATE_PENDING:  # its first end failed to announce it
                    self._wake_later(self._config.announce_retry_s)
                return ended, True
            log.info("run %s of %s ended: %s", run.run_id, run.child_id, pb.RunStatus.Name(status))
            crash_point("run-ended")
            try:
                return await self.settle(run.run_id), False
            except errors.Unavailable:
                self._wake_later(self._config.announce_retry_s)  # the sweeper announces it once the store is back
                raise

    async def settle(self, run_id: str) -> RunRecord:
        """Announce a pending run and clean it up; safe to call at any time,
        from several places at once."""
        now = now_us()
        outcome = await self._store.announce_run(run_id, now)
        run = outcome.run
        if outcome.envelope is not None:
            tracer.start_span("announce", context=context_of(outcome.envelope), attributes={
                "inboxmesh.run": run.run_id, "messaging.message.id": outcome.envelope.message_id,
                "inboxmesh.recipient": run.requester_id, "inboxmesh.sequence": run.announce_sequence}).end()
            self._hub.on_appended([outcome.envelope])
            log.info("announced run %s to %s at seq %d", run.run_id, run.requester_id, run.announce_sequence)
        elif outcome.retry:
            self._wake_later(self._config.announce_retry_s)
            return run
        elif run.announce_state == REQUESTER_GONE and not run.cleaned_up_at_us:
            log.info("run %s: %s", run.run_id, run.announce_detail)
        if run.announce_state in (pb.ANNOUNCE_STATE_ANNOUNCED, REQUESTER_GONE) and not run.cleaned_up_at_us:
            crash_point("run-announced")
            run = await self._cleanup(run)
        return run

    async def _cleanup(self, run: RunRecord) -> RunRecord:
        """cleanup=delete: close the child (once announced), then record it."""
        child = await self._agents.get_agent(run.child_id)
        detail = "child already closed"
        if child is not None and child.is_open:
            closed = await self._close_agent(run.child_id, CLEANUP_REASON.format(run_id=run.run_id))
            self.on_closed(closed)  # the child's own children may have had runs: the close ended them
            detail = "child closed"
        return await self._store.finish_cleanup(run.run_id, detail, now_us())

    def _wake_later(self, delay: float) -> None:
        asyncio.get_running_loop().call_later(delay, self._wake.set)

    async def sweep(self) -> pb.SweepRunsResponse:
        """One pass: time out overdue runs, announce pending ones, finish
        cleanups, archive settled runs past their time."""
        response = pb.SweepRunsResponse()
        work = await self._store.run_work(now_us(), 500)
        for run_id in work.overdue:
            run, already = await self._store.end_run(run_id, pb.RUN_STATUS_TIMEOUT, "its run timeout passed",
                                                     now_us())
            if not already:
                response.timed_out.append(run_id)
                work.pending.append(run_id)
        for run_id in dict.fromkeys(work.pending + work.cleanup):
            run = await self.settle(run_id)
            if run.announce_state != pb.ANNOUNCE_STATE_PENDING and run_id in work.pending:
                response.announced.append(run_id)
            if run.cleaned_up_at_us:
                response.cleaned_up.append(run_id)
        for run_id in work.archivable:
            await self._store.archive_run(run_id, now_us())
            response.archived.append(run_id)
        return response

    async def _sweeper(self) -> None:
        while not self._stopping:
            try:
                done = await self.sweep()
                if any((done.timed_out, done.announced, done.cleaned_up, done.archived)):
                    log.info("run sweeper: %d timed out, %d announced, %d cleaned up, %d archived",
                             len(done.timed_out), len(done.announced), len(done.cleaned_up), len(done.archived))
            except errors.Unavailable as exc:
                if exc.reason == Reason.STORE_CLOSED:
                    return  # the store is closing
                # the store failed this pass (on JetStream: NATS away, a stream electing its leader): soon again,
                # as an announce that failed is retried (it may be stored and not yet recorded as announced)
                log.warning("run sweeper: %s; trying again in %.0f s", exc.message, self._config.announce_retry_s)
                self._wake_later(self._config.announce_retry_s)
            except Exception:
                log.exception("run sweeper pass failed; trying again at the next interval")
            if self._stopping:
                return
            try:
                await asyncio.wait_for(self._wake.wait(), self._config.sweep_interval_s)
            except TimeoutError:
                pass
            self._wake.clear()

    # -- queries ------------------------------------------------------------------
    async def get(self, caller: Caller, *, run_id: str, child_id: str) -> RunRecord:
        if not run_id and not child_id:
            raise errors.InvalidArgument("give run_id or child_id", reason=Reason.MISSING_FIELD)
        check_text("run_id", run_id, max_len=128)
        check_text("child_id", child_id, max_len=128)
        run = await self._store.get_run(run_id=run_id, child_id=child_id)
        if run is None:
            raise errors.NotFound(f"no run {run_id or 'for child ' + child_id}", reason=Reason.RUN_NOT_FOUND)
        requester = await self._directory.get(run.requester_id)
        child = await self._directory.get(run.child_id)
        if not any(a is not None and self._directory.in_reach(caller, a) for a in (requester, child)):
            raise errors.PermissionDenied(f"{caller} may not see run {run.run_id}: outside its scope",
                                          reason=Reason.OUT_OF_SCOPE)
        return run

    async def list(self, caller: Caller, requester_id: str, include_archived: bool, size: int,
                   page_token: str) -> tuple[list[RunRecord], str]:
        requester_id = requester_id or caller.require_agent("naming no requester").agent_id
        requester = await self._directory.require(requester_id)
        self._directory.check_reach(caller, requester, "list the runs of")
        limit = page_size(size)
        found = await self._store.list_runs(requester_id, include_archived, page_token, limit)
        fit = fitting(r.ByteSize() for r in found)
        if fit < len(found):  # cut by bytes: the next page starts after the last run shown
            return found[:fit], found[fit - 1].run_id
        return found, (found[-1].run_id if len(found) == limit else "")
