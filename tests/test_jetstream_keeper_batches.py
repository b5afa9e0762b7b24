"""The JetStream agent indexes (a scope's agents, a name's holders, a parent's children) are one small key an
entry. Before, each index was one JSON list, read and written whole by every registration: registering N
agents of one scope moved N squared ids in all, and a list past NATS's largest message could not be written
(about 37,000 ids with the default 1 MiB). The keeper rolls agent records forward a batch at a time, and
what it rolls forward still restores what a process that died midway left undone: the index entries, in
one read and one write for the batch."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import pytest

from harness.nats import CONFIG, NatsCluster, NatsNode, wait_for_jetstream
from inboxmesh.client.errors import MeshError
from inboxmesh.client.mesh import AgentHandle, MeshClient
from inboxmesh.registry.v1 import registry_pb2 as reg_pb
from services.config import RunsConfig
from services.server import Mesh
from services.store.jetstream import agents as agents_module
from services.store.jetstream import kv
from services.store.jetstream.store import JetStreamStore
from tests.fixtures import ADMIN_TOKEN, make_config

pytestmark = pytest.mark.store_independent


async def test_a_batch_of_children_restores_the_missing_index_entries_in_one_read_and_one_write(
        tmp_path, monkeypatch):
    with NatsNode(tmp_path / "nats") as node:
        config = replace(make_config(tmp_path), store=node.store_config(nats_namespace=f"k{uuid.uuid4().hex[:12]}"),
                         runs=RunsConfig(max_active_children=40))
        async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            store = mesh.store
            assert isinstance(store, JetStreamStore)
            lead = await client.register("lead")
            children = [await lead.spawn(f"c{i}") for i in range(30)]
            ids = [c.agent_id for c in children]
            await store.keeper.stop()  # its own rounds would be counted too: this test is the keeper's round
            # a process that died after writing ten more records, before their index entries
            template = await store.agents.get(ids[0])
            assert template is not None
            lost = [replace(template, agent_id=f"agt_lost{i:02d}", name=f"lost{i}") for i in range(10)]
            for record in lost:
                assert await kv.create(store.conn.agents, kv.agent_key(record.agent_id), record, kv.AGENT)
            reads, writes = [], []
            last_many, write_many = kv.last_many, kv.write_many

            async def counted_reads(conn, bucket, keys):
                reads.append(len(keys))
                return await last_many(conn, bucket, keys)

            async def counted_writes(conn, bucket, entries):
                writes.append(len(entries))
                return await write_many(conn, bucket, entries)

            monkeypatch.setattr(agents_module.kv, "last_many", counted_reads)
            monkeypatch.setattr(agents_module.kv, "write_many", counted_writes)
            every = ids + [r.agent_id for r in lost]
            rows = await store.agents.roll_forward(every + ids[:5])  # a record written twice: rolled forward once
            assert reads == [len(every), 3 * len(every), 1], \
                "one batched read of the records, one of every entry they stand for, one of their parent"
            assert writes == [3 * len(lost)], "one write of the missing entries: scope, name, parent's children"
            children_index = f"c.{kv.token(lead.agent_id)}"
            assert sorted(await store.agents._index(children_index)) == sorted(every), "the lost entries restored"
            found = await lead.list_agents(parent_id=lead.agent_id)
            assert sorted(a.agent_id for a in found) == sorted(every)
            assert len(rows) == len(every), "one registered event per agent"


async def test_an_index_longer_than_the_largest_nats_message_still_registers_lists_and_finds(tmp_path):
    """A server whose largest message is 16 KiB (the default 1 MiB holds about 37,000 ids of a list): 1,200
    children of one parent, 200 at a time, each batch's runs ended before the next (the parent's running
    children are one list, bounded by max_active_children). Its children, its scope and its runs index hold
    1,200 entries each (33,600 and 48,000 bytes as lists). Before, spawns failed once a list passed 16 KiB
    ("maximum payload exceeded"); now every child is stored, listed by parent and by scope (in pages),
    found by name, and every run listed."""
    small = tmp_path / "nats-server.conf"
    small.write_text(CONFIG.read_text() + "\nmax_payload: 16384\n")
    with NatsNode(tmp_path / "nats", config=small) as node:
        config = replace(make_config(tmp_path), store=node.store_config(nats_namespace=f"p{uuid.uuid4().hex[:12]}"),
                         runs=RunsConfig(max_active_children=200))
        async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            handles: list[AgentHandle] = []
            for start in range(0, 1200, 200):
                got = await lead.spawn_many([reg_pb.RegisterAgentRequest(name=f"w{i}")
                                             for i in range(start, start + 200)])
                refused = [g for g in got if isinstance(g, MeshError)]
                assert not refused, f"{len(refused)} spawns refused, the first: {refused[0]}"
                batch = [g for g in got if isinstance(g, AgentHandle)]
                await asyncio.gather(*(child.end_run("done") for child in batch))
                handles += batch
            ids = {h.agent_id for h in handles}
            assert len(ids) == 1200
            by_parent = await lead.list_agents(parent_id=lead.agent_id)  # pages of 1,000
            assert {a.agent_id for a in by_parent} == ids
            assert by_parent == sorted(by_parent, key=lambda a: (a.created_at_us, a.agent_id)), "registration order"
            by_scope = await lead.list_agents(scope_id=lead.agent_id)
            assert {a.agent_id for a in by_scope} == ids | {lead.agent_id}
            found = await lead.resolve("w777", scope_id=lead.agent_id)
            assert found.agent_id == handles[777].agent_id
            runs = await lead.list_runs(include_archived=True)
            assert {r.child_id for r in runs} == ids


async def test_with_three_replicas_the_leader_answers_the_index_reads(tmp_path):
    """With replicas the agents and runs buckets serve no direct gets (a follower may be behind its leader):
    an index is read from the leader, an entry a request. A parent's children are listed by parent and by
    scope, found by name, their runs listed, and the parent's close reaches every one of them (the close
    walks the children index)."""
    with NatsCluster(tmp_path / "nats") as cluster:
        await wait_for_jetstream(cluster.urls, replicas=3)
        config = replace(make_config(tmp_path),
                         store=cluster.node_store_config(nats_namespace=f"r{uuid.uuid4().hex[:12]}"),
                         runs=RunsConfig(max_active_children=30))
        async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            got = await lead.spawn_many([reg_pb.RegisterAgentRequest(name=f"w{i}") for i in range(30)])
            children = [g for g in got if isinstance(g, AgentHandle)]
            ids = {c.agent_id for c in children}
            assert len(ids) == 30, [g for g in got if isinstance(g, MeshError)][:1]
            listed = await lead.list_agents(parent_id=lead.agent_id)
            assert {a.agent_id for a in listed} == ids
            assert listed == sorted(listed, key=lambda a: (a.created_at_us, a.agent_id)), "in registration order"
            assert {a.agent_id for a in await lead.list_agents(scope_id=lead.agent_id)} == ids | {lead.agent_id}
            assert (await lead.resolve("w17", scope_id=lead.agent_id)).agent_id == children[17].agent_id
            assert {r.child_id for r in await lead.list_runs()} == ids
            await lead.close(reason="done")
            left = await lead.list_agents(scope_id=lead.agent_id, include_closed=True)
            assert {a.agent_id for a in left if a.state == reg_pb.AGENT_STATE_OPEN} == set(), \
                "the close reached every child"
