"""How an envelope travels as an IOA message, both ways (docs/ioa.md):
the envelope's fields ride in `inboxmesh-*` headers beside the W3C
`traceparent`; the trail's header is services.ioa.trail's. A received
message whose headers are over their bounds or not in their format is
refused (Refused, TrailRefused), never cut or guessed."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context

from inboxmesh.client import errors
from inboxmesh.client.tracing import context_of, inject
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.ioa.v1 import network_pb2 as net
from services.ioa import trail as trails
from services.store.base import IOA_PREFIX

H = "inboxmesh-"
"""Prefix of the headers relays write; a sender's own headers with it are dropped."""
assert trails.HEADER == H + "trail"


NOTICE_HEADERS = (H + "notice", H + "reason", H + "outcome")
"""What a notice the mesh made carries (services.store.notices): they cross with it."""
KEPT_HEADERS = (H + "relay", *NOTICE_HEADERS)
"""Relay headers the stored envelope of a received message keeps: that an inboxmesh relay sent it (so a
dead-letter notice can cross back), and a crossing notice's own."""


_KINDS = frozenset(env_pb.MessageKind.keys())
_KIND_NAME = {value: env_pb.MessageKind.Name(value) for value in env_pb.MessageKind.values()}


def address_of(node: str, agent: str) -> str:
    return f"{IOA_PREFIX}{node}/{agent}"


class Refused(ValueError):
    """A received message this relay does not store (a header over its bounds); answered NOT_PERMITTED.
    The text names the header, never its value."""


def to_message(env: env_pb.Envelope, *, node: str, relay_id: str, sender_id: str, ioa_id: str,
               to: tuple[str, str], attempt: str, trail: str, span: trace.Span) -> net.IoaMessage:
    """The IOA message for local agent `sender_id`'s envelope, published by relay `relay_id` of `node`
    (`trail`: the header value, services.ioa.trail.encode)."""
    headers = {k: v for k, v in env.headers.items() if not k.startswith(H)}  # the relay's own, never a sender's
    if env.origin.kind == env_pb.ORIGIN_KIND_MESH:  # a notice the mesh made (only the mesh makes these)
        headers.update({k: v for k, v in env.headers.items() if k in NOTICE_HEADERS})
    headers.update({
        H + "relay": f"{node}/{relay_id}",
        H + "attempt": attempt,
        H + "kind": _KIND_NAME.get(env.kind or env_pb.MESSAGE_KIND_TEXT) or env_pb.MessageKind.Name(env.kind),
        H + "message-id": env.message_id,
        H + "hops": str(env.hop_count + 1),
        trails.HEADER: trail,
    })
    for field in ("in_reply_to", "conversation_id"):
        if getattr(env, field):
            headers[H + field.replace("_", "-")] = getattr(env, field)
    if env.expires_at_us:
        headers[H + "expires-at-us"] = str(env.expires_at_us)
    carrier = env_pb.Envelope()
    inject(carrier, trace.set_span_in_context(span))
    if carrier.trace.traceparent:
        headers["traceparent"] = carrier.trace.traceparent
    return from_address(net.IoaMessage(
        ioa_message_id=ioa_id, direct=net.Address(node=to[0], agent=to[1]), text=env.content.text,
        data=env.content.data, media_type=env.content.media_type, headers=headers), node, sender_id)


def from_address(message: net.IoaMessage, node: str, agent: str) -> net.IoaMessage:
    """The message with its `from` address set (a Python keyword, so not a constructor argument)."""
    getattr(message, "from").CopyFrom(net.Address(node=node, agent=agent))
    return message


def to_envelope(message: net.IoaMessage, *, node: str, max_hops: int, span: trace.Span) -> env_pb.Envelope:
    """The envelope node `node` stores for a received message: sender `ioa:<from>`, origin IOA, the
    IOA id as its message id, the trail in local form; traced as a child of `span`."""
    h = dict(message.headers)  # one copy out of the protobuf map: read a dozen times below
    sender = getattr(message, "from")
    if H + "relay" in h and h[H + "relay"].partition("/")[0] != sender.node:
        raise Refused(f"the {H}relay header names another node than the one the message came from"
                      f" ({errors.clip(sender.node, 128)})")
    kind = h.get(H + "kind", "MESSAGE_KIND_TEXT")
    env = env_pb.Envelope(
        message_id=message.ioa_message_id,
        sender=address_of(sender.node, sender.agent),
        recipient=message.direct.agent,
        kind=kind if kind in _KINDS else "MESSAGE_KIND_TEXT",
        content=env_pb.Content(text=message.text, data=message.data, media_type=message.media_type),
        in_reply_to=local_id(h.get(H + "in-reply-to", ""), node),
        conversation_id=h.get(H + "conversation-id", ""),
        origin=env_pb.Origin(kind=env_pb.ORIGIN_KIND_IOA, ioa_node=sender.node, ioa_message_id=message.ioa_message_id),
        hop_count=_count_header(h, H + "hops", "1", 1, 2**32 - 1),
        trail=trails.decode(h.get(trails.HEADER), node=node, sender=(sender.node, sender.agent),
                            max_entries=max_hops),
        expires_at_us=_count_header(h, H + "expires-at-us", "0", 0, 2**63 - 1),
        headers={k: v for k, v in h.items() if (not k.startswith(H) and k != "traceparent") or k in KEPT_HEADERS},
        created_at_us=message.sent_at_us,
    )
    inject(env, trace.set_span_in_context(span))
    return env


def local_id(ioa_id: str, node: str) -> str:
    """An IOA id `node` minted for one of its own messages is answered with
    the original message id (correlation is kept both ways)."""
    minted_by, _, rest = ioa_id.partition(":")
    if minted_by == node and rest:
        return rest.partition(":")[2] or ioa_id
    return ioa_id


def _count_header(headers, name: str, default: str, low: int, high: int) -> int:
    value = headers.get(name, default) or default
    if len(value) > 20 or not (value.isascii() and value.isdigit()) or not low <= int(value) <= high:
        raise Refused(f"the {name} header is not a number from {low} to {high}")
    return int(value)


def context_of_headers(headers: Mapping[str, str]) -> Context | None:
    if "traceparent" not in headers:
        return None
    return context_of(env_pb.Envelope(trace=env_pb.TraceContext(traceparent=headers["traceparent"])))


def trace_id(span: trace.Span) -> str:
    context = span.get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else ""
