"""The fuzzer's calls and checks, for tests/test_fuzz.py: one call path for
every kind of RPC (the requests go as raw bytes, so undecodable bytes take
the same path as generated messages), and the contract every answer must
keep. The requests come from tests.fuzz_messages."""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import Message
from hypothesis import strategies as st

from inboxmesh.client.status import error_info
from tests.fuzz_messages import MessageStrategies, Pool, Rpc, cut, mostly, raw_bytes, repeat_to, short, show

TRAILER_LIMIT = 8 * 1024
"""gRPC clients refuse a response whose metadata is larger (their default
grpc.max_metadata_size)."""
FINE_CODES = (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
"""OK, and the two endings the client itself causes (its deadline, or it
stopped reading a stream that was still open)."""


# -- calling ---------------------------------------------------------------
@dataclass
class Case:
    """One fuzzed call: the RPC, the credential, the requests."""

    rpc: Rpc
    credential: str
    """Which credential: none, garbage, malformed, agent, child, admin, ingress."""
    metadata: tuple[tuple[str, str], ...]
    requests: list[bytes]
    shown: list[str]
    """The requests for a report: messages on one line, raw bytes cut."""

    def __repr__(self) -> str:
        auth = f"{self.credential} {short(self.metadata[0][1])}" if self.metadata else self.credential
        return f"{self.rpc} ({self.rpc.kind}) credential={auth} requests=[{'; '.join(self.shown)}]"

    def _repr_pretty_(self, printer, cycle) -> None:  # how hypothesis prints a failing case
        printer.text(repr(self))


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    trailers: tuple = ()
    responses: int = 0
    client_side: str = ""
    """Set when the status is the client library's, not the server's."""

    def summary(self) -> str:
        """The status and ErrorInfo reason, e.g. `INVALID_ARGUMENT FIELD_TOO_LONG`."""
        if self.client_side:
            return "client-side write race"
        try:
            info = error_info(_Trailers(self.trailers))
        except Exception:
            info = None
        return f"{self.code.name} {info.reason if info is not None else '-'}"


@dataclass(frozen=True)
class Timing:
    unary_timeout_s: float = 30.0
    """Deadline of a unary or client-streaming call (one that passes fails the
    check: the server never answered)."""
    stream_timeout_s: float = 4.0
    """Deadline of a server-streaming or bidi call; a stream still open then is fine."""
    step_s: float = 0.05
    """How long a stream may stay quiet after a request before the next one is
    sent (the answer to a request usually comes at once; a request written
    while the server ends the call loses the server's status to grpc.aio)."""
    idle_s: float = 0.2
    """How long a stream may stay quiet after the last request before it is
    left open."""
    max_responses: int = 20
    """Responses read from one stream before it is left."""


WRITE_RACE = "Internal error from Core"
"""What grpc.aio reports, as a client-side INTERNAL that replaces the
server's status, when a client write races the server ending the call."""


class _Reader:
    """Reads a response stream without ever cancelling a read (grpc.aio
    cancels the whole call when a pending read is cancelled)."""

    def __init__(self, call):
        self.call = call
        self.pending: asyncio.Future | None = None
        self.count = 0
        self.ended = False

    async def drain(self, idle_s: float, limit: int, *, one: bool = False) -> None:
        """Read until the stream is quiet for idle_s, ends, or `limit` responses
        were read (with `one`: until the first response)."""
        start = self.count
        while not self.ended and self.count < limit and not (one and self.count > start):
            if self.pending is None:
                self.pending = asyncio.ensure_future(self.call.read())
            done, _ = await asyncio.wait({self.pending}, timeout=idle_s)
            if not done:
                return
            read, self.pending = self.pending, None
            try:
                response = read.result()
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                self.ended = True
                return
            if response is grpc.aio.EOF:
                self.ended = True
                return
            self.count += 1

    async def leave(self) -> None:
        if not self.call.done():
            self.call.cancel()
        if self.pending is not None:
            await asyncio.wait({self.pending})
            if not self.pending.cancelled():
                self.pending.exception()  # retrieved: the call's status is read from the call


async def _write(call, request: bytes) -> bool:
    """Write one request; False when the call had already ended."""
    try:
        await call.write(request)
        return True
    except (grpc.RpcError, asyncio.InvalidStateError):
        return False


async def _finish(call, responses: int, write_failed: bool) -> Outcome:
    outcome = Outcome(await call.code(), await call.details() or "", tuple(await call.trailing_metadata() or ()),
                      responses)
    if write_failed and outcome.code == grpc.StatusCode.INTERNAL and outcome.details == WRITE_RACE:
        outcome.client_side = "a write raced the end of the call; grpc.aio replaced the server's status"
    return outcome


async def invoke(channel: grpc.aio.Channel, case: Case, timing: Timing, *, careful: bool = False) -> Outcome:
    """Make the call with the requests' bytes as they are (no serializer) and
    return how it ended. Streamed requests go one at a time, each after a
    response to the one before, step_s of quiet, or the end of the call
    (nothing is written to a call that has ended); `careful`: each after
    idle_s of quiet (slower, for a case whose write raced the end)."""
    rpc, metadata = case.rpc, case.metadata or None
    if rpc.kind == "unary":
        call = channel.unary_unary(rpc.path)(case.requests[0], timeout=timing.unary_timeout_s, metadata=metadata)
        try:
            await call
        except grpc.aio.AioRpcError:
            pass
        return await _finish(call, 0, False)
    if rpc.kind == "client-streaming":
        call = channel.stream_unary(rpc.path)(timeout=timing.unary_timeout_s, metadata=metadata)
        answer = asyncio.ensure_future(_answer(call))
        write_failed = False
        for request in case.requests:
            if answer.done() or not await _write(call, request):
                write_failed = not answer.done()
                break
            await asyncio.wait({answer}, timeout=timing.step_s)
        if not answer.done():
            await _done_writing(call)
        await answer
        return await _finish(call, 0, write_failed)
    if rpc.kind == "server-streaming":
        call = channel.unary_stream(rpc.path)(case.requests[0], timeout=timing.stream_timeout_s, metadata=metadata)
        reader = _Reader(call)
        write_failed = False
    else:
        call = channel.stream_stream(rpc.path)(timeout=timing.stream_timeout_s, metadata=metadata)
        reader = _Reader(call)
        write_failed = False
        for request in case.requests:
            if reader.ended:
                break
            if not await _write(call, request):
                write_failed = True
                break
            if careful:
                await reader.drain(timing.idle_s, timing.max_responses)
            else:
                await reader.drain(timing.step_s, timing.max_responses, one=True)
        if not reader.ended and not write_failed:
            await _done_writing(call)
    await reader.drain(timing.idle_s, timing.max_responses)
    await reader.leave()
    return await _finish(call, reader.count, write_failed)


async def _answer(call) -> None:
    try:
        await call
    except grpc.aio.AioRpcError:
        pass


async def _done_writing(call) -> None:
    try:
        await call.done_writing()
    except (grpc.RpcError, asyncio.InvalidStateError):
        pass


# -- checks ----------------------------------------------------------------
class FuzzFailure(AssertionError):
    """A call broke the contract. Subclassed per kind of failure so that
    hypothesis reports (and shrinks) each kind on its own."""


_FAILURE_TYPES: dict[str, type[FuzzFailure]] = {}


def failure_type(signature: str) -> type[FuzzFailure]:
    if signature not in _FAILURE_TYPES:
        name = "Fuzz_" + re.sub(r"\W+", "_", signature)
        _FAILURE_TYPES[signature] = type(name, (FuzzFailure,), {"__module__": __name__})
    return _FAILURE_TYPES[signature]


def trailer_bytes(outcome: Outcome) -> int:
    """Roughly what the trailers weigh on the wire: each entry with its HPACK
    overhead, binary values base64-encoded, grpc-message percent-encoded."""
    total = len("grpc-status") + 2 + 32
    message = outcome.details.encode()
    total += len("grpc-message") + 32 + sum(1 if 0x20 <= b < 0x7F and b != 0x25 else 3 for b in message)
    for key, value in outcome.trailers:
        size = len(value) if isinstance(value, (str, bytes)) else len(str(value))
        if key.endswith("-bin"):
            size = (size + 2) // 3 * 4
        total += len(key) + size + 32
    return total


class _Trailers:
    """What inboxmesh.client.status.error_info reads: an object with trailing_metadata()."""

    def __init__(self, trailers):
        self._trailers = trailers

    def trailing_metadata(self):
        return self._trailers


def _exception_name(details: str) -> str:
    """The exception type an INTERNAL/UNKNOWN answer names (our servicers say
    `... failed: ValueError; see the mesh log`, grpc says `Exception
    deserializing request!` or `Unexpected <class 'X'>`), to tell apart
    failures of one RPC."""
    for pattern in (r"failed: (\w+)", r"<class '([\w.]+)'>", r"Exception (\w+)", r"^(\w+)"):
        found = re.search(pattern, details)
        if found:
            return found.group(1)
    return "no details"


@dataclass
class Findings:
    """Every distinct failure seen (hypothesis reports the shrunk ones; this
    keeps the first example of each, for the summary)."""

    first: dict[str, str] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    seen: collections.Counter = field(default_factory=collections.Counter)
    """How the calls ended (status and reason), failing or not."""

    def add(self, signature: str, report: str) -> None:
        self.first.setdefault(signature, report)
        self.count[signature] = self.count.get(signature, 0) + 1

    def summary(self) -> str:
        return "\n".join(f"[{self.count[s]}x] {s}\n    {self.first[s]}" for s in sorted(self.first))


def check(case: Case, outcome: Outcome, findings: Findings | None = None, where: str = "") -> None:
    """The contract: never INTERNAL or UNKNOWN; every refusal carries a
    google.rpc.ErrorInfo with a reason; a unary call is answered before its
    deadline; trailers under 8 KiB. `where` (a field path) tells apart
    failures that are otherwise the same."""
    problems: list[tuple[str, str]] = []
    code = outcome.code
    if outcome.client_side:
        code = grpc.StatusCode.CANCELLED  # the server's status is not known; only the trailers can be checked
    info = None
    try:
        info = error_info(_Trailers(outcome.trailers))
    except Exception as exc:  # a status detail that does not parse is a failure too
        problems.append((f"{case.rpc} {code.name} unparsable status details",
                         f"grpc-status-details-bin does not parse: {exc!r}"))
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        problems.append((f"{case.rpc} {code.name} {_exception_name(outcome.details)}", f"status {code.name}"))
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED and info is None and not case.rpc.method.server_streaming:
        # a stream may stay open; a unary call the server never answers is hanging somewhere
        problems.append((f"{case.rpc} no answer", "no answer before the call's deadline"))
    elif code not in FINE_CODES and (info is None or not info.reason):
        problems.append((f"{case.rpc} {code.name} without ErrorInfo",
                         "a refusal without google.rpc.ErrorInfo" if info is None else "ErrorInfo without a reason"))
    size = trailer_bytes(outcome)
    if size >= TRAILER_LIMIT:
        reason = info.reason if info is not None else "-"
        problems.append((f"{case.rpc} {code.name} {reason} trailers over 8 KiB",
                         f"trailing metadata is about {size} bytes (limit {TRAILER_LIMIT})"))
    if not problems:
        return
    if where:
        problems = [(f"{signature} at {where}", what) for signature, what in problems]
    signature, what = problems[0]
    details = (f"call: {case!r}\n  status: {code.name}, reason: {info.reason if info else None}, "
              f"details: {cut(outcome.details)!r}, trailers: {trailer_bytes(outcome)} bytes, "
              f"responses read: {outcome.responses}")
    if findings is not None:
        for extra, extra_what in problems:
            findings.add(extra, f"{extra_what}\n  {details}")
    raise failure_type(signature)(f"{what}\n  {details}")


def credential_strategy(credentials: dict[str, str]) -> st.SearchStrategy[tuple[str, tuple]]:
    """(label, call metadata): none or one of the real credentials given two
    times in three; otherwise a garbage bearer credential or a value that is
    not `Bearer ...`."""
    printable = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
    garbage = st.one_of(st.text(printable, min_size=1, max_size=40),
                        st.builds(lambda a, b: f"agt_{a}.{b}", st.text("0123456789abcdef", max_size=20),
                                  st.text(printable, max_size=40)),
                        st.builds(repeat_to, st.text(printable, min_size=1, max_size=4), st.integers(1000, 3000)))
    real = st.sampled_from([("none", ()), *((label, (("authorization", "Bearer " + value),))
                                            for label, value in credentials.items())])
    odd = st.one_of(garbage.map(lambda g: ("garbage", (("authorization", "Bearer " + g),))),
                    garbage.map(lambda g: ("malformed", (("authorization", g),))))
    return mostly(real, odd)


def cases(rpc: Rpc, credentials: dict[str, str], pool: Pool, *, raw: bool,
          fix: Callable[[Message], None] | None = None,
          opener: st.SearchStrategy[Message] | None = None) -> st.SearchStrategy[Case]:
    """Calls of one RPC with each kind of credential: a generated message (or
    raw bytes), or for a client stream a few of them, half of the time after
    `opener` (a valid first message, so that what follows it is reached)."""
    single = raw_bytes() if raw else MessageStrategies(pool).of(rpc.method.input_type)

    def entry(item) -> tuple[bytes, str]:
        if isinstance(item, bytes):
            return item, f"bytes {short(item)}"
        if fix is not None:
            fix(item)
        return item.SerializeToString(), show(item)

    @st.composite
    def make(draw) -> Case:  # a composite, so that a failure prints the Case's repr
        label, metadata = draw(credential_strategy(credentials))
        if not rpc.method.client_streaming:
            items = [draw(single)]
        else:
            items = [draw(opener)] if opener is not None and draw(st.booleans()) else []
            items += draw(st.lists(single, max_size=4))
        entries = [entry(item) for item in items]
        return Case(rpc, label, metadata, [e[0] for e in entries], [e[1] for e in entries])

    return make()
