"""What every servicer shares: turning MeshErrors into statuses, finding the
caller, and limiting the damage of an unexpected exception."""

from __future__ import annotations

import functools
import logging

import grpc

from services import auth, errors
from services.directory import Caller, Directory
from services.grpc_status import to_grpc

log = logging.getLogger(__name__)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    if not isinstance(exc, errors.MeshError):
        log.exception("%s failed unexpectedly", method)
        exc = errors.Internal(f"{method} failed: {type(exc).__name__}; see the mesh log")
    code, details, trailers = to_grpc(exc)
    await context.abort(code, details, trailers)


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

    return wrapper


def bearer(context: grpc.aio.ServicerContext) -> str | None:
    return auth.bearer_from_metadata(context.invocation_metadata())


async def caller_of(context: grpc.aio.ServicerContext, directory: Directory) -> Caller:
    caller = await directory.authenticate(bearer(context))
    assert caller is not None
    return caller
