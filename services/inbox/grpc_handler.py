"""InboxService over gRPC: translation only."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import cast

import grpc

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.status import status_code_of, to_grpc
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.inbox.v1 import inbox_pb2_grpc
from services.auth_policy import authenticated
from services.directory import Caller
from services.grpc_common import interrupted, streaming, unary
from services.inbox.consume import ACK_ANSWERED, REFUSALS, AckAnswer, ConsumeSession
from services.inbox.delivery import DeliveryHub, Subscription
from services.inbox.service import InboxService, StreamSenders
from services.store.base import AckOutcome, MessageRecord, SendOutcome

log = logging.getLogger(__name__)
ACKS_IN_FLIGHT = 64
"""Acks (`ack` and `ack_many` requests) of one Consume stream being processed at once (they group-commit).
With this many unanswered the handler reads no further request of the stream: the client's writes wait on
the call's flow control; nothing is dropped."""
PIPELINED_SENDS = 16
"""Reads of one SendStream started and not yet answered, at most. A read whose messages all go to IOA
addresses is answered once its receipts come back from the far meshes; meanwhile the next reads are
started (the relay publishes in the order of the reads). With this many unanswered the handler takes no
further read: the read-ahead fills, then the client's writes wait on the call's flow control."""
SENDS_READ_AHEAD = 64
"""Requests of one SendStream read ahead and stored together, at most (and at most READ_AHEAD_BYTES of
them); the handler reads no further while that many wait."""
READ_AHEAD_BYTES = 8 * 1024 * 1024
REFUSAL_DRAIN_S = 2.0
REFUSAL_DRAIN_REQUESTS = 1024
"""After a refused SendStream request the handler reads (and discards, storing none) what the client is
still writing, until it half-closes, for at most this long and this many requests, and only then ends the
call with the refusal: a client whose writes are already on their way sees the refusal's status and reason,
not a failed write (gRPC reports a write after the call's end as its own INTERNAL error)."""
_HALF_CLOSE_WAIT_S = 5.0
"""How long a Consume stream whose agents all left stays open for acks still
on the wire, waiting for the client to half-close (a host does so at once)."""


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


def error_pb(exc: errors.MeshError) -> pb.AckError:
    """A refusal answered on a Consume stream (an ack's, an attach's, a detach's)."""
    return pb.AckError(code=status_code_of(exc).value[0], reason=exc.reason, message=exc.message,
                       metadata=exc.metadata)


def ack_response_pb(answer: AckAnswer, request_id: int) -> pb.AckResponse:
    if answer.refusal is not None:
        return pb.AckResponse(agent_id=answer.agent_id, request_id=request_id, error=error_pb(answer.refusal))
    return pb.AckResponse(results=[ack_result_pb(o) for o in answer.outcomes], agent_id=answer.agent_id,
                          request_id=request_id)


def event_pb(agent_id: str, kind: pb.SubscriptionEventKind, *, detail: str = "", request_id: int = 0,
             error: errors.MeshError | None = None) -> pb.SubscribeResponse:
    return pb.SubscribeResponse(subscription=pb.SubscriptionEvent(
        agent_id=agent_id, kind=kind, detail=detail, request_id=request_id,
        error=error_pb(error) if error is not None else None))


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
        call = authenticated()
        answered, failure = await self._service.send_requests(StreamSenders(call.caller, call.proven), [request])
        if failure is not None:
            raise failure
        return pb.SendResponse(receipts=[receipt_pb(o) for o in answered[0]])

    @streaming
    async def SendStream(self, request_iterator, context):
        call = authenticated()
        senders = StreamSenders(call.caller, call.proven)  # one for the stream: credentials proven once
        ahead = _ReadAhead(SENDS_READ_AHEAD, READ_AHEAD_BYTES)
        reader = asyncio.create_task(ahead.fill(request_iterator))
        sends = _SendPipeline(self._service, senders, ahead)
        try:
            async for answered, failure in sends.answers():
                for outcomes in answered:
                    yield pb.SendResponse(receipts=[receipt_pb(o) for o in outcomes])
                if failure is not None:
                    await sends.stop()
                    await ahead.discard_rest(REFUSAL_DRAIN_S, REFUSAL_DRAIN_REQUESTS)
                    raise failure
        finally:
            sends.cancel()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

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

    async def _broken(self, subscription: Subscription, exc: BaseException, context, method: str) -> None:
        """A Subscribe or Consume stream ended by an exception: the subscriber went away (the call was
        cancelled: raised on), or a wait inside its delivery was cancelled by someone else (answered
        UNAVAILABLE: grpc_common.interrupted)."""
        interruption = interrupted(exc, method)
        await self._service.unsubscribed(subscription, "delivery interrupted" if interruption else
                                         f"subscriber gone ({type(exc).__name__})")
        if interruption is None:
            raise exc
        await context.abort(*to_grpc(interruption))

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
            await self._broken(subscription, exc, context, "Subscribe")
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
        session = ConsumeSession(self._service, subscription, callers, authenticated().proven,
                                 first.subscribe.max_in_flight)
        writing = asyncio.Lock()  # one write at a time on the stream; answers and deliveries take turns
        acking = asyncio.Semaphore(ACKS_IN_FLIGHT)

        async def write(response: pb.SubscribeResponse) -> None:
            async with writing:
                await _write(context, response)

        async def answer(acks: pb.AckRequest | pb.AckManyRequest) -> None:
            """Answer one ack or ack_many request (a task of its own: acks in progress group-commit)."""
            try:
                if isinstance(acks, pb.AckRequest):
                    await write(pb.SubscribeResponse(acked=ack_response_pb(await session.ack(acks), acks.request_id)))
                    return
                try:
                    answers = await session.ack_many(acks)
                except ACK_ANSWERED as exc:
                    await write(pb.SubscribeResponse(acked_many=pb.AckManyResponse(request_id=acks.request_id,
                                                                                   error=error_pb(exc))))
                    return
                await write(pb.SubscribeResponse(acked_many=pb.AckManyResponse(
                    request_id=acks.request_id,
                    acks=[ack_response_pb(a, entry.request_id) for a, entry in zip(answers, acks.acks)])))
            except BaseException:
                subscription.stop()  # the stream ends with this error
                raise
            finally:
                acking.release()

        async def attach(request: pb.AttachRequest) -> None:
            try:
                await session.attach(request)  # answered by the subscription: an ATTACHED per agent
            except REFUSALS as exc:
                log.info("Consume on %r: attach %d refused: %s (%s)", subscription, request.request_id, exc.reason,
                         exc.message)
                await write(event_pb("", pb.SUBSCRIPTION_EVENT_KIND_REFUSED, request_id=request.request_id,
                                     error=exc))

        async def detach(request: pb.DetachRequest) -> None:
            try:
                named = await session.detach(request)
            except REFUSALS as exc:
                await write(event_pb("", pb.SUBSCRIPTION_EVENT_KIND_REFUSED, request_id=request.request_id,
                                     error=exc))
                return
            for agent_id, was_here in named:
                await write(event_pb(agent_id, pb.SUBSCRIPTION_EVENT_KIND_DETACHED, request_id=request.request_id,
                                     detail="detached" if was_here else "this stream was not delivering for it"))

        async def read_requests(group: asyncio.TaskGroup) -> None:
            try:
                async for request in requests:
                    which = request.WhichOneof("request")
                    if which == "ack" or which == "ack_many":
                        await acking.acquire()  # full: read nothing more until an ack is answered
                        group.create_task(answer(request.ack if which == "ack" else request.ack_many))
                    elif which == "attach":  # in order: an ack after it may name the agents it adds
                        await attach(request.attach)
                    elif which == "detach":
                        await detach(request.detach)
                    else:
                        raise errors.InvalidArgument(
                            "only `ack`, `ack_many`, `attach` or `detach` may follow the first ConsumeRequest",
                            reason=Reason.ACK_EXPECTED)
            except Exception:
                subscription.stop()
                raise

        try:
            async with asyncio.TaskGroup() as group:
                reader = group.create_task(read_requests(group))
                async for response in subscription.responses():
                    session.produced(response)
                    await write(response)
                session.ending = True  # before anything else runs: no attach to a subscription that ended
                if not subscription.stopped and not self._service.hub.closing:
                    await self._await_half_close(reader, self._service.hub)
                reader.cancel()
        except BaseExceptionGroup as failed:  # a task of the stream failed
            first_error = failed.exceptions[0]
            if isinstance(first_error, _SubscriberGone):
                await self._service.unsubscribed(subscription, f"subscriber gone (write failed: {first_error})")
                return
            await self._service.unsubscribed(subscription, f"stream failed ({type(first_error).__name__})")
            if not isinstance(first_error, errors.MeshError):
                log.error("Consume stream failed", exc_info=first_error)
                first_error = errors.Internal(f"the stream failed: {type(first_error).__name__}; see the mesh log")
            await context.abort(*to_grpc(first_error))
        except BaseException as exc:  # cancelled: the subscriber went away (or a wait inside, by someone else)
            await self._broken(subscription, exc, context, "Consume")
        await self._finish(subscription, context)

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


_Answers = tuple[list[list[SendOutcome]], errors.MeshError | None]


class _SendPipeline:
    """The reads of one SendStream (_ReadAhead.take), started one after the other in a task of their own
    (InboxService.start_requests: checked, published to IOA or stored) and answered in the same order.
    A read whose messages all go to IOA addresses leaves only its receipts to wait for, and the next read
    is started meanwhile; any other read is started once every read before it has its answers, and the
    next one once it has its own (what follows a local store, or a refusal, is not started before it).
    Nothing is started after a read that was refused or whose receipts failed."""

    def __init__(self, service: InboxService, senders: StreamSenders, ahead: _ReadAhead):
        self._service, self._senders, self._ahead = service, senders, ahead
        self._started: collections.deque[asyncio.Future[_Answers] | None] = collections.deque()
        """Each read's answers, in order; None after the last."""
        self._changed = asyncio.Event()
        self._stopping = False
        self._starting = False
        """Whether the task is starting a read (then it is not cancelled by stop: it publishes or stores)."""
        self._failed = False
        """Whether a started read failed or was refused. Kept here: its answers may be handed out and taken
        off `_started` before `_run` looks at them."""
        self._task = asyncio.create_task(self._run())

    def _push(self, answers: asyncio.Future[_Answers] | None) -> None:
        self._started.append(answers)
        self._changed.set()

    def _settled(self, answers: asyncio.Future[_Answers]) -> None:
        """A started read has its answers (the first callback of its future: this runs before `answers`
        hands them out and takes the read off `_started`, and before `_run` looks)."""
        if answers.cancelled() or answers.exception() is not None or answers.result()[1] is not None:
            self._failed = True

    def _failed_before(self) -> bool:
        return self._failed or self._stopping

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping:
                while len(self._started) >= PIPELINED_SENDS:
                    self._changed.clear()
                    await self._changed.wait()
                batch = await self._ahead.take(self._service.max_batch_messages)
                if not batch or self._stopping:
                    break
                pipelined = self._service.all_to_ioa(batch)
                if not pipelined and self._started:
                    await asyncio.wait([f for f in self._started if f is not None])
                if self._failed_before():
                    break
                self._starting = True
                try:
                    finish, refused = await self._service.start_requests(self._senders, batch)
                finally:
                    self._starting = False
                answers = asyncio.ensure_future(finish())
                answers.add_done_callback(self._settled)
                self._push(answers)
                if refused:
                    break
                if not pipelined:
                    await asyncio.wait([answers])
                if self._failed_before():
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a read that could not be taken (undecodable), or a fault: in its turn
            failed: asyncio.Future[_Answers] = loop.create_future()
            failed.set_exception(exc)
            failed.add_done_callback(_retrieved)
            self._push(failed)
        finally:
            self._push(None)

    async def answers(self) -> AsyncIterator[_Answers]:
        """Each read's answers, in order, until the stream ended (what failed a read is raised in its turn)."""
        while True:
            while not self._started:
                self._changed.clear()
                await self._changed.wait()
            answers = self._started[0]
            if answers is None:
                return
            result = await answers
            self._started.popleft()
            self._changed.set()
            yield result

    async def stop(self) -> None:
        """After a failure: start nothing more, and wait for what was started (IOA reads published after
        the failed one wait for their receipts; they are not answered)."""
        self._stopping = True
        if not self._starting:
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        started = [f for f in self._started if f is not None]
        if started:
            await asyncio.wait(started)

    def cancel(self) -> None:
        """The stream ended: start nothing more (reads already started finish on their own)."""
        self._stopping = True
        self._task.cancel()


def _retrieved(future: asyncio.Future) -> None:
    """A started read's answers may never be asked for (the stream ended): its failure is not logged as lost."""
    if not future.cancelled():
        future.exception()


class _ReadAhead:
    """Requests of a stream read before their turn: at most `max_items`, and at most `max_bytes` of them
    (a bigger request is taken alone). `fill` reads while there is room; `take` hands over what waits."""

    def __init__(self, max_items: int, max_bytes: int):
        self._max_items, self._max_bytes = max_items, max_bytes
        self._waiting: collections.deque[tuple[pb.SendRequest, int]] = collections.deque()
        self._bytes = 0
        self._ended = False
        self._failure: Exception | None = None
        self._changed = asyncio.Condition()

    def _has_room(self, size: int) -> bool:
        return not self._waiting or (len(self._waiting) < self._max_items and self._bytes + size <= self._max_bytes)

    async def fill(self, requests: AsyncIterator[pb.SendRequest]) -> None:
        try:
            async for request in requests:
                size = request.ByteSize()
                async with self._changed:
                    await self._changed.wait_for(functools.partial(self._has_room, size))
                    self._waiting.append((request, size))
                    self._bytes += size
                    self._changed.notify_all()
        except Exception as exc:  # an undecodable request, say: its turn comes after the requests before it
            self._failure = exc
        finally:
            self._ended = True
            async with self._changed:
                self._changed.notify_all()

    async def discard_rest(self, within_s: float, max_requests: int) -> None:
        """Drop what waits and what the client still writes, until the stream ends (the client half-closed),
        `within_s` passed or `max_requests` were dropped; nothing dropped is stored."""
        dropped = 0

        def done_or_waiting() -> bool:
            return self._ended or bool(self._waiting)

        try:
            async with asyncio.timeout(within_s):
                while dropped < max_requests:
                    async with self._changed:
                        await self._changed.wait_for(done_or_waiting)
                        dropped += len(self._waiting)
                        self._waiting.clear()
                        self._bytes = 0
                        self._changed.notify_all()
                        if self._ended:
                            return
        except TimeoutError:
            return

    async def take(self, max_messages: int) -> list[pb.SendRequest]:
        """The requests waiting, in order: at least one, and no more than max_messages messages unless the
        first alone holds more. [] once the stream ended and every request was taken; what ended the stream
        (an undecodable request) is raised in its turn."""
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._waiting) or self._ended)
        # One turn of the loop for `fill` first: a commit blocks the loop while gRPC goes on receiving, so
        # after one more requests are usually there to be read, and they are best stored with these.
        await asyncio.sleep(0)
        async with self._changed:
            taken: list[pb.SendRequest] = []
            messages = 0
            while self._waiting and (not taken or messages + len(self._waiting[0][0].messages) <= max_messages):
                request, size = self._waiting.popleft()
                self._bytes -= size
                taken.append(request)
                messages += len(request.messages)
            self._changed.notify_all()
        if not taken and self._failure is not None:
            raise self._failure
        return taken
