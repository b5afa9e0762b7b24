"""The JetStream keeper rolls agent records forward a batch at a time: a parent's children index (as long as
the number of children) is read and written once for the batch, not once per child, which made the keeper
spend about 10 s of mesh CPU after 1,000 registrations (quadratic in the number of children). And what it
rolls forward still restores what a process that died midway left undone: the index entries."""

from __future__ import annotations

import collections
import uuid
from dataclasses import replace

import pytest

from harness.nats import NatsNode
from inboxmesh.client.mesh import MeshClient
from services.config import RunsConfig
from services.server import Mesh
from services.store.jetstream import agents as agents_module
from services.store.jetstream import kv
from services.store.jetstream.store import JetStreamStore
from tests.fixtures import ADMIN_TOKEN, make_config

pytestmark = pytest.mark.store_independent


async def test_a_batch_of_children_reads_and_writes_each_index_once(tmp_path, monkeypatch):
    with NatsNode(tmp_path / "nats") as node:
        config = replace(make_config(tmp_path), store=node.store_config(nats_namespace=f"k{uuid.uuid4().hex[:12]}"),
                         runs=RunsConfig(max_active_children=40))
        async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            store = mesh.store
            assert isinstance(store, JetStreamStore)
            lead = await client.register("lead")
            children = [await lead.spawn(f"c{i}") for i in range(40)]
            ids = [c.agent_id for c in children]
            await store.keeper.stop()  # its own rounds would be counted too: this test is the keeper's round
            # a process that died after writing the records: the parent's children index lost
            children_key = f"c.{kv.token(lead.agent_id)}"
            await store.conn.agents.delete(children_key)
            changes: collections.Counter[str] = collections.Counter()
            cas = kv.cas

            async def counted(bucket, key, change, codec):
                changes[key] += 1
                return await cas(bucket, key, change, codec)

            monkeypatch.setattr(agents_module.kv, "cas", counted)
            rows = await store.agents.roll_forward(ids + ids[:5])  # a record written twice: rolled forward once
            assert changes[children_key] == 1, changes
            assert max(changes.values()) == 1, "each index key once for the batch"
            assert sorted(await store.agents._index(children_key)) == sorted(ids), "the lost entries restored"
            assert len(rows) == len(ids), "one registered event per agent"
