"""An agent host: many agents in one process, each with its own inbox stream
and scheduler (agent_host.runner), against a mesh over gRPC.

Every agent the host creates, top-level or spawned by another agent's tool
call, is registered in the mesh and has its inbox subscribed before its
first turn. The host remembers its agents (host.db) and a restarted host
resumes them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from agent_host.config import CLOSE_ON_COMPLETE, Budget, HostConfig
from agent_host.conversation import Conversation, key_of, system_prompt
from agent_host.hoststore import AgentRecord, HostStore
from agent_host.models.base import Model, ModelError, ModelReply
from agent_host.runner import AgentRunner, BudgetExceeded, ChildGone
from agent_host.tools import ALL_TOOLS
from inboxmesh.client import errors
from inboxmesh.client.addressing import IOA_PREFIX
from inboxmesh.client.mesh import MeshClient
from inboxmesh.client.status import from_rpc_error
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.ioa.v1 import relay_pb2, relay_pb2_grpc
from inboxmesh.registry.v1 import registry_pb2 as reg

log = logging.getLogger(__name__)
MODES = {"sync": reg.AGENT_MODE_SYNC, "async": reg.AGENT_MODE_ASYNC, "fork": reg.AGENT_MODE_FORK}


@dataclass(frozen=True)
class AgentProfile:
    """How an agent runs: its model, its tools, the role in its system prompt."""

    model: Model
    tools: tuple[str, ...] = ALL_TOOLS
    role: str = ""
    max_spawns: int | None = None
    """Children the agent may start in all; once reached, spawn_agent is no
    longer offered (None: no limit)."""


ProfileFactory = Callable[[AgentRecord], AgentProfile]
"""Chooses the profile of every agent the host creates or resumes."""


@dataclass
class HostEvent:
    at: float
    agent_name: str
    agent_id: str
    kind: str
    detail: str


class TaskBudget:
    """The budget of one top-level task, shared by every agent working on it."""

    def __init__(self, limits: Budget):
        self.limits = limits
        self.started = time.monotonic()
        self.requests = 0
        self.max_output_tokens_seen = 0

    def remaining_s(self) -> float:
        return self.limits.max_wall_time_s - (time.monotonic() - self.started)

    def check(self, runner: AgentRunner) -> None:
        where = f"{runner.record.name} ({runner.agent_id}) at turn {runner.record.turn}"
        if self.requests >= self.limits.max_model_requests:
            raise BudgetExceeded(f"stopped at {where}: all {self.limits.max_model_requests} model requests used")
        if self.remaining_s() <= 0:
            raise BudgetExceeded(f"stopped at {where}: the wall-time budget of {self.limits.max_wall_time_s:.0f}s"
                                 " ran out")

    def report(self) -> dict[str, Any]:
        return {"model_requests": self.requests, "max_model_requests": self.limits.max_model_requests,
                "elapsed_s": round(time.monotonic() - self.started, 3),
                "max_wall_time_s": self.limits.max_wall_time_s,
                "max_output_tokens_per_request": self.limits.max_output_tokens,
                "most_output_tokens_in_a_request": self.max_output_tokens_seen}


@dataclass
class TaskOutcome:
    agent_id: str
    ok: bool
    result: str = ""
    error: str = ""
    budget: dict[str, Any] = field(default_factory=dict)


class Host:
    def __init__(self, config: HostConfig, profiles: ProfileFactory, *, client: MeshClient | None = None):
        self.config = config
        self.profiles = profiles
        self.client = client or MeshClient(config.mesh_address, timeout=config.call_timeout_s)
        self._own_client = client is None
        self.store = HostStore(config.data_dir / "host.db")
        self.runners: dict[str, AgentRunner] = {}
        self.observers: list[Callable[[HostEvent], None]] = []
        self._names: dict[str, str] = {}
        self._addresses: dict[str, str] = {}
        self._relay_stub = relay_pb2_grpc.IoaRelayServiceStub(self.client.channel)
        self._tasks: dict[str, asyncio.Future] = {}
        self._background: set[asyncio.Task] = set()
        self._stopped = False

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        """Resume the agents this host had when it stopped (or crashed)."""
        budgets: dict[str, TaskBudget] = {}
        resumed = []
        for record, conversation in self.store.load_open():
            handle = self.client.agent(record.agent_id, record.credential)
            try:
                info = await handle.get()
            except errors.MeshError as exc:
                log.warning("not resuming %s (%s): %s", record.name, record.agent_id, exc)
                continue
            if info.state == reg.AGENT_STATE_CLOSED:
                record.closed = True
                self.store.save(record)
                continue
            budget = budgets.setdefault(info.scope_id, TaskBudget(self.config.budget))
            runner = self._runner(record, handle, conversation, budget)
            recovered = await self._recover_consumed(runner)
            runner.start_requested = record.running or recovered > 0
            resumed.append(runner)
        for runner in resumed:
            await runner.start()
            self.observe(runner, "resumed", f"turn {runner.record.turn}" + (", resuming its run"
                                                                          if runner.start_requested else ""))

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for runner in list(self.runners.values()):
            await runner.stop()
            self.save(runner)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for future in self._tasks.values():
            if not future.done():
                future.cancel()
        if self._own_client:
            await self.client.close()
        self.store.close()

    async def __aenter__(self) -> Host:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    def _runner(self, record: AgentRecord, handle, conversation: Conversation, budget: TaskBudget) -> AgentRunner:
        profile = self.profiles(record)
        if not record.tools:
            record.tools = profile.tools
        if not conversation.messages:
            conversation.messages.append({"role": "system", "content": system_prompt(
                record.name, record.agent_id, profile.role, self.config.show_ids)})
        runner = AgentRunner(self, record, handle, profile.model, conversation, budget)
        runner.max_spawns = profile.max_spawns
        self.runners[record.agent_id] = runner
        self._names[record.agent_id] = record.name
        return runner

    def _in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    # -- tasks --------------------------------------------------------------
    async def start_task(self, name: str, task: str, *, metadata: dict[str, str] | None = None) -> AgentRunner:
        """Register a top-level agent, give it the task, and start it."""
        handle = await self.client.register(name, metadata=metadata)
        record = AgentRecord(agent_id=handle.agent_id, name=name, credential=handle.credential, mode="main",
                             keep_alive=self.config.keep_alive)
        runner = self._runner(record, handle, Conversation(), TaskBudget(self.config.budget))
        runner.conversation.add_user(task)
        runner.start_requested = True
        self._tasks[handle.agent_id] = asyncio.get_running_loop().create_future()
        self.save(runner)
        self.observe(runner, "registered", f"top-level agent, task: {task[:120]}")
        await runner.start()
        return runner

    async def run_task(self, name: str, task: str, *, timeout: float | None = None,
                       metadata: dict[str, str] | None = None) -> TaskOutcome:
        """Run a task to its result (or to a failure with a report of where
        it stopped)."""
        runner = await self.start_task(name, task, metadata=metadata)
        return await self.outcome(runner.agent_id, timeout=timeout)

    async def outcome(self, agent_id: str, timeout: float | None = None) -> TaskOutcome:
        future = self._tasks[agent_id]
        runner = self.runners.get(agent_id)
        limit = timeout if timeout is not None else (runner.budget.remaining_s() + 5 if runner else None)
        try:
            return await asyncio.wait_for(asyncio.shield(future), limit)
        except TimeoutError:
            budget = runner.budget.report() if runner else {}
            return TaskOutcome(agent_id, ok=False, error=f"no result within {limit:.0f}s", budget=budget)


    def run_failed(self, runner: AgentRunner, exc: Exception) -> None:
        """A run failed for good (budget or model): the whole task fails, and
        every run working on it stops."""
        log.error("%s: run failed: %s", runner, exc)
        self.observe(runner, "failed", str(exc))
        for other in list(self.runners.values()):
            if other.budget is runner.budget and other is not runner:
                other.cancel_run()
        top = runner
        while top.record.parent_id and top.record.parent_id in self.runners:
            top = self.runners[top.record.parent_id]
        future = self._tasks.get(top.agent_id)
        if future is not None and not future.done():
            future.set_result(TaskOutcome(top.agent_id, ok=False, error=str(exc), budget=runner.budget.report()))

    async def call_model(self, runner: AgentRunner, tools: list[dict[str, Any]]) -> ModelReply:
        budget = runner.budget
        budget.check(runner)
        max_requests = min(budget.limits.max_requests_per_reply, budget.limits.max_model_requests - budget.requests)
        try:
            reply = await asyncio.wait_for(
                runner.model.complete(runner.conversation.messages, tools,
                                      max_output_tokens=budget.limits.max_output_tokens, max_requests=max_requests),
                max(0.001, budget.remaining_s()))
        except ModelError as exc:
            budget.requests += exc.attempts
            runner.model_requests += exc.attempts
            raise
        except TimeoutError:
            raise BudgetExceeded(f"stopped at {runner.record.name} ({runner.agent_id}) turn {runner.record.turn}:"
                                 f" the wall-time budget of {budget.limits.max_wall_time_s:.0f}s ran out during a"
                                 " model request") from None
        budget.requests += reply.attempts
        runner.model_requests += reply.attempts
        budget.max_output_tokens_seen = max(budget.max_output_tokens_seen, reply.usage.completion_tokens)
        self.observe(runner, "model", f"{runner.model.name}: {len(reply.tool_calls)} tool call(s)"
                                      f"{', text' if reply.text else ''} ({reply.attempts} request(s))")
        return reply

    # -- spawning and closing -------------------------------------------------
    def children_status(self, runner: AgentRunner) -> tuple[list[str], list[str]]:
        """Names of the agent's children here that have reported (their
        COMPLETION answering their task was consumed by the agent) and of
        those still working."""
        answered = {m.in_reply_to for m in runner.received.values() if m.kind == env_pb.MESSAGE_KIND_COMPLETION}
        children = [c for c in self.runners.values() if c.record.parent_id == runner.agent_id]
        return ([c.record.name for c in children if c.record.task_message_id in answered],
                [c.record.name for c in children if c.record.task_message_id not in answered])

    def team_targets(self, runner: AgentRunner) -> list[str] | None:
        """send_message's choice of names (config.team_targets): the agent's
        siblings and children hosted here, open ones only."""
        if not self.config.team_targets:
            return None
        record = runner.record
        return sorted({r.record.name for r in self.runners.values() if r is not runner and not r.record.closed
                       and (r.record.parent_id == record.agent_id
                            or (record.parent_id and r.record.parent_id == record.parent_id))}) or None

    def children_working(self, runner: AgentRunner) -> list[str]:
        """The agent's open children whose report this agent has not consumed yet."""
        return self.children_status(runner)[1]

    async def spawn(self, parent: AgentRunner, *, name: str, task: str, mode: str = "async") -> dict[str, Any]:
        for existing in self.runners.values():
            if existing.record.parent_id == parent.agent_id and existing.record.name == name \
                    and existing.record.task_text == task:  # the same call again: a retry, not a twin
                return {"agent_id": existing.agent_id, "name": name, "mode": existing.record.mode,
                        "task_message_id": existing.record.task_message_id, "status": "already started"}
        if parent.max_spawns is not None and parent.record.spawned >= parent.max_spawns:
            return {"error": f"you may start {parent.max_spawns} subagents and have started them all"}
        task_message_id = f"task-{uuid.uuid4().hex}"
        conversation_id = f"conv-{uuid.uuid4().hex}"
        run = reg.RunSpec(task=task, task_message_id=task_message_id, label=name, conversation_id=conversation_id,
                             cleanup=reg.RUN_CLEANUP_KEEP)
        child = await parent.handle.spawn(name, MODES[mode], inbox_capacity=self.config.child_inbox_capacity,
                                          run=run)  # the mesh's limits may refuse it (the tool reports why)
        parent.record.spawned += 1
        record = AgentRecord(agent_id=child.agent_id, name=name, credential=child.credential, mode=mode,
                             parent_id=parent.agent_id, task_message_id=task_message_id, task_text=task,
                             conversation_id=conversation_id, keep_alive=self.config.keep_alive,
                             run_id=child.run_id)
        conversation = Conversation()
        if mode == "fork":
            conversation = parent.conversation.fork()
            conversation.messages = conversation.messages[1:]  # the child gets its own system prompt
        runner = self._runner(record, child, Conversation(), parent.budget)
        runner.conversation.messages += conversation.messages
        self.save(runner)
        await runner.start()  # subscribed before its first turn
        await parent.event(ev.EVENT_KIND_AGENT_SPAWNED, message_id=task_message_id,
                           detail=f"{child.agent_id} name={name} mode={mode}")
        done = parent.expect_completion(task_message_id, child.agent_id) if mode == "sync" else None
        receipt = await parent.send(child.agent_id, task, kind=env_pb.MESSAGE_KIND_TASK, message_id=task_message_id,
                                    conversation_id=record.conversation_id)
        result = {"agent_id": child.agent_id, "name": name, "mode": mode, "task_message_id": task_message_id}
        if receipt.status != inbox_pb2.RECEIPT_STATUS_ACCEPTED:
            return {**result, "status": "failed", "error": f"the task was not accepted: {receipt.detail}"}
        if done is None:
            return {**result, "status": "started"}
        try:
            completion = await parent.wait_for_completion(done, child.agent_id)
        except ChildGone as exc:
            return {**result, "status": "failed", "error": str(exc)}
        return {**result, "status": "completed", "result": completion.content.text}

    async def close(self, agent_id: str, *, reason: str, by: AgentRunner | None = None) -> list[str]:
        """Close an agent (and its descendants) in the mesh and stop their
        runners here. `by` is the agent asking (defaults to the agent itself)."""
        asker = by or self.runners.get(agent_id)
        if asker is None:
            raise errors.NotFound(f"this host does not run {agent_id}", reason="AGENT_NOT_HOSTED")
        response = await asker.handle.close(agent_id, reason=reason)
        closed = list(response.closed_agent_ids)
        await asyncio.gather(*(self._closed_here(cid, reason) for cid in closed))
        return closed

    async def agent_closed(self, runner: AgentRunner, detail: str) -> None:
        """The mesh ended a runner's stream because the agent was closed
        (by an ancestor, an operator, another host)."""
        self._in_background(self._closed_here(runner.agent_id, detail))

    async def _closed_here(self, agent_id: str, reason: str) -> None:
        runner = self.runners.pop(agent_id, None)
        for other in self.runners.values():
            other.child_gone(agent_id, reason)
        if runner is None:
            return
        runner.record.closed = True
        self.save(runner)
        self.observe(runner, "closed", reason)
        if asyncio.current_task() not in runner._tasks:
            await runner.stop()
        else:
            self._in_background(runner.stop())
        future = self._tasks.get(agent_id)
        if future is not None and not future.done():
            future.set_result(TaskOutcome(agent_id, ok=False, error=f"closed before finishing: {reason}",
                                          budget=runner.budget.report()))

    def after_finish(self, runner: AgentRunner) -> None:
        """The turn in which the agent finished its task has ended."""
        future = self._tasks.get(runner.agent_id)
        if future is not None and not future.done():
            future.set_result(TaskOutcome(runner.agent_id, ok=True, result=runner.record.result,
                                          budget=runner.budget.report()))
        if runner.record.keep_alive == CLOSE_ON_COMPLETE and runner.record.parent_id:
            self._in_background(self.close(runner.agent_id, reason="task completed (close_on_complete)"))

    def idle_expired(self, runner: AgentRunner) -> None:
        if runner.agent_id in self.runners and runner.state == "idle":
            self._in_background(self.close(runner.agent_id, reason=f"idle for {self.config.idle_timeout_s:.0f}s"
                                                                   " after completing its task"))

    async def cancel(self, agent_id: str) -> bool:
        runner = self.runners.get(agent_id)
        return runner.cancel_run() if runner is not None else False

    # -- bookkeeping ----------------------------------------------------------
    def save(self, runner: AgentRunner) -> None:
        self.store.save(runner.record, runner.conversation)

    async def address_for(self, runner: AgentRunner, to: str) -> str:
        """Where a message to `to` goes: the agent itself, or with
        route_via_ioa its IOA address (kept per agent)."""
        if not self.config.route_via_ioa or to.startswith(IOA_PREFIX):
            return to
        address = self._addresses.get(to)
        if address is None:
            response = await self._relay_stub.MapAddress(relay_pb2.MapAddressRequest(agent_id=to),
                                                         metadata=runner.handle.metadata,
                                                         timeout=self.config.call_timeout_s)
            address = self._addresses[to] = response.address
        return address

    async def space_send(self, runner: AgentRunner, space: str, text: str) -> dict[str, Any]:
        response = await self._relay_call("SpaceSend", relay_pb2.SpaceSendRequest(space=space, text=text), runner)
        status = net.PublishStatus.Name(response.status).removeprefix("PUBLISH_STATUS_").lower()
        return {"status": status, "ioa_message_id": response.ioa_message_id, **(
            {"detail": response.detail} if response.detail else {})}

    async def space_read(self, runner: AgentRunner, space: str, after: int) -> dict[str, Any]:
        response = await self._relay_call("SpaceRead", relay_pb2.SpaceReadRequest(space=space, after_seq=after),
                                          runner)
        messages = []
        for m in response.messages:
            sender = getattr(m, "from")
            messages.append({"position": m.space_seq, "from": await self.name_of(f"{IOA_PREFIX}{sender.node}/"
                                                                                  f"{sender.agent}"),
                             "from_address": f"{IOA_PREFIX}{sender.node}/{sender.agent}", "text": m.text})
        return {"space": space, "messages": messages}

    async def _relay_call(self, method: str, request, runner: AgentRunner):
        try:
            return await getattr(self._relay_stub, method)(request, metadata=runner.handle.metadata,
                                                           timeout=self.config.call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise errors.FailedPrecondition("this mesh has no IOA relay", reason="NO_RELAY") from None
            raise from_rpc_error(exc) from None

    async def name_of(self, agent_id: str) -> str:
        if agent_id.startswith(IOA_PREFIX):
            node, _, local = agent_id.removeprefix(IOA_PREFIX).partition("/")
            known = self._names.get(local)
            return f"{known}@{node}" if known else agent_id
        name = self._names.get(agent_id)
        if name is None:
            asker = next(iter(self.runners.values()), None)
            try:
                name = (await asker.handle.get(agent_id)).name if asker else agent_id
            except errors.MeshError:
                name = agent_id
            self._names[agent_id] = name
        return name

    def observe(self, runner: AgentRunner, kind: str, detail: str) -> None:
        event = HostEvent(time.time(), runner.record.name, runner.agent_id, kind, detail)
        for observer in self.observers:
            observer(event)

    async def _recover_consumed(self, runner: AgentRunner) -> int:
        """Messages the mesh recorded as consumed by this agent that never made
        it into its conversation (the host died between ack and save): put
        them in now. Returns how many."""
        missing, after = [], 0
        while True:
            page = await runner.handle.events(agent_id=runner.agent_id, kinds=[ev.EVENT_KIND_MESSAGE_CONSUMED],
                                              after=after, limit=1000)
            missing += [e for e in page if e.agent_id == runner.agent_id
                        and f"{e.sender}/{e.message_id}" not in runner.conversation.injected]
            if len(page) < 1000:
                break
            after = page[-1].event_id
        items = []
        for event in missing:
            message = (await runner.handle.inbox_status(event.sequence)).envelope
            if key_of(message) not in runner.conversation.injected:
                runner.received[message.message_id] = message
                items.append((message, await self.name_of(message.sender)))
        added = runner.conversation.inject(items)
        if added:
            self.observe(runner, "recovered", f"{len(added)} consumed message(s) put back into the conversation")
            self.save(runner)
        return len(added)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("host background task failed", exc_info=task.exception())
