"""Requests for the fuzzer (tests/test_fuzz.py), built from the generated
descriptors: the RPCs there are, hypothesis strategies for any request
message (recursively, to a bounded depth), request bytes that are no message
at all, a plausible request and its variants with one field at its limits,
and a one-line form of a message for reports."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

import inboxmesh

MAX_DEPTH = 3
"""Nesting of generated messages; deeper message fields stay unset."""
REPORT_CHARS = 60
"""How much of a string or bytes value a report shows."""


# -- the RPCs --------------------------------------------------------------
@dataclass(frozen=True)
class Rpc:
    method: MethodDescriptor

    @property
    def service(self) -> str:
        return self.method.containing_service.full_name

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.method.name}"

    @property
    def kind(self) -> str:
        return {(False, False): "unary", (False, True): "server-streaming",
                (True, False): "client-streaming", (True, True): "bidi"}[
            (self.method.client_streaming, self.method.server_streaming)]

    def __str__(self) -> str:
        return f"{self.service}.{self.method.name}"


def generated_services() -> list[ServiceDescriptor]:
    """Every service in the generated package (inboxmesh.*_pb2), by name."""
    found: dict[str, ServiceDescriptor] = {}
    for module_info in pkgutil.walk_packages(inboxmesh.__path__, "inboxmesh."):
        if module_info.name.endswith("_pb2"):
            module = importlib.import_module(module_info.name)
            for service in module.DESCRIPTOR.services_by_name.values():
                found[service.full_name] = service
    return [found[name] for name in sorted(found)]


def all_rpcs() -> list[Rpc]:
    return [Rpc(method) for service in generated_services() for method in service.methods]


# -- generated messages ----------------------------------------------------
@dataclass(frozen=True)
class Pool:
    """Values worth trying besides random ones: real ids, credentials and
    addresses, so that generated requests get past the first checks."""

    strings: tuple[str, ...] = ()
    integers: tuple[int, ...] = (0, 1, 2, 3)


_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
UNKNOWN_ENUM_VALUES = (99, -1, 2**31 - 1)


def repeat_to(unit, size: int):
    return (unit * (size // len(unit) + 1))[:size]


def huge_text() -> st.SearchStrategy[str]:
    """10,000 to 100,000 characters (a short random unit repeated: cheap to
    draw, and it shrinks)."""
    return st.builds(repeat_to, st.text(min_size=1, max_size=8), st.integers(10_000, 100_000))


_WORD = "abcdefghijklmnopqrstuvwxyz0123456789-_"


def _typical_scalar(fd: FieldDescriptor, pool: Pool) -> st.SearchStrategy:
    """A value such as a well-behaved client would send."""
    if fd.type == FieldDescriptor.TYPE_STRING:
        words = st.text(_WORD, min_size=1, max_size=16)
        return mostly(st.sampled_from(pool.strings), words) if pool.strings else words
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=16)
    if fd.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if fd.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in fd.enum_type.values])
    if fd.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(0, 1000)
    low, high = _INT_RANGES[fd.type]
    return st.sampled_from([v for v in pool.integers if low <= v <= high] or [0])


def _hostile_scalar(fd: FieldDescriptor, pool: Pool) -> st.SearchStrategy:
    """A value meant to break things: huge, empty, odd characters, unknown
    enum numbers, extreme integers, random bytes."""
    if fd.type == FieldDescriptor.TYPE_STRING:
        # in this order so that shrinking (towards earlier options) can leave a huge string for a short one
        options = [st.just(""), st.text(max_size=40), st.text(_WORD, min_size=120, max_size=300), huge_text()]
        if pool.strings:
            options.insert(2, st.builds(str.__add__, st.sampled_from(pool.strings), st.text(min_size=1, max_size=4)))
        return st.one_of(options)
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64),
                         st.builds(repeat_to, st.binary(min_size=1, max_size=8), st.integers(10_000, 100_000)))
    if fd.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if fd.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from(UNKNOWN_ENUM_VALUES)
    if fd.type == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if fd.type == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    low, high = _INT_RANGES[fd.type]
    edges = sorted({v for v in (low, high, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**53 + 1, 2**63 - 1, 2**63)
                    if low <= v <= high})
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def mostly(typical: st.SearchStrategy, odd: st.SearchStrategy) -> st.SearchStrategy:
    """`typical` about two times in three, else `odd`; shrinks towards typical.
    (Not st.one_of(typical, typical, odd): hypothesis favours branches with
    more to explore, so the odd one would win most draws.)"""

    @st.composite
    def pick(draw):
        return draw(odd) if draw(st.sampled_from((False, False, True))) else draw(typical)

    return pick()


def _is_map(fd: FieldDescriptor) -> bool:
    return fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry


def _many(element: st.SearchStrategy, low: int, high: int) -> st.SearchStrategy[list]:
    """A long list: a few drawn items repeated to `low`..`high` entries."""
    return st.builds(repeat_to, st.lists(element, min_size=1, max_size=4), st.integers(low, high))


def _numbered(items: list, size: int) -> dict:
    """`size` map entries from a few (key, value) pairs, string keys made distinct."""
    return {f"{k}{i}" if isinstance(k, str) else k: v for i, (k, v) in enumerate(repeat_to(items, size))}


class MessageStrategies:
    """Hypothesis strategies for the messages of one pool. Each set field is
    typical two times in three and hostile otherwise, so that one odd value
    usually reaches the code behind the first checks; shrinking goes towards
    unset and typical fields, leaving the hostile one that matters."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self._cache: dict[tuple[str, int, bool], st.SearchStrategy[Message]] = {}

    def of(self, descriptor: Descriptor, depth: int = 0, hostile: bool = True) -> st.SearchStrategy[Message]:
        key = (descriptor.full_name, depth, hostile)
        if key not in self._cache:
            self._cache[key] = st.deferred(lambda: self._message(descriptor, depth, hostile))
        return self._cache[key]

    def _single(self, fd: FieldDescriptor, depth: int, hostile: bool, odd: bool) -> st.SearchStrategy:
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            return self.of(fd.message_type, depth + 1, hostile)
        return _hostile_scalar(fd, self.pool) if odd else _typical_scalar(fd, self.pool)

    def _value(self, fd: FieldDescriptor, depth: int, hostile: bool) -> st.SearchStrategy | None:
        """What to put in the field, or None when it stays unset (too deep)."""
        if _is_map(fd):
            key_fd, value_fd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            if value_fd.type == FieldDescriptor.TYPE_MESSAGE and depth + 1 >= MAX_DEPTH:
                return None
            typical: st.SearchStrategy = st.dictionaries(self._single(key_fd, depth, hostile, False),
                                                         self._single(value_fd, depth, hostile, False), max_size=3)
            if not hostile:
                return typical
            odd = st.one_of(
                st.builds(_numbered, st.lists(st.tuples(self._single(key_fd, depth, False, False),
                                                        self._single(value_fd, depth, False, False)),
                                              min_size=1, max_size=3), st.integers(65, 600)),
                st.dictionaries(self._single(key_fd, depth, True, True), self._single(value_fd, depth, True, True),
                                min_size=1, max_size=4))
            return mostly(typical, odd)
        nested = fd.type == FieldDescriptor.TYPE_MESSAGE
        if nested and depth + 1 >= MAX_DEPTH:
            return None
        if fd.label == FieldDescriptor.LABEL_REPEATED:
            typical = st.lists(self._single(fd, depth, hostile, False), max_size=3)
            if not hostile:
                return typical
            odd = st.one_of(_many(self._single(fd, depth, False, False), 50, 200 if nested else 2_000),
                            st.lists(self._single(fd, depth, True, True), min_size=1, max_size=4))
            return mostly(typical, odd)
        typical = self._single(fd, depth, hostile, False)
        if nested or not hostile:
            return typical
        return mostly(typical, self._single(fd, depth, True, True))

    def _message(self, descriptor: Descriptor, depth: int, hostile: bool) -> st.SearchStrategy[Message]:
        cls = message_factory.GetMessageClass(descriptor)
        plain = [fd for fd in descriptor.fields if fd.containing_oneof is None]
        oneofs = list(descriptor.oneofs)
        values = {fd.name: self._value(fd, depth, hostile) for fd in descriptor.fields}

        @st.composite
        def build(draw) -> Message:
            message = cls()
            for fd in plain:
                if values[fd.name] is not None and draw(st.sampled_from((False, True, True))):
                    set_field(message, fd, draw(values[fd.name]))
            for oneof in oneofs:
                choices = [fd for fd in oneof.fields if values[fd.name] is not None]
                chosen = draw(st.sampled_from([None, *choices])) if choices else None
                if chosen is not None:
                    set_field(message, chosen, draw(values[chosen.name]))
            return message

        return build()


def set_field(message: Message, fd: FieldDescriptor, value) -> None:
    target = getattr(message, fd.name)
    if _is_map(fd):
        for key, item in value.items():
            if isinstance(item, Message):
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif fd.label == FieldDescriptor.LABEL_REPEATED:
        target.extend(value)
    elif fd.type == FieldDescriptor.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(message, fd.name, value)


def raw_bytes() -> st.SearchStrategy[bytes]:
    """Request bytes that are (almost always) not a valid protobuf message:
    random bytes, truncated or oversized lengths, wrong wire types, invalid
    UTF-8 in a string field, field number 0."""
    crafted = st.sampled_from([
        b"\x0a\xff\xff\xff\xff\x0f",  # field 1, length 2^32-1, no bytes
        b"\x0a\x05ab",  # field 1, length 5, 2 bytes
        b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # an 11-byte varint
        b"\x0a\x02\xff\xfe",  # field 1 as invalid UTF-8
        b"\x00\x00",  # field number 0
        b"\x0b\x0c",  # a group
        b"\x0f",  # wire type 7
        b"\x12\x03\x0a\x01\xc3",  # a nested message cut in a UTF-8 sequence
    ])
    return st.one_of(crafted, st.binary(min_size=1, max_size=256),
                     st.builds(bytes.__add__, crafted, st.binary(max_size=32)))


# -- one field at its limits -------------------------------------------------
EXTREME_INTEGERS = {
    FieldDescriptor.TYPE_UINT64: (2**63, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (2**63, 2**64 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_UINT32: (2**32 - 1,),
    FieldDescriptor.TYPE_FIXED32: (2**32 - 1,), FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
}
HUGE = 100_000
"""Characters of a huge string, bytes of a huge bytes field."""
MANY = 1_001
"""Items of a repeated scalar field: one more than the mesh's batch and page bounds."""


def _extremes(fd: FieldDescriptor) -> tuple:
    """The values of one field worth a request each."""
    if fd.type == FieldDescriptor.TYPE_STRING:
        return "", "x" * HUGE, "\x80\x00\u2028é"  # empty, huge, not ASCII and control characters
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return (b"\xff" * HUGE,)
    if fd.type == FieldDescriptor.TYPE_ENUM:
        return UNKNOWN_ENUM_VALUES[:2]
    if fd.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return float("nan"), float("inf")
    return EXTREME_INTEGERS.get(fd.type, ())


def filled(descriptor: Descriptor, value_of: Callable[[FieldDescriptor], str], depth: int = 0) -> Message:
    """A plausible request: every string field gets value_of(field), every
    enum its last value (a real one, where the first is UNSPECIFIED), every
    singular message field (and a oneof's first member) is filled the same
    way to MAX_DEPTH; numbers, bools and maps stay unset."""
    message = message_factory.GetMessageClass(descriptor)()
    for fd in descriptor.fields:
        if fd.containing_oneof is not None and fd is not fd.containing_oneof.fields[0]:
            continue
        if fd.type == FieldDescriptor.TYPE_ENUM and fd.label != FieldDescriptor.LABEL_REPEATED:
            setattr(message, fd.name, fd.enum_type.values[-1].number)
        elif fd.type == FieldDescriptor.TYPE_STRING:
            value = value_of(fd)
            if fd.label != FieldDescriptor.LABEL_REPEATED:
                setattr(message, fd.name, value)
            elif value:
                getattr(message, fd.name).append(value)
        elif fd.type == FieldDescriptor.TYPE_MESSAGE and not _is_map(fd) and depth + 1 < MAX_DEPTH \
                and fd.label != FieldDescriptor.LABEL_REPEATED:
            getattr(message, fd.name).CopyFrom(filled(fd.message_type, value_of, depth + 1))
    return message


def at_limits(base: Message, value_of: Callable[[FieldDescriptor], str],
              depth: int = 0) -> list[tuple[str, Message]]:
    """(field path, request) pairs: `base` with one field changed to each of
    its extremes (empty, huge, odd characters, unknown enum numbers, integers
    at the ends of their range, far too many items or entries), nested
    fields to MAX_DEPTH (inside a `filled` message when base has none, or for
    one item of a repeated field), each oneof member in turn."""
    out: list[tuple[str, Message]] = []

    def variant(name: str) -> Message:
        """A copy of base listed under `name`, for the caller to change."""
        message = type(base)()
        message.CopyFrom(base)
        out.append((name, message))
        return message

    for fd in base.DESCRIPTOR.fields:
        repeated = fd.label == FieldDescriptor.LABEL_REPEATED
        if _is_map(fd):
            key_fd, value_fd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            if value_fd.type == FieldDescriptor.TYPE_MESSAGE or key_fd.type != FieldDescriptor.TYPE_STRING:
                continue
            sample = "x" if value_fd.type == FieldDescriptor.TYPE_STRING else 0
            getattr(variant(f"{fd.name}{{600 entries}}"), fd.name).update({f"k{i}": sample for i in range(600)})
            for key in _extremes(key_fd):
                getattr(variant(f"{fd.name}{{{short(key)}: ...}}"), fd.name).update({key: sample})
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            if depth + 1 >= MAX_DEPTH:
                continue
            inner = getattr(base, fd.name) if not repeated and base.HasField(fd.name) else \
                filled(fd.message_type, value_of, depth + 1)
            for path, sub in at_limits(inner, value_of, depth + 1):
                if repeated:
                    getattr(variant(f"{fd.name}[0].{path}"), fd.name).add().CopyFrom(sub)
                else:
                    getattr(variant(f"{fd.name}.{path}"), fd.name).CopyFrom(sub)
            if repeated:
                getattr(variant(f"{fd.name}[200 items]"), fd.name).extend([inner] * 200)
        else:
            for value in _extremes(fd):
                if repeated:
                    getattr(variant(f"{fd.name}[{short(value)}]"), fd.name).append(value)
                else:
                    setattr(variant(f"{fd.name}={short(value)}"), fd.name, value)
            if repeated and fd.type != FieldDescriptor.TYPE_BOOL:
                many = {FieldDescriptor.TYPE_STRING: "x", FieldDescriptor.TYPE_BYTES: b"x"}.get(fd.type, 1)
                getattr(variant(f"{fd.name}[{MANY} items]"), fd.name).extend([many] * MANY)
    return out


def replace_text(message: Message, old: str, new: Callable[[], str]) -> None:
    """Every string field (at any depth) that is `old` becomes new()."""
    for fd, value in message.ListFields():
        if fd.type == FieldDescriptor.TYPE_STRING:
            if fd.label == FieldDescriptor.LABEL_REPEATED:
                value[:] = [new() if v == old else v for v in value]
            elif value == old:
                setattr(message, fd.name, new())
        elif fd.type == FieldDescriptor.TYPE_MESSAGE and not _is_map(fd):
            for item in value if fd.label == FieldDescriptor.LABEL_REPEATED else [value]:
                replace_text(item, old, new)


# -- reports ---------------------------------------------------------------
def short(value) -> str:
    if isinstance(value, (str, bytes)) and len(value) > REPORT_CHARS:
        return f"{value[:REPORT_CHARS]!r}...({len(value)} {'chars' if isinstance(value, str) else 'bytes'})"
    return repr(value)


def show(message: Message) -> str:
    """A message on one line with long values cut: `Type{field: value, ...}`."""
    parts = []
    for fd, value in message.ListFields():
        if _is_map(fd):
            items = list(value.items())
            shown = ", ".join(f"{short(k)}: {show(v) if isinstance(v, Message) else short(v)}"
                              for k, v in items[:4])
            parts.append(f"{fd.name}: {{{shown}{f', ...({len(items)} entries)' if len(items) > 4 else ''}}}")
        elif fd.label == FieldDescriptor.LABEL_REPEATED:
            shown = ", ".join(show(v) if isinstance(v, Message) else _show_scalar(fd, v) for v in value[:4])
            parts.append(f"{fd.name}: [{shown}{f', ...({len(value)} items)' if len(value) > 4 else ''}]")
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            parts.append(f"{fd.name}: {show(value)}")
        else:
            parts.append(f"{fd.name}: {_show_scalar(fd, value)}")
    return f"{message.DESCRIPTOR.name}{{{', '.join(parts)}}}"


def _show_scalar(fd: FieldDescriptor, value) -> str:
    if fd.type == FieldDescriptor.TYPE_ENUM:
        known = fd.enum_type.values_by_number.get(value)
        return known.name if known is not None else f"{value} (unknown)"
    return short(value)


def cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


