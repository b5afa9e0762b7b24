"""The mesh's side of gateways (inboxmesh.gateway.v1): claiming the A2A gateway agent with the admin token,
Deliver only by that agent and only from `a2a:` addresses, and sends to `a2a:` addresses stored in its
inbox (or refused while no gateway claimed it). The gateway process itself: tests/test_a2a_gateway.py."""

from __future__ import annotations

import pytest

from inboxmesh.client import errors
from inboxmesh.client.mesh import MeshClient
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from services.gateway.service import gateway_agent_id


async def test_a2a_addresses_need_a_claimed_gateway_and_land_in_its_inbox(client: MeshClient):
    lead = await client.register("lead")
    before = await lead.send("a2a:https://agents.example/card.json", "hi", message_id="m-1")
    assert before.status == inbox_pb2.RECEIPT_STATUS_UNKNOWN_TARGET and "no A2A gateway" in before.detail

    gateway = await client.claim_gateway("a2a")
    assert gateway.agent_id == gateway_agent_id("a2a") and gateway.info.metadata["inboxmesh-gateway"] == "a2a"
    after = await lead.send("a2a:https://agents.example/card.json", "hi", message_id="m-2")
    assert after.status == inbox_pb2.RECEIPT_STATUS_ACCEPTED and after.recipient == gateway.agent_id
    [stored] = [e for e in await client.admin_events(message_id="m-2") if e.kind == ev.EVENT_KIND_MESSAGE_STORED]
    assert stored.recipient == gateway.agent_id and stored.sender == lead.agent_id
    not_an_address = await lead.send("a2a:mailto:x", "hi", message_id="m-3")
    assert not_an_address.status == inbox_pb2.RECEIPT_STATUS_UNKNOWN_TARGET and "not an A2A address" in \
        not_an_address.detail

    # a second claim: the same agent and inbox, a new credential; the first stops working
    again = await client.claim_gateway("a2a")
    assert again.agent_id == gateway.agent_id
    with pytest.raises(errors.Unauthenticated):
        await gateway.get()
    await again.get()


async def test_deliver_is_the_gateways_alone_and_only_from_its_addresses(client: MeshClient):
    lead = await client.register("lead")
    gateway = await client.claim_gateway("a2a")
    message = env_pb.Envelope(message_id="in-1", sender="a2a:client/alice", recipient=lead.agent_id,
                              content=env_pb.Content(text="hello"))
    [receipt] = await gateway.deliver([message])
    assert receipt.status == inbox_pb2.RECEIPT_STATUS_ACCEPTED
    [again] = await gateway.deliver([message])
    assert again.status == inbox_pb2.RECEIPT_STATUS_DUPLICATE
    [unknown] = await gateway.deliver([env_pb.Envelope(message_id="in-2", sender="a2a:client/alice",
                                                       recipient="agt_00000000000000000000")])
    assert unknown.status == inbox_pb2.RECEIPT_STATUS_UNKNOWN_TARGET
    with pytest.raises(errors.PermissionDenied) as not_gateway:
        await lead.deliver([message])
    assert not_gateway.value.reason == "NOT_GATEWAY"
    with pytest.raises(errors.InvalidArgument) as bad_sender:
        await gateway.deliver([env_pb.Envelope(message_id="in-3", sender="ioa:node/agent", recipient=lead.agent_id)])
    assert bad_sender.value.reason == "BAD_GATEWAY_SENDER"
    with pytest.raises(errors.InvalidArgument) as unknown_family:
        await client.claim_gateway("smtp")
    assert unknown_family.value.reason == "UNKNOWN_FAMILY"
    with pytest.raises(errors.PermissionDenied) as claimed_origin:
        await lead.send_batch([env_pb.Envelope(message_id="x-1", recipient=lead.agent_id,
                                               origin=env_pb.Origin(kind=env_pb.ORIGIN_KIND_A2A))])
    assert claimed_origin.value.reason == "ORIGIN_NOT_ALLOWED"
    # what the agent receives: the a2a sender, the A2A origin
    [event] = [e for e in await client.admin_events(message_id="in-1") if e.kind == ev.EVENT_KIND_MESSAGE_STORED]
    assert event.sender == "a2a:client/alice"
