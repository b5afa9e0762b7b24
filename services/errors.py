"""One exception hierarchy for the mesh. Each error names what was wrong and
carries a machine-readable reason; services.grpc_status maps it to a gRPC
status with google.rpc.ErrorInfo, and the client maps it back."""

from __future__ import annotations


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
