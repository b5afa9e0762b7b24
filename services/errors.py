"""One exception hierarchy for the mesh. Each error names what was wrong and
carries a machine-readable reason; services.grpc_status maps it to a gRPC
status with google.rpc.ErrorInfo, and the client maps it back."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 400
"""An error's text is cut to this many UTF-8 bytes on the wire (a caller's input is never echoed whole)."""
MAX_METADATA_ENTRIES = 16
MAX_METADATA_KEY_BYTES = 64
MAX_METADATA_VALUE_BYTES = 128
"""ErrorInfo.metadata is cut to these bounds: with the text, a refusal's trailing metadata stays far
below gRPC's 8 KiB soft limit whatever the request held."""


def clip(value: str, max_bytes: int = 64) -> str:
    """value cut to at most max_bytes of UTF-8 (at a character boundary), saying how much was left out;
    for naming caller input (ids, names) in an error without echoing all of it."""
    data = value.encode("utf-8", "surrogatepass")
    if len(data) <= max_bytes:
        return value
    marker = f"...(+{len(data)} bytes)"
    head = data[:max(0, max_bytes - len(marker))].decode("utf-8", "ignore")
    return head + marker


def bounded_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """metadata within the ErrorInfo bounds above (extra entries dropped, keys and values clipped)."""
    items = list(metadata.items())[:MAX_METADATA_ENTRIES]
    return {clip(str(k), MAX_METADATA_KEY_BYTES): clip(str(v), MAX_METADATA_VALUE_BYTES) for k, v in items}


class MeshError(Exception):
    """Base of every error the mesh reports to a caller."""

    default_reason = "MESH_ERROR"

    def __init__(self, message: str, *, reason: str | None = None, metadata: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata = dict(metadata or {})


class InvalidArgument(MeshError):
    default_reason = "INVALID_ARGUMENT"


class Unauthenticated(MeshError):
    default_reason = "UNAUTHENTICATED"


class PermissionDenied(MeshError):
    default_reason = "PERMISSION_DENIED"


class NotFound(MeshError):
    default_reason = "NOT_FOUND"


class FailedPrecondition(MeshError):
    default_reason = "FAILED_PRECONDITION"


class ResourceExhausted(MeshError):
    default_reason = "RESOURCE_EXHAUSTED"


class Unavailable(MeshError):
    """The mesh cannot serve the call now (shutting down, store failing);
    nothing from this call was accepted; retrying is safe."""

    default_reason = "UNAVAILABLE"


class DeadlineExceeded(MeshError):
    default_reason = "DEADLINE_EXCEEDED"


class Internal(MeshError):
    default_reason = "INTERNAL"
