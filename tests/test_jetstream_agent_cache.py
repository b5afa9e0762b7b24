"""A JetStream mesh process reads a send's targets and a delivery's recipient from its own copy of the agent
records (agent_cache.py), kept by a watch of the agents bucket. The copy may be behind the bucket: a close
made by another process is never overtaken all the same (the target is read again once the message is
published, and the sender is always read from the bucket)."""

import time
import uuid
from dataclasses import replace

import pytest

from harness.nats import NatsNode
from inboxmesh.client.mesh import MeshClient
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.clock import now_us
from services.server import Mesh
from services.store.base import ACCEPTED, NOT_PERMITTED, AppendItem
from services.store.jetstream.store import JetStreamStore
from tests.fixtures import ADMIN_TOKEN, eventually, make_config

pytestmark = [pytest.mark.store_independent, pytest.mark.timeout(120)]


@pytest.fixture
async def two_processes(tmp_path):
    """Mesh processes A and B on one NATS namespace, a client of each."""
    with NatsNode(tmp_path / "nats") as node:
        config = replace(make_config(tmp_path), store=node.store_config(nats_namespace=f"c{uuid.uuid4().hex[:12]}"))
        async with Mesh(config) as a, Mesh(config) as b, MeshClient(a.address, admin_token=ADMIN_TOKEN) as on_a, \
                MeshClient(b.address, admin_token=ADMIN_TOKEN) as on_b:
            assert isinstance(a.store, JetStreamStore) and isinstance(b.store, JetStreamStore)
            yield a, b, on_a, on_b


async def test_the_watch_keeps_the_copy_in_step_with_what_another_process_writes(two_processes):
    a, b, on_a, on_b = two_processes
    lead = await on_b.register("lead")
    x = await lead.spawn("x")
    cache = a.store.agent_cache
    await eventually(lambda: cache.held(x.agent_id) is not None, message="A holds the record B registered")
    reads = cache.reads
    as_a = on_a.agent(x.info, x.credential)
    assert (await as_a.send(lead.agent_id, "hello")).status == pb.RECEIPT_STATUS_ACCEPTED
    assert cache.reads == reads, "a send through A does not read its target from NATS first"
    await lead.close(x.agent_id, "done")
    await eventually(lambda: not cache.held(x.agent_id).is_open, message="A's copy learns of B's close")


async def test_a_send_on_a_stale_copy_is_refused_when_the_sender_or_target_closed_elsewhere(two_processes):
    """A's watch is stopped, so its copy still holds x and y open after B closed them; a send through A
    after those closes returned is refused all the same, and nothing stays in the inbox."""
    a, b, on_a, on_b = two_processes
    lead = await on_a.register("lead")
    x, y, z = await lead.spawn("x"), await lead.spawn("y"), await lead.spawn("z")
    assert (await x.send(y.agent_id, "warm")).status == pb.RECEIPT_STATUS_ACCEPTED
    cache = a.store.agent_cache
    await cache.stop()  # the copy keeps what it holds, and learns nothing more from the bucket
    on_b_lead = on_b.agent(lead.info, lead.credential)
    await on_b_lead.close(x.agent_id, "sender gone")
    await on_b_lead.close(y.agent_id, "target gone")
    assert cache.held(x.agent_id).is_open and cache.held(y.agent_id).is_open, "A's copy is stale"

    from_x = await x.send(z.agent_id, "after my close")
    assert from_x.status == pb.RECEIPT_STATUS_NOT_PERMITTED, from_x
    assert "closed" in from_x.detail
    to_y = await z.send(y.agent_id, "after its close")
    assert to_y.status == pb.RECEIPT_STATUS_TARGET_CLOSED, to_y
    assert await a.store.inbox.messages.unconsumed(z.agent_id) == 0, "x's message was taken back"
    again = await x.send(z.agent_id, "after my close", message_id=from_x.message_id)
    assert again.status == pb.RECEIPT_STATUS_NOT_PERMITTED, "a retry is refused too, not a duplicate"


async def test_a_send_takes_the_read_of_its_sender_made_beside_its_frontier_and_no_older_one(two_processes):
    """A send's frontier and its sender's record are read together (one round trip), once the mesh took
    the request (AppendItem.taken_at), and the append takes that read rather than making its own. A read
    made before a close another process made is never taken: the append reads again, and refuses."""
    a, b, on_a, on_b = two_processes
    lead = await on_a.register("lead")
    x, z = await lead.spawn("x"), await lead.spawn("z")
    store = a.store
    reads = store.agent_cache._fresh  # the reads of records as the bucket holds them now

    def envelope(message_id: str) -> envelope_pb2.Envelope:
        return envelope_pb2.Envelope(message_id=message_id, recipient=z.agent_id, sender=x.agent_id)

    def sender_read_began() -> float:
        return reads._recent.done[x.agent_id][0]  # when the last read of x that ended began

    taken_at = time.monotonic()
    await store.get_frontier(x.agent_id)
    began = sender_read_began()
    assert began >= taken_at, "the frontier's read reads the sender too"
    outcome, = await store.append(x.agent_id, [AppendItem(envelope("m1"), taken_at=taken_at)], now_us())
    assert outcome.status == ACCEPTED
    assert sender_read_began() == began, "the append took that read, and made none of the sender"

    await on_b.agent(lead.info, lead.credential).close(x.agent_id, "sender gone")
    outcome, = await store.append(x.agent_id, [AppendItem(envelope("m2"), taken_at=time.monotonic())], now_us())
    assert outcome.status == NOT_PERMITTED, "the read before the close was not taken"
    assert sender_read_began() > began
