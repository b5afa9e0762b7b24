"""A host process killed with SIGKILL while a message it received waits,
unacked, for the next turn boundary: the message comes back to the
restarted host and is consumed exactly once."""

import asyncio
import os
import signal
import sys
from pathlib import Path

from harness.evidence import K, Record
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from tests.fixtures import eventually

ROOT = Path(__file__).resolve().parent.parent


async def _host(mesh_address, data_dir, *args):
    # asyncio subprocess: the mesh under test runs on this same event loop
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "harness.host_process", "--mesh", mesh_address, "--data-dir", str(data_dir), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT)


async def _line(proc, prefix):
    async with asyncio.timeout(30):
        while True:
            line = (await proc.stdout.readline()).decode()
            if not line:
                raise AssertionError(f"host exited ({await proc.wait()}): {(await proc.stderr.read())[-2000:]}")
            if line.startswith(prefix):
                return line.split()[1:]


async def _kill(proc):
    if proc.returncode is None:
        os.kill(proc.pid, signal.SIGKILL)
    await proc.wait()


async def test_a_host_killed_before_it_acked_gets_the_message_back_and_consumes_it_once(mesh, client, tmp_path):
    first = await _host(mesh.address, tmp_path, "--hold-turn", "2")
    try:
        agent_id, credential = await _line(first, "worker ")
        await _line(first, "holding")  # turn 2 is in its model call, forever
        worker = client.agent(agent_id, credential)
        poker = await worker.spawn("poker")
        receipt = await poker.send(agent_id, "are you there?")
        await eventually(lambda: _attempts(poker, receipt.message_id, 1), message="delivered to the first host")
    finally:
        await _kill(first)  # SIGKILL: no goodbye, no ack
    assert (await poker.status(receipt.message_id)).state != pb.MESSAGE_STATE_CONSUMED
    second = await _host(mesh.address, tmp_path, "--resume")
    try:
        assert await _line(second, "resumed") == [agent_id]
        await eventually(lambda: _state(poker, receipt.message_id, pb.MESSAGE_STATE_CONSUMED), 20)
        await eventually(lambda: _answered(poker, receipt.message_id), 20, message="and answered")
    finally:
        await _kill(second)
    record = await Record.read(client)
    consumed = record.of(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=receipt.message_id)
    assert len(consumed) == 1, "consumed exactly once"
    delivered = record.of(K.EVENT_KIND_MESSAGE_DELIVERED, message_id=receipt.message_id)
    assert [e.detail for e in delivered] == ["attempt=1", "attempt=2"], "redelivered to the new host"
    assert len(record.of(K.EVENT_KIND_MESSAGE_STORED, in_reply_to=receipt.message_id)) == 1, "answered once"


async def _state(agent, message_id, state):
    return (await agent.status(message_id)).state == state


async def _attempts(agent, message_id, attempts):
    status = await agent.status(message_id)
    return status.state == pb.MESSAGE_STATE_DELIVERED and status.delivery_attempts == attempts


async def _answered(agent, message_id):
    from inboxmesh.events.v1 import events_pb2 as ev

    return any(e.in_reply_to == message_id for e in await agent.events(kinds=[ev.EVENT_KIND_MESSAGE_STORED],
                                                                     agent_id=agent.agent_id))
