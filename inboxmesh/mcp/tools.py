"""The MCP tools an MCP client gets: what each is (name, description, input schema) and what a call does
as the session's agent. Every result is one JSON text; a refusal is a result with `isError` whose JSON
names the mesh's reason (`UNKNOWN_TARGET`, `INBOX_FULL`, `NAME_NOT_FOUND`, ...) and says what to do.

Which RPCs each tool uses is the table in docs/interop.md, "MCP".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import mcp_types as types

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.mcp.session import AgentSession

log = logging.getLogger(__name__)

MAX_TAKE = 100
MAX_WAIT_S = 30.0
_SENT = (inbox_pb2.RECEIPT_STATUS_ACCEPTED, inbox_pb2.RECEIPT_STATUS_DUPLICATE, inbox_pb2.RECEIPT_STATUS_OUTBOXED)
"""Receipts that are not refusals: stored, stored before (a retry), kept in the outbox for an IOA node."""


def _schema(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


TOOLS = [
    types.Tool(
        name="whoami",
        description="Your agent in the mesh: id, name, parent and the inbox resource.",
        input_schema=_schema({}),
        annotations=types.ToolAnnotations(read_only_hint=True),
    ),
    types.Tool(
        name="list_agents",
        description="The open agents of your tree (parent, siblings, children): names and ids.",
        input_schema=_schema({}),
        annotations=types.ToolAnnotations(read_only_hint=True),
    ),
    types.Tool(
        name="send_message",
        description=("Send a text message to another agent (its id, or its name in your tree). Returns the mesh's"
                     " receipt. To retry after an error, send again with the same message_id: a copy already"
                     " stored comes back DUPLICATE, never twice."),
        input_schema=_schema({
            "to": {"type": "string", "description": "agent id (agt_...) or a name unique in your tree"},
            "text": {"type": "string"},
            "message_id": {"type": "string", "description": "your id for this message (default: a new one)"},
        }, ("to", "text")),
        annotations=types.ToolAnnotations(idempotent_hint=True, destructive_hint=False),
    ),
    types.Tool(
        name="reply",
        description="Answer a message take_messages gave you; it goes to its sender, marked as a reply to it.",
        input_schema=_schema({
            "message_id": {"type": "string", "description": "the message you answer"},
            "text": {"type": "string"},
            "reply_id": {"type": "string", "description": "your id for the reply, for a retry (default: a new one)"},
        }, ("message_id", "text")),
        annotations=types.ToolAnnotations(idempotent_hint=True, destructive_hint=False),
    ),
    types.Tool(
        name="take_messages",
        description=(f"Take the next messages from your inbox (oldest first, at most max), waiting up to wait_s"
                     f" seconds (0 to {MAX_WAIT_S:g}) for one to arrive. Taking is consuming: a message returned"
                     " here is not returned again. A call interrupted before it returns gives its messages back."),
        input_schema=_schema({
            "max": {"type": "integer", "minimum": 1, "maximum": MAX_TAKE, "default": 10},
            "wait_s": {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S, "default": 0},
        }),
        annotations=types.ToolAnnotations(destructive_hint=True),
    ),
]
TOOL_NAMES = {tool.name for tool in TOOLS}


def result(value: Any, *, error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=json.dumps(value, ensure_ascii=False))],
                                is_error=error)


def refusal(exc: errors.MeshError, **extra: Any) -> types.CallToolResult:
    """A MeshError as the tool's error: its reason, its text, what it is about."""
    body: dict[str, Any] = {"error": str(exc.reason), "message": exc.message}
    if exc.metadata:
        body["about"] = exc.metadata
    return result({**body, **extra}, error=True)


# -- arguments -----------------------------------------------------------------------------------
def _text(args: Mapping[str, Any], name: str, *, required: bool = True) -> str | None:
    value = args.get(name)
    if value is None and not required:
        return None
    if value is None:
        raise errors.InvalidArgument(f"{name} is required", reason=Reason.MISSING_FIELD, metadata={"field": name})
    if not isinstance(value, str):
        raise errors.InvalidArgument(f"{name} must be a string, not {type(value).__name__}", reason=Reason.WRONG_TYPE,
                                     metadata={"field": name})
    if required and name != "text" and not value.strip():
        raise errors.InvalidArgument(f"{name} must not be empty", reason=Reason.MISSING_FIELD, metadata={"field": name})
    return value


def _number(args: Mapping[str, Any], name: str, default: float, low: float, high: float, *,
            integer: bool = False) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not float(value).is_integer()):
        kind = "an integer" if integer else "a number"
        raise errors.InvalidArgument(f"{name} must be {kind} from {low:g} to {high:g}", reason=Reason.WRONG_TYPE,
                                     metadata={"field": name})
    if not low <= value <= high:
        raise errors.InvalidArgument(f"{name} must be from {low:g} to {high:g}, not {value:g}", reason=Reason.BAD_VALUE,
                                     metadata={"field": name})
    return value


def _unknown_arguments(name: str, args: Mapping[str, Any]) -> None:
    tool = next(t for t in TOOLS if t.name == name)
    unknown = sorted(set(args) - set(tool.input_schema["properties"]))
    if unknown:
        known = ", ".join(tool.input_schema["properties"]) or "none"
        raise errors.InvalidArgument(f"{name} has no argument {unknown[0]!r} (its arguments: {known})",
                                     reason=Reason.UNKNOWN_KEY, metadata={"field": unknown[0]})


# -- the tools -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """What a tool knows of the call besides its arguments."""

    abandoned: Callable[[], Awaitable[bool]] | None = None
    """Whether the caller is gone (HTTP: its request's connection closed); None when it cannot tell."""


def _receipt(receipt: inbox_pb2.Receipt) -> dict[str, Any]:
    body: dict[str, Any] = {"status": inbox_pb2.ReceiptStatus.Name(receipt.status).removeprefix("RECEIPT_STATUS_"),
                            "message_id": receipt.message_id, "to": receipt.recipient, "sequence": receipt.sequence}
    if receipt.detail:
        body["detail"] = receipt.detail
    return body


def _sent(receipt: inbox_pb2.Receipt) -> types.CallToolResult:
    """A receipt as the tool's result: an error when the mesh refused the message (nothing was stored)."""
    body = _receipt(receipt)
    if receipt.status in _SENT:
        return result(body)
    return result({"error": body["status"], "message": f"not sent: {body['status']}"
                   + (f" ({receipt.detail})" if receipt.detail else ""), "receipt": body}, error=True)


async def _whoami(session: AgentSession, args: Mapping[str, Any], call: Call) -> types.CallToolResult:
    info = session.agent.info
    return result({"agent_id": session.agent_id, "name": info.name, "parent_id": info.parent_id,
                   "scope_id": info.scope_id, "inbox": session.uri})


async def _list_agents(session: AgentSession, args: Mapping[str, Any], call: Call) -> types.CallToolResult:
    agents = await session.agents()
    return result({"agents": [{"agent_id": a.agent_id, "name": a.name, "parent_id": a.parent_id,
                               **({"you": True} if a.agent_id == session.agent_id else {})} for a in agents]})


async def _send_message(session: AgentSession, args: Mapping[str, Any], call: Call) -> types.CallToolResult:
    to, text = _text(args, "to"), _text(args, "text")
    assert to is not None and text is not None
    return _sent(await session.send(to, text, message_id=_text(args, "message_id", required=False)))


async def _reply(session: AgentSession, args: Mapping[str, Any], call: Call) -> types.CallToolResult:
    message_id, text = _text(args, "message_id"), _text(args, "text")
    assert message_id is not None and text is not None
    return _sent(await session.reply(message_id, text, reply_id=_text(args, "reply_id", required=False)))


async def _take_messages(session: AgentSession, args: Mapping[str, Any], call: Call) -> types.CallToolResult:
    count = int(_number(args, "max", 10, 1, MAX_TAKE, integer=True))
    wait_s = _number(args, "wait_s", 0, 0, MAX_WAIT_S)
    turn, messages = await session.take(count, wait_s, call.abandoned)
    return result({"turn": turn, "messages": [await _message(session, m) for m in messages]})


async def _message(session: AgentSession, message: env_pb.Envelope) -> dict[str, Any]:
    body: dict[str, Any] = {"message_id": message.message_id, "from": message.sender,
                            "from_name": await session.name_of(message.sender),
                            "kind": env_pb.MessageKind.Name(message.kind).removeprefix("MESSAGE_KIND_").lower(),
                            "text": message.content.text}
    if message.in_reply_to:
        body["in_reply_to"] = message.in_reply_to
    if message.content.data:
        body["data"] = {"media_type": message.content.media_type, "bytes": len(message.content.data)}
    if message.headers:
        body["headers"] = dict(message.headers)
    return body


_CALLS: dict[str, Callable[[AgentSession, Mapping[str, Any], Call], Awaitable[types.CallToolResult]]] = {
    "whoami": _whoami,
    "list_agents": _list_agents,
    "send_message": _send_message,
    "reply": _reply,
    "take_messages": _take_messages,
}


async def call(session: AgentSession, name: str, arguments: Mapping[str, Any] | None,
               abandoned: Callable[[], Awaitable[bool]] | None = None) -> types.CallToolResult:
    """Run tool `name` (one of TOOL_NAMES) as the session's agent; `abandoned` says whether the caller is
    gone (AgentSession.take). A refusal, of the arguments or by the mesh, is an error result naming its
    reason; an unexpected failure is logged here and answered as INTERNAL, never as a traceback."""
    args = arguments or {}
    try:
        _unknown_arguments(name, args)
        return await _CALLS[name](session, args, Call(abandoned))
    except errors.MeshError as exc:
        return refusal(exc)
    except Exception:
        log.exception("MCP tool %s of %s failed", name, session.agent_id)
        return result({"error": "INTERNAL", "message": f"the MCP server failed running {name}; its log says why"},
                      error=True)
