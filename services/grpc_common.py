"""What every servicer shares: turning MeshErrors into statuses, limiting the damage of an unexpected
exception, and the server interceptors of a mesh (authentication among them: services/auth_policy.py)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging

import grpc

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.status import own_cancel, to_grpc
from services.auth_policy import AuthInterceptor
from services.directory import Directory

log = logging.getLogger(__name__)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    if not isinstance(exc, errors.MeshError):
        log.exception("%s failed unexpectedly", method)
        exc = errors.Internal(f"{method} failed: {type(exc).__name__}; see the mesh log")
    code, details, trailers = to_grpc(exc)
    await context.abort(code, details, trailers)


def interrupted(exc: BaseException, method: str) -> errors.MeshError | None:
    """What to answer for a CancelledError that is not the cancellation of the handler's own task (the
    client leaving, the deadline, the server stopping) but of something it waited for, cancelled by
    someone else: UNAVAILABLE (STORE_UNAVAILABLE), for the client to try again; None for any other
    exception. grpc sends no status at all for a handler that raises CancelledError: a Subscribe stream
    whose delivery met such a wait stayed open, silent, and its client waited for ever."""
    if not isinstance(exc, asyncio.CancelledError) or own_cancel(exc):
        return None
    log.error("%s: a wait inside it was cancelled under it; answered UNAVAILABLE", method, exc_info=exc)
    return errors.Unavailable(f"{method} was interrupted inside the mesh (see the mesh log); try again",
                              reason=Reason.STORE_UNAVAILABLE)


async def _abort_interrupted(context: grpc.aio.ServicerContext, exc: asyncio.CancelledError, method: str) -> None:
    """Answer a CancelledError someone else caused (interrupted); raise the handler's own on."""
    answer = interrupted(exc, method)
    if answer is None:
        raise exc
    await _abort(context, answer, method)


def unary(method):
    """Wrap a unary servicer method: MeshError -> gRPC status."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, method.__qualname__)
        except asyncio.CancelledError as exc:
            await _abort_interrupted(context, exc, method.__qualname__)

    return wrapper


def streaming(method):
    """Wrap a server-streaming servicer method (an async generator)."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            async for response in method(self, request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, method.__qualname__)
        except asyncio.CancelledError as exc:
            await _abort_interrupted(context, exc, method.__qualname__)

    return wrapper


class _Undecodable:
    """What the safe deserializer hands on in place of a request whose bytes are not its message (or are
    more than the server takes: error is None, limit is set)."""

    __slots__ = ("type_name", "size", "error", "limit")

    def __init__(self, type_name: str, size: int, error: Exception | None, limit: int = 0):
        self.type_name, self.size, self.error, self.limit = type_name, size, error, limit

    def mesh_error(self) -> errors.MeshError:
        if self.error is None:
            return errors.ResourceExhausted(
                f"the {self.type_name} is {self.size} bytes; this server takes requests of at most {self.limit}"
                " bytes (send fewer or smaller messages per request)", reason=Reason.REQUEST_TOO_LARGE,
                metadata={"size": str(self.size), "limit": str(self.limit)})
        return errors.InvalidArgument(
            f"the request is not a valid {self.type_name} ({self.size} bytes could not be decoded: "
            f"{errors.clip(str(self.error), 120)})", reason=Reason.UNDECODABLE_REQUEST,
            metadata={"message_type": self.type_name})


def _safe_deserializer(deserializer, max_request_bytes: int):
    if deserializer is None:
        return None
    type_name = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    type_name = type_name.full_name if type_name is not None else "request message"

    def deserialize(data: bytes):
        if len(data) > max_request_bytes:
            return _Undecodable(type_name, len(data), None, max_request_bytes)
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or anything a parser raises on garbage
            return _Undecodable(type_name, len(data), exc)

    return deserialize


async def _checked_stream(requests):
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise request.mesh_error()
        yield request


def _call_is_over(exc: Exception) -> bool:
    """grpc's own machinery failed (a write or an abort on a call that already ended: the client left or
    the server is stopping): no status can be sent any more."""
    return type(exc).__module__.startswith("grpc._cython")


async def _refuse(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    """End the call with the status of exc; anything but a MeshError is a bug: logged, INTERNAL."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if _call_is_over(exc):
        log.info("%s ended before its status could be sent (%s)", method, type(exc).__name__)
        return
    try:
        await _abort(context, exc, method)
    except grpc.aio.AbortError:
        raise
    except Exception as failed:
        if not _call_is_over(failed):
            raise
        log.info("%s ended before its status could be sent (%s)", method, type(failed).__name__)


def _guard_unary_request(behavior, method: str):
    async def guarded(request, context):
        try:
            if isinstance(request, _Undecodable):
                raise request.mesh_error()
            return await behavior(request, context)
        except Exception as exc:
            await _refuse(context, exc, method)

    return guarded


def _guard_unary_request_stream(behavior, method: str):
    if not inspect.isasyncgenfunction(behavior):  # a handler that writes with context.write
        return _guard_unary_request(behavior, method)

    async def guarded(request, context):
        try:
            if isinstance(request, _Undecodable):
                raise request.mesh_error()
            async for response in behavior(request, context):
                yield response
        except Exception as exc:
            await _refuse(context, exc, method)

    return guarded


def _guard_streaming_request(behavior, method: str):
    if inspect.isasyncgenfunction(behavior):
        async def guarded_stream(request_iterator, context):
            try:
                async for response in behavior(_checked_stream(request_iterator), context):
                    yield response
            except Exception as exc:
                await _refuse(context, exc, method)

        return guarded_stream

    async def guarded(request_iterator, context):  # unary response, or one that writes with context.write
        try:
            return await behavior(_checked_stream(request_iterator), context)
        except Exception as exc:
            await _refuse(context, exc, method)

    return guarded


def receive_limit(max_request_bytes: int) -> int:
    """gRPC's own receive limit for a server whose requests may be max_request_bytes: twice that, so that a
    request somewhat over the limit reaches ErrorBoundaryInterceptor and is refused with ErrorInfo; beyond
    it gRPC refuses by itself (RESOURCE_EXHAUSTED without ErrorInfo)."""
    return 2 * max_request_bytes


class ErrorBoundaryInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC of a server ends in a documented status: request bytes that are not the method's message
    are refused with INVALID_ARGUMENT and the reason UNDECODABLE_REQUEST (grpc's own handling answers
    UNKNOWN with a Python traceback text), a request over max_request_bytes is RESOURCE_EXHAUSTED with the
    reason REQUEST_TOO_LARGE (give gRPC's own receive limit some room above it: see receive_limit), a
    MeshError that escapes a handler (or an interceptor inside this one) becomes its status with ErrorInfo,
    and any other exception is logged and answered INTERNAL with ErrorInfo, never UNKNOWN. A streaming RPC
    gets the refusal when it reaches the undecodable message; what came before it was handled."""

    def __init__(self, max_request_bytes: int):
        self.max_request_bytes = max_request_bytes

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        safe = _safe_deserializer(handler.request_deserializer, self.max_request_bytes)
        if handler.unary_unary is not None:
            return handler._replace(request_deserializer=safe,
                                    unary_unary=_guard_unary_request(handler.unary_unary, method))
        if handler.unary_stream is not None:
            return handler._replace(request_deserializer=safe,
                                    unary_stream=_guard_unary_request_stream(handler.unary_stream, method))
        if handler.stream_unary is not None:
            return handler._replace(request_deserializer=safe,
                                    stream_unary=_guard_streaming_request(handler.stream_unary, method))
        return handler._replace(request_deserializer=safe,
                                stream_stream=_guard_streaming_request(handler.stream_stream, method))


def mesh_interceptors(max_request_bytes: int, directory: Directory, *,
                      bind: bool = False) -> list[grpc.aio.ServerInterceptor]:
    """The server interceptors of a mesh process, outermost first: the error boundary, so that a refusal of
    the authentication inside it (and an undecodable request, checked before anyone is authenticated)
    carries ErrorInfo; then authentication by the policy of services/auth_policy.py."""
    return [ErrorBoundaryInterceptor(max_request_bytes), AuthInterceptor(directory, bind=bind)]
