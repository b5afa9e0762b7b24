"""The A2A gateway (`inboxmesh a2a`, docs/interop.md): one mesh agent exposed as an A2A agent, and the
mesh's `a2a:` addresses reached through A2A.

Inbound. An A2A client's message becomes a message from `a2a:client/<principal>` (the bearer token's
principal) to the exposed agent, through the mesh's Deliver (GatewayService): its mesh message id is the
task id, derived from the principal and the client's messageId, so a retry is the mesh's DUPLICATE and
never a second message. The task's states are facts of the mesh's record, written to the task book
(inboxmesh/a2a/book.py) in the order they happen: SUBMITTED when the receipt was ACCEPTED; WORKING when the
record shows the agent consumed the message; COMPLETED with the agent's answer (a message to the client's
`a2a:` address, which the mesh stores in the gateway agent's inbox), FAILED when the message was
dead-lettered or the agent closed without answering. Streams and SubscribeToTask read the book, and
resume after the client's `Last-Event-ID` (every event carries its id in `metadata["inboxmesh.event_id"]`).

Outbound. A local agent's message to `a2a:<agent card URL>` is stored by the mesh in the gateway agent's
inbox; the gateway sends it to that A2A agent (SendMessage, messageId = the mesh message id, so a resend
after a gateway restart is the same message to a remote that deduplicates), waits for the task to end, and
delivers the answer to the sender's inbox as a REPLY from `a2a:<URL>` with `in_reply_to` set (its id derived
from the message's, so a second answer after a restart is a DUPLICATE). A remote that cannot be reached, that
fails or that does not answer in time gets the sender a dead-letter notice instead (CONTROL, `in_reply_to`,
`inboxmesh-notice: dead-lettered`, `inboxmesh-reason`), as a local message that is dead-lettered does. The
outbox message is acked only after the answer or the notice was stored: a gateway killed in between sends
again when it restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.client.errors import A2AClientError
from a2a.server.context import ServerCallContext
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.types import a2a_pb2 as a2a
from a2a.utils.errors import (
    A2AError,
    ContentTypeNotSupportedError,
    ExtendedAgentCardNotConfiguredError,
    InvalidParamsError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from google.protobuf import json_format

from inboxmesh.a2a.book import TERMINAL, TaskBook, TaskEvent, TaskRow
from inboxmesh.a2a.errors import AuthenticationRequiredError, TooManyStreamsError, refusal
from inboxmesh.client import errors
from inboxmesh.client.addressing import A2A_PREFIX, A2A_TO_HEADER
from inboxmesh.client.mesh import AgentHandle, MeshClient
from inboxmesh.client.stream import InboxStream
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev_pb
from inboxmesh.inbox.v1 import inbox_pb2 as inbox_pb

log = logging.getLogger(__name__)

CLIENT_PREFIX = f"{A2A_PREFIX}client/"
EVENT_ID_KEY = "inboxmesh.event_id"
LAST_EVENT_ID = "last-event-id"
"""The request header (HTTP) or metadata key (gRPC) naming the last event a resuming client saw."""
ANONYMOUS = "anonymous"
MAX_OUTBOUND = 16
"""Calls to remote A2A agents in flight at once; more messages wait, stored, in the gateway's inbox."""
NOTICE_HEADERS = {"inboxmesh-notice": "dead-lettered"}
MAX_STREAMS = 256
"""Streams (SendStreamingMessage, SubscribeToTask) served at once; one more is TOO_MANY_STREAMS."""
PRUNE_EVERY_S = 3600.0
CURSOR_EVERY = 1000
"""The record watch saves its cursor at every event that changed a task, and at least every this many."""


@dataclass(frozen=True)
class A2aConfig:
    """One `inboxmesh a2a` process."""

    mesh: str
    admin_token: str = field(repr=False)
    agent_id: str
    """The mesh agent exposed as an A2A agent."""
    state: Path
    """The task book (SQLite)."""
    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    tokens: dict[str, str] = field(default_factory=dict, repr=False)
    """Bearer token -> the principal it proves."""
    anonymous: bool = False
    """Accept callers without a token (as principal `anonymous`)."""
    public_url: str = ""
    """Base URL the card advertises (default: http://host:http_port)."""
    description: str = ""
    skills: tuple[tuple[str, str], ...] = ()
    """(id, description) of the skills the card lists."""
    send_wait_s: float = 30.0
    """A non-streaming SendMessage waits this long for the task to end, then returns it as it is."""
    remote_token: str | None = field(default=None, repr=False)
    """Bearer token sent to remote A2A agents."""
    remote_timeout_s: float = 120.0
    """A remote A2A agent's task must end within this; else the sender gets a notice (A2A_TIMEOUT)."""
    keep_days: float = 7.0
    """Ended tasks are forgotten this long after they ended (GetTask is then TaskNotFound)."""
    max_streams: int = MAX_STREAMS
    timeout_s: float = 10.0
    tls: grpc.ChannelCredentials | None = field(default=None, repr=False)


class UnknownRemoteError(Exception):
    """An `a2a:` address whose agent card cannot be read: the sender's notice says UNKNOWN_TARGET."""


def task_id_for(principal: str, client_message_id: str) -> str:
    return "a2a-" + hashlib.sha256(f"{principal}\0{client_message_id}".encode()).hexdigest()[:40]


class Gateway(RequestHandler):
    """The gateway's mesh side (claim, record watch, inbox) and its A2A request handler."""

    def __init__(self, config: A2aConfig):
        self.config = config
        self.client = MeshClient(config.mesh, timeout=config.timeout_s, admin_token=config.admin_token,
                                 tls=config.tls)
        self.book = TaskBook(config.state)
        self.agent: AgentHandle | None = None
        self.exposed_name = ""
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._stream: InboxStream | None = None
        self._outbound = asyncio.Semaphore(MAX_OUTBOUND)
        self._calls: set[asyncio.Task] = set()
        self._cards: dict[str, a2a.AgentCard] = {}
        self._streams = 0

    # -- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        exposed = await self.client.admin_agent(self.config.agent_id)
        self.exposed_name = exposed.name
        self.agent = await self.client.claim_gateway("a2a")
        self._stream = InboxStream([self.agent], max_in_flight=64)
        self._tasks = [asyncio.create_task(self._watch_record(), name="a2a-record"),
                       asyncio.create_task(self._read_inbox(), name="a2a-inbox"),
                       asyncio.create_task(self._prune(), name="a2a-prune")]
        log.info("A2A gateway %s exposes %s (%s)", self.agent.agent_id, self.config.agent_id, self.exposed_name)

    async def stop(self) -> None:
        if self._stream is not None:
            self._stream.stop()
        for task in [*self._tasks, *self._calls]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._calls, return_exceptions=True)
        await self.client.close()
        self.book.close()

    async def _prune(self) -> None:
        while True:
            try:
                pruned = self.book.prune(time.time_ns() // 1000 - int(self.config.keep_days * 86_400e6))
            except (sqlite3.Error, OSError) as exc:  # the book's file failing: tried again at the next round
                log.error("could not forget the tasks that ended over %g days ago: %s", self.config.keep_days, exc)
                pruned = 0
            if pruned:
                log.info("forgot %d tasks that ended over %g days ago", pruned, self.config.keep_days)
            await asyncio.sleep(PRUNE_EVERY_S)

    def _bump(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # -- the mesh's record: consumed, dead-lettered, closed -----------------------------------------
    async def _watch_record(self) -> None:
        kinds = [ev_pb.EVENT_KIND_MESSAGE_CONSUMED, ev_pb.EVENT_KIND_MESSAGE_DEAD_LETTERED,
                 ev_pb.EVENT_KIND_AGENT_CLOSED]
        backoff = 0.1
        while True:
            try:
                unsaved = 0
                async for event in self.client.admin_watch_events(kinds=kinds, after=self.book.cursor(),
                                                                  agent_id=self.config.agent_id):
                    unsaved += 1
                    if self._on_record_event(event) or unsaved >= CURSOR_EVERY:
                        self.book.set_cursor(event.event_id)  # events after it are read again on a restart
                        unsaved = 0
                    backoff = 0.1
            except errors.MeshError as exc:
                log.warning("record watch ended (%s: %s); resuming in %.1fs", exc.reason, exc.message, backoff)
            except (sqlite3.Error, OSError) as exc:  # the book's file failing: resumed from its cursor
                log.error("record watch stopped, the task book failed (%s); resuming in %.1fs", exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def _on_record_event(self, event: ev_pb.Event) -> bool:
        """Whether the event changed a task."""
        changed = False
        if event.kind == ev_pb.EVENT_KIND_AGENT_CLOSED and event.agent_id == self.config.agent_id:
            for task in self.book.open_tasks(self.config.agent_id):
                changed |= self.book.add_event(
                    task.task_id, f"closed:{task.task_id}", a2a.TASK_STATE_FAILED,
                    message=_agent_text(task, f"agent {self.config.agent_id} was closed without answering"
                                              f" ({event.detail[:200]})")) is not None
        elif event.sender.startswith(CLIENT_PREFIX) and event.recipient == self.config.agent_id:
            found = self.book.task(event.message_id)
            if found is None:
                return False
            task = found
            if event.kind == ev_pb.EVENT_KIND_MESSAGE_CONSUMED:
                changed = self.book.add_event(task.task_id, f"consumed:{task.task_id}",
                                              a2a.TASK_STATE_WORKING) is not None
            elif event.kind == ev_pb.EVENT_KIND_MESSAGE_DEAD_LETTERED:
                changed = self.book.add_event(
                    task.task_id, f"dead:{task.task_id}", a2a.TASK_STATE_FAILED,
                    message=_agent_text(task, f"the mesh dead-lettered the message: {event.detail[:300]}")) is not None
        if changed:
            self._bump()
        return changed

    # -- the gateway agent's inbox: answers to A2A clients, messages to A2A agents ---------------------
    async def _read_inbox(self) -> None:
        """Follow the gateway agent's inbox. Should handling a message fail unexpectedly, the stream is
        replaced by a new one: the mesh delivers what was not acked again to the new subscriber."""
        assert self.agent is not None
        while True:
            try:
                await self._follow_inbox()
                return
            except (errors.MeshError, sqlite3.Error, OSError) as exc:
                log.error("reading the gateway's inbox failed (%r); subscribing again", exc)
                assert self._stream is not None
                self._stream.stop()
                self._stream = InboxStream([self.agent], max_in_flight=64)
                await asyncio.sleep(1.0)

    async def _follow_inbox(self) -> None:
        assert self._stream is not None and self.agent is not None
        async for item in self._stream:
            if item.agent_event is not None:
                continue
            for message in item.messages:
                to = message.headers.get(A2A_TO_HEADER, "")
                if to.startswith(CLIENT_PREFIX):
                    self._on_answer(message, to)
                    await self._ack(message)
                elif to.startswith(A2A_PREFIX):
                    await self._outbound.acquire()
                    call = asyncio.create_task(self._call_remote(message, to.removeprefix(A2A_PREFIX)))
                    self._calls.add(call)
                    call.add_done_callback(self._call_done)
                else:
                    log.warning("message %s from %s in the gateway's inbox names no a2a: address; acked unread",
                                message.message_id, message.sender)
                    await self._ack(message)

    def _call_done(self, call: asyncio.Task) -> None:
        self._calls.discard(call)
        self._outbound.release()
        if not call.cancelled() and call.exception() is not None:
            log.error("an outbound A2A call failed: %r (its message stays unacked: sent again on restart)",
                      call.exception())

    async def _ack(self, message: env_pb.Envelope) -> None:
        assert self._stream is not None and self.agent is not None
        await self._stream.consume(self.agent.agent_id, [message])

    def _on_answer(self, message: env_pb.Envelope, to: str) -> None:
        """An agent's message to a client: the answer of the task it replies to (else of the client's newest
        open task in the same conversation)."""
        principal = to.removeprefix(CLIENT_PREFIX)
        task = self.book.task(message.in_reply_to) if message.in_reply_to else None
        if task is None or task.principal != principal:
            candidates = self.book.open_tasks(self.config.agent_id, principal=principal,
                                              context_id=message.conversation_id)
            task = candidates[0] if candidates else None
        if task is None:
            log.warning("message %s to %s answers no open task of that client: not delivered", message.message_id, to)
            return
        parts = _parts(message.content)
        artifact = a2a.Artifact(artifact_id=f"answer-{message.message_id}", name="answer", parts=parts)
        self.book.add_event(task.task_id, f"answer:{message.message_id}:artifact", a2a.TASK_STATE_WORKING,
                            artifact=artifact)
        reply = a2a.Message(message_id=message.message_id, context_id=task.context_id, task_id=task.task_id,
                            role=a2a.ROLE_AGENT, parts=parts)
        self.book.add_event(task.task_id, f"answer:{message.message_id}", a2a.TASK_STATE_COMPLETED, message=reply)
        self._bump()

    # -- outbound: a local agent's message to an A2A agent ------------------------------------------
    async def _call_remote(self, message: env_pb.Envelope, url: str) -> None:
        assert self.agent is not None
        try:
            answer = await asyncio.wait_for(self._ask_remote(message, url), self.config.remote_timeout_s)
            envelope = env_pb.Envelope(
                message_id=_derived("a2a-answer", message), sender=f"{A2A_PREFIX}{url}", recipient=message.sender,
                kind=env_pb.MESSAGE_KIND_REPLY, in_reply_to=message.message_id,
                conversation_id=message.conversation_id, content=answer,
                hop_count=message.hop_count + 1, trail=list(message.trail))
        except (TimeoutError, UnknownRemoteError, A2AClientError, A2AError, httpx.HTTPError, ValueError) as exc:
            reason = ("A2A_TIMEOUT" if isinstance(exc, TimeoutError) else
                      "UNKNOWN_TARGET" if isinstance(exc, UnknownRemoteError) else "A2A_FAILED")
            why = (f"no answer within {self.config.remote_timeout_s:g}s" if isinstance(exc, TimeoutError)
                   else f"{type(exc).__name__}: {str(exc)[:300]}")
            log.warning("A2A message %s from %s to %s: %s (%s)", message.message_id, message.sender, url, reason, why)
            envelope = env_pb.Envelope(
                message_id=_derived("a2a-notice", message), sender=f"{A2A_PREFIX}{url}", recipient=message.sender,
                kind=env_pb.MESSAGE_KIND_CONTROL, in_reply_to=message.message_id,
                conversation_id=message.conversation_id,
                content=env_pb.Content(text=f"message {message.message_id} to a2a:{url} was dead-lettered:"
                                            f" {reason}: {why}"),
                headers={**NOTICE_HEADERS, "inboxmesh-reason": reason})
        [receipt] = await self.agent.deliver([envelope])
        if receipt.status not in (inbox_pb.RECEIPT_STATUS_ACCEPTED, inbox_pb.RECEIPT_STATUS_DUPLICATE):
            log.warning("the answer to %s could not be stored in %s's inbox: %s %s", message.message_id,
                        message.sender, inbox_pb.ReceiptStatus.Name(receipt.status), receipt.detail)
        await self._ack(message)

    async def _ask_remote(self, message: env_pb.Envelope, url: str) -> env_pb.Content:
        headers = {"Authorization": f"Bearer {self.config.remote_token}"} if self.config.remote_token else {}
        async with httpx.AsyncClient(headers=headers, timeout=self.config.remote_timeout_s) as http:
            card = self._cards.get(url)
            if card is None:
                base, _, path = url.partition("/.well-known/")
                resolver = A2ACardResolver(http, base, **({"agent_card_path": f"/.well-known/{path}"} if path else {}))
                try:
                    card = await resolver.get_agent_card()
                except (A2AClientError, httpx.HTTPError, ValueError) as exc:
                    raise UnknownRemoteError(f"no A2A agent card at {url[:200]}: {str(exc)[:300]}") from exc
                self._cards[url] = card
            factory = ClientFactory(ClientConfig(streaming=False, httpx_client=http,
                                                 supported_protocol_bindings=["JSONRPC", "HTTP+JSON"]))
            client = factory.create(card)
            request = a2a.SendMessageRequest(message=a2a.Message(
                message_id=message.message_id, role=a2a.ROLE_USER, parts=_parts(message.content),
                context_id=message.conversation_id))
            request.message.metadata.update({"inboxmesh.sender": message.sender,
                                             "inboxmesh.sender_name": await self._name(message.sender)})
            last: a2a.Task | a2a.Message | None = None
            async for response in client.send_message(request):
                last = response.message if response.HasField("message") else response.task
            while isinstance(last, a2a.Task) and last.status.state not in TERMINAL:
                await asyncio.sleep(0.5)
                last = await client.get_task(a2a.GetTaskRequest(id=last.id))
            if last is None:
                raise A2AClientError("the remote agent answered nothing")
            if isinstance(last, a2a.Task) and last.status.state != a2a.TASK_STATE_COMPLETED:
                raise A2AClientError(f"the remote task ended {a2a.TaskState.Name(last.status.state)}:"
                                     f" {_text(last.status.message.parts)[:300]}")
            return env_pb.Content(text=_answer_text(last))

    async def _name(self, agent_id: str) -> str:
        with contextlib.suppress(errors.MeshError):
            return (await self.client.admin_agent(agent_id)).name
        return ""

    # -- inbound: the A2A request handler ----------------------------------------------------------
    def principal(self, context: ServerCallContext) -> str:
        token = ""
        headers = context.state.get("headers")
        if isinstance(headers, dict):
            token = headers.get("authorization", "")
        grpc_context = context.state.get("grpc_context")
        if grpc_context is not None:
            for key, value in grpc_context.invocation_metadata() or ():
                if key == "authorization":
                    token = value if isinstance(value, str) else value.decode()
        scheme, _, token = token.partition(" ")
        principal = self.config.tokens.get(token.strip()) if scheme.lower() == "bearer" else None
        if principal is not None:
            return principal
        if self.config.anonymous and not token:
            return ANONYMOUS
        raise AuthenticationRequiredError("a bearer token the gateway knows is required (Authorization: Bearer"
                                          " <token>); nothing was read or stored")

    @staticmethod
    def _last_event_id(context: ServerCallContext) -> int | None:
        value = None
        headers = context.state.get("headers")
        if isinstance(headers, dict):
            value = headers.get(LAST_EVENT_ID)
        grpc_context = context.state.get("grpc_context")
        if grpc_context is not None:
            for key, item in grpc_context.invocation_metadata() or ():
                if key == LAST_EVENT_ID:
                    value = item if isinstance(item, str) else item.decode()
        if value is None:
            return None
        if not value.strip().isdigit():
            raise InvalidParamsError(f"{LAST_EVENT_ID} must be an event id (digits) from metadata"
                                     f" {EVENT_ID_KEY!r}; got {value[:40]!r}")
        return int(value)

    def _owned(self, task_id: str, principal: str) -> TaskRow:
        task = self.book.task(task_id)
        if task is None or task.principal != principal:
            raise TaskNotFoundError(f"no task {task_id[:80]!r} of this caller")
        return task

    async def _submit(self, params: a2a.SendMessageRequest, context: ServerCallContext) -> TaskRow:
        assert self.agent is not None
        principal = self.principal(context)
        message = params.message
        if not message.message_id:
            raise InvalidParamsError("message.messageId is required: it makes a retry the same message")
        if len(message.message_id) > 512:
            raise InvalidParamsError(f"message.messageId is {len(message.message_id)} characters; at most 512")
        if message.task_id:
            self._owned(message.task_id, principal)
            raise UnsupportedOperationError("this agent does not continue a task: send a new message (the same"
                                            " contextId keeps the conversation)")
        content = _content(message)
        task_id = task_id_for(principal, message.message_id)
        context_id = message.context_id or task_id
        task = TaskRow(task_id, principal, context_id, message.message_id, self.config.agent_id, message,
                       time.time_ns() // 1000)
        added = self.book.add_task(task)
        envelope = env_pb.Envelope(
            message_id=task_id, sender=f"{CLIENT_PREFIX}{principal}", recipient=self.config.agent_id,
            kind=env_pb.MESSAGE_KIND_TEXT, content=content, conversation_id=context_id,
            headers={"inboxmesh-a2a-message-id": message.message_id[:512], "inboxmesh-a2a-task-id": task_id,
                     "inboxmesh-a2a-principal": principal})
        try:
            [receipt] = await self.agent.deliver([envelope])
        except errors.MeshError:
            if added:
                self.book.drop_task(task_id)
            raise
        if receipt.status not in (inbox_pb.RECEIPT_STATUS_ACCEPTED, inbox_pb.RECEIPT_STATUS_DUPLICATE):
            self.book.drop_task(task_id)
            raise refusal(receipt, self.config.agent_id)
        stored = self.book.task(task_id)
        assert stored is not None
        return stored

    def snapshot(self, task: TaskRow, history_length: int | None = None) -> a2a.Task:
        events = self.book.events(task.task_id)
        result = a2a.Task(id=task.task_id, context_id=task.context_id)
        history = [task.request]
        for event in events:
            if event.artifact is not None:
                result.artifacts.append(event.artifact)
                continue
            result.status.CopyFrom(_status(event))
            if event.message is not None:
                history.append(event.message)
        if history_length is not None:
            history = history[-history_length:] if history_length else []
        result.history.extend(history)
        result.metadata.update({EVENT_ID_KEY: str(events[-1].seq if events else 0),
                                "inboxmesh.agent_id": task.target})
        return result

    @contextlib.contextmanager
    def _stream_slot(self):
        if self._streams >= self.config.max_streams:
            raise TooManyStreamsError(f"this gateway serves {self.config.max_streams} streams at once; retry later,"
                                      " or read the task with GetTask")
        self._streams += 1
        try:
            yield
        finally:
            self._streams -= 1

    async def _follow(self, task: TaskRow, after: int) -> AsyncIterator[a2a.TaskStatusUpdateEvent |
                                                                        a2a.TaskArtifactUpdateEvent]:
        """The task's events after `after`, live, until the task ends."""
        while True:
            changed = self._changed
            events = self.book.events(task.task_id, after)
            for event in events:
                after = event.seq
                yield _stream_event(task, event)
                if event.artifact is None and event.state in TERMINAL:
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), 15.0)

    async def on_message_send(self, params: a2a.SendMessageRequest, context: ServerCallContext) -> a2a.Task:
        task = await self._submit(params, context)
        if not params.configuration.return_immediately:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._until_ended(task), self.config.send_wait_s)
        return self.snapshot(task, params.configuration.history_length or None)

    async def _until_ended(self, task: TaskRow) -> None:
        async for event in self._follow(task, 0):
            del event

    async def on_message_send_stream(self, params: a2a.SendMessageRequest, context: ServerCallContext):
        with self._stream_slot():
            task = await self._submit(params, context)
            after = self._last_event_id(context)
            if after is None:
                snapshot = self.snapshot(task)
                yield snapshot
                after = int(str(snapshot.metadata[EVENT_ID_KEY]))
            async for event in self._follow(task, after):
                yield event

    async def on_subscribe_to_task(self, params: a2a.SubscribeToTaskRequest, context: ServerCallContext):
        with self._stream_slot():
            task = self._owned(params.id, self.principal(context))
            after = self._last_event_id(context)
            if after is None:
                snapshot = self.snapshot(task)
                if snapshot.status.state in TERMINAL:
                    raise UnsupportedOperationError(
                        f"task {task.task_id} has ended ({a2a.TaskState.Name(snapshot.status.state)}): GetTask"
                        f" reads it; a subscription with {LAST_EVENT_ID} replays what came after")
                yield snapshot
                after = int(str(snapshot.metadata[EVENT_ID_KEY]))
            async for event in self._follow(task, after):
                yield event

    async def on_get_task(self, params: a2a.GetTaskRequest, context: ServerCallContext) -> a2a.Task:
        task = self._owned(params.id, self.principal(context))
        return self.snapshot(task, params.history_length if params.HasField("history_length") else None)

    async def on_list_tasks(self, params: a2a.ListTasksRequest, context: ServerCallContext) -> a2a.ListTasksResponse:
        principal = self.principal(context)
        size = params.page_size or 50
        if not 1 <= size <= 100:
            raise InvalidParamsError("pageSize must be 1-100")
        after = 0
        if params.page_token:
            if not params.page_token.isdigit():
                raise InvalidParamsError("pageToken is not one this gateway handed out")
            after = int(params.page_token)
        rows = self.book.tasks(principal, context_id=params.context_id, after_created_us=after, limit=size + 1)
        tasks = [self.snapshot(t, params.history_length if params.HasField("history_length") else None)
                 for t in rows[:size]]
        if params.status:
            tasks = [t for t in tasks if t.status.state == params.status]
        if not params.include_artifacts:
            for t in tasks:
                del t.artifacts[:]
        return a2a.ListTasksResponse(tasks=tasks, page_size=size, total_size=len(tasks),
                                     next_page_token=str(rows[size - 1].created_us) if len(rows) > size else "")

    async def on_cancel_task(self, params: a2a.CancelTaskRequest, context: ServerCallContext) -> a2a.Task:
        task = self._owned(params.id, self.principal(context))
        raise TaskNotCancelableError(f"task {task.task_id}: a message stored in an agent's inbox is not taken"
                                     " back; the agent's answer ends the task")

    async def on_create_task_push_notification_config(self, params, context):
        raise PushNotificationNotSupportedError("push notifications are not offered: stream, or subscribe")

    async def on_get_task_push_notification_config(self, params, context):
        raise PushNotificationNotSupportedError("push notifications are not offered: stream, or subscribe")

    async def on_list_task_push_notification_configs(self, params, context):
        raise PushNotificationNotSupportedError("push notifications are not offered: stream, or subscribe")

    async def on_delete_task_push_notification_config(self, params, context):
        raise PushNotificationNotSupportedError("push notifications are not offered: stream, or subscribe")

    async def on_get_extended_agent_card(self, params, context):
        raise ExtendedAgentCardNotConfiguredError("this agent has no extended card")


# -- conversions --------------------------------------------------------------------------------------
def _content(message: a2a.Message) -> env_pb.Content:
    """A client's message as mesh content: its text parts, and at most one data or file part."""
    texts = [p.text for p in message.parts if p.HasField("text")]
    other = [p for p in message.parts if not p.HasField("text")]
    if not texts and not other:
        raise InvalidParamsError("message.parts is empty")
    if len(other) > 1 or any(p.HasField("url") for p in other):
        raise ContentTypeNotSupportedError("at most one data or raw part, and no url parts, besides text")
    content = env_pb.Content(text="\n".join(texts))
    for part in other:
        if part.HasField("data"):
            content.data = json.dumps(json_format.MessageToDict(part.data)).encode()
            content.media_type = "application/json"
        else:
            content.data = part.raw
            content.media_type = part.media_type or "application/octet-stream"
    return content


def _parts(content: env_pb.Content) -> list[a2a.Part]:
    parts = [a2a.Part(text=content.text)] if content.text or not content.data else []
    if content.data:
        parts.append(a2a.Part(raw=content.data, media_type=content.media_type))
    return parts


def _text(parts) -> str:
    return "\n".join(p.text for p in parts if p.HasField("text"))


def _answer_text(answer: a2a.Task | a2a.Message) -> str:
    if isinstance(answer, a2a.Message):
        return _text(answer.parts)
    texts = [_text(artifact.parts) for artifact in answer.artifacts]
    return "\n".join(t for t in texts if t) or _text(answer.status.message.parts)


def _agent_text(task: TaskRow, text: str) -> a2a.Message:
    return a2a.Message(message_id=f"{task.task_id}-status-{time.time_ns()}", context_id=task.context_id,
                       task_id=task.task_id, role=a2a.ROLE_AGENT, parts=[a2a.Part(text=text)])


def _status(event: TaskEvent) -> a2a.TaskStatus:
    status = a2a.TaskStatus(state=event.state)  # type: ignore[arg-type]
    if event.message is not None:
        status.message.CopyFrom(event.message)
    status.timestamp.FromMicroseconds(event.at_us)
    return status


def _stream_event(task: TaskRow, event: TaskEvent) -> a2a.TaskStatusUpdateEvent | a2a.TaskArtifactUpdateEvent:
    if event.artifact is not None:
        update: a2a.TaskStatusUpdateEvent | a2a.TaskArtifactUpdateEvent = a2a.TaskArtifactUpdateEvent(
            task_id=task.task_id, context_id=task.context_id, artifact=event.artifact, last_chunk=True)
    else:
        update = a2a.TaskStatusUpdateEvent(task_id=task.task_id, context_id=task.context_id, status=_status(event))
    update.metadata.update({EVENT_ID_KEY: str(event.seq)})
    return update


def _derived(kind: str, message: env_pb.Envelope) -> str:
    return f"{kind}-" + hashlib.sha256(f"{message.sender}\0{message.message_id}".encode()).hexdigest()[:40]
