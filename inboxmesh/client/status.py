"""The one table between MeshError classes and gRPC status codes, both ways.

Server side: `to_grpc` builds the status (with google.rpc.ErrorInfo in the
`grpc-status-details-bin` trailer) that servicers abort with. Client side:
`from_rpc_error` turns a failed call back into the matching MeshError.
"""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]  # ships no type information

from inboxmesh.client import errors

DOMAIN = "inboxmesh"
_DETAILS_KEY = "grpc-status-details-bin"

STATUS_OF: dict[type[errors.MeshError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Internal: grpc.StatusCode.INTERNAL,
}
ERROR_OF: dict[grpc.StatusCode, type[errors.MeshError]] = {code: cls for cls, code in STATUS_OF.items()}


def status_code_of(exc: errors.MeshError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.UNKNOWN


def to_grpc(exc: errors.MeshError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, bytes], ...]]:
    """(code, details, trailing metadata) for aborting a call with exc."""
    code = status_code_of(exc)
    message = errors.clip(exc.message, errors.MAX_MESSAGE_BYTES)
    info = error_details_pb2.ErrorInfo(reason=errors.clip(exc.reason, 63), domain=DOMAIN,
                                       metadata=errors.bounded_metadata(exc.metadata))
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    return code, message, ((_DETAILS_KEY, status.SerializeToString()),)


def error_info(rpc_error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo a mesh server attached to a failed call, if any."""
    trailers = rpc_error.trailing_metadata() if hasattr(rpc_error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == _DETAILS_KEY:
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info
    return None


def from_rpc_error(rpc_error: grpc.RpcError) -> errors.MeshError:
    """The MeshError for a failed call (Unavailable/DeadlineExceeded for
    transport failures that carry no ErrorInfo)."""
    code = rpc_error.code() if hasattr(rpc_error, "code") else grpc.StatusCode.UNKNOWN
    message = rpc_error.details() if hasattr(rpc_error, "details") else str(rpc_error)
    cls = ERROR_OF.get(code, errors.MeshError)
    info = error_info(rpc_error)
    if info is None:
        return cls(message or code.name, reason=code.name)
    return cls(message, reason=errors.reason_of(info.reason), metadata=dict(info.metadata))


def from_error_fields(code: int, reason: str, message: str, metadata: dict[str, str]) -> errors.MeshError:
    """The MeshError of a refusal answered inside a response (AckError, RegistrationError): code numbered
    as google.rpc.Code."""
    status = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    return ERROR_OF.get(status, errors.MeshError)(message, reason=errors.reason_of(reason), metadata=metadata)


CALL_ENDED = (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, asyncio.CancelledError)
"""What reading or writing a grpc.aio streaming call raises once the call is over. CancelledError among them: a
call cancelled locally (by another task: a failed write, a stream's end, a stop) raises it in every reader and
writer of the call, not only in a task that was cancelled; `own_cancel` tells the two apart."""


def own_cancel(exc: BaseException) -> bool:
    """Whether exc is the cancellation of the running task itself (to be raised on), not the end of a call
    that someone cancelled."""
    task = asyncio.current_task()
    return isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling() > 0
