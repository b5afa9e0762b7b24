"""The subagent run registry and the announce (docs/runs.md): every result
reaches the requester's inbox exactly once, also across restarts in every
phase, concurrent completion paths, a full inbox and a requester that is
gone; the sweeper; the spawn limits."""

import asyncio
from dataclasses import replace

import pytest

from harness.evidence import Record
from inboxmesh.client import errors
from inboxmesh.client.mesh import MeshClient
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.registry.v1 import registry_pb2 as reg
from inboxmesh.runs.v1 import runs_pb2 as runs
from services.config import RunsConfig
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, eventually, make_config
from tests.processes import MeshProcess
from tests.streams import Collector

K = ev.EventKind


def spec(task: str = "do it", cleanup: reg.RunCleanup = reg.RUN_CLEANUP_KEEP, **fields) -> reg.RunSpec:
    return reg.RunSpec(task=task, task_message_id=f"task-{task.replace(' ', '-')}", cleanup=cleanup, **fields)


async def announces_to(client: MeshClient, requester: str) -> list[ev.Event]:
    """Announce messages stored in the requester's inbox, from the event record."""
    record = await Record.read(client)
    return [e for e in record.of(K.EVENT_KIND_MESSAGE_STORED, recipient=requester)
            if e.message_id.startswith("inboxmesh:announce:")]


async def test_a_child_is_registered_with_its_run_and_its_result_is_announced_once(client):
    lead = await client.register("lead")
    child = await lead.spawn("worker", run=spec("count to three"))
    assert child.run_id.startswith("run-")
    run = await lead.get_run(child_id=child.agent_id)
    assert (run.run_id, run.requester_id, run.task, run.status, run.announce_state) == (
        child.run_id, lead.agent_id, "count to three", runs.RUN_STATUS_RUNNING, runs.ANNOUNCE_STATE_WAITING)
    await lead.send(child.agent_id, "count to three", kind=env_pb.MESSAGE_KIND_TASK,
                    message_id="task-count-to-three")
    worker = Collector(child, auto_ack=True)
    await eventually(lambda: worker.consumed, message="the task consumed")
    await worker.stop()
    await eventually(lambda: _started(lead, child.run_id), message="run started")

    ended = await child.end_run("1, 2, 3")
    assert not ended.already_ended
    assert ended.run.status == runs.RUN_STATUS_OK
    assert ended.run.announce_state == runs.ANNOUNCE_STATE_ANNOUNCED and ended.run.announce_sequence > 0
    again = await child.end_run("something else", failed=True)
    assert again.already_ended and again.run.status == runs.RUN_STATUS_OK and again.run.result == "1, 2, 3"

    inbox = Collector(lead, auto_ack=True)
    try:
        [report] = await inbox.wait_for(1)
        await asyncio.sleep(0.2)
        assert len(inbox.messages) == 1, "announced once"
    finally:
        await inbox.stop()
    assert (report.sender, report.kind, report.in_reply_to, report.content.text) == (
        child.agent_id, env_pb.MESSAGE_KIND_COMPLETION, "task-count-to-three", "1, 2, 3")
    assert report.message_id == ended.run.announce_message_id == f"inboxmesh:announce:{child.run_id}"
    assert report.origin.kind == env_pb.ORIGIN_KIND_MESH and report.headers["inboxmesh-run-status"] == "ok"
    record = await Record.read(client)
    kinds = [e.kind for e in record.events if e.message_id == child.run_id]
    assert kinds == [K.EVENT_KIND_RUN_CREATED, K.EVENT_KIND_RUN_STARTED, K.EVENT_KIND_RUN_ENDED,
                     K.EVENT_KIND_RUN_ANNOUNCED, K.EVENT_KIND_RUN_CLEANED_UP]
    assert record.one(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=report.message_id, agent_id=lead.agent_id)


async def _started(lead, run_id):
    return (await lead.get_run(run_id=run_id)).started_at_us > 0


async def test_concurrent_completion_paths_announce_exactly_once(client):
    """The child ends its run from several connections at once while its
    parent ends it too and closes it: one outcome, one announce."""
    lead = await client.register("lead")
    for round_ in range(5):
        child = await lead.spawn(f"worker-{round_}", run=spec(f"job {round_}"))
        views = [MeshClient(client.target) for _ in range(4)]
        try:
            calls = [v.agent(child.info, child.credential).end_run(f"done {i}") for i, v in enumerate(views)]
            calls.append(lead.end_run("parent says failed", failed=True, run_id=child.run_id))
            calls.append(lead.close(child.agent_id, reason="parent closes it"))
            results = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            for v in views:
                await v.close()
        assert not [r for r in results if isinstance(r, BaseException)]
        fresh = [r for r in results[:5] if not isinstance(r, BaseException) and not r.already_ended]
        run = await client.admin_run(run_id=child.run_id)
        assert len(fresh) <= 1 and run.status != runs.RUN_STATUS_RUNNING
        record = await Record.read(client)
        assert len(record.of(K.EVENT_KIND_RUN_ENDED, message_id=child.run_id)) == 1
        stored = [e for e in await announces_to(client, lead.agent_id) if e.sender == child.agent_id]
        assert len(stored) == 1, f"round {round_}: {len(stored)} announces"
        assert run.announce_state == runs.ANNOUNCE_STATE_ANNOUNCED


async def test_a_closed_child_is_an_orphan_with_a_recorded_outcome(client):
    lead = await client.register("lead")
    child = await lead.spawn("worker", run=spec("long job"))
    await lead.close(child.agent_id, reason="not needed any more")
    run = await eventually(lambda: _settled(client, child.run_id), message="run settled")
    assert run.status == runs.RUN_STATUS_CLOSED and "not needed any more" in run.result
    inbox = Collector(lead)
    try:
        [report] = await inbox.wait_for(1)
    finally:
        await inbox.stop()
    assert report.kind == env_pb.MESSAGE_KIND_COMPLETION and report.headers["inboxmesh-run-status"] == "closed"
    assert "closed before its task ended" in report.content.text


async def _settled(client, run_id):
    run = await client.admin_run(run_id=run_id)
    return run if run.announce_state in (runs.ANNOUNCE_STATE_ANNOUNCED, runs.ANNOUNCE_STATE_REQUESTER_GONE) \
        and run.cleaned_up_at_us else None


async def test_a_requester_that_is_gone_is_recorded_and_visible(client):
    lead = await client.register("lead")
    mid = await lead.spawn("middle", run=spec("delegate"))
    leaf = await mid.spawn("leaf", run=spec("leaf work"))
    await lead.close(reason="all done")  # cascades: the middle agent (the leaf's requester) is gone too
    run = await eventually(lambda: _settled(client, leaf.run_id), message="leaf run settled")
    assert run.status == runs.RUN_STATUS_CLOSED
    assert run.announce_state == runs.ANNOUNCE_STATE_REQUESTER_GONE
    assert f"requester {mid.agent_id} is closed" in run.announce_detail
    record = await Record.read(client)
    assert record.one(K.EVENT_KIND_RUN_REQUESTER_GONE, message_id=leaf.run_id)


async def test_a_full_requester_inbox_defers_the_announce_until_there_is_room(client):
    lead = await client.register("lead", inbox_capacity=2)
    child = await lead.spawn("worker", run=spec("job"))
    filler = await lead.spawn("filler", run=spec("filler"))
    for i in range(2):
        assert (await filler.send(lead.agent_id, f"noise {i}")).status == pb.RECEIPT_STATUS_ACCEPTED
    ended = await child.end_run("the result")
    assert ended.run.announce_state == runs.ANNOUNCE_STATE_PENDING
    assert "inbox is full" in ended.run.announce_detail
    inbox = Collector(lead, auto_ack=True)  # consuming makes room; the retry stores the announce once
    try:
        await inbox.wait_for(3, timeout=15)
        await asyncio.sleep(0.3)
        assert [m.content.text for m in inbox.messages] == ["noise 0", "noise 1", "the result"]
    finally:
        await inbox.stop()
    record = await Record.read(client)
    assert record.one(K.EVENT_KIND_RUN_ANNOUNCE_DEFERRED, message_id=child.run_id)
    assert len([e for e in await announces_to(client, lead.agent_id) if e.sender == child.agent_id]) == 1


# -- restarts in every phase -----------------------------------------------------
async def _spawned(proc: MeshProcess, cleanup: reg.RunCleanup):
    async with MeshClient(proc.address, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")
        child = await lead.spawn("worker", run=spec("job", cleanup=cleanup))
        return (lead.info, lead.credential), (child.info, child.credential, child.run_id)


async def _after_restart(tmp_path, lead_info, child_info, *, end_again: bool):
    with MeshProcess(tmp_path) as proc:
        async with MeshClient(proc.address, admin_token=ADMIN_TOKEN) as client:
            lead = client.agent(*lead_info)
            child = client.agent(child_info[0], child_info[1])
            run_id = child_info[2]
            if end_again:  # the child's host retries after the crash: the first end stands
                again = await child.end_run("the result, retried")
                assert again.already_ended and again.run.result == "the result"
            run = await eventually(lambda: _settled(client, run_id), message="run settled after restart")
            inbox = Collector(lead, auto_ack=True)
            try:
                [report] = await inbox.wait_for(1)
                await asyncio.sleep(0.3)
                assert len(inbox.messages) == 1
            finally:
                await inbox.stop()
            stored = await announces_to(client, lead.agent_id)
            assert len(stored) == 1 and report.content.text == "the result"
            return run, client, child


@pytest.mark.parametrize("phase", ["running", "ended, not announced", "announced, not cleaned up"])
async def test_a_restart_in_every_phase_announces_exactly_once(tmp_path, phase):
    crash_at = {"running": None, "ended, not announced": "run-ended",
                "announced, not cleaned up": "run-announced"}[phase]
    with MeshProcess(tmp_path, env={"INBOXMESH_CRASH_AT": crash_at} if crash_at else None) as proc:
        lead_info, child_info = await _spawned(proc, reg.RUN_CLEANUP_DELETE)
        # not waiting for the dead process to come back: the call fails as soon as the connection is gone
        async with MeshClient(proc.address, admin_token=ADMIN_TOKEN, wait_for_ready=False) as client:
            child = client.agent(child_info[0], child_info[1])
            if crash_at:
                with pytest.raises(errors.MeshError):  # the process dies inside the call
                    await child.end_run("the result")
                assert proc.wait(10) == 137
            else:
                proc.kill()  # kill -9 while the run is running
    if not crash_at:
        with MeshProcess(tmp_path) as proc:
            async with MeshClient(proc.address, admin_token=ADMIN_TOKEN) as client:
                ended = await client.agent(child_info[0], child_info[1]).end_run("the result")
                assert not ended.already_ended
    run, _, _ = await _after_restart(tmp_path, lead_info, child_info, end_again=bool(crash_at))
    assert run.status == runs.RUN_STATUS_OK


async def test_cleanup_delete_closes_the_child_once_announced(client):
    lead = await client.register("lead")
    child = await lead.spawn("worker", run=spec("job", cleanup=reg.RUN_CLEANUP_DELETE))
    ended = await child.end_run("done")
    assert ended.run.cleaned_up_at_us > 0
    assert (await lead.get(child.agent_id)).state == reg.AGENT_STATE_CLOSED
    record = await Record.read(client)
    assert record.one(K.EVENT_KIND_RUN_CLEANED_UP, message_id=child.run_id).detail == "child closed"
    announced = record.one(K.EVENT_KIND_RUN_ANNOUNCED, message_id=child.run_id)
    closed = record.one(K.EVENT_KIND_AGENT_CLOSED, agent_id=child.agent_id)
    assert announced.event_id < closed.event_id, "announced before the child was closed"


# -- the sweeper ---------------------------------------------------------------
async def test_the_sweeper_times_out_and_archives_runs(tmp_path):
    config = replace(make_config(tmp_path), runs=RunsConfig(archive_after_s=0.3, sweep_interval_s=0.1))
    async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")
        slow = await lead.spawn("slow", run=spec("slow job", run_timeout_s=1))
        quick = await lead.spawn("quick", run=spec("quick job", cleanup=reg.RUN_CLEANUP_DELETE))
        await quick.end_run("quick result")
        run = await eventually(lambda: _archived(client, slow.run_id), timeout=10, message="slow run archived")
        assert run.status == runs.RUN_STATUS_TIMEOUT and run.announce_state == runs.ANNOUNCE_STATE_ANNOUNCED
        assert await eventually(lambda: _archived(client, quick.run_id), timeout=10, message="quick archived")
        assert await lead.list_runs() == []
        assert {r.run_id for r in await lead.list_runs(include_archived=True)} == {slow.run_id, quick.run_id}
        texts = [m.content.text for m in await _drain(lead, 2)]
        assert texts == ["quick result", "The task did not end in time: its run timeout passed"]


async def _archived(client, run_id):
    run = await client.admin_run(run_id=run_id)
    return run if run.archived_at_us else None


async def _drain(agent, count):
    inbox = Collector(agent)
    try:
        return await inbox.wait_for(count)
    finally:
        await inbox.stop()


async def test_sweep_runs_needs_the_admin_token(mesh, client):
    lead = await client.register("lead")
    async with MeshClient(mesh.address, admin_token=lead.credential) as pretender:  # an agent's, not the operator's
        with pytest.raises(errors.PermissionDenied) as refused:
            await pretender.sweep_runs()
    assert refused.value.reason == "NOT_ADMIN"
    assert isinstance(await client.sweep_runs(), runs.SweepRunsResponse)


# -- limits --------------------------------------------------------------------------
async def test_spawn_depth_and_active_children_limits(tmp_path):
    config = replace(make_config(tmp_path), runs=RunsConfig(max_spawn_depth=2, max_active_children=2))
    async with Mesh(config) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")
        child = await lead.spawn("child", run=spec("c"))
        grandchild = await child.spawn("grandchild", run=spec("g"))
        with pytest.raises(errors.ResourceExhausted) as too_deep:
            await grandchild.spawn("too-deep", run=spec("t"))
        assert too_deep.value.reason == "SPAWN_DEPTH" and "depth 3" in too_deep.value.message
        second = await lead.spawn("second", run=spec("s"))
        with pytest.raises(errors.ResourceExhausted) as too_many:
            await lead.spawn("third", run=spec("x"))
        assert too_many.value.reason == "TOO_MANY_CHILDREN" and "2 running children" in too_many.value.message
        await second.end_run("done")  # an ended run frees its place
        assert (await lead.spawn("third", run=spec("x"))).run_id
        record = await Record.read(client)
        refused = record.of(K.EVENT_KIND_LIMIT_REFUSED)
        assert [e.detail.split(":")[0] for e in refused] == ["SPAWN_DEPTH", "TOO_MANY_CHILDREN"]


async def test_the_loop_guard_stops_chains_not_only_pairs(tmp_path):
    """A -> B -> C -> A -> ...: each agent consumes what it got, then sends on; the mesh derives every
    hop's trail from what the sender consumed (a client's own trail is ignored) and refuses the hop that
    would visit an agent a sixth time."""
    async with Mesh(make_config(tmp_path)) as mesh, MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")
        a, b, c = [await lead.spawn(n, run=spec(n)) for n in "abc"]
        ring = [a, b, c]
        receipts = []
        for hop in range(30):
            sender, target = ring[hop % 3], ring[(hop + 1) % 3]
            receipt = await sender.send(target.agent_id, f"hop {hop}", trail=["made-up"], hop_count=0)
            receipts.append(receipt)
            if receipt.status != pb.RECEIPT_STATUS_ACCEPTED:
                break
            assert [r.status for r in await target.ack([receipt.sequence])] == [pb.ACK_STATUS_CONSUMED]
        last = receipts[-1]
        assert last.status == pb.RECEIPT_STATUS_NOT_PERMITTED and "loop guard" in last.detail
        assert len(receipts) == 15, "a already in the trail 5 times: the 15th hop is refused"
        first = await b.inbox_status(receipts[0].sequence)
        assert list(first.envelope.trail) == [a.agent_id], "the client's trail is not the mesh's"
        fourth = await b.inbox_status(receipts[3].sequence)
        assert list(fourth.envelope.trail) == [a.agent_id, b.agent_id, c.agent_id, a.agent_id]
        assert fourth.envelope.hop_count == 3


async def test_the_conversation_budget_caps_a_conversation(tmp_path):
    async with Mesh(make_config(tmp_path, conversation_budget=5)) as mesh, \
            MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")
        a, b = await lead.spawn("a", run=spec("a")), await lead.spawn("b", run=spec("b"))
        statuses = [(await a.send(b.agent_id, f"m{i}", conversation_id="chatty")).status for i in range(7)]
        assert statuses == [pb.RECEIPT_STATUS_ACCEPTED] * 5 + [pb.RECEIPT_STATUS_NOT_PERMITTED] * 2
        assert (await a.send(b.agent_id, "another topic", conversation_id="fresh")).status == \
            pb.RECEIPT_STATUS_ACCEPTED
