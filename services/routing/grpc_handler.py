"""RoutingService over gRPC: translation only."""

from __future__ import annotations

from inboxmesh.routing.v1 import routing_pb2 as pb
from inboxmesh.routing.v1 import routing_pb2_grpc
from services.auth_policy import authenticated
from services.grpc_common import unary
from services.inbox.grpc_handler import receipt_pb
from services.routing.service import RoutingService, route_pb


class RoutingServicer(routing_pb2_grpc.RoutingServiceServicer):
    def __init__(self, service: RoutingService):
        self._service = service

    @unary
    async def Ingress(self, request: pb.IngressRequest, context) -> pb.IngressResponse:
        route, agent, created, outcome = await self._service.ingress(authenticated().token, request)
        return pb.IngressResponse(route=route_pb(route), session_agent_id=agent.agent_id, session_created=created,
                                  receipt=receipt_pb(outcome))

    @unary
    async def ResolveRoute(self, request: pb.ResolveRouteRequest, context) -> pb.ResolvedRoute:
        return route_pb(self._service.resolve(request.source))

    @unary
    async def ListConfiguredAgents(self, request: pb.ListConfiguredAgentsRequest,
                                   context) -> pb.ListConfiguredAgentsResponse:
        return self._service.configured_agents()

    @unary
    async def ClaimSession(self, request: pb.ClaimSessionRequest, context) -> pb.ClaimSessionResponse:
        return await self._service.claim(authenticated().token, request.session_key)
