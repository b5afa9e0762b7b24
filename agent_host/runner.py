"""One agent's scheduler: its inbox (its part of the host's inbox stream,
agent_host.inbox_hub), its pending messages and its one model loop.

Rules (docs/lifecycle.md):
- A single task (`_loop`) starts every run, one after the other, so an
  agent never has two model loops at once.
- A run is a sequence of turns. A turn starts by consuming everything
  pending (acked on the stream with the agent's turn number, then written into the
  conversation as the newest user turn), then makes one model call and
  carries out its tool calls. The run ends when the model answers without
  tool calls or calls finish; if messages are pending then, another run
  starts at once.
- Messages arriving while the agent is idle wake it.
- Cancel stops the current run at its next await; the inbox stays.

The runner sees its host only through `AgentHost`, the mesh only through
its agent's `AgentCalls` and `Inbox` (agent_host/ports.py); what the agent
does through its tools is its `AgentActions` (agent_host/actions.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from opentelemetry import trace

from agent_host.actions import AgentActions, ChildGone
from agent_host.budget import BudgetExceeded, TaskBudget
from agent_host.config import CLOSE_ON_COMPLETE, IDLE_TIMEOUT, HostConfig
from agent_host.conversation import NOTE_PREFIX, Conversation
from agent_host.hoststore import HostedAgent
from agent_host.model_usage import MODEL_USAGE
from agent_host.models.base import Model, ModelAttempt, ModelChain, ModelError, ModelReply
from agent_host.ports import AgentCalls, AgentHost, Inbox
from agent_host.tools import ToolContext, offered, result_message, run_tool, schemas
from inboxmesh.client import errors
from inboxmesh.client.stream import StreamItem
from inboxmesh.client.tracing import context_of, tracer
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2

__all__ = ["AgentRunner", "BudgetExceeded", "ChildGone"]
log = logging.getLogger(__name__)
HandleT = TypeVar("HandleT", bound=AgentCalls)
"""The runner's mesh calls: AgentHandle on a real host, an in-memory one in tests/test_runner.py."""


class AgentRunner(Generic[HandleT]):
    """One hosted agent: its inbox, its pending messages, its one loop. The host builds it
    (Host._runner) and reads it through its public names only: record, conversation, budget, state,
    pending, received, stream, the run counters, start/stop/cancel_run/child_gone/is_own_task/
    take_recovered."""

    def __init__(self, host: AgentHost, record: HostedAgent, handle: HandleT, inbox: Inbox,
                 model: Model | ModelChain,
                 conversation: Conversation, budget: TaskBudget, config: HostConfig, *,
                 max_spawns: int | None = None, max_working: int | None = None, max_depth: int | None = None):
        self.host = host
        self.record = record
        self.handle = handle
        self.stream = inbox
        self.model = ModelChain.of(model)
        """The agent's models: its primary, then its fallbacks."""
        self.profile: Any = None
        """The host's AgentProfile of this agent (set by Host._runner)."""
        self.conversation = conversation
        self.budget = budget
        self.config = config
        self.max_spawns = max_spawns
        """Children the agent may start in all (None: no limit)."""
        self.actions = AgentActions(record, handle, host, conversation, budget, max_spawns=max_spawns,
                                    consume=self._consume, record_event=self.event)
        self.pending: list[env_pb.Envelope] = []
        self.wake = asyncio.Event()
        self.state = "starting"
        self.start_requested = False
        self.stopping = False
        self.run_task: asyncio.Task[None] | None = None
        self.runs_active = 0
        self.max_runs_active = 0
        self.model_requests = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.started_at = time.monotonic()
        self._turn: _Turn | None = None
        """The turn in progress: what it consumed, whether the model was called, the calls run and skipped."""
        self._tools = ToolContext(agent=record, handle=handle, host=host, actions=self.actions,
                                  max_spawns=max_spawns, max_working=max_working, max_depth=max_depth,
                                  min_task_words=config.min_task_words,
                                  refuse_own_task=config.refuse_own_task,
                                  max_messages_per_peer=config.max_messages_per_peer)
        self._items: AsyncGenerator[StreamItem, None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._idle_timer: asyncio.TimerHandle | None = None
        self._quiet_timer: asyncio.TimerHandle | None = None
        self._quiet_woken_at = -1
        """The tree's consumption count (_tree_consumed) when this agent was last woken for a quiet tree."""
        self._recording: set[asyncio.Future[None]] = set()
        self._held: list[tuple[ev.EventKind, dict[str, Any]]] = []
        """Runtime events to record with the next one (hold_event): an AGENT_WOKEN goes with its turn's
        TURN_STARTED, one mesh call (one commit) between the message and the turn instead of two."""
        self.notes: list[str] = []
        """Runtime notes for the agent's next turn, with no message behind them (team_joined)."""
        self._stream_down = False
        """An ack failed because the inbox stream was lost; cleared when it attaches again."""

    @property
    def received(self) -> dict[str, env_pb.Envelope]:
        """Every message this agent consumed, by message id, oldest first."""
        return self.actions.received

    @property
    def agent_id(self) -> str:
        return self.handle.agent_id

    def __repr__(self) -> str:
        return f"AgentRunner({self.record.name}:{self.agent_id})"

    # -- lifecycle ----------------------------------------------------------
    async def start(self, *, run: bool = False) -> None:
        """Attach the inbox (and wait until the mesh confirmed it: ATTACHED),
        then start reading and scheduling: before the agent's first turn.
        With `run` the agent takes a turn at once (a new task, a resumed run)."""
        if run:
            self.start_requested = True
        items = self._items = self.stream.__aiter__()
        first = await anext(items)
        if first.agent_event is None or first.agent_event.kind != inbox_pb2.SUBSCRIPTION_EVENT_KIND_ATTACHED:
            raise errors.Unavailable(f"{self}: expected the subscription to attach first, got {first}")
        self._tasks = [asyncio.create_task(self._read(items), name=f"read-{self.record.name}"),
                       asyncio.create_task(self._loop(), name=f"loop-{self.record.name}")]
        self.state = "idle"
        if self.start_requested:
            self.wake.set()

    async def stop(self) -> None:
        """Stop reading and running (the agent itself stays as it is in the mesh)."""
        self.stopping = True
        self._cancel_idle_timer()
        if self._quiet_timer is not None:
            self._quiet_timer.cancel()
        self.stream.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # already reported by the task itself
                pass
        if self._held:  # a wake whose turn never started: recorded all the same
            kind, fields = self._held.pop()
            await self.event(kind, **fields)
        if self._recording:  # runtime events already on their way (a stop right after a finish)
            await asyncio.wait(self._recording, timeout=self.config.call_timeout_s)
        self.actions.abandon()
        if self._items is not None:
            await self._items.aclose()

    def is_own_task(self, task: asyncio.Task[Any] | None) -> bool:
        """Whether `task` is this runner's reader or loop: such a task must not await stop(), which
        cancels it."""
        return task in self._tasks

    def take_recovered(self, items: list[tuple[env_pb.Envelope, str]]) -> list[env_pb.Envelope]:
        """Messages (with their senders' names) the mesh recorded as consumed by this agent that its
        conversation lacks (a host died between ack and save): received now, and written into the
        conversation. Returns those added."""
        for message, _ in items:
            self.actions.took(message)
        return self.conversation.inject(items)

    async def send(self, to: str, text: str, **fields: Any) -> inbox_pb2.Receipt:
        """Send as this agent (AgentActions.send), from outside its turns."""
        return await self.actions.send(to, text, **fields)

    def child_gone(self, child_id: str, reason: str) -> None:
        """A child of this agent was closed (a sync spawn waiting for it fails)."""
        self.actions.child_gone(child_id, reason)

    def tools_now(self) -> tuple[str, ...]:
        """The tools the agent needs now (agent_host.tools.offered), as a turn begins: without spawn_agent
        while a child is at its task, unless config.spawn_while_children_work."""
        tools = offered(self._tools)
        if not self.config.spawn_while_children_work and "spawn_agent" in tools and any(
                not child.completed for child in self.host.team(self.record).children):
            tools = tuple(t for t in tools if t != "spawn_agent")
        return tools

    def cancel_run(self) -> bool:
        """Stop the current run at its next await; the inbox stays open."""
        if self.run_task is not None and not self.run_task.done():
            self.run_task.cancel()
            return True
        return False

    # -- inbox --------------------------------------------------------------
    async def _read(self, items: AsyncGenerator[StreamItem, None]) -> None:
        try:
            async for item in items:
                event = item.agent_event
                if event is not None:
                    if event.kind == inbox_pb2.SUBSCRIPTION_EVENT_KIND_CLOSED:
                        await self.host.release([self.agent_id], event.detail)
                        return
                    if event.kind == inbox_pb2.SUBSCRIPTION_EVENT_KIND_SUPERSEDED:
                        log.error("%s: another subscriber took over this agent's inbox (%s); stopping here",
                                  self, event.detail)
                        self.host.observe(self.record, "superseded", event.detail)
                        return
                    if event.kind == inbox_pb2.SUBSCRIPTION_EVENT_KIND_ATTACHED:
                        self._stream_down = False
                        if self.pending:
                            self.wake.set()  # back after a lost stream: consume what an ack could not take then
                    continue
                for message in item.messages:
                    self._route(message)
        except errors.MeshError as exc:
            log.error("%s: inbox stream failed: %s", self, exc)
            self.host.observe(self.record, "stream-failed", str(exc))
        except Exception as exc:  # a bug here must be seen, not end delivery silently
            log.exception("%s: inbox reader failed", self)
            self.host.observe(self.record, "stream-failed", repr(exc))

    def _route(self, message: env_pb.Envelope) -> None:
        if self.actions.completion_arrived(message):
            return  # a sync spawn of the current turn takes it
        if any(p.sequence == message.sequence for p in self.pending):
            return  # redelivered after a reconnect while still pending here
        self.pending.append(message)
        self.wake.set()

    async def _consume(self, messages: list[env_pb.Envelope]) -> list[env_pb.Envelope] | None:
        """Ack on the stream for this turn; keep what this ack won. On a lost
        stream the messages stay pending (they come again) and the answer is None."""
        try:
            taken = {(m.sender, m.message_id) for m in self.received.values()}
            won = await self.stream.consume(self.agent_id, messages, turn=self.record.turn, taken=taken)
        except errors.Unavailable as exc:
            log.warning("%s: could not consume %d messages (%s); they stay pending until the inbox stream is"
                        " back", self, len(messages), exc)
            self.pending = messages + self.pending
            self._stream_down = True
            return None
        if self._turn is not None:
            self._turn.consumed += len(won)
        for message in won:
            with tracer.start_as_current_span("consume", context=context_of(message), attributes={
                "messaging.message.id": message.message_id, "inboxmesh.sender": message.sender,
                "inboxmesh.recipient": self.agent_id, "inboxmesh.turn": self.record.turn}) as span:
                self.actions.took(message, span.get_span_context())
            self.host.observe(self.record, "consumed", f"{message.message_id} from"
                              f" {await self.host.name_of(message.sender)} (turn {self.record.turn})")
        return won

    async def _take_pending(self) -> bool:
        """Consume what is pending into the conversation; False when something
        was pending and none of it was taken in: the ack could not be made (the
        stream is lost; it stays pending), or this ack won none of it."""
        if not self.pending:
            return True
        batch, self.pending = self.pending, []
        won = await self._consume(batch)
        if won is None:
            return False
        if won:
            names = {m.sender: await self.host.name_of(m.sender) for m in won}
            self.conversation.inject([(m, names[m.sender]) for m in won], note=self._task_note(won),
                                     show_ids=self.config.show_ids)
        return bool(won)

    def _task_note(self, won: list[env_pb.Envelope]) -> str:
        """Notes the runtime adds after the messages of a turn: which of the
        agent's children have reported (whenever reports are among them), and
        with restate_task the agent's task and what it has done so far."""
        notes = []
        if any(m.kind == env_pb.MESSAGE_KIND_COMPLETION for m in won):
            reported, working = self.actions.children_status()
            if working:
                notes.append(f"Reports received from: {', '.join(reported) or 'none'}. Still working: "
                             f"{', '.join(working)}.")
            elif reported and not self.record.completed:
                notes.append(f"All your subagents have reported ({', '.join(reported)}). You can finish now.")
        task_note = self._restated_task(won)
        if task_note:
            notes.append(task_note)
        return f"\n{NOTE_PREFIX}".join(notes)

    def _restated_task(self, won: list[env_pb.Envelope]) -> str:
        if not self.config.restate_task:
            return ""
        task = next((m.content.text for m in won if m.kind == env_pb.MESSAGE_KIND_TASK), "")
        if not task:
            task = next((m.content.text for m in reversed(list(self.received.values()))
                         if m.kind == env_pb.MESSAGE_KIND_TASK), "")
        if not task or any(m.kind == env_pb.MESSAGE_KIND_TASK for m in won):
            return ""
        done = self.conversation.done_so_far()
        return f"Your task: {task}" + (f"\n{NOTE_PREFIX}Done so far: {'; '.join(done)}." if done else "")

    def _team_targets(self) -> list[str] | None:
        """send_message's choice of names (the profile's team_targets, else config.team_targets): the agent's
        children and siblings here."""
        chosen = self.profile.team_targets if self.profile is not None else None
        if not (self.config.team_targets if chosen is None else chosen):
            return None
        team = self.host.team(self.record)
        return sorted({a.name for a in team.children + team.siblings}) or None

    def team_joined(self, agent: HostedAgent) -> None:
        """`agent` joined this agent's team: if this agent's send_message could not find that name before
        (a sibling spawned after it tried), its next turn is told, now if it is idle (the real model's A
        sent to a B not spawned yet, waited, and nothing ever woke it)."""
        if self.record.completed or not self.actions.was_missed(agent.name):
            return
        self.notes.append(f"{agent.name} has joined your team now; you could not reach {agent.name} before.")
        self.start_requested = True
        self.wake.set()

    # -- the one loop ---------------------------------------------------------
    async def _loop(self) -> None:
        while not self.stopping:
            await self.wake.wait()
            self.wake.clear()
            if self.stopping:
                return
            if self.budget.per_wake and self.state in ("idle", "failed") and self.pending and self._alone():
                self.budget.renew()  # a session's next message: a fresh budget (TaskBudget.per_wake)
            if self.budget.failed is not None:
                # the task failed: nothing more runs for it, and nothing is consumed (what is pending stays in
                # the inbox, and is dead-lettered with the reason when the agent is closed)
                self.start_requested = False
                continue
            if not (self.pending or self.start_requested):
                continue
            self._cancel_idle_timer()
            if self.notes and not self.pending and self.state == "idle":
                self.hold_event(ev.EVENT_KIND_AGENT_WOKEN, detail=" ".join(self.notes)[:500])
            if self.pending and self.state in ("idle", "failed"):
                senders = sorted({await self.host.name_of(m.sender) for m in self.pending})
                with tracer.start_as_current_span("wake", links=[trace.Link(c.get_span_context())
                                                                for m in self.pending
                                                                if (c := _span_of(m)) is not None]):
                    self.hold_event(ev.EVENT_KIND_AGENT_WOKEN,
                                    detail=f"{len(self.pending)} message(s) from {', '.join(senders)}")
            self.start_requested = False
            self.run_task = asyncio.create_task(self._run(), name=f"run-{self.record.name}")
            try:
                await self.run_task
            except asyncio.CancelledError:
                if _cancelling():  # the loop itself is being stopped (closed, or the host stops): stop() records
                    self._end_open_turn("stopped: the agent's runner stopped (it was closed, or its host stopped)")
                    raise
                why = f": the task failed ({self.budget.failed[:200]})" if self.budget.failed is not None else ""
                self._end_open_turn(f"cancelled{why}")
                await self.event(ev.EVENT_KIND_RUN_CANCELLED, turn=self.record.turn, detail=f"cancelled{why}")
            except (BudgetExceeded, ModelError) as exc:
                await self._failed(exc)
            except Exception as exc:  # a bug must fail the task loudly, not kill the loop silently
                log.exception("%s: run failed unexpectedly", self)
                await self._failed(exc)
            finally:
                self.run_task = None
                self._turn = None
                self.record.running = False
                try:
                    self.host.save(self.record, self.conversation)
                except Exception:  # host.db failing (a full disk, say): said loudly, and the loop goes on
                    log.exception("%s: could not save the agent in the host's store", self)
            if self.stopping:
                return
            if self.budget.failed is not None:
                self.state = "failed"
                continue
            if self.pending and not self._stream_down:
                self.wake.set()
                continue
            # idle; with messages still pending only while the inbox stream is down: they are taken when
            # it is back (ATTACHED wakes the agent), not by turns that could not consume them anyway
            self.state = "idle"
            await self.event(ev.EVENT_KIND_AGENT_IDLE, turn=self.record.turn)
            if not self.pending:
                self._arm_idle_timer()
                self._arm_quiet_timer()

    def _alone(self) -> bool:
        """No other agent working on this agent's budget has a run in progress (its children are idle)."""
        return not any(r is not self and r.budget is self.budget and r.run_task is not None
                       for r in self.host.runners_on(self.budget))

    async def _failed(self, exc: Exception) -> None:
        """This agent's run failed for good (budget, every model, a bug): the turn it was in ends saying
        so, TASK_FAILED records why, and the host fails the whole task (every other run of it stops)."""
        why = f"{type(exc).__name__}: {exc}" if not isinstance(exc, (BudgetExceeded, ModelError)) else str(exc)
        self._hold_attempts(getattr(exc, "tried", ()))
        self._end_open_turn(f"failed: {why[:300]}")
        self.budget.fail(f"{self.record.name} ({self.agent_id}): {why[:500]}")
        await self.event(ev.EVENT_KIND_TASK_FAILED, turn=self.record.turn, detail=why[:1000])
        self.host.task_ended(self.record, self.budget, exc)

    def _end_open_turn(self, outcome: str) -> None:
        """Hold the TURN_ENDED of a turn that a failure or a cancel cut short (recorded with the next event),
        saying how it ended, what ran, and whether messages it consumed never reached a model."""
        turn, self._turn = self._turn, None
        if turn is None:
            return
        detail = f"{outcome}; {turn.calls()}"
        if turn.consumed and not turn.model_called:
            detail += f"; {turn.consumed} message(s) it consumed were not seen by a model"
        self.hold_event(ev.EVENT_KIND_TURN_ENDED, turn=turn.number, detail=detail)

    def _hold_attempts(self, tried: tuple[ModelAttempt, ...]) -> None:
        for attempt in tried:
            self.hold_event(ev.EVENT_KIND_MODEL_CALLED, turn=self.record.turn, detail=attempt.detail())
            MODEL_USAGE.count(self.agent_id, attempt)  # the host's metrics: what the event says

    async def _run(self) -> None:
        self.runs_active += 1
        self.max_runs_active = max(self.max_runs_active, self.runs_active)
        self.state = "running"
        self.record.running = True
        try:
            while True:
                if self.record.turn >= self.budget.limits.max_turns_per_agent:
                    raise BudgetExceeded(f"{self.record.name} reached {self.record.turn} turns, the most one agent"
                                         " may take")
                # before the turn starts: a turn that could not call the model consumes nothing
                self.budget.check(self.record, before_turn=True)
                self.record.turn += 1
                turn = self._turn = _Turn(self.record.turn)
                await self.event(ev.EVENT_KIND_TURN_STARTED, turn=turn.number)
                with tracer.start_as_current_span("turn", attributes={"inboxmesh.agent": self.agent_id,
                                                                      "inboxmesh.turn": turn.number}):
                    if self.notes:
                        self.conversation.add_user(NOTE_PREFIX + f"\n{NOTE_PREFIX}".join(self.notes))
                        self.notes = []
                    if not await self._take_pending() and not self.conversation.has_new_input():
                        # the turn was for messages it could not consume: no model call on old input;
                        # they stay pending and the agent wakes when the inbox stream is back
                        self._turn = None
                        await self.event(ev.EVENT_KIND_TURN_ENDED, turn=turn.number,
                                         detail=f"no model call: the inbox stream was lost, {len(self.pending)}"
                                                " message(s) stay pending")
                        return
                    given = schemas(self.tools_now(), self._team_targets(),
                                    ioa=self.config.offer_ioa_addresses or self.config.route_via_ioa,
                                    spawn_as=self.profile.spawn_as if self.profile is not None else ())
                    reply = await self._call_model(given)
                    assistant = reply.as_message()
                    self.conversation.messages.append(assistant)
                    sent = False
                    for index, call in enumerate(reply.tool_calls):
                        if call.name == "wait" and index < len(reply.tool_calls) - 1:
                            # a wait in the middle of an answer: the calls after it say what the model wants
                            # done now; waiting is what ends a turn, so only a last wait counts
                            turn.skipped.append(call.name)
                            continue
                        if self.actions.turn_ends:
                            # an earlier call said "wait": the rest of this turn does not run, and is left out
                            # of the conversation (the history shows what happened, nothing to copy wrongly)
                            turn.skipped.append(call.name)
                            self.host.observe(self.record, "tool",
                                              f"{call.name} -> skipped: the turn ended with a wait")
                            continue
                        if call.name == "finish" and turn.failed:
                            # written before the model saw that calls before it failed: its result cannot
                            # account for them (the real model spawned nobody and finished in one answer)
                            result = {"error": f"not finished: {', '.join(turn.failed)} failed earlier in this"
                                               " answer; read those errors and deal with them first"}
                        else:
                            with tracer.start_as_current_span(f"tool {call.name}"):
                                result = await run_tool(self._tools, call, given)
                        if "error" in result and not self.actions.turn_ends and "existing_child" not in result:
                            turn.failed.append(call.name)
                        turn.ran.append((call.id, call.name))
                        sent = sent or (call.name == "send_message" and "error" not in result)
                        self.conversation.messages.append(result_message(call, result))
                        self.host.observe(self.record, "tool", f"{call.name} -> {_brief(result)}")
                    if turn.skipped:
                        ran = {call_id for call_id, _ in turn.ran}
                        assistant["tool_calls"] = [c for c in assistant["tool_calls"] if c["id"] in ran]
                self._turn = None
                self._hold_attempts(reply.tried)
                await self.event(ev.EVENT_KIND_TURN_ENDED, turn=turn.number, detail=turn.calls())
                self.host.save(self.record, self.conversation)
                if self.actions.finished:
                    self.actions.finished = False
                    self._after_finish()
                    return
                if not reply.tool_calls:
                    return
                if turn.failed:
                    # a wait (or a refusal that waits) written before the model saw its errors does not end
                    # the run: the next turn shows them (the real model's parent idled for its whole budget
                    # with a refused spawn it never saw)
                    self.actions.turn_ends = False
                    continue
                if self.actions.turn_ends or (self.config.yield_after_send and sent):
                    self.actions.turn_ends = False
                    return  # wait for answers: the next message wakes the agent
        finally:
            self.runs_active -= 1

    async def _call_model(self, tools: list[dict[str, Any]]) -> ModelReply:
        """One model reply within the task's budget (its requests counted for this agent too)."""
        if self._turn is not None:
            self._turn.model_called = True
        try:
            reply = await self.budget.complete(self.model, self.conversation.messages, tools, self.record)
        except ModelError as exc:
            self.model_requests += exc.attempts
            raise
        self.model_requests += reply.attempts
        self.prompt_tokens += reply.usage.prompt_tokens
        self.output_tokens += reply.usage.completion_tokens
        answered = reply.tried[-1].model if reply.tried else self.model.name
        self.host.observe(self.record, "model", f"{answered}: {len(reply.tool_calls)} tool call(s)"
                                                f"{', text' if reply.text else ''} ({reply.attempts} request(s))")
        return reply

    def stats(self) -> str:
        """The stats line of the agent's announce: run time, model requests, tokens."""
        return (f"Stats: ran {time.monotonic() - self.started_at:.1f}s, {self.model_requests} model request(s),"
                f" {self.prompt_tokens} prompt + {self.output_tokens} output tokens")

    def _after_finish(self) -> None:
        """The turn in which the agent finished its task has ended: the result is the task's outcome,
        and with close_on_complete a child is closed now."""
        self.host.task_ended(self.record, self.budget)
        if self.record.keep_alive == CLOSE_ON_COMPLETE and self.record.parent_id:
            self.host.close_soon(self.agent_id, "task completed (close_on_complete)")

    # -- evidence -------------------------------------------------------------
    def hold_event(self, kind: ev.EventKind, **fields: Any) -> None:
        """Record this runtime event with the next `event` (in the same call, before it)."""
        self._held.append((kind, fields))

    async def event(self, kind: ev.EventKind, **fields: Any) -> None:
        """Record a runtime event about this agent in the mesh's event record (after any held ones, in
        one call)."""
        recorded = [*self._held, (kind, fields)]
        self._held.clear()
        call = asyncio.ensure_future(self.handle.record_events([ev.Event(kind=k, **f) for k, f in recorded],
                                                               timeout=self.config.call_timeout_s))
        self._recording.add(call)  # a stop waits for it: the record keeps the last turn's end
        call.add_done_callback(self._recording.discard)
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # evidence must not take the agent down; say so loudly
            log.error("%s: could not record %s: %s", self, ", ".join(ev.EventKind.Name(k) for k, _ in recorded), exc)
        for k, f in recorded:
            self.host.observe(self.record, ev.EventKind.Name(k).removeprefix("EVENT_KIND_").lower(),
                              f.get("detail", "") or (f"turn {f['turn']}" if f.get("turn") else ""))

    # -- keep-alive -----------------------------------------------------------
    def _arm_idle_timer(self) -> None:
        if self.record.completed and self.record.keep_alive == IDLE_TIMEOUT and self._idle_timer is None:
            self._idle_timer = asyncio.get_running_loop().call_later(self.config.idle_timeout_s, self._idle_expired)

    def _idle_expired(self) -> None:
        if self.state == "idle":
            self.host.close_soon(self.agent_id, f"idle for {self.config.idle_timeout_s:.0f}s after completing"
                                                " its task")

    # -- a quiet tree (HostConfig.quiet_wake_s) ---------------------------------
    def _tree_consumed(self) -> int:
        return sum(len(r.actions.received) for r in self.host.runners_on(self.budget))

    def _arm_quiet_timer(self) -> None:
        if not self.config.quiet_wake_s or self.budget.failed is not None:
            return
        if self._quiet_timer is not None:
            self._quiet_timer.cancel()
        self._quiet_timer = asyncio.get_running_loop().call_later(
            self.config.quiet_wake_s, self._quiet_check, self._tree_consumed())

    def _quiet_check(self, consumed: int) -> None:
        """The tree has been idle since this agent went idle, `consumed` messages consumed then: when it still
        is, with nothing pending and no answer awaited, wake the subagents that can end their open tasks."""
        self._quiet_timer = None
        runners = [r for r in self.host.runners_on(self.budget) if not r.record.closed]
        if (self.stopping or self.budget.failed is not None or self._tree_consumed() != consumed
                or any(r.state != "idle" or r.run_task is not None or r.pending or r.start_requested
                       or r.actions.unanswered for r in runners)):
            return
        for r in runners:
            record = r.record
            if (not record.parent_id or not record.task_text or record.completed or r._quiet_woken_at == consumed
                    or any(not c.completed for c in self.host.team(record).children)):
                continue
            r._quiet_woken_at = consumed
            r.notes.append(f"No message is on its way to you: every agent of your team has been waiting for"
                           f" {self.config.quiet_wake_s:g} s. Your task is still open: finish it now with your"
                           f" report (what you sent, and what you received).")
            r.start_requested = True
            r.wake.set()

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None


@dataclass
class _Turn:
    """A turn in progress, for its TURN_ENDED: the calls that ran and were skipped, what it consumed."""

    number: int
    consumed: int = 0
    model_called: bool = False
    ran: list[tuple[str, str]] = field(default_factory=list)
    """(call id, tool name) of the calls carried out, in order."""
    skipped: list[str] = field(default_factory=list)
    """Tools the model called that were not carried out: after a call that ended the turn (a wait), and a
    wait that was not the answer's last call."""
    failed: list[str] = field(default_factory=list)
    """Tools whose call came back with an error that did not end the turn (a refusal that waits ends it)."""

    def calls(self) -> str:
        """`ran: a, b` (or `ran: none`), then `; skipped: c` when some were skipped."""
        text = "ran: " + (", ".join(name for _, name in self.ran) or "none")
        return text + (f"; skipped: {', '.join(self.skipped)}" if self.skipped else "")


def _cancelling() -> bool:
    """Whether the current task is being cancelled itself (not only what it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _span_of(message: env_pb.Envelope) -> trace.Span | None:
    ctx = context_of(message)
    if ctx is None:
        return None
    span = trace.get_current_span(ctx)
    return span if span.get_span_context().is_valid else None


def _brief(result: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v}" for k, v in result.items() if k in ("status", "error", "agent_id", "to", "closed"))
    return text or str(result)[:120]
