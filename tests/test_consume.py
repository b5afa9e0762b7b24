"""The Consume stream (subscribe and ack on one stream) and the host-side
InboxStream that uses it, including resuming across a mesh restart."""

import asyncio
from dataclasses import replace

import grpc
import pytest

from inboxmesh.client.mesh import MeshClient
from inboxmesh.client.stream import InboxStream
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, eventually, make_config


@pytest.fixture
async def family(client):
    lead = await client.register("lead")
    return lead, await lead.spawn("a"), await lead.spawn("b")


async def _responses(call, kind, count, timeout=10):
    found: list = []
    async with asyncio.timeout(timeout):
        while len(found) < count:
            response = await call.read()
            if response.WhichOneof("event") == kind:
                found.append(getattr(response, kind))
    return found


async def test_acks_on_the_stream_are_answered_once(family):
    lead, a, b = family
    call = b.client.inbox.Consume()
    await call.write(pb.ConsumeRequest(subscribe=pb.SubscribeRequest(credentials=[b.credential])))
    await lead.send(b.agent_id, "one")
    await lead.send(b.agent_id, "two")
    delivered = [m for d in await _responses(call, "deliveries", 1) for m in d.messages]
    while len(delivered) < 2:
        delivered += [m for d in await _responses(call, "deliveries", 1) for m in d.messages]
    await call.write(pb.ConsumeRequest(ack=pb.AckRequest(agent_id=b.agent_id, sequences=[1, 2], request_id=7)))
    (acked,) = await _responses(call, "acked", 1)
    assert acked.request_id == 7 and acked.agent_id == b.agent_id
    assert [r.status for r in acked.results] == [pb.ACK_STATUS_CONSUMED] * 2
    await call.write(pb.ConsumeRequest(ack=pb.AckRequest(agent_id=b.agent_id, sequences=[1], request_id=8)))
    (again,) = await _responses(call, "acked", 1)
    assert [r.status for r in again.results] == [pb.ACK_STATUS_ALREADY_CONSUMED]
    call.cancel()


async def test_the_first_request_must_subscribe(family):
    _, _, b = family
    call = b.client.inbox.Consume()
    await call.write(pb.ConsumeRequest(ack=pb.AckRequest(agent_id=b.agent_id, sequences=[1])))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_inbox_stream_consumes_each_message_once_across_a_mesh_restart(tmp_path):
    config = make_config(tmp_path)
    mesh = Mesh(config)
    port = await mesh.start()
    config = replace(config, port=port)
    consumed, seen = [], []
    try:
        async with MeshClient(f"127.0.0.1:{port}", admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            b = await lead.spawn("b")
            stream = InboxStream([b], min_backoff=0.02, max_backoff=0.2)

            async def host():
                async for item in stream:
                    seen.extend(item.messages)
                    consumed.extend(await stream.consume(b.agent_id, item.messages))

            async def hosted(count: int, timeout: float) -> None:
                """Until the host consumed `count`; what ended the host, if it ended, rather than a timeout."""
                await eventually(lambda: task.done() or len(consumed) >= count, timeout, message=f"{count} consumed")
                if task.done():
                    await task

            task = asyncio.create_task(host())
            for i in range(10):
                await lead.send(b.agent_id, f"before-{i}", message_id=f"before-{i}")
            await hosted(10, timeout=10)
            await mesh.stop(grace=0.2)
            mesh = Mesh(config)
            await mesh.start()
            # The client's channel failed to connect while the mesh was away; these sends wait for it to
            # reconnect (services/client.py) instead of failing at once with UNAVAILABLE, as they did on a busy CI
            # machine, where the reconnect backoff had grown past the sends' declared retries.
            for i in range(10):
                await lead.send(b.agent_id, f"after-{i}", message_id=f"after-{i}")
            await hosted(20, timeout=20)
            assert stream.reconnects >= 1
            assert [m.message_id for m in consumed] == [f"before-{i}" for i in range(10)] + [
                f"after-{i}" for i in range(10)]
            stream.stop()
            await task
    finally:
        await mesh.stop()


async def test_a_subscriber_going_away_is_a_clean_end(family, caplog):
    lead, _, b = family
    stream = InboxStream([b])
    items = stream.__aiter__()
    await items.__anext__()  # attached
    await lead.send(b.agent_id, "hello")
    item = await items.__anext__()
    assert [m.content.text for m in item.messages] == ["hello"]
    stream.stop()
    await items.aclose()
    from inboxmesh.events.v1 import events_pb2 as ev

    await eventually(lambda: _events(lead, b.agent_id, ev.EVENT_KIND_UNSUBSCRIBED))
    problems = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not problems, [r.getMessage() for r in problems]


async def _events(agent, agent_id, kind):
    return await agent.events(agent_id=agent_id, kinds=[kind])
