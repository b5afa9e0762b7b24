"""InboxService over gRPC: translation only."""

from __future__ import annotations

import grpc

from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.inbox.v1 import inbox_pb2_grpc
from services import errors
from services.directory import Directory
from services.grpc_common import bearer, caller_of, streaming, unary
from services.grpc_status import to_grpc
from services.inbox.service import InboxService
from services.store.base import MessageRecord, SendOutcome


def receipt_pb(outcome: SendOutcome) -> pb.Receipt:
    return pb.Receipt(
        message_id=outcome.message_id,
        recipient=outcome.recipient,
        status=outcome.status,
        sequence=outcome.sequence,
        stored_at_us=outcome.stored_at_us,
        detail=outcome.detail,
    )


def status_pb(record: MessageRecord) -> pb.MessageStatus:
    return pb.MessageStatus(
        envelope=record.envelope,
        state=record.state,
        delivery_attempts=record.attempts,
        stored_at_us=record.stored_at_us,
        delivered_at_us=record.delivered_at_us,
        consumed_at_us=record.consumed_at_us,
        dead_lettered_at_us=record.dead_at_us,
        dead_letter_reason=record.dead_reason,
    )


class InboxServicer(inbox_pb2_grpc.InboxServiceServicer):
    def __init__(self, service: InboxService, directory: Directory):
        self._service = service
        self._directory = directory

    @unary
    async def Send(self, request: pb.SendRequest, context) -> pb.SendResponse:
        caller = await caller_of(context, self._directory)
        outcomes = await self._service.send(caller, list(request.messages))
        return pb.SendResponse(receipts=[receipt_pb(o) for o in outcomes])

    @streaming
    async def SendStream(self, request_iterator, context):
        caller = await caller_of(context, self._directory)
        async for request in request_iterator:
            outcomes = await self._service.send(caller, list(request.messages))
            yield pb.SendResponse(receipts=[receipt_pb(o) for o in outcomes])

    async def Subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext):
        try:
            credentials = list(request.credentials) or [bearer(context)]
            callers = [await self._directory.authenticate(c) for c in credentials]
            subscription = await self._service.subscribe(callers, request.max_in_flight, context.peer())
        except errors.MeshError as exc:
            await context.abort(*to_grpc(exc))
            return
        why = "stream ended"
        try:
            async for response in subscription.responses():
                await context.write(response)
            if self._service.hub.closing:
                why = "mesh shutting down"
                await context.abort(*to_grpc(errors.Unavailable(
                    "the mesh is shutting down; subscribe again to resume (unacked messages are redelivered)",
                    reason="SHUTTING_DOWN")))
        except BaseException as exc:
            why = f"subscriber gone ({type(exc).__name__})"
            raise
        finally:
            await self._service.unsubscribed(subscription, why)

    @unary
    async def Ack(self, request: pb.AckRequest, context) -> pb.AckResponse:
        caller = await caller_of(context, self._directory)
        outcomes = await self._service.ack(caller, request.agent_id, list(request.sequences))
        return pb.AckResponse(
            results=[pb.AckResult(sequence=o.sequence, message_id=o.message_id, status=o.status) for o in outcomes]
        )

    @unary
    async def GetMessageStatus(self, request: pb.GetMessageStatusRequest, context) -> pb.GetMessageStatusResponse:
        caller = await caller_of(context, self._directory)
        return pb.GetMessageStatusResponse(status=status_pb(await self._service.status(caller, request.key)))

    @unary
    async def ListDeadLetters(self, request: pb.ListDeadLettersRequest, context) -> pb.ListDeadLettersResponse:
        caller = await caller_of(context, self._directory)
        records, token = await self._service.dead_letters(
            caller, recipient=request.recipient, sender=request.sender, size=request.page_size,
            page_token=request.page_token,
        )
        return pb.ListDeadLettersResponse(messages=[status_pb(r) for r in records], next_page_token=token)
