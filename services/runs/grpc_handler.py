"""SubagentRunService over gRPC: translation only."""

from __future__ import annotations

from inboxmesh.runs.v1 import runs_pb2 as pb
from inboxmesh.runs.v1 import runs_pb2_grpc
from services.auth_policy import authenticated
from services.grpc_common import unary
from services.runs.service import RunService


class RunServicer(runs_pb2_grpc.SubagentRunServiceServicer):
    def __init__(self, service: RunService):
        self._service = service  # who is calling: auth_policy.authenticated() (the interceptor proved it)

    @unary
    async def EndRun(self, request: pb.EndRunRequest, context) -> pb.EndRunResponse:
        caller = authenticated().caller
        run, already = await self._service.end(caller, request.run_id, request.failed, request.result)
        return pb.EndRunResponse(run=run, already_ended=already)

    @unary
    async def GetRun(self, request: pb.GetRunRequest, context) -> pb.SubagentRun:
        caller = authenticated().caller
        return await self._service.get(caller, run_id=request.run_id, child_id=request.child_id)

    @unary
    async def ListRuns(self, request: pb.ListRunsRequest, context) -> pb.ListRunsResponse:
        caller = authenticated().caller
        runs, token = await self._service.list(caller, request.requester_id, request.include_archived,
                                               request.page_size, request.page_token)
        return pb.ListRunsResponse(runs=runs, next_page_token=token)

    @unary
    async def SweepRuns(self, request: pb.SweepRunsRequest, context) -> pb.SweepRunsResponse:
        return await self._service.sweep()  # the admin token only (services/auth_policy.py)
