"""Delivery with many agents on one subscription: what the hub reads per beat and per delivery,
fairness between the feeds of one stream, attach and detach on an open subscription."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.server import Mesh
from tests.fixtures import eventually


class Drain:
    """Runs a Subscription's responses() in a task and records them."""

    def __init__(self, subscription):
        self.subscription = subscription
        self.delivered: dict[str, list[int]] = {}
        self.events: list[tuple[str, int]] = []
        self.heartbeats = 0
        self.task = asyncio.create_task(self._run())

    async def _run(self):
        async for response in self.subscription.responses():
            which = response.WhichOneof("event")
            if which == "deliveries":
                for m in response.deliveries.messages:
                    self.delivered.setdefault(m.recipient, []).append(m.sequence)
            elif which == "subscription":
                self.events.append((response.subscription.agent_id, response.subscription.kind))
            else:
                self.heartbeats += 1

    async def stop(self):
        self.subscription.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@pytest.fixture
def hub(mesh: Mesh):
    return mesh.services.hub


async def test_attach_and_detach_on_an_open_subscription(client, hub):
    lead = await client.register("lead")
    a, b = await lead.spawn("a"), await lead.spawn("b")
    subscription = hub.open([a.agent_id], 0, "test")
    drain = Drain(subscription)
    try:
        await eventually(lambda: (a.agent_id, pb.SUBSCRIPTION_EVENT_KIND_ATTACHED) in drain.events)
        await lead.send(b.agent_id, "before attach")
        hub.attach(subscription, [b.agent_id], 0)
        await eventually(lambda: drain.delivered.get(b.agent_id) == [1], message="b's first message")
        assert drain.events.index((b.agent_id, pb.SUBSCRIPTION_EVENT_KIND_ATTACHED)) >= 0
        await lead.send(b.agent_id, "after attach")
        await eventually(lambda: drain.delivered.get(b.agent_id) == [1, 2])
        assert hub.detach(subscription, [b.agent_id, "nobody"]) == [b.agent_id]
        await lead.send(b.agent_id, "after detach")
        await lead.send(a.agent_id, "to a")
        await eventually(lambda: drain.delivered.get(a.agent_id) == [1])
        assert drain.delivered[b.agent_id] == [1, 2]
        assert hub.detach(subscription, [b.agent_id]) == []
        hub.attach(subscription, [b.agent_id], 0)  # again: redelivers what it did not ack, then the new one
        await eventually(lambda: drain.delivered[b.agent_id] == [1, 2, 1, 2, 3])
    finally:
        await drain.stop()
        hub.release(subscription)
