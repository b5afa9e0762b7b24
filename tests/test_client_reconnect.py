"""A client whose mesh restarts carries on once the mesh is back: unary calls
made while the mesh is away wait for it within their deadline instead of
failing at once with UNAVAILABLE, the channel reconnects soon after the mesh
is back, and the declared retries still finish a call whose mesh died under
it.

While the mesh is down an AddressHolder keeps its address: it drops every
connection at once, as a port nobody listens on refuses it, and counts the
client's connection attempts. That count is what makes these tests fail
without the fix whatever the machine's speed: a call that does not wait for
ready ends with its last attempt once that many connections have failed, so
the mesh is started again only after such a call has certainly failed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import replace

import pytest

from inboxmesh.client import errors
from inboxmesh.client.mesh import SERVICE_CONFIG, MeshClient
from inboxmesh.client.stream import InboxStream
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.faults import ENV as CRASH_AT
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, eventually, make_config, store_args, store_config
from tests.processes import MeshProcess
from tests.streams import Collector

CALL_TIMEOUT = 60.0
"""Deadline of the calls made while the mesh is down: it covers the down time
and a restart on a loaded machine."""
ATTEMPTS_BEFORE_RESTART = max(entry.get("retryPolicy", {}).get("maxAttempts", 1)
                              for entry in json.loads(SERVICE_CONFIG)["methodConfig"]) + 2
"""Failed connections to wait for before the mesh comes back. Each attempt of
a call that fails fast ends by the first connection failure after it began;
one more because the first counted connection may have begun before the call."""


class AddressHolder:
    """Listens on a (stopped) mesh's address and drops each connection at once.
    `async with AddressHolder(port) as holder:`; port 0 for any free one."""

    def __init__(self, port: int = 0):
        self.port = port
        self.attempts = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> AddressHolder:
        self._server = await asyncio.start_server(self._drop, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _drop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.attempts += 1
        writer.transport.abort()

    async def until_failed_or_waiting(self, *calls: asyncio.Task) -> None:
        """Until every call ended, or the client failed to connect often
        enough that a call that does not wait for ready has ended."""
        await eventually(lambda: all(c.done() for c in calls) or self.attempts >= ATTEMPTS_BEFORE_RESTART,
                         timeout=CALL_TIMEOUT, message=f"{ATTEMPTS_BEFORE_RESTART} connection attempts")


async def _consumed(agent, agent_id: str, expected: set[str]) -> list[str]:
    """The message ids of the agent's CONSUMED events, once all expected are recorded."""

    async def recorded():
        events = await agent.events(agent_id=agent_id, kinds=[ev.EVENT_KIND_MESSAGE_CONSUMED])
        ids = [e.message_id for e in events]
        return ids if set(ids) >= expected else None

    return await eventually(recorded, timeout=30, interval=0.1, message=f"CONSUMED events of {sorted(expected)}")


async def test_a_send_and_an_ack_made_while_the_mesh_is_down_complete_once_it_is_back(tmp_path):
    """The mesh stops (in this process) and comes back on the same address; a
    send and an ack started while it is away are answered by it once it is
    back: the send ACCEPTED, the ack CONSUMED, and each message consumed once."""
    config = make_config(tmp_path)
    mesh = Mesh(config)
    port = await mesh.start()
    config = replace(config, port=port)  # the mesh comes back where the client connects
    try:
        async with MeshClient(f"127.0.0.1:{port}", timeout=CALL_TIMEOUT, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            b = await lead.spawn("b")
            first = await lead.send(b.agent_id, "before", message_id="before")
            inbox = Collector(b)
            (delivered,) = await inbox.wait_for(1)
            await mesh.stop(grace=0.2)
            await inbox.ended.wait()
            async with AddressHolder(port) as holder:
                sending = asyncio.create_task(lead.send(b.agent_id, "while down", message_id="while-down"))
                acking = asyncio.create_task(b.ack([delivered.sequence]))
                await holder.until_failed_or_waiting(sending, acking)
            mesh = Mesh(config)
            await mesh.start()

            receipt = await sending
            assert (receipt.status, receipt.message_id) == (pb.RECEIPT_STATUS_ACCEPTED, "while-down")
            assert [(r.sequence, r.status) for r in await acking] == [(first.sequence, pb.ACK_STATUS_CONSUMED)]
            inbox = Collector(b, auto_ack=True)  # the same channel subscribes again
            try:
                assert [m.message_id for m in await inbox.wait_for(1)] == ["while-down"]
                await eventually(lambda: len(inbox.consumed) == 1, message="the ack after the restart")
            finally:
                await inbox.stop()
            assert inbox.messages[0].sequence == receipt.sequence
            consumed = await _consumed(lead, b.agent_id, {"before", "while-down"})
            assert sorted(consumed) == ["before", "while-down"], "each message consumed once"
    finally:
        await mesh.stop()


async def test_an_ack_whose_mesh_died_after_storing_it_is_retried_once_the_mesh_is_back(tmp_path):
    """The declared retry on UNAVAILABLE, now waiting for the mesh: the mesh
    process stores the ack and dies before answering (a crash point); the
    client's next attempt goes to the restarted mesh, which answers that the
    message is consumed already."""
    store = store_config(tmp_path)
    with MeshProcess(tmp_path / "mesh", *store_args(store), env={CRASH_AT: "ack-stored"}) as crashing:
        port = int(crashing.address.rpartition(":")[2])
        async with MeshClient(crashing.address, timeout=CALL_TIMEOUT, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            b = await lead.spawn("b")
            receipt = await lead.send(b.agent_id, "once", message_id="once")
            inbox = Collector(b)
            await inbox.wait_for(1)
            acking = asyncio.create_task(b.ack([receipt.sequence]))
            assert await asyncio.to_thread(crashing.wait, 30) == 137, "the mesh died after storing the ack"
            await inbox.ended.wait()
            async with AddressHolder(port) as holder:
                await holder.until_failed_or_waiting(acking)
            with MeshProcess(tmp_path / "mesh", *store_args(store), "--port", str(port)):
                results = await acking
                assert [(r.sequence, r.status) for r in results] == [(receipt.sequence,
                                                                      pb.ACK_STATUS_ALREADY_CONSUMED)]
                assert await _consumed(lead, b.agent_id, {"once"}) == ["once"], "consumed once"


async def test_a_call_to_a_mesh_that_stays_away_fails_at_its_deadline_naming_the_address():
    """Waiting is bounded by the call's deadline, and the error says where the
    mesh was expected; a client that asked to fail fast gets UNAVAILABLE."""
    async with AddressHolder() as holder:
        address = f"127.0.0.1:{holder.port}"
        async with MeshClient(address, timeout=0.5) as client:
            with pytest.raises(errors.DeadlineExceeded) as caught:
                await client.register("lead")
            assert caught.value.reason == "MESH_UNREACHABLE" and address in caught.value.message
        async with MeshClient(address, timeout=CALL_TIMEOUT, wait_for_ready=False) as client:
            with pytest.raises(errors.Unavailable):  # long before the deadline, after the declared retries
                await client.register("lead")


async def test_an_ack_the_mesh_does_not_answer_in_time_is_deadline_exceeded_and_can_be_written_again(tmp_path):
    """An ack written on a stream that stays up and gets no answer within ack_timeout (the mesh process
    stopped with SIGSTOP: its connections stay open) fails with DEADLINE_EXCEEDED / NO_ANSWER, documented,
    not a bare TimeoutError; written again once the mesh runs, it reads what the first one did."""
    store = store_config(tmp_path)
    with MeshProcess(tmp_path / "mesh", *store_args(store)) as mesh:
        async with MeshClient(mesh.address, timeout=CALL_TIMEOUT, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            b = await lead.spawn("b")
            receipt = await lead.send(b.agent_id, "once", message_id="once")
            stream = InboxStream([b], ack_timeout=0.5)
            delivered: asyncio.Queue = asyncio.Queue()

            async def read() -> None:
                async for item in stream:
                    if item.messages:
                        delivered.put_nowait(item.messages)

            reader = asyncio.create_task(read())
            try:
                (message,) = await asyncio.wait_for(delivered.get(), 30)
                assert mesh.proc is not None
                os.kill(mesh.proc.pid, signal.SIGSTOP)
                try:
                    with pytest.raises(errors.DeadlineExceeded) as caught:
                        await stream.ack(b.agent_id, [message.sequence])
                finally:
                    os.kill(mesh.proc.pid, signal.SIGCONT)
                assert caught.value.reason == errors.Reason.NO_ANSWER and "outcome is unknown" in caught.value.message
                results = await stream.ack(b.agent_id, [receipt.sequence])
                assert [(r.sequence, r.status) for r in results] == [(receipt.sequence,
                                                                      pb.ACK_STATUS_ALREADY_CONSUMED)]
                assert await _consumed(lead, b.agent_id, {"once"}) == ["once"], "consumed once"
            finally:
                stream.stop()
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
