"""A JetStream mesh process reads a send's targets and a delivery's recipient from its own copy of the agent
records (agent_cache.py), kept by a watch of the agents bucket. The copy may be behind the bucket: a close
made by another process is never overtaken all the same (the target is read again once the message is
published, and the sender is always read from the bucket)."""

import uuid
from dataclasses import replace

import pytest

from harness.nats import NatsNode
from inboxmesh.client.mesh import MeshClient
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.server import Mesh
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
