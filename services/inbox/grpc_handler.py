"""InboxService over gRPC: translation only."""

from __future__ import annotations

import asyncio
import logging
from typing import cast

import grpc

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.status import status_code_of, to_grpc
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.inbox.v1 import inbox_pb2_grpc
from services.auth_policy import authenticated
from services.directory import Caller
from services.grpc_common import streaming, unary
from services.inbox.delivery import DeliveryHub, Subscription
from services.inbox.service import InboxService
from services.store.base import AckOutcome, MessageRecord, SendOutcome

log = logging.getLogger(__name__)
_ACKS_IN_FLIGHT = 8
"""Acks of one Consume stream being processed at once (they group-commit)."""
_HALF_CLOSE_WAIT_S = 5.0
"""How long a Consume stream whose agents all left stays open for acks still
on the wire, waiting for the client to half-close (a host does so at once)."""
_REFUSALS = (errors.InvalidArgument, errors.PermissionDenied, errors.FailedPrecondition, errors.NotFound,
             errors.ResourceExhausted, errors.Unauthenticated)
"""Errors that say an ack on a Consume stream was wrong: answered on the
stream for that ack alone. Others (the mesh could not process it) end the
stream, and the host subscribes again."""
_SHOWN_ID = 64


def receipt_pb(outcome: SendOutcome) -> pb.Receipt:
    return pb.Receipt(
        message_id=outcome.message_id,
        recipient=outcome.recipient,
        status=cast(pb.ReceiptStatus, outcome.status),  # the store keeps enums as ints
        sequence=outcome.sequence,
        stored_at_us=outcome.stored_at_us,
        detail=outcome.detail,
    )


def ack_result_pb(outcome: AckOutcome) -> pb.AckResult:
    return pb.AckResult(sequence=outcome.sequence, message_id=outcome.message_id,
                        status=cast(pb.AckStatus, outcome.status))


def ack_error_pb(request: pb.AckRequest, agent_id: str, exc: errors.MeshError) -> pb.SubscribeResponse:
    """The answer to a refused ack on a Consume stream."""
    return pb.SubscribeResponse(acked=pb.AckResponse(
        agent_id=agent_id, request_id=request.request_id,
        error=pb.AckError(code=status_code_of(exc).value[0], reason=exc.reason, message=exc.message,
                          metadata=exc.metadata)))


def _shown(value: str) -> str:
    """A caller's string as an error may quote it: bounded."""
    return value if len(value) <= _SHOWN_ID else f"{value[:_SHOWN_ID]}... ({len(value)} characters)"


def status_pb(record: MessageRecord) -> pb.MessageStatus:
    return pb.MessageStatus(
        envelope=record.envelope,
        state=cast(pb.MessageState, record.state),
        delivery_attempts=record.attempts,
        stored_at_us=record.stored_at_us,
        delivered_at_us=record.delivered_at_us,
        consumed_at_us=record.consumed_at_us,
        dead_lettered_at_us=record.dead_at_us,
        dead_letter_reason=record.dead_reason,
    )


class _SubscriberGone(Exception):
    """A write to the stream failed: the call ended under us (the subscriber left or was cut off).
    What it carried stays unacked and is redelivered on the next subscribe."""


async def _write(context: grpc.aio.ServicerContext, response: pb.SubscribeResponse) -> None:
    try:
        await context.write(response)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # grpc raises its own internal types here (ExecuteBatchError, UsageError)
        raise _SubscriberGone(type(exc).__name__) from exc


class InboxServicer(inbox_pb2_grpc.InboxServiceServicer):
    def __init__(self, service: InboxService):
        self._service = service  # who is calling: auth_policy.authenticated() (the interceptor proved it)

    @unary
    async def Send(self, request: pb.SendRequest, context) -> pb.SendResponse:
        caller = authenticated().caller
        outcomes = await self._service.send(caller, list(request.messages))
        return pb.SendResponse(receipts=[receipt_pb(o) for o in outcomes])

    @streaming
    async def SendStream(self, request_iterator, context):
        caller = authenticated().caller
        async for request in request_iterator:
            outcomes = await self._service.send(caller, list(request.messages))
            yield pb.SendResponse(receipts=[receipt_pb(o) for o in outcomes])

    async def _open(self, request: pb.SubscribeRequest, context) -> tuple[Subscription, dict[str, Caller]]:
        callers = list(authenticated().callers)  # one per credential of the request (services/auth_policy.py)
        subscription = await self._service.subscribe(callers, request.max_in_flight, context.peer())
        return subscription, {c.agent.agent_id: c for c in callers if c.agent is not None}

    async def _finish(self, subscription: Subscription, context) -> None:
        """The subscription stopped producing: all its agents left, or the mesh is stopping."""
        if self._service.hub.closing:
            await self._service.unsubscribed(subscription, "mesh shutting down")
            await context.abort(*to_grpc(errors.Unavailable(
                "the mesh is shutting down; subscribe again to resume (unacked messages are redelivered)",
                reason=Reason.SHUTTING_DOWN)))
        await self._service.unsubscribed(subscription, "all its agents left")

    async def Subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext):
        try:
            subscription, _ = await self._open(request, context)
        except errors.MeshError as exc:
            await context.abort(*to_grpc(exc))
            return
        try:
            async for response in subscription.responses():
                await _write(context, response)
        except _SubscriberGone as exc:
            await self._service.unsubscribed(subscription, f"subscriber gone (write failed: {exc})")
            return
        except BaseException as exc:
            await self._service.unsubscribed(subscription, f"subscriber gone ({type(exc).__name__})")
            raise
        await self._finish(subscription, context)

    async def Consume(self, request_iterator, context: grpc.aio.ServicerContext):
        requests = request_iterator.__aiter__()
        try:
            first = await anext(requests)
            if first.WhichOneof("request") != "subscribe":
                raise errors.InvalidArgument("the first ConsumeRequest must be `subscribe`",
                                             reason=Reason.SUBSCRIBE_FIRST)
            subscription, callers = await self._open(first.subscribe, context)
        except StopAsyncIteration:
            return
        except errors.MeshError as exc:
            await context.abort(*to_grpc(exc))
            return
        writing = asyncio.Lock()  # one write at a time on the stream; acks and deliveries take turns
        acking = asyncio.Semaphore(_ACKS_IN_FLIGHT)

        async def write(response: pb.SubscribeResponse) -> None:
            async with writing:
                await _write(context, response)

        async def ack_one(request: pb.AckRequest) -> None:
            agent_id = ""
            try:
                try:
                    agent_id, caller = self._ack_caller(request, callers)
                    sequences = list(request.sequences)
                    outcomes = await self._service.ack(caller, agent_id, sequences, request.turn)
                except _REFUSALS as exc:  # this ack was wrong; the stream and its other agents carry on
                    log.info("Consume on %r: ack %d refused: %s (%s)", subscription, request.request_id,
                             exc.reason, exc.message)
                    await write(ack_error_pb(request, agent_id, exc))
                    return
                await write(pb.SubscribeResponse(acked=pb.AckResponse(
                    results=[ack_result_pb(o) for o in outcomes], agent_id=agent_id,
                    request_id=request.request_id)))
            except BaseException:
                subscription.stop()  # the stream ends with this error
                raise
            finally:
                acking.release()

        async def read_acks(group: asyncio.TaskGroup) -> None:
            try:
                async for request in requests:
                    if request.WhichOneof("request") != "ack":
                        raise errors.InvalidArgument("only `ack` may follow the first ConsumeRequest",
                                                     reason=Reason.ACK_EXPECTED)
                    await acking.acquire()
                    group.create_task(ack_one(request.ack))
            except Exception:
                subscription.stop()
                raise

        try:
            async with asyncio.TaskGroup() as group:
                reader = group.create_task(read_acks(group))
                async for response in subscription.responses():
                    await write(response)
                if not subscription.stopped and not self._service.hub.closing:
                    await self._await_half_close(reader, self._service.hub)
                reader.cancel()
        except BaseExceptionGroup as failed:  # a task of the stream failed
            first = failed.exceptions[0]
            if isinstance(first, _SubscriberGone):
                await self._service.unsubscribed(subscription, f"subscriber gone (write failed: {first})")
                return
            await self._service.unsubscribed(subscription, f"stream failed ({type(first).__name__})")
            if not isinstance(first, errors.MeshError):
                log.error("Consume stream failed", exc_info=first)
                first = errors.Internal(f"the stream failed: {type(first).__name__}; see the mesh log")
            await context.abort(*to_grpc(first))
        except BaseException as exc:  # cancelled: the subscriber went away
            await self._service.unsubscribed(subscription, f"subscriber gone ({type(exc).__name__})")
            raise
        await self._finish(subscription, context)

    @staticmethod
    def _ack_caller(request: pb.AckRequest, callers: dict[str, Caller]) -> tuple[str, Caller]:
        """Which of the stream's agents an ack is for. An empty agent_id
        means the stream's one agent; on a stream of several it names none."""
        if not request.agent_id:
            if len(callers) == 1:
                return next(iter(callers.items()))
            raise errors.InvalidArgument(
                f"the ack names no agent, and this stream delivers for {len(callers)}: set agent_id",
                reason=Reason.MISSING_FIELD, metadata={"field": "agent_id"})
        caller = callers.get(request.agent_id)
        if caller is None:
            shown = _shown(request.agent_id)
            raise errors.PermissionDenied(
                f"ack names agent {shown!r}, which this stream did not subscribe: ack on the stream that"
                " delivers for it, or with that agent's own credential",
                reason=Reason.AGENT_MISMATCH, metadata={"agent_id": shown})
        return request.agent_id, caller

    @staticmethod
    async def _await_half_close(reader: asyncio.Task, hub: DeliveryHub) -> None:
        """Every agent of the stream left (closed or superseded, the event is
        written). The client may still have acks on the wire: ending the call
        now would fail its writes, and grpc then reports the call as INTERNAL
        on the client side, dropping the answers and events it had not read
        yet. So keep answering acks until the client half-closes, bounded for
        clients that never do, and not past the start of a mesh shutdown."""
        shutting_down = asyncio.create_task(hub.shut.wait())
        try:
            await asyncio.wait({reader, shutting_down}, timeout=_HALF_CLOSE_WAIT_S,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            shutting_down.cancel()

    @unary
    async def Ack(self, request: pb.AckRequest, context) -> pb.AckResponse:
        call = authenticated()
        outcomes = await self._service.ack(call.caller, request.agent_id, list(request.sequences), request.turn)
        return pb.AckResponse(results=[ack_result_pb(o) for o in outcomes], agent_id=call.agent.agent_id)

    @unary
    async def GetMessageStatus(self, request: pb.GetMessageStatusRequest, context) -> pb.GetMessageStatusResponse:
        caller = authenticated().caller
        return pb.GetMessageStatusResponse(status=status_pb(await self._service.status(caller, request.key)))

    @unary
    async def ListDeadLetters(self, request: pb.ListDeadLettersRequest, context) -> pb.ListDeadLettersResponse:
        caller = authenticated().caller
        records, token = await self._service.dead_letters(
            caller, recipient=request.recipient, sender=request.sender, size=request.page_size,
            page_token=request.page_token,
        )
        return pb.ListDeadLettersResponse(messages=[status_pb(r) for r in records], next_page_token=token)
