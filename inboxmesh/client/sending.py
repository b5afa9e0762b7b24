"""One SendStream carrying the sends of many agents of a host, pipelined and coalesced.

Each `send` names its sender. Sends are queued and written by one task: everything queued while the
previous request was being written goes out as one request (at most `max_batch` messages), each message
naming its sender (Envelope.sender), so under load one gRPC message carries the sends of many agents. A
sender's credential rides with the first request that carries its messages (the mesh proves it once per
stream). Requests are written without waiting for the answers of the ones before (up to `max_in_flight`
sends unanswered); the mesh stores the requests it has read together and answers in request order, and
each answer's receipts are split back to the sends whose messages the request carried, in order.

A stream that fails fails every send still waiting (the mesh's refusal, or Unavailable / STREAM_LOST
when the call was lost) and takes no more: open another and send again with the same message ids (what
was stored comes back DUPLICATE with its original sequence, so order holds across the retry). A send
coalesced with a malformed one fails with it: the mesh refuses a request as a whole.
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


class _Queued:
    __slots__ = ("sender", "envelopes", "future")

    def __init__(self, sender: AgentHandle, envelopes: list[env_pb.Envelope],
                 future: asyncio.Future[list[inbox_pb.Receipt]]):
        self.sender = sender
        self.envelopes = envelopes
        self.future = future


class SendStream:
    """`async with mesh.send_stream() as stream: await stream.send(agent, [envelope(...)])`."""

    def __init__(self, client: MeshClient, *, owner: AgentHandle | None = None, max_in_flight: int = 256,
                 max_batch: int = 256):
        """owner: the agent whose credential authenticates the call (its sends need no credential of their
        own); None: the client's admin token, every sender's credential riding with its first request.
        max_batch: the most messages one request carries when sends are coalesced (a single larger send
        goes alone; the mesh's limit per request is its --max-batch-messages, 1,000 by default)."""
        self.client = client
        self.max_in_flight = max_in_flight
        self.max_batch = max_batch
        self._owner_id = owner.agent_id if owner is not None else ""
        token = owner.credential if owner is not None else client.admin_token
        if not token:
            raise ValueError("a SendStream needs an owner agent or a client with the admin token")
        self._call: grpc.aio.StreamStreamCall | None = None
        self._metadata = credentials.metadata_for(token)
        self._proven: set[str] = set()
        """Senders whose credential was written on this stream."""
        self._queue: collections.deque[_Queued] = collections.deque()
        """Sends not yet written."""
        self._waiting: collections.deque[list[_Queued]] = collections.deque()
        """Per request written and not yet answered, the sends it carries."""
        self._room = asyncio.Semaphore(max_in_flight)
        self._writer: asyncio.Task | None = None
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
                self._queue.append(_Queued(sender, envelopes, future))
                if self._writer is None or self._writer.done():
                    self._writer = asyncio.create_task(self._write_queued())
                return await future
        finally:
            for span in spans:
                span.end()

    def _request(self, batch: list[_Queued]) -> tuple[inbox_pb.SendRequest, set[str]]:
        """One request for these sends, and the senders whose credential it carries."""
        first = batch[0].sender.agent_id
        request = inbox_pb.SendRequest(sender=first)
        fresh: set[str] = set()
        for queued in batch:
            agent_id = queued.sender.agent_id
            if agent_id != self._owner_id and agent_id not in self._proven and agent_id not in fresh:
                request.credentials.append(queued.sender.credential)
                fresh.add(agent_id)
            if agent_id == first:
                request.messages.extend(queued.envelopes)
            else:
                for env in queued.envelopes:
                    message = request.messages.add()
                    message.CopyFrom(env)
                    message.sender = agent_id
        return request, fresh

    async def _write_queued(self) -> None:
        """Write what is queued, coalesced, until nothing is (the order of writes is the order of answers)."""
        while self._queue and self._failure is None:
            batch: list[_Queued] = []
            messages = 0
            while self._queue and (not batch or messages + len(self._queue[0].envelopes) <= self.max_batch):
                queued = self._queue.popleft()
                if queued.future.done():  # its send was cancelled before it was written
                    continue
                batch.append(queued)
                messages += len(queued.envelopes)
            if not batch:
                continue
            request, fresh = self._request(batch)
            call = self._open()
            self._waiting.append(batch)
            try:
                await call.write(request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
                self._waiting.remove(batch)
                self._fail(self._lost(f"could not write on the send stream: {exc}"), batch)
                return
            self._proven |= fresh
        if self._failure is not None:
            self._fail(self._failure, list(self._queue))
            self._queue.clear()

    @staticmethod
    def _fail(failure: errors.MeshError, sends: list[_Queued]) -> None:
        for queued in sends:
            if not queued.future.done():
                queued.future.set_exception(failure)

    def _lost(self, why: str) -> errors.MeshError:
        if self._failure is None:
            self._failure = errors.Unavailable(f"{why}; open another send stream and send again with the same"
                                               " message ids", reason=Reason.STREAM_LOST)
        return self._failure

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            async for response in call:
                if not self._waiting:
                    continue
                receipts = list(response.receipts)
                start = 0
                for queued in self._waiting.popleft():
                    end = start + len(queued.envelopes)
                    if not queued.future.done():
                        queued.future.set_result(receipts[start:end])
                    start = end
            self._lost("the send stream ended")
        except grpc.aio.AioRpcError as exc:
            if self._failure is None:
                self._failure = from_rpc_error(exc)
        except asyncio.CancelledError:
            self._lost("the send stream was closed")
        finally:
            failure = self._failure or self._lost("the send stream ended")
            while self._waiting:
                self._fail(failure, self._waiting.popleft())
            self._fail(failure, list(self._queue))
            self._queue.clear()

    async def close(self) -> None:
        """Write what is queued, wait for the answers of every send written, then end the call."""
        writer = self._writer
        if writer is not None:
            await writer
        call, reader = self._call, self._reader
        if call is None or reader is None:
            return
        if self._failure is None:
            try:
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                pass  # the call is over already; the reader says how
        try:
            await reader
        finally:
            call.cancel()
