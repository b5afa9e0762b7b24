"""Registry over real gRPC: registration into trees, credentials, names,
scopes, listing and cascading close."""

from dataclasses import replace

import grpc
import pytest

from inboxmesh.client import errors
from inboxmesh.client.mesh import AgentHandle, MeshClient
from inboxmesh.registry.v1 import registry_pb2 as reg
from services.config import RunsConfig
from services.server import Mesh
from services.store.sqlite.store import SqliteStore
from tests.fixtures import ADMIN_TOKEN, make_config


async def test_register_top_level_and_children(client):
    lead = await client.register("lead", metadata={"team": "x"})
    assert lead.info.mode == reg.AGENT_MODE_MAIN
    assert lead.info.scope_id == lead.agent_id and lead.info.depth == 0
    assert lead.credential.startswith(lead.agent_id + ".")
    child = await lead.spawn("worker", reg.AGENT_MODE_SYNC)
    grandchild = await child.spawn("helper", reg.AGENT_MODE_FORK)
    assert child.info.parent_id == lead.agent_id and child.info.scope_id == lead.agent_id
    assert grandchild.info.scope_id == lead.agent_id and grandchild.info.depth == 2
    fetched = await lead.get(grandchild.agent_id)
    assert fetched.name == "helper" and fetched.state == reg.AGENT_STATE_OPEN
    assert (await lead.get()).metadata["team"] == "x"


async def test_child_registration_needs_the_parents_credential(client):
    lead = await client.register("lead")
    other = await client.register("intruder")
    request = reg.RegisterAgentRequest(name="graft", mode=reg.AGENT_MODE_ASYNC, parent_id=lead.agent_id)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.registry.RegisterAgent(request, metadata=other.metadata, timeout=5)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert lead.agent_id in caught.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.registry.RegisterAgent(request, timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert [a.name for a in await lead.list_agents(parent_id=lead.agent_id)] == []


async def test_bad_modes_and_names_are_refused(client):
    lead = await client.register("lead")
    with pytest.raises(errors.InvalidArgument, match="SYNC, ASYNC or FORK"):
        await lead.spawn("x", reg.AGENT_MODE_MAIN)
    with pytest.raises(errors.InvalidArgument, match="name is required"):
        await client.register("")
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await client.registry.RegisterAgent(reg.RegisterAgentRequest(name="x", mode=reg.AGENT_MODE_FORK), timeout=5)
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs a parent_id" in raw.value.details()
    with pytest.raises(errors.InvalidArgument, match="maximum"):
        await client.register("big", inbox_capacity=10**9)


async def test_credentials_are_checked(client):
    lead = await client.register("lead")
    forged = AgentHandle(client, lead.info, lead.agent_id + ".not-the-secret")
    with pytest.raises(errors.Unauthenticated) as caught:
        await forged.get()
    assert caught.value.reason == "BAD_CREDENTIAL"
    garbage = AgentHandle(client, lead.info, "garbage")
    with pytest.raises(errors.Unauthenticated) as caught:
        await garbage.get()
    assert caught.value.reason == "MALFORMED_CREDENTIAL"
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await client.registry.GetAgent(reg.GetAgentRequest(agent_id=lead.agent_id), timeout=5)
    assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in raw.value.details()


async def test_resolve_names_within_a_scope(client):
    lead = await client.register("lead")
    a = await lead.spawn("alpha")
    await lead.spawn("beta")
    dup1 = await lead.spawn("twin")
    dup2 = await lead.spawn("twin")
    other_lead = await client.register("lead2")
    await other_lead.spawn("alpha")
    assert (await a.resolve("alpha")).agent_id == a.agent_id
    with pytest.raises(errors.FailedPrecondition) as caught:
        await a.resolve("twin")
    assert caught.value.reason == "AMBIGUOUS_NAME"
    assert set(caught.value.metadata["candidates"].split(",")) == {dup1.agent_id, dup2.agent_id}
    assert dup1.agent_id in caught.value.message and dup2.agent_id in caught.value.message
    with pytest.raises(errors.NotFound):
        await a.resolve("nobody")
    with pytest.raises(errors.PermissionDenied):
        await a.resolve("alpha", scope_id=other_lead.agent_id)
    with pytest.raises(errors.InvalidArgument, match="not a scope"):
        await a.resolve("alpha", scope_id=a.agent_id)


async def test_reads_across_scopes_are_refused(client):
    lead = await client.register("lead")
    stranger = await client.register("stranger")
    with pytest.raises(errors.PermissionDenied) as caught:
        await stranger.get(lead.agent_id)
    assert caught.value.reason == "OUT_OF_SCOPE"
    with pytest.raises(errors.PermissionDenied):
        await stranger.list_agents(scope_id=lead.agent_id)
    with pytest.raises(errors.NotFound):
        await stranger.get("agt_doesnotexist")


async def test_list_by_scope_and_parent_with_paging(client):
    lead = await client.register("lead")
    kids = [await lead.spawn(f"kid{i}") for i in range(5)]
    grandkid = await kids[0].spawn("grandkid")
    listed = await lead.list_agents()
    assert [a.agent_id for a in listed] == [lead.agent_id, *(k.agent_id for k in kids), grandkid.agent_id]
    children = await lead.list_agents(parent_id=lead.agent_id)
    assert [a.agent_id for a in children] == [k.agent_id for k in kids]
    page = await client.registry.ListAgents(reg.ListAgentsRequest(page_size=2), metadata=lead.metadata, timeout=5)
    assert len(page.agents) == 2 and page.next_page_token
    rest = await client.registry.ListAgents(
        reg.ListAgentsRequest(page_size=100, page_token=page.next_page_token), metadata=lead.metadata, timeout=5)
    assert [a.agent_id for a in page.agents] + [a.agent_id for a in rest.agents] == [a.agent_id for a in listed]


async def test_close_cascades_to_descendants(client):
    lead = await client.register("lead")
    a = await lead.spawn("a")
    a1 = await a.spawn("a1")
    b = await lead.spawn("b")
    with pytest.raises(errors.PermissionDenied, match="ancestor"):
        await b.close(a.agent_id)
    result = await lead.close(a.agent_id, reason="done with a")
    assert list(result.closed_agent_ids) == [a.agent_id, a1.agent_id]
    assert (await lead.get(a1.agent_id)).state == reg.AGENT_STATE_CLOSED
    assert "done with a" in (await lead.get(a1.agent_id)).close_reason
    assert (await lead.get(b.agent_id)).state == reg.AGENT_STATE_OPEN
    assert list((await lead.close(a.agent_id)).closed_agent_ids) == []  # closing twice is harmless
    with pytest.raises(errors.FailedPrecondition, match="closed"):
        await a.spawn("late")
    assert [x.agent_id for x in await lead.list_agents(include_closed=False)] == [lead.agent_id, b.agent_id]
    whole = await lead.close()
    assert list(whole.closed_agent_ids) == [lead.agent_id, b.agent_id]


async def test_admin_token_sees_everything_but_cannot_act_as_an_agent(client, mesh):
    lead = await client.register("lead")
    admin = AgentHandle(client, reg.Agent(agent_id=""), "test-admin-token")
    assert (await admin.get(lead.agent_id)).name == "lead"
    with pytest.raises(errors.PermissionDenied, match="admin token cannot act"):
        await admin.send(lead.agent_id, "hi")


async def test_a_registration_retried_with_its_request_id_names_the_same_agent(client):
    """A retry after a lost answer: the same agent, credential and run, not a
    second agent; the request_id cannot be reused for another registration."""
    first = await client.register("lead", request_id="req-lead-0123456789")
    again = await client.register("lead", request_id="req-lead-0123456789")
    assert (again.agent_id, again.credential) == (first.agent_id, first.credential)
    assert (await again.get()).name == "lead", "the credential works"
    child = await first.spawn("worker", run=reg.RunSpec(task="t"), request_id="req-child-0123456789")
    retried = await first.spawn("worker", run=reg.RunSpec(task="t"), request_id="req-child-0123456789")
    assert (retried.agent_id, retried.credential, retried.run_id) == (child.agent_id, child.credential, child.run_id)
    assert child.run_id
    assert [a.agent_id for a in await first.list_agents(parent_id=first.agent_id)] == [child.agent_id]
    assert [r.run_id for r in await first.list_runs()] == [child.run_id]
    other_parent = await client.register("other")
    elsewhere = await other_parent.spawn("worker", request_id="req-child-0123456789")
    assert elsewhere.agent_id != child.agent_id, "a request_id names an agent only under its parent"

    with pytest.raises(errors.FailedPrecondition) as caught:
        await first.spawn("someone-else", request_id="req-child-0123456789")
    assert caught.value.reason == "REQUEST_ID_REUSED" and child.agent_id in caught.value.message
    with pytest.raises(errors.InvalidArgument) as refused:
        await first.spawn("worker", request_id="short")
    assert refused.value.reason == "REQUEST_ID_TOO_SHORT"
    await first.close(child.agent_id)
    with pytest.raises(errors.FailedPrecondition) as caught:
        await first.spawn("worker", run=reg.RunSpec(task="t"), request_id="req-child-0123456789")
    assert caught.value.reason == "AGENT_CLOSED"


# -- RegisterChildren: many children in one call ------------------------------------------------------------
async def test_register_children_registers_each_entry_in_order_with_its_run(tmp_path):
    config = replace(make_config(tmp_path), runs=RunsConfig(max_active_children=1000), heartbeat_interval_s=60)
    async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
        await _register_300_children(mesh, client)


async def _register_300_children(mesh: Mesh, client: MeshClient) -> None:
    lead = await client.register("lead")
    entries = [reg.RegisterAgentRequest(name=f"c{i}", run=reg.RunSpec(task=f"task {i}")) for i in range(300)]
    commits = mesh.store.writer.commits if isinstance(mesh.store, SqliteStore) else None
    children = await lead.spawn_many(entries)
    if commits is not None:  # SQLite: every entry's writes were queued before the commit
        assert isinstance(mesh.store, SqliteStore)
        assert mesh.store.writer.commits - commits <= 2, f"{mesh.store.writer.commits - commits} commits"
    assert all(isinstance(c, AgentHandle) for c in children), [c for c in children if not isinstance(c, AgentHandle)]
    handles = [c for c in children if isinstance(c, AgentHandle)]
    assert [c.info.name for c in handles] == [f"c{i}" for i in range(300)]
    assert {c.info.parent_id for c in handles} == {lead.agent_id}
    assert {c.info.mode for c in handles} == {reg.AGENT_MODE_ASYNC}
    assert len({c.agent_id for c in handles}) == 300
    run = await lead.get_run(run_id=handles[7].run_id)
    assert run.child_id == handles[7].agent_id and run.task == "task 7"
    receipt = await handles[299].send(handles[0].agent_id, "each credential works")
    assert receipt.status == 1
    listed = await lead.list_agents(parent_id=lead.agent_id)
    assert len(listed) == 300


async def test_register_children_answers_each_refused_entry_alone(client, mesh):
    lead = await client.register("lead")
    stranger = await client.register("stranger")
    entries = [
        reg.RegisterAgentRequest(name="ok-1"),
        reg.RegisterAgentRequest(name=""),  # no name
        reg.RegisterAgentRequest(name="graft", parent_id=stranger.agent_id),  # someone else's child
        reg.RegisterAgentRequest(name="main", mode=reg.AGENT_MODE_MAIN),  # a child cannot be MAIN
        reg.RegisterAgentRequest(name="ok-2", request_id="short"),  # a request_id under 16 characters
        reg.RegisterAgentRequest(name="ok-3", mode=reg.AGENT_MODE_SYNC),
    ]
    results = await lead.spawn_many(entries)
    kinds = [type(r).__name__ if isinstance(r, errors.MeshError) else r.info.name for r in results]
    assert kinds == ["ok-1", "InvalidArgument", "PermissionDenied", "InvalidArgument", "InvalidArgument", "ok-3"]
    reasons = [r.reason for r in results if isinstance(r, errors.MeshError)]
    assert reasons == ["MISSING_FIELD", "NOT_PARENT", "BAD_MODE", "REQUEST_ID_TOO_SHORT"]
    assert [a.name for a in await lead.list_agents(parent_id=lead.agent_id)] == ["ok-1", "ok-3"]
    assert [a.name for a in await stranger.list_agents(parent_id=stranger.agent_id)] == []


async def test_register_children_stops_at_the_parents_limit_and_refuses_bad_calls_whole(client, mesh, tmp_path):
    lead = await client.register("lead")
    limit = mesh.config.runs.max_active_children
    results = await lead.spawn_many([reg.RegisterAgentRequest(name=f"k{i}") for i in range(limit + 3)])
    registered = [r for r in results if isinstance(r, AgentHandle)]
    refused = [r for r in results if isinstance(r, errors.MeshError)]
    assert [r.info.name for r in registered] == [f"k{i}" for i in range(limit)]  # the later entries are refused
    assert [type(r) for r in refused] == [errors.ResourceExhausted] * 3
    for entries, reason in (([], "MISSING_FIELD"), ([reg.RegisterAgentRequest(name="x")] * 1001, "BATCH_TOO_LARGE")):
        with pytest.raises(errors.InvalidArgument) as caught:
            await lead.spawn_many(entries)
        assert caught.value.reason == reason
    admin = client.agent(lead.info, client.admin_token)  # the operator's token cannot act as a parent
    with pytest.raises(errors.PermissionDenied) as denied:
        await admin.spawn_many([reg.RegisterAgentRequest(name="x")])
    assert denied.value.reason == "AGENT_CREDENTIAL_REQUIRED"


async def test_register_children_retried_with_its_request_ids_names_the_same_agents(client):
    lead = await client.register("lead")
    entries = [reg.RegisterAgentRequest(name=f"r{i}", request_id=f"retry-request-{i:04d}-abcdef") for i in range(5)]
    first = await lead.spawn_many(entries)
    again = await lead.spawn_many(entries)
    assert [a.agent_id for a in first if isinstance(a, AgentHandle)] == [
        a.agent_id for a in again if isinstance(a, AgentHandle)]
    assert len(await lead.list_agents(parent_id=lead.agent_id)) == 5
