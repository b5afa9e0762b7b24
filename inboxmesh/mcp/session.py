"""One MCP session's agent in the mesh, for as long as the session lasts: the agent's handle, its inbox
on one Consume stream (inboxmesh.client.InboxStream) kept open for the session, the messages the mesh
delivered to this server that no take has consumed yet, and what `take_messages` does with them.

Consumption. A message is acked (consumed, with the take's turn) only inside `take`, right before its
result is handed back to the MCP client. A take cancelled before its ack acks nothing: its messages stay
delivered-not-acked on the stream and the next take returns them; a server that dies meanwhile leaves
them unacked in the mesh, which delivers them again to the agent's next subscriber (a server restarted
with the same credential). A take whose caller's HTTP connection closed (without a cancel) acks nothing
either: it looks right before the ack. A take cancelled while its ack is on the wire cannot call the ack
back: the ack goes on (shielded), and what it consumed is returned first by the session's next take.

Turns. The n-th take of a session acks with turn n; a session bound to an existing agent numbers its
takes on from the highest turn the event record shows that agent consumed in.

Bounds: the mesh delivers at most `max_waiting` unacked messages to this server (the stream's
max_in_flight), more stay stored in the mesh until takes ack some; the session remembers the last
REMEMBERED messages it returned (for `reply` and for telling its own lost acks from others').
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
from collections.abc import Awaitable, Callable

from inboxmesh.client import errors
from inboxmesh.client.credentials import agent_id_of
from inboxmesh.client.errors import Reason
from inboxmesh.client.mesh import AgentHandle, MeshClient
from inboxmesh.client.stream import InboxStream
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev_pb
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.mcp.config import MAX_WAITING, Identity
from inboxmesh.registry.v1 import registry_pb2 as reg_pb

log = logging.getLogger(__name__)

AGENT_ID = re.compile(r"agt_[0-9a-f]{20}")
REMEMBERED = 10_000
"""Messages a session remembers having returned: `reply` answers one of them."""
NAMES_CACHED = 1_000
SUPERSEDED = "SUPERSEDED"
SESSION_ENDED = "SESSION_ENDED"
"""Reasons of this server's own tool errors (the Consume stream's event, the session's end): not refusals
of a mesh call, so not members of inboxmesh.client.errors.Reason."""
CRASH_ENV = "INBOXMESH_CRASH_AT"
_crash_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Exit at once (like kill -9) when INBOXMESH_CRASH_AT is `name` (or `name:N`, the N-th time): the
    mesh's crash points (services/faults.py), for this process, which may not import the mesh. Unset in
    normal operation."""
    wanted = os.environ.get(CRASH_ENV)
    if not wanted or wanted.partition(":")[0] != name:
        return
    _crash_hits[name] = _crash_hits.get(name, 0) + 1
    if _crash_hits[name] >= int(wanted.partition(":")[2] or 1):
        log.error("crash point %r reached (%s): exiting now", name, CRASH_ENV)
        os._exit(137)


class AgentSession:
    """One agent and its inbox stream, for one MCP session. `start()`, then `take`, `send`, `reply`;
    `close()` (safe twice) stops the stream and closes the agent when this session registered it."""

    def __init__(self, agent: AgentHandle, *, owned: bool, max_waiting: int = MAX_WAITING, first_turn: int = 1,
                 on_arrival: Callable[[], Awaitable[None]] | None = None):
        self.agent = agent
        self.owned = owned
        """This session registered the agent (so closes it at its end); False when bound by credential."""
        self.max_waiting = max_waiting
        self.on_arrival = on_arrival
        """Called (awaited, from the stream's reader) when messages not seen before were delivered."""
        self._turn = first_turn - 1
        self._stream = InboxStream([agent], max_in_flight=max_waiting)
        self._waiting: dict[int, env_pb.Envelope] = {}
        """Delivered to this server, not acked: by inbox sequence."""
        self._held: list[env_pb.Envelope] = []
        """Consumed by the ack of a take that was cancelled before it could return them."""
        self._returned: collections.OrderedDict[tuple[str, str], env_pb.Envelope] = collections.OrderedDict()
        """(sender, message_id) of the messages this session's acks consumed (returned by their take, or held
        for the next), newest last, at most REMEMBERED."""
        self._names: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._changed = asyncio.Event()
        self._attached = asyncio.Event()
        self._take_lock = asyncio.Lock()
        self._acks: set[asyncio.Task] = set()
        self._reader: asyncio.Task | None = None
        self._ended: errors.MeshError | None = None
        self._closed = False

    @property
    def agent_id(self) -> str:
        return self.agent.agent_id

    @property
    def uri(self) -> str:
        """The MCP resource that says what waits in this agent's inbox."""
        return f"inbox://{self.agent_id}"

    # -- life cycle -------------------------------------------------------------------
    async def start(self, timeout: float) -> None:
        """Subscribe the agent's inbox; returns once the mesh attached it (raises its refusal, or
        Unavailable when that takes longer than `timeout`)."""
        self._reader = asyncio.create_task(self._follow(), name=f"mcp-inbox-{self.agent_id}")
        attached = asyncio.create_task(self._attached.wait())
        ended = asyncio.create_task(self._changed.wait())
        try:
            await asyncio.wait({attached, ended}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            attached.cancel()
            ended.cancel()
        if self._attached.is_set():
            return
        await self.close()
        raise self._ended or errors.Unavailable(
            f"the mesh did not attach {self.agent_id}'s inbox within {timeout:g}s", reason=Reason.MESH_UNREACHABLE,
            metadata={"agent_id": self.agent_id})

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._end(errors.FailedPrecondition("this MCP session has ended", reason=SESSION_ENDED))
        self._stream.stop()
        tasks = [t for t in (self._reader, *self._acks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.owned:
            try:
                await self.agent.close(reason="its MCP session ended")
            except errors.MeshError as exc:
                log.warning("could not close %s at the end of its MCP session: %s: %s", self.agent_id, exc.reason,
                            exc.message)

    def _end(self, failure: errors.MeshError) -> None:
        if self._ended is None:
            self._ended = failure
        self._changed.set()

    async def _follow(self) -> None:
        """The stream's reader: deliveries into `_waiting`, the agent's end into `_ended`."""
        try:
            async for item in self._stream:
                event = item.agent_event
                if event is not None:
                    self._on_agent_event(event)
                    continue
                fresh = False
                for message in item.messages:
                    if message.recipient != self.agent_id:
                        continue
                    fresh = fresh or message.sequence not in self._waiting
                    self._waiting[message.sequence] = message  # a redelivery replaces its earlier copy
                if fresh:
                    self._changed.set()
                    if self.on_arrival is not None:
                        await self.on_arrival()
            self._end(errors.Unavailable("the inbox stream ended", reason=Reason.STREAM_LOST))
        except errors.MeshError as exc:
            log.warning("inbox stream of %s failed: %s: %s", self.agent_id, exc.reason, exc.message)
            self._end(exc)

    def _on_agent_event(self, event: inbox_pb2.SubscriptionEvent) -> None:
        if event.kind == inbox_pb2.SUBSCRIPTION_EVENT_KIND_ATTACHED:
            self._attached.set()
        elif event.kind == inbox_pb2.SUBSCRIPTION_EVENT_KIND_CLOSED:
            self._end(errors.FailedPrecondition(f"agent {self.agent_id} was closed: {event.detail}".rstrip(": "),
                                                reason=Reason.AGENT_CLOSED, metadata={"agent_id": self.agent_id}))
        elif event.kind == inbox_pb2.SUBSCRIPTION_EVENT_KIND_SUPERSEDED:
            self._end(errors.FailedPrecondition(
                f"another subscriber took agent {self.agent_id}'s inbox over (a second server bound to the same"
                " credential, or a host): this session takes nothing more", reason=SUPERSEDED,
                metadata={"agent_id": self.agent_id}))

    # -- reading the inbox --------------------------------------------------------------
    def waiting(self) -> list[env_pb.Envelope]:
        """Delivered to this server and not taken yet, oldest first (held ones included)."""
        return [*self._held, *(self._waiting[s] for s in sorted(self._waiting))]

    async def take(self, max_messages: int, wait_s: float,
                   abandoned: Callable[[], Awaitable[bool]] | None = None) -> tuple[int, list[env_pb.Envelope]]:
        """One take: waits up to wait_s for at least one message, acks at most max_messages of them with
        this take's turn, and returns (turn, the messages its ack consumed) in inbox order. `abandoned`
        says, right before the ack, whether the caller is gone (its HTTP connection closed without a
        cancel: the SDK's HTTP transport runs a call apart from its request's connection); then nothing
        is acked and the messages wait for the next take."""
        async with self._take_lock:
            self._turn += 1
            turn = self._turn
            if self._acks:  # a cancelled take's ack still on the wire: what it consumes is returned here
                await asyncio.wait(set(self._acks))
            if self._held:
                if abandoned is not None and await abandoned():
                    return turn, []
                taken, self._held = self._held[:max_messages], self._held[max_messages:]
                return turn, taken
            if self._ended is not None:  # closed, superseded, or the session is over: nothing can be acked
                raise self._ended
            await self._wait_for_messages(wait_s)
            if self._ended is not None:
                raise self._ended
            if not self._waiting:
                return turn, []
            if abandoned is not None and await abandoned():
                log.info("take %d of %s: its caller is gone; nothing acked", turn, self.agent_id)
                return turn, []
            batch = [self._waiting.pop(s) for s in sorted(self._waiting)[:max_messages]]
            crash_point("mcp-take-before-ack")
            ack = asyncio.create_task(self._ack(batch, turn), name=f"mcp-ack-{self.agent_id}-{turn}")
            self._acks.add(ack)
            ack.add_done_callback(self._ack_done)
            # shielded: once written an ack cannot be called back, so a cancelled take lets it finish and
            # leaves what it consumed in _held for the next take
            await asyncio.shield(ack)
            taken, self._held = self._held, []
            return turn, taken

    def _ack_done(self, ack: asyncio.Task) -> None:
        self._acks.discard(ack)
        if not ack.cancelled() and ack.exception() is not None:  # retrieved here too: its take may be gone
            log.info("an ack of %s failed (its messages wait for the next take): %r", self.agent_id, ack.exception())

    async def _wait_for_messages(self, wait_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not self._waiting and self._ended is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def _ack(self, batch: list[env_pb.Envelope], turn: int) -> None:
        """Consume `batch` on the stream; what the ack won goes to `_held` (the take returns it from there).
        Not won (dead-lettered meanwhile) is dropped. A failed ack puts the batch back: the stream was lost
        (the mesh delivers them again, or, if the ack was recorded after all, the next ack finds them
        consumed by this session) or the mesh refused it."""
        taken = set(self._returned)
        try:
            won = await self._stream.consume(self.agent_id, batch, turn=turn, taken=taken)
        except errors.MeshError:
            for message in batch:
                self._waiting.setdefault(message.sequence, message)
            raise
        for message in won:
            self._returned[(message.sender, message.message_id)] = message
            while len(self._returned) > REMEMBERED:
                self._returned.popitem(last=False)
        self._held.extend(won)

    def returned(self, message_id: str) -> env_pb.Envelope | None:
        """The newest message with this id that this session consumed."""
        for (_, returned_id), message in reversed(self._returned.items()):
            if returned_id == message_id:
                return message
        return None

    # -- sending ------------------------------------------------------------------------
    async def recipient(self, to: str) -> str:
        """An agent id or address as it is; anything else is a name, looked up in the agent's scope."""
        if AGENT_ID.fullmatch(to) or ":" in to:
            return to
        return (await self.agent.resolve(to)).agent_id

    async def send(self, to: str, text: str, *, message_id: str | None = None,
                   kind: int = env_pb.MESSAGE_KIND_TEXT, in_reply_to: str = "",
                   conversation_id: str = "") -> inbox_pb2.Receipt:
        recipient = await self.recipient(to)
        return await self.agent.send(recipient, text, message_id=message_id, kind=kind, in_reply_to=in_reply_to,
                                     conversation_id=conversation_id)

    async def reply(self, message_id: str, text: str, *, reply_id: str | None = None) -> inbox_pb2.Receipt:
        answered = self.returned(message_id)
        if answered is None:
            raise errors.NotFound(
                f"no message {errors.clip(message_id)} was taken in this session: reply answers a message that"
                " take_messages returned; send_message writes to any agent", reason=Reason.MESSAGE_NOT_FOUND,
                metadata={"message_id": message_id})
        return await self.agent.send(answered.sender, text, message_id=reply_id, kind=env_pb.MESSAGE_KIND_REPLY,
                                     in_reply_to=answered.message_id, conversation_id=answered.conversation_id)

    # -- who is who -----------------------------------------------------------------------
    async def name_of(self, agent_id: str) -> str:
        """An agent's name, "" when it cannot be read (another scope, an IOA address)."""
        if agent_id == self.agent_id:
            return self.agent.info.name
        if agent_id not in self._names:
            name = ""
            if AGENT_ID.fullmatch(agent_id):
                with contextlib.suppress(errors.MeshError):
                    name = (await self.agent.get(agent_id)).name
            self._names[agent_id] = name
            while len(self._names) > NAMES_CACHED:
                self._names.popitem(last=False)
        return self._names[agent_id]

    async def agents(self) -> list[reg_pb.Agent]:
        """The open agents of this agent's scope (its tree)."""
        return await self.agent.list_agents()


async def open_agent(client: MeshClient, identity: Identity, name: str | None = None
                     ) -> tuple[AgentHandle, bool, int]:
    """The agent one session is: (its handle, whether the session registered it, its first turn).
    Registers a child of the parent, or a top-level agent, named `name` (else identity.name); or binds to
    the agent whose credential identity.credential is, after proving it (GetAgent)."""
    if identity.credential:
        agent = client.agent(agent_id_of(identity.credential), identity.credential)
        agent.info = await agent.get()
        return agent, False, await _last_turn(agent) + 1
    if identity.parent_credential:
        parent = client.agent(agent_id_of(identity.parent_credential), identity.parent_credential)
        return await parent.spawn(name or identity.name), True, 1
    return await client.register(name or identity.name), True, 1


async def _last_turn(agent: AgentHandle) -> int:
    """The highest turn the event record shows the agent consumed messages in (0 when none): one page of
    1,000 events per call, over the agent's MESSAGE_CONSUMED events."""
    last, after = 0, 0
    while True:
        page = await agent.events(agent_id=agent.agent_id, kinds=[ev_pb.EVENT_KIND_MESSAGE_CONSUMED], after=after)
        if not page:
            return last
        last = max([last, *(e.turn for e in page if e.agent_id == agent.agent_id)])
        after = page[-1].event_id
