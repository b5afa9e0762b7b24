"""Every call the many-agent benchmark (bench/many_host.py) makes through
inboxmesh.client, in one place, so that when the client grows calls for many
agents (attach on an open stream, an ack of many agents at once, a send
stream carrying many senders) only this module changes.

What it uses today:
- registration: `AgentHandle.spawn`, one RegisterAgent call per child, up to
  `window` of them at once;
- attach: one `InboxStream` carrying every agent (`streams="one"`), or one
  `InboxStream` per agent (`streams="per-agent"`, what agent_host does
  today), up to `window` subscriptions waiting for their ATTACHED at once;
- acks: `InboxStream.consume`, one AckRequest per agent per batch (an
  AckRequest names one agent);
- sends: the unary `Send`, one message per call, with the sending agent's
  own credential (a SendStream request names one sender, so a host with
  many senders would need a stream per agent).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

from inboxmesh.client.mesh import AgentHandle, MeshClient, envelope
from inboxmesh.client.stream import InboxStream, StreamItem
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.inbox.v1 import inbox_pb2

StreamMode = Literal["one", "per-agent"]
STREAM_MODES: tuple[StreamMode, ...] = ("one", "per-agent")


def stream_mode(text: str) -> StreamMode:
    """The stream mode named `text` (ValueError for another)."""
    for mode in STREAM_MODES:
        if text == mode:
            return mode
    raise ValueError(f"unknown stream mode {text!r} (one of {', '.join(STREAM_MODES)})")


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


async def register(client: MeshClient, count: int, window: int) -> tuple[AgentHandle, list[AgentHandle]]:
    """One top-level agent and `count` children of it."""
    parent = await client.register("many")
    children: list[AgentHandle | None] = [None] * count

    async def spawn(index: int) -> None:
        children[index] = await parent.spawn(f"a{index}")

    await windowed(count, window, spawn)
    return parent, [c for c in children if c is not None]


async def send(sender: AgentHandle, recipient: str, text: str, message_id: str) -> inbox_pb2.Receipt:
    """One message from `sender`; its receipt."""
    receipts = await sender.send_batch([envelope(recipient, text, message_id=message_id)])
    return receipts[0]


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
        self._closing = False

    async def attach(self, window: int) -> None:
        """Subscribe every agent; return once the mesh confirmed each (its
        ATTACHED event). Per agent, at most `window` wait for it at once."""
        if self.streams == "one":
            stream = InboxStream(self.agents, max_in_flight=self.max_in_flight, max_failures=0)
            self._stream_of = {a.agent_id: stream for a in self.agents}
            self._readers.append(asyncio.create_task(self._read(stream, None)))
        else:
            waiting = asyncio.Semaphore(window)
            for agent in self.agents:
                await self._raise_failure()
                await waiting.acquire()
                stream = InboxStream([agent], max_in_flight=self.max_in_flight, max_failures=0)
                self._stream_of[agent.agent_id] = stream
                self._readers.append(asyncio.create_task(self._read(stream, waiting)))
        attached: asyncio.Future[Any] = asyncio.create_task(self._all_attached.wait())
        await asyncio.wait([attached, self.failed], return_when=asyncio.FIRST_COMPLETED)
        attached.cancel()
        await self._raise_failure()

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
                if waiting is not None:
                    waiting.release()
                if not self._unattached:
                    self._all_attached.set()
        elif not self.failed.done():
            self.failed.set_exception(RuntimeError(f"agent {event.agent_id} left its stream: {event}"))

    async def consume(self, agent_id: str, messages: list[env_pb.Envelope]) -> list[env_pb.Envelope]:
        """Ack one agent's messages; those this ack consumed."""
        return await self._stream_of[agent_id].consume(agent_id, messages)

    async def close(self) -> None:
        self._closing = True
        if self.failed.done():
            self.failed.exception()  # seen (the benchmark raised it already)
        for stream in set(self._stream_of.values()):
            stream.stop()
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
