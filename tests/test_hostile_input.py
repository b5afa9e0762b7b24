"""What a third-party client gets for hostile input: a clear refusal with a reason, bounded in size,
and a mesh that goes on serving. Raw gRPC calls only (the project's client would refuse some of it)."""

from typing import cast

import grpc
import pytest

from inboxmesh.client.status import error_info
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.registry.v1 import registry_pb2 as reg

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


def reason(exc: grpc.aio.AioRpcError) -> str:
    """The ErrorInfo reason of a refusal (every refusal of the mesh carries one)."""
    info = error_info(exc)
    assert info is not None, f"no ErrorInfo: {exc.code()} {exc.details()}"
    return info.reason


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
    assert reason(exc) == "FIELD_TOO_LONG"
    assert "message_id" in exc.details()
    assert trailer_bytes(exc) < METADATA_SOFT_LIMIT
    assert len(exc.details()) < 1000
    await still_serving(lead)


async def test_an_unknown_agent_mode_is_a_bad_mode(channel, lead):
    register = channel.unary_unary("/inboxmesh.registry.v1.RegistryService/RegisterAgent",
                                   request_serializer=reg.RegisterAgentRequest.SerializeToString,
                                   response_deserializer=reg.RegisterAgentResponse.FromString)
    unknown = cast(reg.AgentMode, 99)  # no such mode: what a client built from other protos might send
    for request, metadata in ((reg.RegisterAgentRequest(name="x", mode=unknown), ()),
                              (reg.RegisterAgentRequest(name="x", mode=unknown, parent_id=lead.agent_id), auth(lead))):
        exc = await refused(register, request, metadata)
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
        assert reason(exc) == "BAD_MODE"
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
        assert reason(exc) == "UNDECODABLE_REQUEST"
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
    assert reason(caught.value) == "UNDECODABLE_REQUEST"
    await still_serving(lead)


async def pages(call, request, metadata, items_field: str) -> list:
    """Every item of a paged list RPC, read by a client with gRPC's default 4 MiB receive limit."""
    found, seen_tokens = [], set()
    while True:
        response = await call(request, metadata=metadata, timeout=30)
        found += getattr(response, items_field)
        if not response.next_page_token:
            return found
        assert response.next_page_token not in seen_tokens, "a page token came twice"
        seen_tokens.add(response.next_page_token)
        request.page_token = response.next_page_token


async def test_large_dead_letters_list_in_pages_a_default_client_can_receive(channel, lead):
    sink = await lead.spawn("sink")
    big = "x" * (250 * 1024)
    for batch in range(4):
        envelopes = [env_pb.Envelope(message_id=f"big-{batch}-{i}", recipient=sink.agent_id,
                                     content=env_pb.Content(text=big)) for i in range(10)]
        receipts = await lead.send_batch(envelopes, timeout=30)
        assert all(r.status == pb.RECEIPT_STATUS_ACCEPTED for r in receipts)
    await lead.close(sink.agent_id)  # dead-letters all 40 (reason: closed)
    listing = channel.unary_unary("/inboxmesh.inbox.v1.InboxService/ListDeadLetters",
                                  request_serializer=pb.ListDeadLettersRequest.SerializeToString,
                                  response_deserializer=pb.ListDeadLettersResponse.FromString)
    dead = await pages(listing, pb.ListDeadLettersRequest(sender=lead.agent_id), auth(lead), "messages")
    assert sorted(m.envelope.message_id for m in dead) == sorted(f"big-{b}-{i}" for b in range(4) for i in range(10))


async def test_agents_with_large_metadata_list_in_pages_a_default_client_can_receive(channel, lead):
    metadata = {f"k{i}": "v" * 4000 for i in range(64)}  # the most metadata an agent may carry (256 KB)
    children = [await lead.spawn(f"c{i}", metadata=metadata) for i in range(8)]  # 8 running children at most
    children += [await c.spawn(f"{c.info.name}-{j}", metadata=metadata) for c in children for j in range(2)]
    listing = channel.unary_unary("/inboxmesh.registry.v1.RegistryService/ListAgents",
                                  request_serializer=reg.ListAgentsRequest.SerializeToString,
                                  response_deserializer=reg.ListAgentsResponse.FromString)
    agents = await pages(listing, reg.ListAgentsRequest(scope_id=lead.info.scope_id), auth(lead), "agents")
    assert sorted(a.agent_id for a in agents if a.metadata) == sorted(c.agent_id for c in children)


async def test_runs_with_large_results_list_in_pages_a_default_client_can_receive(channel, lead):
    from inboxmesh.runs.v1 import runs_pb2 as runs

    ended = []
    for i in range(40):  # 40 results of 128 KB: 5 MB in all
        child = await lead.spawn(f"w{i}")
        await child.end_run("r" * (128 * 1024))
        ended.append(child.run_id)
    listing = channel.unary_unary("/inboxmesh.runs.v1.SubagentRunService/ListRuns",
                                  request_serializer=runs.ListRunsRequest.SerializeToString,
                                  response_deserializer=runs.ListRunsResponse.FromString)
    found = await pages(listing, runs.ListRunsRequest(requester_id=lead.agent_id), auth(lead), "runs")
    assert sorted(r.run_id for r in found) == sorted(ended)


async def test_a_call_that_already_ended_is_left_alone_by_the_error_boundary():
    """A status that cannot be sent any more (the call ended: the client left, or the server is stopping,
    as a loaded CI run hit in Subscribe's shutdown abort) must not escape the boundary: grpc logs it as an
    unexpected servicer exception and aborts a second time ("Abort already called!")."""
    from grpc._cython import cygrpc

    from inboxmesh.client import errors
    from services.grpc_common import _refuse

    class EndedCall:
        aborts = 0

        async def abort(self, *status):
            self.aborts += 1
            raise cygrpc.ExecuteBatchError("Failed execute_batch: the call already ended")

    ended = EndedCall()
    await _refuse(ended, errors.Unavailable("the mesh is shutting down", reason="SHUTTING_DOWN"), "/m/Subscribe")
    await _refuse(ended, cygrpc.ExecuteBatchError("a write on an ended call"), "/m/Subscribe")
    assert ended.aborts == 1, "no second abort for a call whose machinery already failed"
