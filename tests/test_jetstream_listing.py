"""The run sweeper's listing of its work on JetStream (kv.list_keys over the runwork bucket). nats-py's own
KeyValue.keys(), which it used before, answered "no keys" for a bucket holding some when the client was
slow to take what the server had sent (the sweeper then saw no work and slept its whole interval: a run
closed under load was announced a minute late), and left a consumer on the stream for five minutes after
each listing, until nats-server refused new ones on it."""

import uuid
from dataclasses import replace

import pytest

from harness.nats import NatsNode
from inboxmesh.client.mesh import MeshClient
from inboxmesh.runs.v1 import runs_pb2 as runs
from services.clock import now_us
from services.server import Mesh
from services.store.jetstream import kv
from services.store.jetstream.store import JetStreamStore
from tests.fixtures import ADMIN_TOKEN, make_config
from tests.test_runs import spec

pytestmark = [pytest.mark.store_independent, pytest.mark.timeout(120)]

LISTINGS = 300


@pytest.fixture
async def mesh(tmp_path):
    with NatsNode(tmp_path / "nats") as node:
        config = replace(make_config(tmp_path), store=node.store_config(nats_namespace=f"l{uuid.uuid4().hex[:12]}"))
        async with Mesh(config) as mesh:
            assert isinstance(mesh.store, JetStreamStore)
            yield mesh


async def _consumers(store: JetStreamStore) -> int:
    info = await store.conn.js.stream_info(store.conn.kv_stream("runwork"))
    return int(info.state.consumer_count)


async def test_every_listing_names_every_key_held_in_write_order_and_leaves_no_consumer(mesh):
    store = mesh.store
    await kv.put_many(store.conn, "runwork", [(f"r{i}", b"") for i in range(40)])
    for i in range(0, 40, 4):
        await store.conn.runwork.delete(f"r{i}")
    await kv.put_many(store.conn, "runwork", [("r8", b"")])  # written again: listed last
    held = [f"r{i}" for i in range(40) if i % 4 and i != 8] + ["r8"]
    before = await _consumers(store)
    for _ in range(LISTINGS):
        assert await kv.list_keys(store.conn, "runwork") == held
    assert await _consumers(store) == before


async def test_the_sweeper_finds_a_closed_childs_run_in_every_pass(mesh):
    async with MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")
        child = await lead.spawn("worker", run=spec("long job"))
        await mesh.services.runs.stop()  # no sweeper settles it meanwhile: each pass below sees it pending
        await lead.close(child.agent_id, reason="not needed any more")
        run = await client.admin_run(run_id=child.run_id)
        assert run.status == runs.RUN_STATUS_CLOSED and run.announce_state == runs.ANNOUNCE_STATE_PENDING
        for _ in range(LISTINGS):
            assert (await mesh.store.run_work(now_us(), 500)).pending == [child.run_id]
        assert await _consumers(mesh.store) == 0


async def test_a_sweeper_pass_over_many_runs_reads_them_in_a_few_requests(mesh):
    """The runs a pass lists are read in batched direct gets (1,024 a request), not one request a run: a pass
    runs after every close of a child, and over 2,000 runs one a run cost the mesh 0.7-0.9 s of CPU."""
    store = mesh.store
    async with MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")
        children = [await lead.spawn(f"w{i}", run=spec(f"job {i}")) for i in range(8)]
        await mesh.services.runs.stop()
        await store.keeper.stop()  # its roll-forward of these runs would be counted too
        for child in children[:3]:  # their runs end CLOSED, to be announced by the pass
            await lead.close(child.agent_id, reason="not needed")
        nc, requests = store.conn.nc, []
        publish = nc.publish

        async def counted(subject, payload=b"", reply="", headers=None):
            if reply:
                requests.append(subject)
            return await publish(subject, payload, reply=reply, headers=headers)

        nc.publish = counted
        try:
            work = await store.run_work(now_us(), 500)
        finally:
            nc.publish = publish
    assert sorted(work.pending) == sorted(c.run_id for c in children[:3])
    runs_reads = [s for s in requests if "DIRECT.GET" in s and "_runs" in s]
    assert len(runs_reads) == 1, f"the 8 runs read in one request, not {len(runs_reads)}"


@pytest.mark.parametrize("max_payload", [16 * 1024, 1024 * 1024])
def test_a_batched_read_of_many_keys_is_cut_to_fit_the_servers_largest_message(max_payload):
    """kv.last_many asks for at most 1,024 subjects a request, and no request over the server's max_payload:
    a request of 1,024 run keys (66 KiB) was refused on a server set to 16 KiB (MaxPayloadError), and the
    keeper's check of 768 index entries with it, again at every try."""
    import json

    subjects = [f"$KV.pd2a8468eebc4_runs.r.run-{i:032x}" for i in range(3000)]
    chunks = kv._request_chunks(subjects, max_payload)
    assert [s for chunk in chunks for s in chunk] == subjects
    for chunk in chunks:
        assert 0 < len(chunk) <= kv.MULTI_LAST_MAX
        assert len(json.dumps({"multi_last": chunk, "batch": len(chunk)}).encode()) <= max_payload
    if max_payload == 1024 * 1024:
        assert len(chunks) == 3, "cut by count alone"
    else:
        assert len(chunks) > 3, "cut by bytes"
