"""One exception hierarchy for the mesh. Each error names what was wrong and
carries a machine-readable reason; inboxmesh.client.status maps it to a gRPC
status with google.rpc.ErrorInfo, and the client maps it back."""

from __future__ import annotations

import enum

MAX_MESSAGE_BYTES = 400
"""An error's text is cut to this many UTF-8 bytes on the wire (a caller's input is never echoed whole)."""
MAX_METADATA_ENTRIES = 16
MAX_METADATA_KEY_BYTES = 64
MAX_METADATA_VALUE_BYTES = 128
"""ErrorInfo.metadata is cut to these bounds: with the text, a refusal's trailing metadata stays far
below gRPC's 8 KiB soft limit whatever the request held."""


class Reason(enum.StrEnum):
    """Every reason the mesh (and the reference IOA network) puts in a refusal's `google.rpc.ErrorInfo`,
    and the three this client raises itself (MESH_UNREACHABLE, STREAM_LOST, NO_ANSWER). What each means, and with
    which status code, is the table "Every refusal" in docs/delivery-contract.md; tests/test_error_table.py
    fails when the code, this enumeration and that table disagree. A StrEnum: a member equals its name as a
    string, so `exc.reason == Reason.AGENT_CLOSED` and `exc.reason == Reason.AGENT_CLOSED` say the same. A reason
    read from the wire that this version does not know stays a plain string."""

    UNDECODABLE_REQUEST = "UNDECODABLE_REQUEST"
    MISSING_FIELD = "MISSING_FIELD"
    FIELD_TOO_LONG = "FIELD_TOO_LONG"
    BAD_CHARACTERS = "BAD_CHARACTERS"
    TOO_MANY_ENTRIES = "TOO_MANY_ENTRIES"
    EMPTY_REQUEST = "EMPTY_REQUEST"
    BATCH_TOO_LARGE = "BATCH_TOO_LARGE"
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
    BAD_KIND = "BAD_KIND"
    BAD_MODE = "BAD_MODE"
    RESERVED_ID = "RESERVED_ID"
    CONFLICTING_FIELDS = "CONFLICTING_FIELDS"
    CAPACITY_TOO_LARGE = "CAPACITY_TOO_LARGE"
    REQUEST_ID_TOO_SHORT = "REQUEST_ID_TOO_SHORT"
    RUN_WITHOUT_PARENT = "RUN_WITHOUT_PARENT"
    NOT_A_SCOPE = "NOT_A_SCOPE"
    BAD_PAGE_TOKEN = "BAD_PAGE_TOKEN"
    NOT_A_RUNTIME_EVENT = "NOT_A_RUNTIME_EVENT"
    SUBSCRIBE_FIRST = "SUBSCRIBE_FIRST"
    ACK_EXPECTED = "ACK_EXPECTED"
    BAD_IOA_ADDRESS = "BAD_IOA_ADDRESS"
    BAD_ROUTE_INPUT = "BAD_ROUTE_INPUT"
    BAD_PEER = "BAD_PEER"
    BAD_SESSION_KEY = "BAD_SESSION_KEY"
    UNKNOWN_FAMILY = "UNKNOWN_FAMILY"
    BAD_GATEWAY_SENDER = "BAD_GATEWAY_SENDER"
    BAD_NODE_ID = "BAD_NODE_ID"
    NODE_NOT_CERTIFIED = "NODE_NOT_CERTIFIED"
    FAULTS_OFF = "FAULTS_OFF"
    BAD_CONFIG = "BAD_CONFIG"
    BAD_CONFIG_FILE = "BAD_CONFIG_FILE"
    UNKNOWN_KEY = "UNKNOWN_KEY"
    UNKNOWN_TOOL = "UNKNOWN_TOOL"
    UNKNOWN_PROVIDER = "UNKNOWN_PROVIDER"
    WRONG_TYPE = "WRONG_TYPE"
    BAD_VALUE = "BAD_VALUE"
    BAD_AGENT_ID = "BAD_AGENT_ID"
    DUPLICATE_AGENT_ID = "DUPLICATE_AGENT_ID"
    MISSING_CREDENTIAL = "MISSING_CREDENTIAL"
    MALFORMED_CREDENTIAL = "MALFORMED_CREDENTIAL"
    BAD_CREDENTIAL = "BAD_CREDENTIAL"
    CREDENTIAL_BOUND = "CREDENTIAL_BOUND"
    SENDER_MISMATCH = "SENDER_MISMATCH"
    SENDER_NOT_PROVEN = "SENDER_NOT_PROVEN"
    AGENT_MISMATCH = "AGENT_MISMATCH"
    ORIGIN_NOT_ALLOWED = "ORIGIN_NOT_ALLOWED"
    OUT_OF_SCOPE = "OUT_OF_SCOPE"
    NOT_PARENT = "NOT_PARENT"
    NOT_ANCESTOR = "NOT_ANCESTOR"
    AGENT_NOT_ALLOWED = "AGENT_NOT_ALLOWED"
    AGENT_CREDENTIAL_REQUIRED = "AGENT_CREDENTIAL_REQUIRED"
    NOT_ADMIN = "NOT_ADMIN"
    NOT_GATEWAY = "NOT_GATEWAY"
    AGENT_NOT_FOUND = "AGENT_NOT_FOUND"
    NAME_NOT_FOUND = "NAME_NOT_FOUND"
    MESSAGE_NOT_FOUND = "MESSAGE_NOT_FOUND"
    RUN_NOT_FOUND = "RUN_NOT_FOUND"
    NODE_NOT_FOUND = "NODE_NOT_FOUND"
    AGENT_CONFIG_NOT_FOUND = "AGENT_CONFIG_NOT_FOUND"
    AGENT_CLOSED = "AGENT_CLOSED"
    STREAM_ENDING = "STREAM_ENDING"
    AMBIGUOUS_NAME = "AMBIGUOUS_NAME"
    REQUEST_ID_REUSED = "REQUEST_ID_REUSED"
    AGENT_EXISTS = "AGENT_EXISTS"
    NO_ROUTING_CONFIG = "NO_ROUTING_CONFIG"
    NO_INGRESS_TOKENS = "NO_INGRESS_TOKENS"
    SCHEMA_MISMATCH = "SCHEMA_MISMATCH"
    REQUEST_TOO_LARGE = "REQUEST_TOO_LARGE"
    SPAWN_DEPTH = "SPAWN_DEPTH"
    TOO_MANY_CHILDREN = "TOO_MANY_CHILDREN"
    STREAM_FULL = "STREAM_FULL"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    STORE_CLOSED = "STORE_CLOSED"
    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
    NATS_DOWN = "NATS_DOWN"
    NATS_NOT_DURABLE = "NATS_NOT_DURABLE"
    CONTENTION = "CONTENTION"
    BIND_FAILED = "BIND_FAILED"
    IOA_DISCONNECTED = "IOA_DISCONNECTED"
    IOA_CONNECTION_LOST = "IOA_CONNECTION_LOST"
    IOA_PUBLISH_STATUS_UNKNOWN_NODE = "IOA_PUBLISH_STATUS_UNKNOWN_NODE"
    IOA_PUBLISH_STATUS_NODE_OFFLINE = "IOA_PUBLISH_STATUS_NODE_OFFLINE"
    IOA_PUBLISH_STATUS_NOT_A_MEMBER = "IOA_PUBLISH_STATUS_NOT_A_MEMBER"
    IOA_PUBLISH_STATUS_INVALID = "IOA_PUBLISH_STATUS_INVALID"
    IOA_SPACE_UNREADABLE = "IOA_SPACE_UNREADABLE"
    IOA_NO_RECEIPT = "IOA_NO_RECEIPT"
    NO_ANSWER = "NO_ANSWER"
    IOA_OUTBOX_FULL = "IOA_OUTBOX_FULL"
    MESH_UNREACHABLE = "MESH_UNREACHABLE"
    STREAM_LOST = "STREAM_LOST"
    INTERNAL = "INTERNAL"


def reason_of(text: str) -> str:
    """A reason read from the wire: the Reason member when this version knows it, else the text itself."""
    return Reason(text) if text in Reason._value2member_map_ else text


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
    default_reason = Reason.INTERNAL
