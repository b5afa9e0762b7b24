"""Every call the many-agent benchmark (bench/many_host.py) makes through
inboxmesh.client, in one place, so that when the client grows calls for many
agents only this module changes.

What it uses:
- registration: `AgentHandle.spawn_many`, one RegisterChildren call per
  1,000 children, two calls at once;
- attach, `streams="one"`: one `InboxStream` opened with the first agent,
  the others added on the open stream with `InboxStream.attach`, 1,000 per
  request; `streams="per-agent"`: one `InboxStream` per agent (what
  agent_host did until it shared one), up to `window` subscriptions waiting for their
  ATTACHED at once;
- acks: on one stream `InboxStream.consume_many` (one `ack_many` request for
  every agent with something pending); on a stream per agent
  `InboxStream.consume` on each agent's own stream;
- sends, `sends="stream"`: one pipelined `SendStream` for every sender of
  the host (`MeshClient.send_stream`, owned by the host's top-level agent,
  each sender's credential written once; the sends queued while a request
  is being written go out together in the next, each message naming its
  sender);
  `sends="unary"`: the unary `Send` with the sender's own credential, one
  message per call (the only way for many senders before SendStream took
  several).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

from inboxmesh.client.mesh import AgentHandle, MeshClient, envelope
from inboxmesh.client.sending import SendStream
from inboxmesh.client.stream import InboxStream, StreamItem
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.registry.v1 import registry_pb2 as reg_pb

StreamMode = Literal["one", "per-agent"]
STREAM_MODES: tuple[StreamMode, ...] = ("one", "per-agent")
SendMode = Literal["stream", "unary"]
SEND_MODES: tuple[SendMode, ...] = ("stream", "unary")
ATTACH_CHUNK = 1000
"""Agents per InboxStream.attach request (the mesh takes at most 10,000 per request)."""


def stream_mode(text: str) -> StreamMode:
    """The stream mode named `text` (ValueError for another)."""
    for mode in STREAM_MODES:
        if text == mode:
            return mode
    raise ValueError(f"unknown stream mode {text!r} (one of {', '.join(STREAM_MODES)})")


def send_mode(text: str) -> SendMode:
    """The send mode named `text` (ValueError for another)."""
    for mode in SEND_MODES:
        if text == mode:
            return mode
    raise ValueError(f"unknown send mode {text!r} (one of {', '.join(SEND_MODES)})")


OnMessages = Callable[[list[env_pb.Envelope]], None]
"""Called with the messages of one item the moment the host-side stream yields it."""


async def windowed(count: int, window: int, one: Callable[[int], Awaitable[None]]) -> None:
    """Run one(0) .. one(count - 1) with at most `window` of them at once."""
    indexes = iter(range(count))

    async def worker() -> None:
        for index in indexes:
            await one(index)

    async with asyncio.TaskGroup() as group:
        for _ in range(min(window, count)):
            group.create_task(worker())


CHILDREN_PER_CALL = 1_000
"""Children per RegisterChildren call (its most)."""
CALLS_AT_ONCE = 2
"""RegisterChildren calls in flight at once."""


async def register(client: MeshClient, count: int) -> tuple[AgentHandle, list[AgentHandle]]:
    """One top-level agent and `count` children of it, CHILDREN_PER_CALL per RegisterChildren call,
    CALLS_AT_ONCE calls at a time."""
    parent = await client.register("many")
    chunks: list[list[AgentHandle]] = [[] for _ in range(0, count, CHILDREN_PER_CALL)]

    async def spawn(chunk: int) -> None:
        start = chunk * CHILDREN_PER_CALL
        names = [f"a{i}" for i in range(start, min(count, start + CHILDREN_PER_CALL))]
        results = await parent.spawn_many([reg_pb.RegisterAgentRequest(name=name) for name in names])
        refused = [r for r in results if not isinstance(r, AgentHandle)]
        if refused:
            raise SystemExit(f"{len(refused)} of {len(names)} children refused, the first: {refused[0]}")
        chunks[chunk] = [r for r in results if isinstance(r, AgentHandle)]

    await windowed(len(chunks), CALLS_AT_ONCE, spawn)
    return parent, [child for chunk in chunks for child in chunk]


class HostSender:
    """The sends of all of a host's agents."""

    def __init__(self, client: MeshClient, owner: AgentHandle, mode: SendMode) -> None:
        self.mode = mode
        self._stream: SendStream | None = client.send_stream(owner) if mode == "stream" else None

    async def send(self, sender: AgentHandle, recipient: str, text: str, message_id: str) -> inbox_pb2.Receipt:
        """One message from `sender`; its receipt."""
        envelopes = [envelope(recipient, text, message_id=message_id)]
        if self._stream is not None:
            receipts = await self._stream.send(sender, envelopes)
        else:
            receipts = await sender.send_batch(envelopes)
        return receipts[0]

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()


class HostInbox:
    """The inboxes of all of a host's agents: deliveries go to `on_messages`
    as the streams yield them; `consume` acks them for one agent."""

    def __init__(self, agents: Iterable[AgentHandle], streams: StreamMode, *, max_in_flight: int,
                 on_messages: OnMessages) -> None:
        self.agents = list(agents)
        self.streams = streams
        self.max_in_flight = max_in_flight
        self.on_messages = on_messages
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Fails with the first error of a stream (a benchmark cannot go on after one)."""
        self._stream_of: dict[str, InboxStream] = {}
        self._readers: list[asyncio.Task[None]] = []
        self._unattached = {a.agent_id for a in self.agents}
        self._all_attached = asyncio.Event()
        self._changed = asyncio.Event()
        self._closing = False

    @property
    def acks_many(self) -> bool:
        """Whether one ack request can cover many agents (they share a stream)."""
        return self.streams == "one"

    async def attach(self, window: int) -> None:
        """Subscribe every agent; return once the mesh confirmed each (its
        ATTACHED event). Per agent, at most `window` wait for it at once."""
        if self.streams == "one":
            first, rest = self.agents[:1], self.agents[1:]
            stream = InboxStream(first, max_in_flight=self.max_in_flight, max_failures=0)
            self._stream_of = {a.agent_id: stream for a in self.agents}
            self._readers.append(asyncio.create_task(self._read(stream, None)))
            await self._until(self._attached(first))
            for start in range(0, len(rest), ATTACH_CHUNK):
                await self._until(stream.attach(rest[start:start + ATTACH_CHUNK]))
        else:
            waiting = asyncio.Semaphore(window)
            for agent in self.agents:
                await self._raise_failure()
                await waiting.acquire()
                stream = InboxStream([agent], max_in_flight=self.max_in_flight, max_failures=0)
                self._stream_of[agent.agent_id] = stream
                self._readers.append(asyncio.create_task(self._read(stream, waiting)))
        await self._until(self._all_attached.wait())

    async def _attached(self, agents: list[AgentHandle]) -> None:
        while any(a.agent_id in self._unattached for a in agents):
            self._changed.clear()
            await self._changed.wait()

    async def _until(self, step: Awaitable[Any]) -> None:
        """Await `step`, or raise a stream's failure as soon as there is one."""
        task: asyncio.Future[Any] = asyncio.ensure_future(step)
        await asyncio.wait([task, self.failed], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._raise_failure()
        await task

    async def _raise_failure(self) -> None:
        if self.failed.done():
            await self.failed

    async def _read(self, stream: InboxStream, waiting: asyncio.Semaphore | None) -> None:
        try:
            async for item in stream:
                if item.agent_event is not None:
                    self._on_event(item, waiting)
                elif item.messages:
                    self.on_messages(item.messages)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if waiting is not None:
                waiting.release()  # attach() is not left waiting for a window slot; it raises the failure
            if not self.failed.done():
                self.failed.set_exception(exc)
        else:
            if not self.failed.done() and not self._closing:
                self.failed.set_exception(RuntimeError("an inbox stream ended while its agents were attached"))

    def _on_event(self, item: StreamItem, waiting: asyncio.Semaphore | None) -> None:
        event = item.agent_event
        assert event is not None, "only called for agent events"
        if event.kind == inbox_pb2.SUBSCRIPTION_EVENT_KIND_ATTACHED:
            if event.agent_id in self._unattached:
                self._unattached.discard(event.agent_id)
                self._changed.set()
                if waiting is not None:
                    waiting.release()
                if not self._unattached:
                    self._all_attached.set()
        elif not self.failed.done():
            self.failed.set_exception(RuntimeError(f"agent {event.agent_id} left its stream: {event}"))

    async def consume(self, agent_id: str, messages: list[env_pb.Envelope]) -> list[env_pb.Envelope]:
        """Ack one agent's messages; those this ack consumed."""
        return await self._stream_of[agent_id].consume(agent_id, messages)

    async def consume_many(self, messages: dict[str, list[env_pb.Envelope]]) -> dict[str, list[env_pb.Envelope]]:
        """Ack many agents' messages in one request (acks_many only); per agent those its ack consumed.
        A refused ack raises its refusal."""
        stream = self._stream_of[next(iter(messages))]
        done = await stream.consume_many(messages)
        for refusal in done.refused.values():
            raise refusal
        return done.messages

    async def close(self) -> None:
        self._closing = True
        if self.failed.done():
            self.failed.exception()  # seen (the benchmark raised it already)
        for stream in set(self._stream_of.values()):
            stream.stop()
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
