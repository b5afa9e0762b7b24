"""What an agent does through its tools: send, reply, spawn, finish and wait, and the messages it
consumed that those act on. One per hosted agent, owned by its runner (agent_host/runner.py), which
consumes the messages and reads the turn's outcome (`turn_ends`, `finished`); the tools
(agent_host/tools.py) reach it through their ToolContext."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry import trace

from agent_host.budget import TaskBudget
from agent_host.conversation import Conversation
from agent_host.hoststore import HostedAgent
from agent_host.ports import AgentCalls, AgentHost
from inboxmesh.client import errors
from inboxmesh.client.addressing import IOA_PREFIX
from inboxmesh.client.errors import Reason
from inboxmesh.client.tracing import tracer
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.runs.v1 import runs_pb2

Consume = Callable[[list[env_pb.Envelope]], Awaitable[list[env_pb.Envelope] | None]]
"""The runner's consume: ack in the current turn; the messages won (None: the inbox stream is lost)."""
RecordEvent = Callable[..., Awaitable[None]]
"""The runner's event(kind, **fields): a runtime event in the mesh's event record."""


_DELIVERED = (inbox_pb2.RECEIPT_STATUS_ACCEPTED, inbox_pb2.RECEIPT_STATUS_DUPLICATE, inbox_pb2.RECEIPT_STATUS_OUTBOXED)
"""Receipts of a message that is (or will be) in its recipient's inbox."""


def _name_key(name: str) -> str:
    """A name as send_message's `to` may give it: case and an `agt_` a model put in front set aside."""
    key = name.strip().lower()
    return key.removeprefix("agt_") or key


def _peer(address: str) -> str:
    """Who an address names, for counting messages per peer: an agent reached through the IOA relay
    (route_via_ioa) is counted as its agent id, the last part of its IOA address."""
    return address.rpartition("/")[2] if address.startswith(IOA_PREFIX) else address


class ChildGone(Exception):
    """A sync child was closed before it completed."""


NOT_ASKING = (env_pb.MESSAGE_KIND_REPLY, env_pb.MESSAGE_KIND_COMPLETION)
"""Kinds of message that ask for nothing back (an answer, a report): neither awaits an answer (`unanswered`)
nor keeps its holder from waiting (the wait tool)."""


class AgentActions:
    def __init__(self, record: HostedAgent, handle: AgentCalls, host: AgentHost, conversation: Conversation,
                 budget: TaskBudget, *, max_spawns: int | None, consume: Consume, record_event: RecordEvent):
        self.record = record
        self.handle = handle
        self.host = host
        self.conversation = conversation
        self.budget = budget
        self.max_spawns = max_spawns
        self._consume = consume
        self._event = record_event
        self.received: dict[str, env_pb.Envelope] = {}
        """Every message the agent consumed, by message id, oldest first."""
        self.replied: dict[str, str] = {}
        """message id -> the id of the agent's reply to it (accepted, or kept in the outbox): each message is
        answered once (a small model answered the same message again every turn, and its sender, woken by
        each answer, wrote again: a ping-pong until the turn limit)."""
        self._peer_sends: dict[str, int] = {}
        """recipient -> messages sent to it since a third party (not that recipient, not the mesh) last wrote
        to this agent: the count HostConfig.max_messages_per_peer limits."""
        self.unanswered: set[str] = set()
        """Ids of the messages this agent sent (not tasks, replies or reports) that no message it consumed has
        answered yet: an answer may still wake it."""
        self.missed: set[str] = set()
        """Names (and ids) send_message could not find (`reached_for`): when an agent of that name joins the
        team, this agent is told (AgentRunner.team_joined)."""
        self.turn_ends = False
        """A tool said the run ends after this turn (the agent waits for a message)."""
        self.finished = False
        """The agent finished its task in this turn."""
        self._awaiting: dict[str, tuple[str, asyncio.Future[env_pb.Envelope]]] = {}
        """task message id -> (child id, future of its completion message): sync spawns."""
        self._consume_contexts: dict[str, trace.SpanContext] = {}
        self.stats: Callable[[], str] = lambda: ""
        """The stats line its announce ends with (AgentRunner.stats: run time, model requests, tokens)."""

    # -- the messages consumed --------------------------------------------------
    def took(self, message: env_pb.Envelope, span: trace.SpanContext | None = None) -> None:
        """The agent consumed `message` (its consume span, which a reply to it continues)."""
        self.received[message.message_id] = message
        self.unanswered.discard(message.in_reply_to)
        if message.kind != env_pb.MESSAGE_KIND_CONTROL:  # new input: every exchange but the one with its sender
            # may need more messages
            sender = _peer(message.sender)
            self._peer_sends = {sender: self._peer_sends[sender]} if sender in self._peer_sends else {}
        if span is not None:
            self._consume_contexts[message.message_id] = span

    def completion_arrived(self, message: env_pb.Envelope) -> bool:
        """Whether `message` is the completion a sync spawn of this turn waits for (it is handed over
        there, and consumed in this turn, instead of waiting for the next)."""
        if message.kind != env_pb.MESSAGE_KIND_COMPLETION or message.in_reply_to not in self._awaiting:
            return False
        _, future = self._awaiting.pop(message.in_reply_to)
        if future.done():
            return False
        future.set_result(message)
        return True

    def message(self, message_id: str | None = None) -> env_pb.Envelope | None:
        """A message the agent consumed, by id (also by the end of its id after a `:`, when that names
        one message: the real model dropped the node prefix of IOA message ids, then gave up replying and
        finished, 1 of 3 runs over IOA on 2026-12-04; or by its sender's id, when one message it can
        answer is from that sender); without an id the newest one it can answer (not its
        task, not a mesh notice). None when there is none."""
        if message_id is not None:
            found = self.received.get(message_id)
            if found is None and message_id:  # an IOA id without its node prefix, if it names one message
                tails = [m for m in self.received.values() if m.message_id.endswith(":" + message_id)]
                found = tails[0] if len(tails) == 1 else None
            if found is None and message_id:  # the sender's id given for the message's (the real model did,
                # then finished without answering: 1 run over IOA in CI on 2026-12-04), if one answerable
                # message is from that sender
                senders = [m for m in self.answerable(len(self.received))
                           if message_id in (m.sender, m.sender.rpartition("/")[2])]
                found = senders[0] if len(senders) == 1 else None
            return found
        newest = self.answerable(1)
        return newest[0] if newest else None

    def answerable(self, limit: int = 3) -> list[env_pb.Envelope]:
        """The newest messages the agent consumed that it can answer (not its task, not a mesh notice, not
        one it answered already), newest first, at most `limit`."""
        found: list[env_pb.Envelope] = []
        for message in reversed(list(self.received.values())):
            if len(found) == limit:
                break
            if self.not_answerable(message) is None:
                found.append(message)
        return found

    def not_answerable(self, message: env_pb.Envelope) -> str | None:
        """Why the agent cannot reply to `message`, a message it consumed (None: it can)."""
        if message.kind == env_pb.MESSAGE_KIND_TASK:
            return f"message_id {message.message_id!r} is your task: you answer it with finish, not reply"
        if message.kind == env_pb.MESSAGE_KIND_CONTROL:
            return f"message_id {message.message_id!r} is a notice from the mesh: it takes no reply"
        if message.message_id in self.replied:
            return (f"you answered message_id {message.message_id!r} already (your reply"
                    f" {self.replied[message.message_id]!r})")
        return None

    def reached_for(self, target: str) -> None:
        """send_message found no agent `target` (a name, or an id a model made of one, agt_<name>)."""
        self.missed.add(_name_key(target))

    def was_missed(self, name: str) -> bool:
        """Whether send_message could not find an agent named `name` before (forgotten once asked)."""
        key = _name_key(name)
        if key in self.missed:
            self.missed.discard(key)
            return True
        return False

    def sent_to_peer(self, peer: str) -> int:
        """Messages sent to `peer` since a third party last wrote to this agent."""
        return self._peer_sends.get(_peer(peer), 0)

    def children_status(self) -> tuple[list[str], list[str]]:
        """Names of the agent's children on this host that have reported (their COMPLETION answering
        their task was consumed by the agent) and of those still working."""
        answered = {m.in_reply_to for m in self.received.values() if m.kind == env_pb.MESSAGE_KIND_COMPLETION}
        children = self.host.team(self.record).children
        return ([c.name for c in children if c.task_message_id in answered],
                [c.name for c in children if c.task_message_id not in answered])

    def _cause(self) -> env_pb.Envelope | None:
        """The newest message this agent consumed (its task included): what
        its sends now answer. Their trail and conversation continue its own,
        so the mesh's loop guard sees chains of agents."""
        for message in reversed(list(self.received.values())):
            if message.kind != env_pb.MESSAGE_KIND_CONTROL:
                return message
        return None

    # -- actions ------------------------------------------------------------------
    async def send(self, to: str, text: str, **fields: Any) -> inbox_pb2.Receipt:
        """Send as the agent, continuing the trail and conversation of what it consumed last."""
        cause = self._cause()
        if cause is not None:
            fields.setdefault("trail", list(cause.trail))
            fields.setdefault("conversation_id", cause.conversation_id or self.record.conversation_id)
        to = await self.host.address_for(self.handle, to)
        receipt = await self.handle.send(to, text, **fields)
        if receipt.status in _DELIVERED and fields.get("kind") != env_pb.MESSAGE_KIND_TASK:  # a task is not
            # part of an exchange
            self._peer_sends[_peer(to)] = self._peer_sends.get(_peer(to), 0) + 1
            if fields.get("kind") not in NOT_ASKING:
                self.unanswered.add(receipt.message_id)
        self.host.observe(self.record, "sent", f"{receipt.message_id} to {await self.host.name_of(to)}: "
                          f"{inbox_pb2.ReceiptStatus.Name(receipt.status).removeprefix('RECEIPT_STATUS_')}")
        return receipt

    async def reply(self, original: env_pb.Envelope, text: str) -> inbox_pb2.Receipt:
        """Answer a message the agent consumed: to its sender, in its conversation, and in its trace
        (the reply span is a child of the message's consume span)."""
        parent = self._consume_contexts.get(original.message_id)
        ctx = trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent is not None else None
        with tracer.start_as_current_span("reply", context=ctx, attributes={"inboxmesh.in_reply_to":
                                                                           original.message_id}):
            receipt = await self.send(original.sender, text, kind=env_pb.MESSAGE_KIND_REPLY,
                                      in_reply_to=original.message_id, conversation_id=original.conversation_id,
                                      trail=list(original.trail),
                                      hop_count=original.hop_count)
        if receipt.status in _DELIVERED:
            self.replied[original.message_id] = receipt.message_id
        return receipt

    def wait_for_messages(self) -> None:
        """End the run after this turn: there is nothing to act on until a
        message arrives (which wakes the agent)."""
        self.turn_ends = True

    async def spawn(self, name: str, task: str, mode: str = "async", config_id: str = "") -> dict[str, Any]:
        """Start a child with a task (the spawn_agent tool's result); a sync child's result comes back
        in this same turn."""
        for existing in self.host.team(self.record).children:
            if existing.name == name and existing.task_text == task:  # the same call again: a retry, not a twin
                # what to do instead, said: the real model's lead repeated its spawns, each a success, until its
                # turn limit, while B's report was on its way
                note = (f"{name} has finished this task and its result was sent to you" if existing.completed
                        else f"{name} is working on this task: its result comes to you as a message when it"
                             " finishes, so do not start it again; wait for it")
                return {"agent_id": existing.agent_id, "name": name, "mode": existing.mode,
                        "task_message_id": existing.task_message_id, "status": "already started", "note": note}
        if self.max_spawns is not None and self.record.spawned >= self.max_spawns:
            return {"error": f"you may start {self.max_spawns} subagents and have started them all"}
        taken = await self._name_taken(name)
        if taken:
            mine = next((c for c in self.host.team(self.record).children if c.name == name), None)
            if mine is not None:  # a child it has already: `existing_child` (AgentRunner: not a failure that
                # stops a finish in the same answer; the real model's lead wrote its spawns again, with other
                # words, before every finish, after both children had reported)
                state = "has finished its task" if mine.completed else "is working on its task"
                return {"error": f"you already have a subagent named {name!r}; it {state}. Choose another name"
                                 " for a new subagent", "existing_child": mine.agent_id}
            return {"error": taken}
        history = self.conversation.fork().messages[1:] if mode == "fork" else []  # it gets its own system prompt
        # the mesh's limits may refuse it (the tool reports why)
        child = await self.host.start_child(self.record, name=name, task=task, mode=mode, history=history,
                                            budget=self.budget, config_id=config_id)
        await self._event(ev.EVENT_KIND_AGENT_SPAWNED, message_id=child.task_message_id,
                          detail=f"{child.agent_id} name={name} mode={mode}")
        done = self._expect_completion(child.task_message_id, child.agent_id) if mode == "sync" else None
        receipt = await self.send(child.agent_id, task, kind=env_pb.MESSAGE_KIND_TASK,
                                  message_id=child.task_message_id, conversation_id=child.conversation_id)
        result = {"agent_id": child.agent_id, "name": name, "mode": mode, "task_message_id": child.task_message_id}
        if config_id:
            result["agent"] = config_id
        if receipt.status != inbox_pb2.RECEIPT_STATUS_ACCEPTED:
            return {**result, "status": "failed", "error": f"the task was not accepted: {receipt.detail}"}
        if done is None:
            return {**result, "status": "started"}
        try:
            completion = await self._wait_for_completion(done, child.agent_id)
        except ChildGone as exc:
            return {**result, "status": "failed", "error": str(exc)}
        return {**result, "status": "completed", "result": completion.content.text}

    async def _name_taken(self, name: str) -> str:
        """Why `name` cannot be a new child's ("" when it can): an open agent of the same scope (the whole
        task tree) already has it, so sends to it by name would become ambiguous."""
        try:
            existing = await self.handle.resolve(name)
        except errors.NotFound:
            return ""
        except errors.FailedPrecondition as exc:
            if exc.reason != Reason.AMBIGUOUS_NAME:
                raise
            return f"several agents of your team are already named {name!r}; choose another name"
        whose = "you" if existing.agent_id == self.record.agent_id else f"an agent of your team ({existing.agent_id})"
        return f"{whose} already has the name {name!r}; choose another name for the new subagent"

    async def finish(self, result: str) -> dict[str, Any]:
        """Complete the agent's task (the finish tool's result); refused while children have not
        reported. A child's result is announced to its parent by the mesh, when its run ends."""
        if self.record.completed:
            self.wait_for_messages()
            return {"error": "your task is already finished"}
        working = self.children_status()[1]
        if working:
            self.wait_for_messages()  # the only thing to do is wait for their reports
            return {"error": f"not finished: {', '.join(working)} still working; their reports will arrive as"
                             " messages. End your turn now and wait."}
        outcome: dict[str, Any] = {"status": "completed"}
        completion_id = ""
        if self.record.parent_id:
            # the mesh ends the run and announces the result in the parent's inbox, exactly once
            stats = self.stats()
            ended = await self.handle.end_run(f"{result}\n\n{stats}" if stats else result)
            run = ended.run
            completion_id = run.announce_message_id
            outcome["delivered_to"] = self.record.parent_id
            outcome["announce"] = runs_pb2.AnnounceState.Name(run.announce_state).removeprefix(
                "ANNOUNCE_STATE_").lower()
            if ended.already_ended:
                outcome["note"] = "your run had already ended; nothing was sent again"
            self.host.observe(self.record, "sent", f"result to {await self.host.name_of(self.record.parent_id)}:"
                              f" {outcome['announce']}")
        self.record.completed = True
        self.record.result = result
        self.finished = True
        await self._event(ev.EVENT_KIND_TASK_COMPLETED, message_id=completion_id, turn=self.record.turn,
                          detail=result[:500])
        return outcome

    # -- sync spawns ------------------------------------------------------------------
    def _expect_completion(self, task_message_id: str, child_id: str) -> asyncio.Future[env_pb.Envelope]:
        """Register, before the task is sent, that this agent waits for the
        child's completion (so it cannot slip past into the runner's pending)."""
        future: asyncio.Future[env_pb.Envelope] = asyncio.get_running_loop().create_future()
        self._awaiting[task_message_id] = (child_id, future)
        return future

    async def _wait_for_completion(self, future: asyncio.Future[env_pb.Envelope],
                                   child_id: str) -> env_pb.Envelope:
        """Block this run until the child's completion reaches this agent's
        inbox; the completion is consumed here, in this turn."""
        message = await future
        won = await self._consume([message])
        if not won:
            raise ChildGone(f"the completion of {child_id} could not be consumed")
        return message

    def child_gone(self, child_id: str, reason: str) -> None:
        """The child was closed: a sync spawn waiting for it fails."""
        for key, (waited, future) in list(self._awaiting.items()):
            if waited == child_id and not future.done():
                del self._awaiting[key]
                future.set_exception(ChildGone(f"subagent {child_id} was closed before it completed: {reason}"))

    def abandon(self) -> None:
        """The runner stops: every sync spawn still waiting fails."""
        for _, future in self._awaiting.values():
            if not future.done():
                future.set_exception(ChildGone("the waiting agent stopped"))
