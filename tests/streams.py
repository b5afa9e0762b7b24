"""A subscriber for tests: runs a raw Subscribe call in a task and records
everything it receives. And the receipts of a SendStream call that ends with an error."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from inboxmesh.client.mesh import AgentHandle
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from tests.fixtures import eventually


async def receipts_until_error(call) -> tuple[list[pb.Receipt], grpc.aio.AioRpcError]:
    """Every receipt a SendStream call answered, and the error it then ended with (a call that ends
    without one fails the test)."""
    receipts: list[pb.Receipt] = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for response in call:
            receipts += response.receipts
    return receipts, caught.value


class Collector:
    def __init__(self, agent: AgentHandle, *, max_in_flight: int = 0, extra=(), auto_ack: bool = False):
        self.agent = agent
        self.call = agent.subscribe(max_in_flight, extra=extra)
        self.messages: list[envelope_pb2.Envelope] = []
        self.events: list[pb.SubscriptionEvent] = []
        self.heartbeats = 0
        self.error: grpc.aio.AioRpcError | None = None
        self.ended = asyncio.Event()
        self.auto_ack = auto_ack
        self.consumed: list[envelope_pb2.Envelope] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self):
        try:
            async for response in self.call:
                which = response.WhichOneof("event")
                if which == "deliveries":
                    batch = list(response.deliveries.messages)
                    self.messages += batch
                    if self.auto_ack:
                        results = await self.agent.ack(m.sequence for m in batch)
                        won = {r.sequence for r in results if r.status == pb.ACK_STATUS_CONSUMED}
                        self.consumed += [m for m in batch if m.sequence in won]
                elif which == "subscription":
                    self.events.append(response.subscription)
                else:
                    self.heartbeats += 1
        except grpc.aio.AioRpcError as exc:
            self.error = exc
        finally:
            self.ended.set()

    def texts(self):
        return [m.content.text for m in self.messages]

    async def wait_for(self, count: int, timeout: float = 10.0):
        await eventually(lambda: len(self.messages) >= count, timeout, message=f"{count} deliveries")
        return self.messages[:count]

    async def wait_event(self, kind: int, timeout: float = 10.0):
        return await eventually(lambda: next((e for e in self.events if e.kind == kind), None), timeout,
                                message=f"subscription event {kind}")

    async def stop(self):
        self.call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
