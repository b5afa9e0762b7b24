"""One SendStream carrying the sends of many agents of a host, pipelined.

Each `send` names its sender; the sender's credential rides with its first request on the stream (the
mesh proves it once per stream) and every request names its sender. Requests are written without waiting
for the answers of the ones before (up to `max_in_flight` unanswered); the mesh stores the requests it
has read together and answers in request order, so each answer goes to the `send` whose request it was.

A stream that fails fails every send still waiting (the mesh's refusal, or Unavailable / STREAM_LOST
when the call was lost) and takes no more: open another and send again with the same message ids (what
was stored comes back DUPLICATE with its original sequence, so order holds across the retry).
"""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING

import grpc

from inboxmesh.client import credentials, errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.status import from_rpc_error
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.inbox.v1 import inbox_pb2 as inbox_pb

if TYPE_CHECKING:
    from inboxmesh.client.mesh import AgentHandle, MeshClient


class SendStream:
    """`async with mesh.send_stream() as stream: await stream.send(agent, [envelope(...)])`."""

    def __init__(self, client: MeshClient, *, owner: AgentHandle | None = None, max_in_flight: int = 256):
        """owner: the agent whose credential authenticates the call (its sends need no credential of their
        own); None: the client's admin token, every sender's credential riding with its first request."""
        self.client = client
        self.max_in_flight = max_in_flight
        self._owner_id = owner.agent_id if owner is not None else ""
        token = owner.credential if owner is not None else client.admin_token
        if not token:
            raise ValueError("a SendStream needs an owner agent or a client with the admin token")
        self._call: grpc.aio.StreamStreamCall | None = None
        self._metadata = credentials.metadata_for(token)
        self._proven: set[str] = set()
        """Senders whose credential was written on this stream."""
        self._waiting: collections.deque[asyncio.Future[list[inbox_pb.Receipt]]] = collections.deque()
        self._room = asyncio.Semaphore(max_in_flight)
        self._write_lock = asyncio.Lock()
        self._reader: asyncio.Task | None = None
        self._failure: errors.MeshError | None = None

    async def __aenter__(self) -> SendStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def _open(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            self._call = self.client.inbox.SendStream(metadata=self._metadata)
            self._reader = asyncio.create_task(self._read(self._call))
        return self._call

    async def send(self, sender: AgentHandle, envelopes: list[env_pb.Envelope]) -> list[inbox_pb.Receipt]:
        """Send these messages as `sender`, in order after every earlier send on this stream; one receipt
        per message. Raises the stream's failure (every send still waiting gets it)."""
        if self._failure is not None:
            raise self._failure
        spans = sender._traced(envelopes)
        try:
            async with self._room:
                future: asyncio.Future[list[inbox_pb.Receipt]] = asyncio.get_running_loop().create_future()
                request = inbox_pb.SendRequest(messages=envelopes, sender=sender.agent_id)
                first = sender.agent_id != self._owner_id and sender.agent_id not in self._proven
                if first:
                    request.credentials.append(sender.credential)
                async with self._write_lock:  # the order of writes is the order of answers
                    if self._failure is not None:
                        raise self._failure
                    call = self._open()
                    self._waiting.append(future)
                    try:
                        await call.write(request)
                    except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
                        self._waiting.remove(future)
                        future.cancel()
                        raise self._lost(f"could not write on the send stream: {exc}") from None
                    if first:
                        self._proven.add(sender.agent_id)
                return await future
        finally:
            for span in spans:
                span.end()

    def _lost(self, why: str) -> errors.MeshError:
        if self._failure is None:
            self._failure = errors.Unavailable(f"{why}; open another send stream and send again with the same"
                                               " message ids", reason=Reason.STREAM_LOST)
        return self._failure

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            async for response in call:
                if self._waiting:
                    future = self._waiting.popleft()
                    if not future.done():
                        future.set_result(list(response.receipts))
            self._lost("the send stream ended")
        except grpc.aio.AioRpcError as exc:
            if self._failure is None:
                self._failure = from_rpc_error(exc)
        except asyncio.CancelledError:
            self._lost("the send stream was closed")
        finally:
            failure = self._failure or self._lost("the send stream ended")
            while self._waiting:
                future = self._waiting.popleft()
                if not future.done():
                    future.set_exception(failure)

    async def close(self) -> None:
        """Wait for the answers of every send written, then end the call."""
        call, reader = self._call, self._reader
        if call is None or reader is None:
            return
        async with self._write_lock:
            if self._failure is None:
                try:
                    await call.done_writing()
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                    pass  # the call is over already; the reader says how
        try:
            await reader
        finally:
            call.cancel()
