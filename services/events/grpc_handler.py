"""EventService over gRPC: translation only."""

from __future__ import annotations

from inboxmesh.events.v1 import events_pb2 as pb
from inboxmesh.events.v1 import events_pb2_grpc
from services.auth_policy import authenticated
from services.events.service import EventsService
from services.grpc_common import streaming, unary
from services.validation import fitting


class EventServicer(events_pb2_grpc.EventServiceServicer):
    def __init__(self, service: EventsService):
        self._service = service  # who is calling: auth_policy.authenticated() (the interceptor proved it)

    @unary
    async def ListEvents(self, request: pb.ListEventsRequest, context) -> pb.ListEventsResponse:
        caller = authenticated().caller
        events = await self._service.list(caller, request.filter, request.after_event_id, request.limit)
        return pb.ListEventsResponse(events=events)

    @unary
    async def RecordEvents(self, request: pb.RecordEventsRequest, context) -> pb.RecordEventsResponse:
        caller = authenticated().caller
        return pb.RecordEventsResponse(event_ids=await self._service.record(caller, list(request.events)))

    @streaming
    async def WatchEvents(self, request: pb.WatchEventsRequest, context):
        caller = authenticated().caller
        async for events in self._service.watch(caller, request.filter, request.after_event_id, request.from_now):
            while events:  # answers of at most PAGE_BYTES each, like ListEvents' pages
                fit = fitting(e.ByteSize() for e in events)
                yield pb.WatchEventsResponse(events=events[:fit])
                events = events[fit:]
