"""Durability: what was accepted survives a restart and a kill -9."""

import asyncio

import pytest

from inboxmesh.client import errors
from inboxmesh.client.mesh import MeshClient, envelope
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.registry.v1 import registry_pb2 as reg
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, contiguous_sequences, eventually, make_config
from tests.processes import MeshProcess
from tests.streams import Collector


async def test_restart_on_the_same_file_keeps_everything(tmp_path):
    config = make_config(tmp_path)
    async with Mesh(config) as mesh:
        async with MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            a, b = await lead.spawn("a"), await lead.spawn("b")
            gone = await lead.spawn("gone")
            await lead.close(gone.agent_id)
            sent = [await a.send(b.agent_id, f"m{i}", message_id=f"id-{i}") for i in range(10)]
            sub = Collector(b)
            await sub.wait_for(10)
            await b.ack([r.sequence for r in sent[:4]])
            await sub.stop()
    async with Mesh(config) as mesh:
        async with MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            a, b, lead = client.agent(a.info, a.credential), client.agent(b.info, b.credential), client.agent(
                lead.info, lead.credential)
            assert (await lead.get(gone.agent_id)).state == reg.AGENT_STATE_CLOSED
            assert (await a.status("id-0")).state == pb.MESSAGE_STATE_CONSUMED
            assert (await a.status("id-9")).state == pb.MESSAGE_STATE_DELIVERED
            again = await a.send(b.agent_id, "m0", message_id="id-0")
            assert (again.status, again.sequence) == (pb.RECEIPT_STATUS_DUPLICATE, sent[0].sequence)
            after = (await a.send(b.agent_id, "after restart")).sequence
            assert after > sent[-1].sequence and (after == 11 or not contiguous_sequences())
            sub = Collector(b, auto_ack=True)
            try:
                got = await sub.wait_for(7)
                assert [m.sequence for m in got] == [r.sequence for r in sent[4:]] + [after]
                assert [m.delivery_attempt for m in got] == [2] * 6 + [1]
            finally:
                await sub.stop()


async def test_kill_9_loses_nothing_accepted_and_consumes_everything_once(tmp_path):
    """A sender streams batches while the mesh process is killed with SIGKILL.
    After a restart the sender retries what it had no receipt for (same
    message ids): every message ends up consumed exactly once."""
    messages = {}
    with MeshProcess(tmp_path) as proc:
        async with MeshClient(proc.address, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            a, b = await lead.spawn("a"), await lead.spawn("b", inbox_capacity=100_000)
            accepted: dict[str, int] = {}

            async def blast():
                for i in range(100_000):
                    batch = [envelope(b.agent_id, f"m{i}-{j}", message_id=f"m{i}-{j}") for j in range(20)]
                    for e in batch:
                        messages[e.message_id] = e
                    receipts = await a.send_batch(batch, timeout=5)
                    for r in receipts:
                        assert r.status == pb.RECEIPT_STATUS_ACCEPTED
                        accepted[r.message_id] = r.sequence

            sender = asyncio.create_task(blast())
            await eventually(lambda: len(accepted) >= 400, timeout=60, message="400 messages accepted")
            proc.kill()
            # the Send in flight is retried (UNAVAILABLE is retryable) and the retry waits for a connection
            # until its deadline
            with pytest.raises(errors.DeadlineExceeded):
                await sender
    accepted_before_kill = dict(accepted)
    with MeshProcess(tmp_path) as proc:
        async with MeshClient(proc.address, admin_token=ADMIN_TOKEN) as client:
            a, b = client.agent(a.info, a.credential), client.agent(b.info, b.credential)
            unreceipted = [e for mid, e in messages.items() if mid not in accepted_before_kill]
            for start in range(0, len(unreceipted), 100):
                for r in await a.send_batch(unreceipted[start:start + 100]):
                    assert r.status in (pb.RECEIPT_STATUS_ACCEPTED, pb.RECEIPT_STATUS_DUPLICATE)
                    if r.message_id in accepted_before_kill:
                        raise AssertionError("an accepted message was accepted again")
            sub = Collector(b, max_in_flight=1000, auto_ack=True)
            try:
                await sub.wait_for(len(messages), timeout=60)
                await eventually(lambda: len(sub.consumed) >= len(messages), 30)
                consumed = [m.message_id for m in sub.consumed]
                assert len(consumed) == len(set(consumed)) == len(messages)
                assert set(consumed) == set(messages)
                by_id = {m.message_id: m.sequence for m in sub.messages}
                for mid, seq in accepted_before_kill.items():
                    assert by_id[mid] == seq, "an accepted message kept its sequence"
            finally:
                await sub.stop()
