"""What a third-party client gets for hostile input: a clear refusal with a reason, bounded in size,
and a mesh that goes on serving. Raw gRPC calls only (the project's client would refuse some of it)."""

import grpc
import pytest

from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.registry.v1 import registry_pb2 as reg
from services.grpc_status import error_info

METADATA_SOFT_LIMIT = 8 * 1024


@pytest.fixture
async def channel(mesh):
    async with grpc.aio.insecure_channel(mesh.address) as ch:
        yield ch


@pytest.fixture
async def lead(client):
    return await client.register("lead")


def auth(agent) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {agent.credential}"),)


def trailer_bytes(exc: grpc.aio.AioRpcError) -> int:
    return sum(len(k) + len(v) for k, v in exc.trailing_metadata() or ())


async def refused(call, request, metadata=()) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(request, metadata=metadata, timeout=10)
    return caught.value


async def still_serving(lead, peer_name: str = "peer"):
    peer = await lead.spawn(peer_name)
    receipt = await lead.send(peer.agent_id, "still here")
    assert receipt.status == pb.RECEIPT_STATUS_ACCEPTED


@pytest.mark.parametrize("length", [5_000, 10_000, 100_000])
async def test_a_huge_message_id_is_refused_without_being_echoed(channel, lead, length):
    send = channel.unary_unary("/inboxmesh.inbox.v1.InboxService/Send",
                               request_serializer=pb.SendRequest.SerializeToString,
                               response_deserializer=pb.SendResponse.FromString)
    request = pb.SendRequest(messages=[env_pb.Envelope(message_id="m" * length, recipient=lead.agent_id,
                                                       content=env_pb.Content(text="x"))])
    exc = await refused(send, request, auth(lead))
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
    assert error_info(exc).reason == "FIELD_TOO_LONG"
    assert "message_id" in exc.details()
    assert trailer_bytes(exc) < METADATA_SOFT_LIMIT
    assert len(exc.details()) < 1000
    await still_serving(lead)


async def test_an_unknown_agent_mode_is_a_bad_mode(channel, lead):
    register = channel.unary_unary("/inboxmesh.registry.v1.RegistryService/RegisterAgent",
                                   request_serializer=reg.RegisterAgentRequest.SerializeToString,
                                   response_deserializer=reg.RegisterAgentResponse.FromString)
    for request, metadata in ((reg.RegisterAgentRequest(name="x", mode=99), ()),
                              (reg.RegisterAgentRequest(name="x", mode=99, parent_id=lead.agent_id), auth(lead))):
        exc = await refused(register, request, metadata)
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
        assert error_info(exc).reason == "BAD_MODE"
        assert "99" in exc.details()
    await still_serving(lead)


GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\xff\x01", bytes(range(256)) * 4]


@pytest.mark.parametrize("method", [
    "/inboxmesh.inbox.v1.InboxService/Send",
    "/inboxmesh.registry.v1.RegistryService/RegisterAgent",
    "/inboxmesh.inbox.v1.InboxService/GetMessageStatus",
    "/inboxmesh.inbox.v1.InboxService/Subscribe",
])
async def test_undecodable_request_bytes_are_an_invalid_argument(channel, lead, method):
    for garbage in GARBAGE:
        if method.endswith("Subscribe"):
            call = channel.unary_stream(method)(garbage, metadata=auth(lead), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in call:
                    pass
            exc = caught.value
        else:
            exc = await refused(channel.unary_unary(method), garbage, auth(lead))
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (garbage[:8], exc.code(), exc.details())
        assert error_info(exc).reason == "UNDECODABLE_REQUEST"
        assert "could not be decoded" in exc.details()
    await still_serving(lead)


@pytest.mark.parametrize("method", ["/inboxmesh.inbox.v1.InboxService/SendStream",
                                    "/inboxmesh.inbox.v1.InboxService/Consume"])
async def test_an_undecodable_message_on_a_stream_ends_it_with_invalid_argument(channel, lead, method):
    call = channel.stream_stream(method)(metadata=auth(lead), timeout=10)
    await call.write(b"\xff\xff\xff\xff")
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert error_info(caught.value).reason == "UNDECODABLE_REQUEST"
    await still_serving(lead)
