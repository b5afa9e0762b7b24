"""Key-value helpers of the JetStream store: key encoding, typed reads, compare-and-set with a typed
result, and the stored forms of agent records and message states.

A compare-and-set is won or lost (somebody wrote in between: read again and retry); any other failure
of the request (NATS down, a timeout, an error answer) is raised, never taken for a lost race.
"""

from __future__ import annotations

import asyncio
import base64
import enum
import hashlib
import json
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import nats.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.common.v1 import envelope_pb2
from services.store.base import CONSUMED, DEAD_LETTERED, DELIVERED, AgentRecord, MessageRecord

T = TypeVar("T")
_SAFE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
MAX_CAS_TRIES = 100
MULTI_LAST_MAX = 1024
"""Keys one batched direct get of their last entries asks for at most (nats-server's limit)."""


def token(value: str) -> str:
    """A key / subject token for any string: itself when safe, else a hash."""
    if _SAFE.fullmatch(value):
        return value
    return "h" + hashlib.sha256(value.encode()).hexdigest()[:32]


def idem_key(sender: str, message_id: str) -> str:
    return "i." + hashlib.sha256(f"{sender}\x00{message_id}".encode()).hexdigest()


def msg_id_header(sender: str, message_id: str) -> str:
    """The Nats-Msg-Id of a message: JetStream's own de-duplication key."""
    return hashlib.sha256(f"{sender}\x00{message_id}".encode()).hexdigest()


# -- codecs ---------------------------------------------------------------------
@dataclass(frozen=True)
class Codec(Generic[T]):
    """How values of one kind are stored in an entry."""

    decode: Callable[[bytes], T]
    encode: Callable[[T], bytes]


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value).encode()


JSON: Codec[Any] = Codec(json.loads, _json_bytes)
"""Index lists, counters, session keys, idempotency records: plain JSON."""


# -- reads and writes -------------------------------------------------------------
@dataclass(frozen=True)
class Entry(Generic[T]):
    value: T
    revision: int


class CasResult(enum.Enum):
    """The outcome of a conditional write."""

    WON = "won"
    """Written: the entry was still at the revision read (or absent, for a create)."""
    LOST = "lost"
    """Somebody wrote in between: nothing written; read again."""


async def get(kv: Any, key: str, codec: Codec[T]) -> Entry[T] | None:
    """The entry's value and revision, or None when it is absent (or deleted)."""
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return None
    if not entry.value:
        return None
    return Entry(codec.decode(entry.value), entry.revision)


async def get_latest(conn: Any, bucket: str, key: str, codec: Codec[T]) -> Entry[T] | None:
    """`get` as a query's answer: with one replica the same direct get; with more, from the bucket stream's
    leader (the JetStream API). A direct get may be answered by a follower behind its leader (one restarted
    and catching up): Status of a message the mesh had accepted was NOT_FOUND so, once, in the fault test of
    a three-node cluster (tests/test_jetstream_faults.py)."""
    if conn.config.nats_replicas == 1:
        return await get(conn.bucket(bucket), key, codec)
    try:
        msg = await conn.js.get_msg(conn.kv_stream(bucket), subject=conn.kv_subject(bucket, key))
    except NotFoundError:
        return None
    if not msg.data or (msg.headers and msg.headers.get("KV-Operation")):
        return None  # deleted or purged
    return Entry(codec.decode(msg.data), int(msg.seq))


async def write(kv: Any, key: str, value: bytes, revision: int) -> CasResult:
    """Write `value` if the entry is still at `revision` (0: only if it is absent)."""
    try:
        if revision:
            await kv.update(key, value, last=revision)
        else:
            await kv.create(key, value)
    except KeyWrongLastSequenceError:
        return CasResult.LOST
    return CasResult.WON


async def create(kv: Any, key: str, value: T, codec: Codec[T]) -> int:
    """Create the key: its revision, or 0 when it exists (somebody else won)."""
    try:
        return int(await kv.create(key, codec.encode(value)))
    except KeyWrongLastSequenceError:
        return 0


_WRONG_LAST = (10071, 10164)
"""JetStream's error codes for a write whose expected last sequence did not match."""


async def write_many(conn: Any, bucket: str, writes: list[tuple[str, bytes, int]]) -> list[int]:
    """Conditional writes of several keys of a bucket at once, pipelined (JetStreamConnection.publish_each):
    each (key, value, revision) written only if the entry is still at `revision` (0: only if absent). For
    each, the new revision, or 0 when somebody else wrote first. Any other failure is raised (the writes
    before it may have been made)."""
    messages = [(conn.kv_subject(bucket, key), value, {"Nats-Expected-Last-Subject-Sequence": str(revision)})
                for key, value, revision in writes]
    if not messages:
        return []
    acks = await _publish(conn, bucket, messages)
    revisions = []
    for ack in acks:
        if isinstance(ack, APIError) and ack.err_code in _WRONG_LAST:
            revisions.append(0)
        elif isinstance(ack, BaseException):
            raise ack
        else:
            revisions.append(int(ack.seq))
    return revisions


async def _publish(conn: Any, bucket: str, messages: list[tuple[str, bytes, dict[str, str]]]) -> list[Any]:
    """Write messages into a bucket's stream: for each a PubAck or the APIError JetStream answered. Into one of
    ATOMIC_BUCKETS shared with the writes other calls make at the same time, in atomic batches when there
    are many (shared_writes.py); into the others pipelined."""
    shared = conn.shared_writes.get(bucket)
    return await (shared.publish(messages) if shared is not None else conn.publish_each(messages))


async def put_many(conn: Any, bucket: str, puts: list[tuple[str, bytes]]) -> None:
    """Unconditional writes of several keys of a bucket (those of ATOMIC_BUCKETS shared with the writes other
    calls make at the same time, shared_writes.py); any failure is raised (the writes before it may have been
    made)."""
    if not puts:
        return
    messages: list[tuple[str, bytes, dict[str, str]]] = [(conn.kv_subject(bucket, key), value, {})
                                                          for key, value in puts]
    for ack in await _publish(conn, bucket, messages):
        if isinstance(ack, BaseException):
            raise ack


def _request_chunks(subjects: list[str], max_payload: int) -> list[list[str]]:
    """The subjects in runs that one batched direct get each may ask for: at most MULTI_LAST_MAX (nats-server
    answers 413 Too Many Results beyond), and a request (their JSON list) within the server's largest message,
    `max_payload` (1 MiB by default; a request over it is refused by the client, MaxPayloadError: 1,024 run
    keys of a ListRuns page made 66 KiB against a server set to 16 KiB)."""
    room = max_payload - 512  # the request's other fields and the list's brackets
    chunks: list[list[str]] = [[]]
    size = 0
    for subject in subjects:
        cost = len(subject) + 4  # quoted, and json.dumps's ", " (subjects are plain tokens: nothing escaped)
        if chunks[-1] and (len(chunks[-1]) >= MULTI_LAST_MAX or size + cost > room):
            chunks.append([])
            size = 0
        chunks[-1].append(subject)
        size += cost
    return chunks


async def last_many(conn: Any, bucket: str, keys: list[str]) -> dict[str, Entry[bytes]]:
    """The entries of the keys that exist (a deleted one counts as absent), in one batched direct get of
    the bucket's stream (`multi_last`). The bucket allows direct gets (JetStreamConnection.open); with
    replicas a follower may answer a moment behind its leader."""
    if not keys:
        return {}
    prefix = conn.kv_subject(bucket, "")
    answers = await asyncio.gather(*(conn.direct_get(conn.kv_stream(bucket), {
        "multi_last": chunk, "batch": len(chunk)}) for chunk in _request_chunks(
            [prefix + key for key in keys], conn.nc.max_payload)))
    entries = {}
    for msg in (msg for found, _ in answers for msg in found):
        if msg.data and not msg.headers.get("KV-Operation"):
            entries[msg.headers["Nats-Subject"][len(prefix):]] = Entry(msg.data, int(msg.headers["Nats-Sequence"]))
    return entries


LIST_PAGE = 1024
"""Keys list_keys takes from its consumer in one fetch."""


async def list_keys(conn: Any, bucket: str) -> list[str]:
    """The keys a bucket holds now (deleted ones left out), in the order they were last written: a pull
    consumer of the last entry of each key, headers only, read to its end, then deleted.

    Not nats-py's KeyValue.keys(): (1) it decides that there is nothing to list from the consumer's
    count of messages still to send, taken after the server may have sent them, so under load it
    answers "no keys" for a bucket that holds some (3 listings of 1,000 beside two busy processes on
    2026-12-08, `bench/kv_listing_probe.py`); (2) it leaves its consumer on the server for five minutes,
    and after about 1,000 listings in that time nats-server refuses every new consumer on the stream
    ("maximum consumers limit reached"). A pull consumer sends nothing before it is asked, so its count
    at creation is exact; each entry says how many follow it; and the consumer goes at the end."""
    stream, prefix = conn.kv_stream(bucket), conn.kv_subject(bucket, "")
    pull = await conn.js.pull_subscribe(prefix + ">", stream=stream, config=ConsumerConfig(
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, ack_policy=AckPolicy.NONE, headers_only=True,
        mem_storage=True, inactive_threshold=60.0))
    name = ""
    try:
        info = await pull.consumer_info()
        name, left = info.name, int(info.num_pending or 0)
        keys: list[str] = []
        while left:
            for msg in await pull.fetch(min(left, LIST_PAGE), timeout=conn.config.nats_timeout_s):
                left = int(msg.metadata.num_pending)
                if not (msg.headers and msg.headers.get("KV-Operation")):
                    keys.append(msg.subject[len(prefix):])
        return keys
    finally:
        try:
            await pull.unsubscribe()
            if name:
                await conn.js.delete_consumer(stream, name)
        except (nats.errors.Error, TimeoutError):  # NATS away: the consumer goes after its inactive threshold
            pass


# -- indexes: one key an entry ----------------------------------------------------------
INDEX_PAGE = 1024
"""Entries of an index read in one batched direct get."""


def entry_key(index: str, member: str) -> str:
    """The key of one member's entry in an index of a bucket (its value is the member): `x.<index>.<member>`.
    Before 2026-12-07 an index was one JSON list under the key `<index>`, read and written whole by each
    addition: adding N members moved N squared ids in all, and a list past NATS's largest message (1 MiB,
    about 37,000 agent ids) could not be written at all."""
    return f"x.{index}.{token(member)}"


async def index_add(conn: Any, bucket: str, entries: list[tuple[str, str]], *, check: bool = False) -> None:
    """Add (index, member) entries the bucket's indexes do not hold yet: create-if-absent writes of one small
    entry each (an entry there already is left as it is), shared with the other writes of the moment into
    the bucket (one atomic batch when there are many, shared_writes.py). `check`: for entries that are
    mostly there already (the keeper's roll-forward), one batched read first and only the missing ones
    written (with one replica; with more the bucket serves no direct gets)."""
    keys = {entry_key(index, member): member for index, member in entries}
    if check and keys and conn.config.nats_replicas == 1:
        held = await last_many(conn, bucket, list(keys))
        keys = {key: member for key, member in keys.items() if key not in held}
    await write_many(conn, bucket, [(key, member.encode(), 0) for key, member in keys.items()])


async def index_members(conn: Any, bucket: str, index: str) -> list[str]:
    """The members an index holds, in the order they were added: the list an earlier version kept under
    the index's own key (read as long as such a store exists; nothing writes it any more), then the
    entries."""
    legacy, entries = await asyncio.gather(get(conn.bucket(bucket), index, JSON), _entries(conn, bucket, index))
    return list(dict.fromkeys([*(legacy.value if legacy else ()), *entries]))


async def _entries(conn: Any, bucket: str, index: str) -> list[str]:
    """The members of an index's entries in the order they were written. With one replica, batched direct
    gets of INDEX_PAGE entries; with more, the bucket's leader answers (a follower may be behind it, and
    the bucket serves no direct gets then: JetStreamConnection._ensure_bucket), one request an entry."""
    stream, subject = conn.kv_stream(bucket), conn.kv_subject(bucket, f"x.{index}.*")
    found: list[str] = []
    seq = 1
    while True:
        if conn.config.nats_replicas == 1:
            page, following = await conn.direct_batch(stream, subject, seq, INDEX_PAGE)
            found += [m.data.decode() for m in page if m.data and not m.headers.get("KV-Operation")]
            if not page or not following:
                return found
            seq = int(page[-1].headers["Nats-Sequence"]) + 1
        else:
            try:
                msg = await conn.js.get_msg(stream, seq=seq, subject=subject, next=True)
            except NotFoundError:
                return found
            if msg.data and not (msg.headers and msg.headers.get("KV-Operation")):
                found.append(msg.data.decode())
            seq = int(msg.seq) + 1


@dataclass(eq=False)
class _Change:
    """One caller's change in a round of merged changes of a key, and what came of it."""

    change: Callable[[Any], Any]
    done: bool = False
    value: Any = None
    error: BaseException | None = None


@dataclass(eq=False)
class _Key:
    """The changes of one key this process is making: one round at a time; what comes meanwhile waits
    for the next."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: list[_Change] = field(default_factory=list)
    running: asyncio.Task[None] | None = None
    """The round in progress (it goes on when the caller that started it is cancelled)."""
    users: int = 0


_KEYS: weakref.WeakKeyDictionary[Any, dict[str, _Key]] = weakref.WeakKeyDictionary()
"""Per bucket, the keys with changes in progress in this process (dropped when the last one ends)."""


async def cas(kv: Any, key: str, change: Callable[[T | None], T | None], codec: Codec[T]) -> T | None:
    """Read, change, write back only if nobody wrote in between; retried.
    `change` gets the current value (None when absent) and returns the new
    one, or None to leave the entry alone. Returns what was written (or
    None).

    Changes of one key made at the same time in this process are merged (the key-value store's group
    commit): while one read-and-write of the key is in flight, the changes that come wait, and the next
    round applies all of them in turn, each to what the one before left, in one write. So the hot keys
    of many concurrent registrations (a parent's running children, its index entries) take a few writes
    instead of one each plus a lost race for nearly every one of them."""
    keys = _KEYS.setdefault(kv, {})
    state = keys.get(key)
    if state is None:
        state = keys[key] = _Key()
    state.users += 1
    mine = _Change(change)
    state.waiting.append(mine)
    try:
        async with state.lock:
            if state.running is not None:  # started by a caller cancelled meanwhile: it may hold mine
                await asyncio.shield(state.running)
                state.running = None
            if not mine.done:
                batch, state.waiting = state.waiting, []
                state.running = asyncio.ensure_future(_round(kv, key, codec, batch))
                await asyncio.shield(state.running)
                state.running = None
    except asyncio.CancelledError:
        if mine in state.waiting:  # not taken into a round: it is not made
            state.waiting.remove(mine)
        raise
    finally:
        state.users -= 1
        if not state.users and keys.get(key) is state:
            del keys[key]
    if mine.error is not None:
        raise mine.error
    return mine.value


async def _round(kv: Any, key: str, codec: Codec[Any], batch: list[_Change]) -> None:
    """Apply the changes of a round in one compare-and-set write (retried when lost); each change
    learns what it wrote (None: it left the entry alone) or what failed."""
    try:
        for _ in range(MAX_CAS_TRIES):
            found = await get(kv, key, codec)
            value = found.value if found else None
            changed = False
            for entry in batch:
                try:
                    entry.value, entry.error = entry.change(value), None
                except Exception as exc:  # that caller's own failure: its change is left out
                    entry.value, entry.error = None, exc
                if entry.value is not None:
                    value, changed = entry.value, True
            if not changed or await write(kv, key, codec.encode(value),
                                          found.revision if found else 0) is CasResult.WON:
                break
        else:
            raise errors.Unavailable(f"too much contention on {key}; nothing changed", reason=Reason.CONTENTION)
    except BaseException as exc:  # the read or write failed: every change of the round failed with it
        for entry in batch:
            entry.value, entry.error = None, exc
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        for entry in batch:
            entry.done = True


# -- agent records ------------------------------------------------------------------
def _agent_encode(record: AgentRecord) -> bytes:
    return _json_bytes({
        "agent_id": record.agent_id, "name": record.name, "mode": record.mode, "parent_id": record.parent_id,
        "scope_id": record.scope_id, "depth": record.depth, "state": record.state, "metadata": record.metadata,
        "inbox_capacity": record.inbox_capacity, "created_at_us": record.created_at_us,
        "credential_hash": record.credential_hash.hex(), "closed_at_us": record.closed_at_us,
        "close_reason": record.close_reason,
    })


def _agent_decode(data: bytes) -> AgentRecord:
    fields = json.loads(data)
    return AgentRecord(**{**fields, "credential_hash": bytes.fromhex(fields["credential_hash"])})


AGENT: Codec[AgentRecord] = Codec(_agent_decode, _agent_encode)
"""Agent records (bucket agents, key `a.<agent_id>`), as JSON."""


def agent_key(agent_id: str) -> str:
    return f"a.{token(agent_id)}"


def written_agent(msg: Any) -> AgentRecord | None:
    """The record an agents-bucket write on its stream holds (None for a delete, a purge or an unreadable
    value), as the watches of the bucket read it (closes.py, agent_cache.py)."""
    if (msg.headers or {}).get("KV-Operation") or not msg.data:
        return None
    try:
        return AGENT.decode(msg.data)
    except (ValueError, TypeError, KeyError):
        return None


async def read_agent(agents: Any, agent_id: str) -> AgentRecord | None:
    """An agent's record from the agents bucket, as it is now."""
    found = await get(agents, agent_key(agent_id), AGENT)
    return found.value if found else None


# -- message states -------------------------------------------------------------------
REJECTED = 0
"""State of a message its sender was refused after all (target closed, over capacity)."""


@dataclass(frozen=True, slots=True)
class MessageState:
    """The state entry of one message (bucket msgs, key `m.<agent>.<seq>`): the arbiter of what happened
    to it, changed only by compare-and-set. Stored as JSON with short keys, defaults left out."""

    state: int
    """QUEUED, DELIVERED, CONSUMED, DEAD_LETTERED or REJECTED."""
    attempts: int = 0
    stored_at_us: int = 0
    envelope: bytes | None = None
    """The serialized envelope (None in a rejection's entry)."""
    delivered_at_us: int = 0
    """First delivery."""
    consumed_at_us: int = 0
    turn: int = 0
    """The consuming ack's turn."""
    dead_at_us: int = 0
    dead_reason: str = ""

    @staticmethod
    def first(envelope: envelope_pb2.Envelope, state: int) -> MessageState:
        """The entry of a message seen for the first time (no attempt yet)."""
        return MessageState(state, stored_at_us=envelope.stored_at_us, envelope=envelope.SerializeToString())

    def first_attempt(self, at_us: int) -> MessageState:
        """Delivered for the first time at `at_us`."""
        return replace(self, state=DELIVERED, attempts=1, delivered_at_us=at_us)

    @property
    def final(self) -> bool:
        """Consumed, dead-lettered or rejected: nothing changes it any more."""
        return self.state in (CONSUMED, DEAD_LETTERED, REJECTED)

    def consumed(self, at_us: int, turn: int) -> MessageState:
        return replace(self, state=CONSUMED, consumed_at_us=at_us, turn=turn)

    def dead(self, at_us: int, reason: str) -> MessageState:
        return replace(self, state=DEAD_LETTERED, dead_at_us=at_us, dead_reason=reason)

    def envelope_pb(self) -> envelope_pb2.Envelope:
        """The message's envelope, its delivery attempt filled in."""
        envelope = envelope_pb2.Envelope.FromString(self.envelope or b"")
        envelope.delivery_attempt = self.attempts
        return envelope

    @property
    def message_id(self) -> str:
        return self.envelope_pb().message_id if self.envelope is not None else ""

    def record(self) -> MessageRecord:
        return MessageRecord(
            envelope=self.envelope_pb(), state=self.state, attempts=self.attempts, stored_at_us=self.stored_at_us,
            delivered_at_us=self.delivered_at_us, consumed_at_us=self.consumed_at_us, dead_at_us=self.dead_at_us,
            dead_reason=self.dead_reason)

    def encode(self) -> bytes:
        data: dict[str, Any] = {"state": self.state}
        for key, value in (("attempts", self.attempts), ("stored", self.stored_at_us),
                           ("delivered", self.delivered_at_us), ("consumed", self.consumed_at_us),
                           ("turn", self.turn), ("dead", self.dead_at_us), ("reason", self.dead_reason)):
            if value:
                data[key] = value
        if self.envelope is not None:
            data["env"] = base64.b64encode(self.envelope).decode()
        return _json_bytes(data)

    @staticmethod
    def decode(data: bytes) -> MessageState:
        """Raises ValueError, TypeError or KeyError on an entry that is not a message state."""
        fields = json.loads(data)
        env = fields.get("env")
        return MessageState(
            state=int(fields["state"]), attempts=fields.get("attempts", 0), stored_at_us=fields.get("stored", 0),
            envelope=None if env is None else base64.b64decode(env), delivered_at_us=fields.get("delivered", 0),
            consumed_at_us=fields.get("consumed", 0), turn=fields.get("turn", 0), dead_at_us=fields.get("dead", 0),
            dead_reason=fields.get("reason", ""))


MESSAGE_STATE: Codec[MessageState] = Codec(MessageState.decode, MessageState.encode)


def state_key(agent_id: str, seq: int) -> str:
    return f"m.{token(agent_id)}.{seq}"


# -- idempotency records ----------------------------------------------------------------
@dataclass(frozen=True)
class Stored:
    """Where a sender's message was stored (bucket msgs, key idem_key(sender, message_id)): the durable
    record of duplicates, for retries after JetStream's own duplicate window."""

    recipient: str
    seq: int
    stored_at_us: int


def _stored_decode(data: bytes) -> Stored:
    recipient, seq, stored_at_us = json.loads(data)
    return Stored(recipient, seq, stored_at_us)


STORED: Codec[Stored] = Codec(_stored_decode, lambda s: _json_bytes([s.recipient, s.seq, s.stored_at_us]))
