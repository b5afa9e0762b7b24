"""One agent's scheduler: its inbox stream, its pending messages and its one
model loop.

Rules (docs/lifecycle.md):
- A single task (`_loop`) starts every run, one after the other, so an
  agent never has two model loops at once.
- A run is a sequence of turns. A turn starts by consuming everything
  pending (acked on the stream with the turn number, then written into the
  conversation as the newest user turn), then makes one model call and
  carries out its tool calls. The run ends when the model answers without
  tool calls or calls finish; if messages are pending then, another run
  starts at once.
- Messages arriving while the agent is idle wake it.
- Cancel stops the current run at its next await; the inbox stays.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from agent_host.conversation import NOTE_PREFIX, Conversation
from agent_host.hoststore import AgentRecord
from agent_host.models.base import ModelError
from agent_host.tools import result_message, run_tool, schemas
from inboxmesh.client import errors
from inboxmesh.client.mesh import AgentHandle
from inboxmesh.client.stream import InboxStream
from inboxmesh.client.tracing import context_of, tracer
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.runs.v1 import runs_pb2

if TYPE_CHECKING:
    from agent_host.host import Host, TaskBudget
    from agent_host.models.base import Model

log = logging.getLogger(__name__)


class BudgetExceeded(Exception):
    """A task's budget ran out; the message says where it stopped."""


class ChildGone(Exception):
    """A sync child was closed before it completed."""


class AgentRunner:
    def __init__(self, host: Host, record: AgentRecord, handle: AgentHandle, model: Model,
                 conversation: Conversation, budget: TaskBudget):
        self.host = host
        self.record = record
        self.handle = handle
        self.model = model
        self.conversation = conversation
        self.budget = budget
        self.stream = InboxStream([handle], max_in_flight=host.config.max_in_flight)
        self.pending: list[env_pb.Envelope] = []
        self.received: dict[str, env_pb.Envelope] = {}
        self.awaiting: dict[str, tuple[str, asyncio.Future]] = {}
        """task message id -> (child id, future of its completion message): sync spawns."""
        self.wake = asyncio.Event()
        self.state = "starting"
        self.start_requested = False
        self.stopping = False
        self.run_task: asyncio.Task | None = None
        self.runs_active = 0
        self.max_runs_active = 0
        self.model_requests = 0
        self.max_spawns: int | None = None
        self._finished_now = False
        self._yield_now = False
        self._consume_contexts: dict[str, trace.SpanContext] = {}
        self._items = None
        self._tasks: list[asyncio.Task] = []
        self._idle_timer: asyncio.TimerHandle | None = None
        self._recording: set[asyncio.Future] = set()
        self._stream_down = False
        """An ack failed because the inbox stream was lost; cleared when it attaches again."""

    @property
    def agent_id(self) -> str:
        return self.handle.agent_id

    def __repr__(self) -> str:
        return f"AgentRunner({self.record.name}:{self.agent_id})"

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        """Subscribe the inbox (and wait until the mesh confirmed it), then
        start reading and scheduling: before the agent's first turn."""
        self._items = self.stream.__aiter__()
        first = await anext(self._items)
        if first.agent_event is None or first.agent_event.kind != inbox_pb2.SUBSCRIPTION_EVENT_KIND_ATTACHED:
            raise errors.Unavailable(f"{self}: expected the subscription to attach first, got {first}")
        self._tasks = [asyncio.create_task(self._read(), name=f"read-{self.record.name}"),
                       asyncio.create_task(self._loop(), name=f"loop-{self.record.name}")]
        self.state = "idle"
        if self.start_requested:
            self.wake.set()

    async def stop(self) -> None:
        """Stop reading and running (the agent itself stays as it is in the mesh)."""
        self.stopping = True
        self._cancel_idle_timer()
        self.stream.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # already reported by the task itself
                pass
        if self._recording:  # runtime events already on their way (a stop right after a finish)
            await asyncio.wait(self._recording, timeout=self.host.config.call_timeout_s)
        for _, future in self.awaiting.values():
            if not future.done():
                future.set_exception(ChildGone("the waiting agent stopped"))
        if self._items is not None:
            await self._items.aclose()

    def cancel_run(self) -> bool:
        """Stop the current run at its next await; the inbox stays open."""
        if self.run_task is not None and not self.run_task.done():
            self.run_task.cancel()
            return True
        return False

    # -- inbox --------------------------------------------------------------
    async def _read(self) -> None:
        try:
            async for item in self._items:
                event = item.agent_event
                if event is not None:
                    if event.kind == inbox_pb2.SUBSCRIPTION_EVENT_KIND_CLOSED:
                        await self.host.agent_closed(self, event.detail)
                        return
                    if event.kind == inbox_pb2.SUBSCRIPTION_EVENT_KIND_SUPERSEDED:
                        log.error("%s: another subscriber took over this agent's inbox (%s); stopping here",
                                  self, event.detail)
                        self.host.observe(self, "superseded", event.detail)
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
            self.host.observe(self, "stream-failed", str(exc))
        except Exception as exc:  # a bug here must be seen, not end delivery silently
            log.exception("%s: inbox reader failed", self)
            self.host.observe(self, "stream-failed", repr(exc))

    def _route(self, message: env_pb.Envelope) -> None:
        if message.kind == env_pb.MESSAGE_KIND_COMPLETION and message.in_reply_to in self.awaiting:
            _, future = self.awaiting.pop(message.in_reply_to)
            if not future.done():
                future.set_result(message)
                return
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
        for message in won:
            self.received[message.message_id] = message
            with tracer.start_as_current_span("consume", context=context_of(message), attributes={
                "messaging.message.id": message.message_id, "inboxmesh.sender": message.sender,
                "inboxmesh.recipient": self.agent_id, "inboxmesh.turn": self.record.turn}) as span:
                self._consume_contexts[message.message_id] = span.get_span_context()
            self.host.observe(self, "consumed", f"{message.message_id} from {await self.host.name_of(message.sender)}"
                              f" (turn {self.record.turn})")
        return won

    async def _take_pending(self) -> bool:
        """Consume what is pending into the conversation; False when there was
        something to take and the ack could not be made (the stream is lost)."""
        if not self.pending:
            return True
        batch, self.pending = self.pending, []
        won = await self._consume(batch)
        if won is None:
            return False
        if won:
            names = {m.sender: await self.host.name_of(m.sender) for m in won}
            self.conversation.inject([(m, names[m.sender]) for m in won], note=self._task_note(won),
                                     show_ids=self.host.config.show_ids)

    def _task_note(self, won: list[env_pb.Envelope]) -> str:
        """Notes the runtime adds after the messages of a turn: which of the
        agent's children have reported (whenever reports are among them), and
        with restate_task the agent's task and what it has done so far."""
        notes = []
        if any(m.kind == env_pb.MESSAGE_KIND_COMPLETION for m in won):
            reported, working = self.host.children_status(self)
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
        if not self.host.config.restate_task:
            return ""
        task = next((m.content.text for m in won if m.kind == env_pb.MESSAGE_KIND_TASK), "")
        if not task:
            task = next((m.content.text for m in reversed(list(self.received.values()))
                         if m.kind == env_pb.MESSAGE_KIND_TASK), "")
        if not task or any(m.kind == env_pb.MESSAGE_KIND_TASK for m in won):
            return ""
        done = self._done_so_far()
        return f"Your task: {task}" + (f"\n{NOTE_PREFIX}Done so far: {'; '.join(done)}." if done else "")

    def _done_so_far(self) -> list[str]:
        """What the agent's successful tool calls did, from its conversation."""
        calls: dict[str, tuple[str, dict]] = {}
        done = []
        for message in self.conversation.messages:
            for call in message.get("tool_calls") or []:
                calls[call["id"]] = (call["function"]["name"], json.loads(call["function"]["arguments"] or "{}"))
            if message["role"] == "tool" and message["tool_call_id"] in calls:
                name, arguments = calls[message["tool_call_id"]]
                result = json.loads(message["content"])
                if "error" in result:
                    continue
                target = arguments.get("to") or arguments.get("agent_name") or result.get("to_name") or ""
                done.append(f"{name} {target}".strip() + (f" ({result['status']})" if "status" in result else ""))
        return done

    # -- the one loop ---------------------------------------------------------
    async def _loop(self) -> None:
        while not self.stopping:
            await self.wake.wait()
            self.wake.clear()
            if self.stopping:
                return
            if not (self.pending or self.start_requested):
                continue
            self._cancel_idle_timer()
            if self.pending and self.state == "idle":
                senders = sorted({await self.host.name_of(m.sender) for m in self.pending})
                with tracer.start_as_current_span("wake", links=[trace.Link(c.get_span_context())
                                                                for m in self.pending
                                                                if (c := _span_of(m)) is not None]):
                    await self.event(ev.EVENT_KIND_AGENT_WOKEN,
                                     detail=f"{len(self.pending)} message(s) from {', '.join(senders)}")
            self.start_requested = False
            self.run_task = asyncio.create_task(self._run(), name=f"run-{self.record.name}")
            try:
                await self.run_task
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # the loop itself is being stopped
                await self.event(ev.EVENT_KIND_RUN_CANCELLED, turn=self.record.turn)
            except (BudgetExceeded, ModelError) as exc:
                self.host.run_failed(self, exc)
            except Exception as exc:  # a bug must fail the task loudly, not kill the loop silently
                log.exception("%s: run failed unexpectedly", self)
                self.host.run_failed(self, exc)
            finally:
                self.run_task = None
                self.record.running = False
                self.host.save(self)
            if self.stopping:
                return
            if self.pending and not self._stream_down:
                self.wake.set()
                continue
            # idle; with messages still pending only while the inbox stream is down: they are taken when
            # it is back (ATTACHED wakes the agent), not by turns that could not consume them anyway
            self.state = "idle"
            await self.event(ev.EVENT_KIND_AGENT_IDLE, turn=self.record.turn)
            if not self.pending:
                self._arm_idle_timer()

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
                self.record.turn += 1
                turn = self.record.turn
                await self.event(ev.EVENT_KIND_TURN_STARTED, turn=turn)
                with tracer.start_as_current_span("turn", attributes={"inboxmesh.agent": self.agent_id,
                                                                      "inboxmesh.turn": turn}):
                    if not await self._take_pending() and not self.conversation.has_new_input():
                        # the turn was for messages it could not consume: no model call on old input;
                        # they stay pending and the agent wakes when the inbox stream is back
                        await self.event(ev.EVENT_KIND_TURN_ENDED, turn=turn,
                                         detail=f"no model call: the inbox stream was lost, {len(self.pending)}"
                                                " message(s) stay pending")
                        return
                    offered = schemas(self.tools_now(), self.host.team_targets(self))
                    reply = await self.host.call_model(self, offered)
                    assistant = reply.as_message()
                    self.conversation.messages.append(assistant)
                    done = []
                    for call in reply.tool_calls:
                        if self._yield_now:
                            # an earlier call said "wait": the rest of this turn does not run, and is left out
                            # of the conversation (the history shows what happened, nothing to copy wrongly)
                            self.host.observe(self, "tool", f"{call.name} -> skipped: the turn ended with a wait")
                            continue
                        with tracer.start_as_current_span(f"tool {call.name}"):
                            result = await run_tool(self, call)
                        done.append(call.id)
                        self.conversation.messages.append(result_message(call, result))
                        self.host.observe(self, "tool", f"{call.name} -> {_brief(result)}")
                    if reply.tool_calls and len(done) < len(reply.tool_calls):
                        assistant["tool_calls"] = [c for c in assistant["tool_calls"] if c["id"] in done]
                tools = ", ".join(c.name for c in reply.tool_calls) or "no tool calls"
                await self.event(ev.EVENT_KIND_TURN_ENDED, turn=turn, detail=tools)
                self.host.save(self)
                if self._finished_now:
                    self._finished_now = False
                    self.host.after_finish(self)
                    return
                if not reply.tool_calls:
                    return
                if self._yield_now or (self.host.config.yield_after_send
                                       and any(c.name == "send_message" for c in reply.tool_calls)):
                    self._yield_now = False
                    return  # wait for answers: the next message wakes the agent
        finally:
            self.runs_active -= 1

    # -- what tools do ------------------------------------------------------
    def _cause(self) -> env_pb.Envelope | None:
        """The newest message this agent consumed (its task included): what
        its sends now answer. Their trail and conversation continue its own,
        so the mesh's loop guard sees chains of agents."""
        for message in reversed(list(self.received.values())):
            if message.kind != env_pb.MESSAGE_KIND_CONTROL:
                return message
        return None

    async def send(self, to: str, text: str, **fields: Any) -> inbox_pb2.Receipt:
        cause = self._cause()
        if cause is not None:
            fields.setdefault("trail", list(cause.trail))
            fields.setdefault("conversation_id", cause.conversation_id or self.record.conversation_id)
        to = await self.host.address_for(self, to)
        receipt = await self.handle.send(to, text, **fields)
        self.host.observe(self, "sent", f"{receipt.message_id} to {await self.host.name_of(to)}: "
                          f"{inbox_pb2.ReceiptStatus.Name(receipt.status).removeprefix('RECEIPT_STATUS_')}")
        return receipt

    async def reply(self, original: env_pb.Envelope, text: str) -> inbox_pb2.Receipt:
        parent = self._consume_contexts.get(original.message_id)
        ctx = trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent is not None else None
        with tracer.start_as_current_span("reply", context=ctx, attributes={"inboxmesh.in_reply_to":
                                                                           original.message_id}):
            return await self.send(original.sender, text, kind=env_pb.MESSAGE_KIND_REPLY,
                                   in_reply_to=original.message_id, conversation_id=original.conversation_id,
                                   trail=list(original.trail),
                                   hop_count=original.hop_count)

    def wait_for_messages(self) -> None:
        """End the run after this turn: there is nothing to act on until a
        message arrives (which wakes the agent)."""
        self._yield_now = True

    def tools_now(self) -> tuple[str, ...]:
        """The tools the agent needs now: `finish` only while its task is
        open, `spawn_agent` only while it may start more children."""
        hidden = set()
        if self.record.completed:
            hidden.add("finish")
        if self.max_spawns is not None and self.record.spawned >= self.max_spawns:
            hidden.add("spawn_agent")
        return tuple(t for t in self.record.tools if t not in hidden)

    async def finish(self, result: str) -> dict[str, Any]:
        if self.record.completed:
            self.wait_for_messages()
            return {"error": "your task is already finished"}
        working = self.host.children_working(self)
        if working:
            self.wait_for_messages()  # the only thing to do is wait for their reports
            return {"error": f"not finished: {', '.join(working)} still working; their reports will arrive as"
                             " messages. End your turn now and wait."}
        outcome: dict[str, Any] = {"status": "completed"}
        completion_id = ""
        if self.record.parent_id:
            # the mesh ends the run and announces the result in the parent's inbox, exactly once
            ended = await self.handle.end_run(result)
            run = ended.run
            completion_id = run.announce_message_id
            outcome["delivered_to"] = self.record.parent_id
            outcome["announce"] = runs_pb2.AnnounceState.Name(run.announce_state).removeprefix(
                "ANNOUNCE_STATE_").lower()
            if ended.already_ended:
                outcome["note"] = "your run had already ended; nothing was sent again"
            self.host.observe(self, "sent", f"result to {await self.host.name_of(self.record.parent_id)}: "
                              f"{outcome['announce']}")
        self.record.completed = True
        self.record.result = result
        self._finished_now = True
        await self.event(ev.EVENT_KIND_TASK_COMPLETED, message_id=completion_id, turn=self.record.turn,
                         detail=result[:500])
        return outcome

    def newest_received(self) -> env_pb.Envelope | None:
        """The newest message this agent consumed that can be answered (not
        its task, not a mesh notice)."""
        for message in reversed(list(self.received.values())):
            if message.kind not in (env_pb.MESSAGE_KIND_TASK, env_pb.MESSAGE_KIND_CONTROL):
                return message
        return None

    def expect_completion(self, task_message_id: str, child_id: str) -> asyncio.Future:
        """Register, before the task is sent, that this agent waits for the
        child's completion (so it cannot slip past into `pending`)."""
        future = asyncio.get_running_loop().create_future()
        self.awaiting[task_message_id] = (child_id, future)
        return future

    async def wait_for_completion(self, future: asyncio.Future, child_id: str) -> env_pb.Envelope:
        """Block this run until the child's completion reaches this agent's
        inbox; the completion is consumed here, in this turn."""
        message = await future
        won = await self._consume([message])
        if not won:
            raise ChildGone(f"the completion of {child_id} could not be consumed")
        return message

    def child_gone(self, child_id: str, reason: str) -> None:
        for key, (waited, future) in list(self.awaiting.items()):
            if waited == child_id and not future.done():
                del self.awaiting[key]
                future.set_exception(ChildGone(f"subagent {child_id} was closed before it completed: {reason}"))

    # -- evidence -------------------------------------------------------------
    async def event(self, kind: int, **fields: Any) -> None:
        """Record a runtime event about this agent in the mesh's event record."""
        request = ev.RecordEventsRequest(events=[ev.Event(kind=kind, **fields)])
        call = asyncio.ensure_future(self.handle.client.events.RecordEvents(
            request, metadata=self.handle.metadata, timeout=self.host.config.call_timeout_s))
        self._recording.add(call)  # a stop waits for it: the record keeps the last turn's end
        call.add_done_callback(self._recording.discard)
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # evidence must not take the agent down; say so loudly
            log.error("%s: could not record %s: %s", self, ev.EventKind.Name(kind), exc)
        self.host.observe(self, ev.EventKind.Name(kind).removeprefix("EVENT_KIND_").lower(),
                          fields.get("detail", "") or (f"turn {fields['turn']}" if fields.get("turn") else ""))

    # -- keep-alive -----------------------------------------------------------
    def _arm_idle_timer(self) -> None:
        from agent_host.config import IDLE_TIMEOUT

        if self.record.completed and self.record.keep_alive == IDLE_TIMEOUT and self._idle_timer is None:
            self._idle_timer = asyncio.get_running_loop().call_later(
                self.host.config.idle_timeout_s, self.host.idle_expired, self)

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None


def _span_of(message: env_pb.Envelope) -> trace.Span | None:
    ctx = context_of(message)
    if ctx is None:
        return None
    span = trace.get_current_span(ctx)
    return span if span.get_span_context().is_valid else None


def _brief(result: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v}" for k, v in result.items() if k in ("status", "error", "agent_id", "to", "closed"))
    return text or str(result)[:120]
