"""RegistryService over gRPC: translation only."""

from __future__ import annotations

from typing import cast

from inboxmesh.client import errors
from inboxmesh.client.status import status_code_of
from inboxmesh.registry.v1 import registry_pb2 as pb
from inboxmesh.registry.v1 import registry_pb2_grpc
from services.auth_policy import authenticated
from services.grpc_common import unary
from services.registry.service import RegistryService
from services.store.base import AgentRecord


def agent_pb(record: AgentRecord) -> pb.Agent:
    return pb.Agent(
        agent_id=record.agent_id,
        name=record.name,
        mode=cast(pb.AgentMode, record.mode),  # the store keeps enums as ints
        parent_id=record.parent_id,
        scope_id=record.scope_id,
        state=cast(pb.AgentState, record.state),
        metadata=record.metadata,
        created_at_us=record.created_at_us,
        closed_at_us=record.closed_at_us,
        close_reason=record.close_reason,
        inbox_capacity=record.inbox_capacity,
        depth=record.depth,
    )


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    def __init__(self, service: RegistryService):
        self._service = service  # who is calling: auth_policy.authenticated() (the interceptor proved it)

    @unary
    async def RegisterAgent(self, request: pb.RegisterAgentRequest, context) -> pb.RegisterAgentResponse:
        call = authenticated()
        record, credential, run_id = await self._service.register(
            call.caller_or_anonymous,
            peer=call.peer,
            name=request.name,
            mode=request.mode,
            parent_id=request.parent_id,
            metadata=dict(request.metadata),
            inbox_capacity=request.inbox_capacity,
            run=request.run if request.HasField("run") else None,
            request_id=request.request_id,
        )
        return pb.RegisterAgentResponse(agent=agent_pb(record), credential=credential, run_id=run_id)

    @unary
    async def RegisterChildren(self, request: pb.RegisterChildrenRequest, context) -> pb.RegisterChildrenResponse:
        call = authenticated()
        results = await self._service.register_children(call.caller, request.children, call.peer)
        return pb.RegisterChildrenResponse(results=[_child_result(r) for r in results])

    @unary
    async def GetAgent(self, request: pb.GetAgentRequest, context) -> pb.GetAgentResponse:
        caller = authenticated().caller
        return pb.GetAgentResponse(agent=agent_pb(await self._service.get(caller, request.agent_id)))

    @unary
    async def ResolveAgent(self, request: pb.ResolveAgentRequest, context) -> pb.ResolveAgentResponse:
        caller = authenticated().caller
        record = await self._service.resolve(caller, request.name, request.scope_id, request.include_closed)
        return pb.ResolveAgentResponse(agent=agent_pb(record))

    @unary
    async def ListAgents(self, request: pb.ListAgentsRequest, context) -> pb.ListAgentsResponse:
        caller = authenticated().caller
        found, token = await self._service.list(
            caller,
            scope_id=request.scope_id,
            parent_id=request.parent_id,
            include_closed=request.include_closed,
            size=request.page_size,
            page_token=request.page_token,
        )
        return pb.ListAgentsResponse(agents=[agent_pb(a) for a in found], next_page_token=token)

    @unary
    async def CloseAgent(self, request: pb.CloseAgentRequest, context) -> pb.CloseAgentResponse:
        caller = authenticated().caller
        outcome = await self._service.close(caller, request.agent_id, request.reason)
        return pb.CloseAgentResponse(
            closed_agent_ids=[a.agent_id for a in outcome.closed], dead_lettered=len(outcome.dead_lettered)
        )


def _child_result(result: tuple[AgentRecord, str, str] | errors.MeshError) -> pb.RegisterChildResult:
    if isinstance(result, errors.MeshError):
        return pb.RegisterChildResult(error=pb.RegistrationError(
            code=status_code_of(result).value[0], reason=result.reason, message=result.message,
            metadata=result.metadata))
    record, credential, run_id = result
    return pb.RegisterChildResult(registered=pb.RegisterAgentResponse(agent=agent_pb(record), credential=credential,
                                                                      run_id=run_id))
