"""An agent host: many agents in one process, each with its own scheduler
(agent_host.runner), against a mesh over gRPC, all following their inboxes on
one inbox stream of the host (agent_host.inbox_hub).

Every agent the host creates, top-level or spawned by another agent's tool
call, is registered in the mesh and attached to the host's inbox stream
before its first turn. The host remembers its agents (host.db) and a
restarted host resumes them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from agent_host.budget import TaskBudget
from agent_host.config import Budget, HostConfig
from agent_host.conversation import Conversation, key_of, system_prompt
from agent_host.hoststore import HostedAgent, HostStore
from agent_host.inbox_hub import InboxHub
from agent_host.models.base import Model, ModelChain
from agent_host.ports import AgentCalls, Team
from agent_host.runner import AgentRunner
from agent_host.tools import ALL_TOOLS, relay_call
from inboxmesh.client import errors
from inboxmesh.client.addressing import A2A_PREFIX, CHANNEL_PREFIX, IOA_PREFIX
from inboxmesh.client.mesh import AgentHandle, MeshClient
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.registry.v1 import registry_pb2 as reg

__all__ = ["AgentProfile", "Budget", "Host", "HostConfig", "HostEvent", "ProfileFactory", "TaskBudget",
           "TaskOutcome"]
log = logging.getLogger(__name__)
MODES = {"sync": reg.AGENT_MODE_SYNC, "async": reg.AGENT_MODE_ASYNC, "fork": reg.AGENT_MODE_FORK}


@dataclass(frozen=True)
class AgentProfile:
    """How an agent runs: its model, its tools, the role in its system prompt."""

    model: Model | ModelChain
    tools: tuple[str, ...] = ALL_TOOLS
    role: str = ""
    max_spawns: int | None = None
    """Children the agent may start in all; once reached, spawn_agent is no
    longer offered (None: no limit)."""
    max_spawn_depth: int | None = None
    """How deep below the top-level agent its tree may go (a configured agent's subagents.maxSpawnDepth,
    which the mesh enforces): spawn_agent is not offered to an agent at that depth."""
    max_working_children: int | None = None
    """Children it may have at their task at once; spawn_agent is not offered while that many work (a
    configured agent's subagents.maxChildrenPerAgent, which the mesh enforces too)."""
    instructions: str = ""
    """Added to the system prompt: the instructions of the agent's skills (agent_host/skills.py)."""
    spawn_as: tuple[tuple[str, str], ...] = ()
    """(id, what it is) of the configured agents its children may run as, its own included, when it has a
    choice (a configured agent's allowAgents): spawn_agent then takes a required `agent` naming one."""
    subagent_models: tuple[str, ...] = ()
    """Model references its children run with (a configured agent's subagents.model and fallbacks; empty:
    their own)."""
    team_targets: bool | None = None
    """Whether send_message offers a choice of team names (a configured agent's tools.sendTo: "team"
    True, "any" False); None: the host's HostConfig.team_targets."""


ProfileFactory = Callable[[HostedAgent], AgentProfile]
"""Chooses the profile of every agent the host creates or resumes."""


@dataclass
class HostEvent:
    at: float
    agent_name: str
    agent_id: str
    kind: str
    detail: str


@dataclass
class TaskOutcome:
    agent_id: str
    ok: bool
    result: str = ""
    error: str = ""
    budget: dict[str, Any] = field(default_factory=dict)


class Host:
    """Runs agents against one mesh; every runner sees it as its AgentHost (agent_host/ports.py)."""

    def __init__(self, config: HostConfig, profiles: ProfileFactory, *, client: MeshClient | None = None):
        self.config = config
        self.profiles = profiles
        self.client = client or MeshClient(config.mesh_address, timeout=config.call_timeout_s, tls=config.tls)
        self._own_client = client is None
        self.store = HostStore(config.data_dir / "host.db")
        self.inbox = InboxHub(max_in_flight=config.max_in_flight, agents_per_stream=config.agents_per_inbox_stream)
        """The host's inbox stream, shared by all its agents (each runner reads its own AgentInbox)."""
        self.runners: dict[str, AgentRunner[AgentHandle]] = {}
        self.observers: list[Callable[[HostEvent], None]] = []
        self._names: dict[str, str] = {}
        self._addresses: dict[str, str] = {}
        self._tasks: dict[str, asyncio.Future[TaskOutcome]] = {}
        self._background: set[asyncio.Task[Any]] = set()
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
            recovered = await self._recover_consumed(runner, handle)
            resumed.append((runner, record.running or recovered > 0))
        # started together: their attaches go to the mesh together (agent_host.inbox_hub)
        started = await asyncio.gather(*(runner.start(run=run) for runner, run in resumed), return_exceptions=True)
        for (runner, run), failure in zip(resumed, started):
            if isinstance(failure, BaseException):
                log.warning("not resuming %s (%s): %s", runner.record.name, runner.agent_id, failure)
                self.observe(runner.record, "not-resumed", str(failure))
                self.runners.pop(runner.agent_id, None)
                await runner.stop()
                if isinstance(failure, errors.FailedPrecondition) and failure.reason == errors.Reason.AGENT_CLOSED:
                    runner.record.closed = True
                    self.save(runner.record, runner.conversation)
                continue
            self.observe(runner.record, "resumed", f"turn {runner.record.turn}" + (", resuming its run"
                                                                                 if run else ""))

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.inbox.closing()  # the stream's end lets go of every agent at once; none is detached alone
        for runner in list(self.runners.values()):
            await runner.stop()
            self.save(runner.record, runner.conversation)
        await self.inbox.close()
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

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _runner(self, record: HostedAgent, handle: AgentHandle, conversation: Conversation, budget: TaskBudget,
                history: list[dict[str, Any]] | None = None) -> AgentRunner[AgentHandle]:
        profile = self.profiles(record)
        if not record.tools:
            record.tools = profile.tools
        if not conversation.messages:
            parent = self._names.get(record.parent_id, "your parent agent") if record.parent_id else ""
            conversation.messages.append({"role": "system", "content": system_prompt(
                record.name, record.agent_id, profile.role, self.config.show_ids, parent=parent,
                task=record.task_text, extra=profile.instructions)})
        conversation.messages += history or []
        inbox = self.inbox.inbox_of(handle)
        runner = AgentRunner(self, record, handle, inbox, profile.model, conversation, budget, self.config,
                             max_spawns=profile.max_spawns, max_working=profile.max_working_children,
                             max_depth=profile.max_spawn_depth)
        runner.actions.stats = runner.stats
        runner.profile = profile
        self.runners[record.agent_id] = runner
        self._names[record.agent_id] = record.name
        return runner

    def _in_background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    # -- tasks --------------------------------------------------------------
    async def start_task(self, name: str, task: str, *, metadata: dict[str, str] | None = None,
                         config_id: str = "") -> AgentRunner[AgentHandle]:
        """Register a top-level agent, give it the task, and start it; with `config_id` it runs as that
        configured agent (the profiles must be ConfiguredAgents: agent_host/configured.py)."""
        if config_id:
            metadata = {**(metadata or {}), "inboxmesh-agent": config_id}
        handle = await self.client.register(name, metadata=metadata)
        record = HostedAgent(agent_id=handle.agent_id, name=name, credential=handle.credential, mode="main",
                             keep_alive=self.config.keep_alive, config_id=config_id, task_text=task)
        conversation = Conversation()
        runner = self._runner(record, handle, conversation, TaskBudget(self.config.budget))
        conversation.add_user(task)
        self._tasks[handle.agent_id] = asyncio.get_running_loop().create_future()
        self.save(record, conversation)
        self.observe(record, "registered", f"top-level agent, task: {task[:120]}")
        await runner.start(run=True)
        return runner

    async def adopt(self, handle: AgentHandle, *, config_id: str) -> AgentRunner[AgentHandle]:
        """Run an agent registered elsewhere (a routing session claimed with ClaimSession) as the configured
        agent `config_id`: its inbox is attached, and the messages in it wake it. Its budget is renewed each
        time it wakes from idle (a session takes message after message; TaskBudget.per_wake)."""
        info = await handle.get()
        record = HostedAgent(agent_id=handle.agent_id, name=info.name, credential=handle.credential, mode="main",
                             keep_alive=self.config.keep_alive, config_id=config_id)
        runner = self._runner(record, handle, Conversation(), TaskBudget(self.config.budget, per_wake=True))
        self.save(record, runner.conversation)
        self.observe(record, "adopted", f"session agent, configured agent {config_id}")
        await runner.start()
        return runner

    async def run_task(self, name: str, task: str, *, timeout: float | None = None,
                       metadata: dict[str, str] | None = None, config_id: str = "") -> TaskOutcome:
        """Run a task to its result (or to a failure with a report of where
        it stopped)."""
        runner = await self.start_task(name, task, metadata=metadata, config_id=config_id)
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

    def task_ended(self, agent: HostedAgent, budget: TaskBudget, error: Exception | None = None) -> None:
        """AgentHost.task_ended: a finished task is its agent's outcome; a failed run fails the whole
        task, and every run working on it stops."""
        if error is None:
            self._settle(agent.agent_id, TaskOutcome(agent.agent_id, ok=True, result=agent.result,
                                                     budget=budget.report()))
            return
        log.error("%s (%s): run failed: %s", agent.name, agent.agent_id, error)
        self.observe(agent, "failed", str(error))
        for other in list(self.runners.values()):
            if other.budget is budget and other.agent_id != agent.agent_id:
                other.cancel_run()
        top = agent
        while top.parent_id and top.parent_id in self.runners:
            top = self.runners[top.parent_id].record
        self._settle(top.agent_id, TaskOutcome(top.agent_id, ok=False, error=str(error), budget=budget.report()))

    def _settle(self, agent_id: str, outcome: TaskOutcome) -> None:
        """The outcome of the task of `agent_id`, if it is a task of this host still open."""
        future = self._tasks.get(agent_id)
        if future is not None and not future.done():
            future.set_result(outcome)

    async def cancel(self, agent_id: str) -> bool:
        runner = self.runners.get(agent_id)
        return runner.cancel_run() if runner is not None else False

    # -- the team: spawning and closing ---------------------------------------
    def runners_on(self, budget: TaskBudget) -> list[AgentRunner[AgentHandle]]:
        """AgentHost.runners_on: the runners working on `budget` (one task, or one session's work)."""
        return [r for r in self.runners.values() if r.budget is budget]

    def team(self, agent: HostedAgent) -> Team:
        open_here = [r.record for r in self.runners.values() if not r.record.closed]
        return Team(children=tuple(r for r in open_here if r.parent_id == agent.agent_id),
                    siblings=tuple(r for r in open_here if agent.parent_id and r.parent_id == agent.parent_id
                                   and r.agent_id != agent.agent_id))

    async def start_child(self, parent: HostedAgent, *, name: str, task: str, mode: str,
                          history: list[dict[str, Any]], budget: TaskBudget, config_id: str = "") -> HostedAgent:
        task_message_id = f"task-{uuid.uuid4().hex}"
        conversation_id = f"conv-{uuid.uuid4().hex}"
        run = reg.RunSpec(task=task, task_message_id=task_message_id, label=name, conversation_id=conversation_id,
                          cleanup=reg.RUN_CLEANUP_KEEP, agent_config_id=config_id)
        as_parent = self.client.agent(parent.agent_id, parent.credential)
        child = await as_parent.spawn(name, MODES[mode], inbox_capacity=self.config.child_inbox_capacity, run=run)
        parent.spawned += 1
        parent_runner = self.runners.get(parent.agent_id)
        record = HostedAgent(agent_id=child.agent_id, name=name, credential=child.credential, mode=mode,
                             parent_id=parent.agent_id, task_message_id=task_message_id, task_text=task,
                             depth=parent.depth + 1,
                             conversation_id=conversation_id, keep_alive=self.config.keep_alive,
                             run_id=child.run_id, config_id=config_id or parent.config_id,
                             models=parent_runner.profile.subagent_models if parent_runner else ())
        runner = self._runner(record, child, Conversation(), budget, history)
        self.save(record, runner.conversation)
        await runner.start()  # attached to the host's inbox stream before its first turn
        for sibling in self.team(record).siblings:  # one that could not reach this name before is told
            if (other := self.runners.get(sibling.agent_id)) is not None:
                other.team_joined(record)
        return record

    async def close(self, agent_id: str, *, reason: str, by: AgentRunner[Any] | None = None) -> list[str]:
        """Close an agent (and its descendants) in the mesh and stop their
        runners here. `by` is the agent asking (defaults to the agent itself)."""
        asker = by or self.runners.get(agent_id)
        if asker is None:
            raise errors.NotFound(f"this host does not run {agent_id}", reason="AGENT_NOT_HOSTED")
        response = await asker.handle.close(agent_id, reason=reason)
        closed = list(response.closed_agent_ids)
        await self.release(closed, reason)
        return closed

    def close_soon(self, agent_id: str, reason: str) -> None:
        if agent_id in self.runners:
            self._in_background(self.close(agent_id, reason=reason))

    async def release(self, agent_ids: list[str], reason: str) -> None:
        caller = asyncio.current_task()  # gather runs each in a task of its own
        self.inbox.closed_in_mesh(agent_ids)  # their delivery ends with the mesh's CLOSED, not a detach
        await asyncio.gather(*(self._closed_here(agent_id, reason, caller) for agent_id in agent_ids))

    async def _closed_here(self, agent_id: str, reason: str, caller: asyncio.Task[Any] | None) -> None:
        """Forget a closed agent here and stop its runner: awaited, unless `caller` (the task asking)
        is the runner's own, which stop() cancels (its reader hearing of the close)."""
        runner = self.runners.pop(agent_id, None)
        for other in self.runners.values():
            other.child_gone(agent_id, reason)
        if runner is None:
            return
        runner.record.closed = True
        self.save(runner.record, runner.conversation)
        self.observe(runner.record, "closed", reason)
        if runner.is_own_task(caller):
            self._in_background(runner.stop())
        else:
            await runner.stop()
        self._settle(agent_id, TaskOutcome(agent_id, ok=False, error=f"closed before finishing: {reason}",
                                           budget=runner.budget.report()))

    # -- bookkeeping ----------------------------------------------------------
    def save(self, agent: HostedAgent, conversation: Conversation) -> None:
        self.store.save(agent, conversation)

    async def address_for(self, sender: AgentCalls, to: str) -> str:
        """Where a message to `to` goes: the agent itself, or with
        route_via_ioa its IOA address (kept per agent)."""
        if not self.config.route_via_ioa or to.startswith((IOA_PREFIX, A2A_PREFIX, CHANNEL_PREFIX)):
            return to
        address = self._addresses.get(to)
        if address is None:
            address = self._addresses[to] = await relay_call(sender.map_address(to))
        return address

    async def name_of(self, agent_id: str) -> str:
        if agent_id.startswith(IOA_PREFIX):
            node, _, local = agent_id.removeprefix(IOA_PREFIX).partition("/")
            known = self._names.get(local)
            return f"{known}@{node}" if known else agent_id
        if agent_id.startswith((A2A_PREFIX, CHANNEL_PREFIX)):  # an address, not an agent here: its own name
            return agent_id
        name = self._names.get(agent_id)
        if name is None:
            asker = next(iter(self.runners.values()), None)
            try:
                name = (await asker.handle.get(agent_id)).name if asker else agent_id
            except errors.MeshError:
                name = agent_id
            self._names[agent_id] = name
        return name

    def observe(self, agent: HostedAgent, kind: str, detail: str) -> None:
        event = HostEvent(time.time(), agent.name, agent.agent_id, kind, detail)
        for observer in self.observers:
            try:
                observer(event)
            except Exception:  # a printer whose stdout is gone (BrokenPipeError), say: not the agent's end
                log.exception("a host observer failed on %s of %s; the agent goes on", kind, agent.name)

    async def _recover_consumed(self, runner: AgentRunner[AgentHandle], handle: AgentHandle) -> int:
        """Messages the mesh recorded as consumed by this agent that never made
        it into its conversation (the host died between ack and save): put
        them in now. Returns how many."""
        missing: list[ev.Event] = []
        after = 0
        while True:
            page = await handle.events(agent_id=runner.agent_id, kinds=[ev.EVENT_KIND_MESSAGE_CONSUMED],
                                       after=after, limit=1000)
            missing += [e for e in page if e.agent_id == runner.agent_id
                        and f"{e.sender}/{e.message_id}" not in runner.conversation.injected]
            if len(page) < 1000:
                break
            after = page[-1].event_id
        items: list[tuple[env_pb.Envelope, str]] = []
        for event in missing:
            message = (await handle.inbox_status(event.sequence)).envelope
            if key_of(message) not in runner.conversation.injected:
                items.append((message, await self.name_of(message.sender)))
        added = runner.take_recovered(items)
        if added:
            self.observe(runner.record, "recovered", f"{len(added)} consumed message(s) put back into the"
                                                     " conversation")
            self.save(runner.record, runner.conversation)
        return len(added)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("host background task failed", exc_info=task.exception())
