"""GatewayService over gRPC: translation only."""

from __future__ import annotations

from inboxmesh.gateway.v1 import gateway_pb2 as pb
from inboxmesh.gateway.v1 import gateway_pb2_grpc
from services.auth_policy import authenticated
from services.gateway.service import GatewayService
from services.grpc_common import unary
from services.inbox.grpc_handler import receipt_pb
from services.registry.grpc_handler import agent_pb


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, service: GatewayService):
        self._service = service

    @unary
    async def ClaimGateway(self, request: pb.ClaimGatewayRequest, context) -> pb.ClaimGatewayResponse:
        record, credential = await self._service.claim(request.family)
        return pb.ClaimGatewayResponse(agent=agent_pb(record), credential=credential)

    @unary
    async def Deliver(self, request: pb.DeliverRequest, context) -> pb.DeliverResponse:
        outcomes = await self._service.deliver(authenticated().caller, list(request.messages))
        return pb.DeliverResponse(receipts=[receipt_pb(o) for o in outcomes])
