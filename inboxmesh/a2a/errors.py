"""What an A2A client gets when the mesh refuses its message, and when the gateway refuses the client.

The A2A specification has no error for a busy, a closed or an unknown agent, for a missing credential or
for a server at its limit of streams, so the gateway adds five (docs/interop.md "Errors"), each with its
own JSON-RPC code in the server range, gRPC status and HTTP status, and a reason in the
`google.rpc.ErrorInfo` (domain a2a-protocol.org) that every binding carries. `register()` enters them in
the SDK's error tables, which map an error class to those codes; without it an unknown class is answered
as an internal error (JSON-RPC) or UNKNOWN (gRPC)."""

from __future__ import annotations

import grpc
from a2a.server.jsonrpc_models import JSONRPCError
from a2a.server.request_handlers import grpc_handler, response_helpers
from a2a.utils import errors as sdk_errors
from a2a.utils.errors import A2AError, ErrorMapping, InvalidParamsError, InvalidRequestError

from inboxmesh.inbox.v1 import inbox_pb2 as inbox_pb


class InboxFullError(A2AError):
    """The agent's inbox is at capacity: nothing was stored; retry later with the same messageId."""

    message = "The agent's inbox is full"


class AgentClosedError(A2AError):
    """The exposed agent was closed: it takes no more messages."""

    message = "The agent is closed"


class AgentNotFoundError(A2AError):
    """The exposed agent does not exist in the mesh (any more)."""

    message = "No such agent"


class AuthenticationRequiredError(A2AError):
    """No bearer token, or one the gateway does not know: nothing was read or stored."""

    message = "Authentication required"


class TooManyStreamsError(A2AError):
    """The gateway serves its most streams at once: retry later (or poll with GetTask)."""

    message = "Too many streams"


ERRORS: dict[type[A2AError], tuple[int, grpc.StatusCode, int, str]] = {
    # class: (JSON-RPC code, gRPC status, HTTP status, reason)
    InboxFullError: (-32010, grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "INBOX_FULL"),
    AgentClosedError: (-32011, grpc.StatusCode.FAILED_PRECONDITION, 410, "AGENT_CLOSED"),
    AgentNotFoundError: (-32012, grpc.StatusCode.NOT_FOUND, 404, "UNKNOWN_TARGET"),
    AuthenticationRequiredError: (-32013, grpc.StatusCode.UNAUTHENTICATED, 401, "UNAUTHENTICATED"),
    TooManyStreamsError: (-32014, grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "TOO_MANY_STREAMS"),
}


def register() -> None:
    """Enter ERRORS in the SDK's tables (idempotent)."""
    for cls, (code, status, http, reason) in ERRORS.items():
        sdk_errors.JSON_RPC_ERROR_CODE_MAP[cls] = code
        sdk_errors.A2A_ERROR_MAPPING[cls] = ErrorMapping(http, status.name, reason)
        sdk_errors.A2A_ERROR_REASONS[cls] = reason
        sdk_errors.A2A_REASON_TO_ERROR[reason] = cls
        response_helpers.EXCEPTION_MAP[cls] = JSONRPCError
        grpc_handler._ERROR_CODE_MAP[cls] = status  # noqa: SLF001 (the handler's own table; no public hook)


def refusal(receipt: inbox_pb.Receipt, agent: str) -> A2AError:
    """The A2A error of a receipt that is not ACCEPTED or DUPLICATE."""
    detail = receipt.detail[:300]
    status = receipt.status
    if status == inbox_pb.RECEIPT_STATUS_INBOX_FULL:
        return InboxFullError(f"agent {agent}'s inbox is full ({detail}); nothing was stored: retry later with the"
                              " same messageId", data={"reason": "INBOX_FULL"})
    if status == inbox_pb.RECEIPT_STATUS_TARGET_CLOSED:
        return AgentClosedError(f"agent {agent} is closed ({detail}); nothing was stored",
                                data={"reason": "TARGET_CLOSED"})
    if status == inbox_pb.RECEIPT_STATUS_UNKNOWN_TARGET:
        return AgentNotFoundError(f"agent {agent} does not exist in the mesh ({detail})",
                                  data={"reason": "UNKNOWN_TARGET"})
    if status == inbox_pb.RECEIPT_STATUS_NOT_PERMITTED:
        return InvalidRequestError(f"the mesh refused the message: {detail}", data={"reason": "NOT_PERMITTED"})
    return InvalidParamsError(f"the mesh refused the message: {inbox_pb.ReceiptStatus.Name(status)} {detail}")
