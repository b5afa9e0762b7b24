"""IoaRelayService over gRPC: translation only."""

from __future__ import annotations

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.ioa.v1 import relay_pb2 as pb
from inboxmesh.ioa.v1 import relay_pb2_grpc
from services.auth_policy import authenticated
from services.directory import Directory
from services.grpc_common import unary
from services.ioa.relay import IoaRelay, address_of, parse_address
from services.validation import check_text


class IoaRelayServicer(relay_pb2_grpc.IoaRelayServiceServicer):
    def __init__(self, relay: IoaRelay, directory: Directory):
        self._relay = relay
        self._directory = directory

    @unary
    async def RelayStatus(self, request, context) -> pb.RelayStatusResponse:
        relay = self._relay
        return pb.RelayStatusResponse(
            node_id=relay.node_id, network=relay.config.network, connected=relay.connected.is_set(),
            reconnects=relay.reconnects, spaces=sorted(relay.spaces), forwarded=relay.counts["forwarded"],
            received=relay.counts["received"], duplicates=relay.counts["duplicates"], held=relay.counts["held"],
            holding=relay.holding, gaps=relay.counts["gaps"] + relay.counts["hold_full"])

    @unary
    async def MapAddress(self, request: pb.MapAddressRequest, context) -> pb.MapAddressResponse:
        caller = authenticated().caller
        which = request.WhichOneof("subject")
        if which == "agent_id":
            agent = await self._directory.require(request.agent_id)
            self._directory.check_reach(caller, agent, "map")
            node, agent_id = self._relay.node_id, agent.agent_id
        elif which == "address":
            node, agent_id = parse_address(request.address)
        else:
            raise errors.InvalidArgument("give agent_id or address", reason=Reason.MISSING_FIELD)
        local = agent_id if node == self._relay.node_id and await self._directory.get(agent_id) else ""
        return pb.MapAddressResponse(address=address_of(node, agent_id), ioa=net.Address(node=node, agent=agent_id),
                                     local_agent_id=local)

    @unary
    async def SpaceSend(self, request: pb.SpaceSendRequest, context) -> pb.SpaceSendResponse:
        agent = authenticated().agent
        check_text("space", request.space, max_len=128, required=True)
        result = await self._relay.space_send(agent.agent_id, request.space, request.text)
        return pb.SpaceSendResponse(ioa_message_id=result.ioa_message_id, status=result.status, detail=result.detail)

    @unary
    async def SpaceRead(self, request: pb.SpaceReadRequest, context) -> pb.SpaceReadResponse:
        check_text("space", request.space, max_len=128, required=True)
        messages = await self._relay.space_read(request.space, request.after_seq, request.limit or 100)
        return pb.SpaceReadResponse(messages=messages)
