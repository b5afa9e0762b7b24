"""What every part of the JetStream store shares: the NATS connection, the JetStream context, the
streams and key-value buckets, the configuration, and the one translation of NATS failures into the
store's Unavailable error.

The parts (agents, inbox, runs, sessions, events, the keeper) each receive this object and the parts
they build on, never the store itself; they let NATS errors rise. The store's public methods translate
them, each explicitly (`@nats_call`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import secrets
import ssl
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import nats
import nats.errors
from nats.js.api import DiscardPolicy, KeyValueConfig, PubAck, StorageType, StreamConfig
from nats.js.errors import APIError, BadRequestError

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from services.config import StoreConfig
from services.store.jetstream.durability import check_durability
from services.store.jetstream.shared_writes import BATCH_MAX, SharedWrites
from services.tls import ssl_context

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

IN_PROCESS = 10158
"""JetStream: a message with this Nats-Msg-Id is being stored right now (another process publishes the same
message or event): it is stored once, as a duplicate would be."""
BATCH_REFUSED = (10201, 10077)
"""Why JetStream refuses a whole atomic batch where one message at a time would store the others: a
message id it has stored already (a retry, an event's copy), an inbox over its limit."""
BUCKETS = ("agents", "msgs", "runs", "runwork", "misc")
"""runwork: one key per run not archived yet, so the sweeper reads only those."""
ATOMIC_BUCKETS = ("msgs", "agents", "runs", "runwork")
"""The buckets whose writes through kv.write_many and kv.put_many are shared by the callers of the moment,
in atomic batches when there are many (shared_writes.py): message states and idempotency records (msgs),
new agent and run records and their index entries (agents, runs), the sweeper's work (runwork)."""
EVENT_DEDUP_WINDOW_S = 300.0
"""Duplicate window of the events stream: how long a replayed event is recognised (the keeper)."""
REPLAY_HORIZON_US = int((EVENT_DEDUP_WINDOW_S - 30) * 1_000_000)
"""An event older than this (by its time) is not published again, by the keeper or as a delivery's
copy of a message's stored events: the duplicate window might no longer drop the copy."""
_ERROR_REPEAT_S = 60.0
"""A NATS client error of one kind is logged again after this long at the soonest (_on_error)."""
NATS_FAILURES: tuple[type[BaseException], ...] = (nats.errors.Error, TimeoutError, APIError, OSError)
"""What a NATS request raises when NATS is down, slow or refuses (disconnected, timed out, no JetStream
leader, an error answer)."""


@contextmanager
def nats_errors() -> Iterator[None]:
    """A NATS failure inside the block is raised as Unavailable (STORE_UNAVAILABLE). Retrying is safe:
    sends carry their message ids, acks and state changes are compare-and-set."""
    try:
        yield
    except errors.MeshError:
        raise
    except NATS_FAILURES as exc:
        raise errors.Unavailable(
            f"NATS JetStream did not answer ({type(exc).__name__}: {exc}); retry with the same"
            " message ids (a send may have been stored; a retry is then a duplicate)",
            reason=Reason.STORE_UNAVAILABLE) from None


def _pub_ack(msg: Any) -> Any:
    """A publish's answer: its PubAck, or the APIError JetStream answered (returned, not raised)."""
    status = msg.headers.get("Status") if msg.headers else None
    if status:  # no JetStream behind the subject (503), or another status instead of an answer
        return APIError(code=int(status) if status.isdigit() else None,
                        description=f"no answer from JetStream (status {status})")
    try:
        reply = json.loads(msg.data)
    except ValueError:
        return APIError(description=f"an answer that is not JSON: {msg.data[:100]!r}")
    error = reply.get("error")
    if error is not None:
        return APIError(code=error.get("code"), err_code=error.get("err_code"),
                        description=str(error.get("description", ""))[:200])
    return PubAck.from_response(reply)


class _Answers:
    """The answers of one request_many: each kept in its place, and `ended` set when the last has come."""

    __slots__ = ("answers", "ended", "missing")

    def __init__(self, answers: list[Any], ended: asyncio.Future[Any]) -> None:
        self.answers, self.ended, self.missing = answers, ended, len(answers)

    def answer(self, index: int, msg: Any) -> None:
        if self.answers[index] is None:
            self.answers[index] = msg
            self.missing -= 1
            if not self.missing and not self.ended.done():
                self.ended.set_result(None)


def _gather_direct(found: list[Any], ended: asyncio.Future[int], stream: str, msg: Any) -> None:
    """One answer of a batched direct get (JetStreamConnection.direct_get): a message is kept; the end of the
    batch (204, with how many more follow) or nothing (more) on the subject (404) ends it; any other status
    fails it."""
    if ended.done():
        return
    status = msg.headers.get("Status") if msg.headers else None
    if status is None:
        found.append(msg)
    elif status == "204":  # end of the batch
        ended.set_result(int(msg.headers.get("Nats-Num-Pending", "0")))
    elif status == "404":  # nothing (more)
        ended.set_result(0)
    else:
        ended.set_exception(nats.errors.Error(f"direct get from {stream}: status {status}"
                                              f" {msg.headers.get('Description', '')}"[:200]))


def _time_out(ended: asyncio.Future[Any]) -> None:
    if not ended.done():
        ended.set_exception(nats.errors.TimeoutError())


def nats_call(method: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Decorate a store method: NATS failures it meets are raised as Unavailable (nats_errors)."""

    @functools.wraps(method)
    async def call(*args: P.args, **kwargs: P.kwargs) -> R:
        with nats_errors():
            return await method(*args, **kwargs)

    return call


CONNECT_TIMEOUT_S = 20.0
"""How long `open` waits for the first connection to NATS."""
UNTRUSTED_GRACE_S = 0.5
"""How long an attempt of `open` goes on once a server's certificate failed verification (a CA not given, or
the wrong one: a mistake of the configuration that waiting does not mend). Then the next attempt gives
another server the first turn (_first_connection), and once every server had it the mesh says why at once,
not after CONNECT_TIMEOUT_S."""


class JetStreamConnection:
    """One mesh process's connection to NATS, and the names of what the store keeps there."""

    def __init__(self, config: StoreConfig):
        ns = config.nats_namespace
        if not ns.isidentifier() or not ns.isascii():
            raise errors.InvalidArgument(f"nats namespace {ns!r}: letters, digits and _ only", reason=Reason.BAD_CONFIG)
        self.config = config
        self._last_error = ""
        """The last error nats-py reported (for the message of a connection that never came)."""
        self._untrusted = asyncio.Event()
        """Set when a server's certificate failed verification (_on_error)."""
        self.ns = ns
        self.inbox_stream = f"{ns.upper()}_INBOX"
        self.event_stream = f"{ns.upper()}_EVENTS"
        self.outbox_stream = f"{ns.upper()}_OUTBOX"
        self.outbox_subject = f"{ns}.outbox"
        self.nc: Any = None
        """The NATS connection (nats.NATS) while open."""
        self.js: Any = None
        """Its JetStream context while open."""
        self._kv: dict[str, Any] = {}
        self._reply_prefix = ""
        self._replies: dict[str, Callable[[Any], None]] = {}
        """Per reply token, what takes the answers of a request in flight (_on_reply)."""
        self._tokens = itertools.count(1)
        self._logged_errors: dict[str, float] = {}
        """When an error of each kind was last logged (_on_error)."""
        self.lost = ""
        """Why the connection is gone for good (_on_closed); empty while it is not."""
        self.on_lost: Callable[[str], None] | None = None
        """Called once, with `lost`, when the connection is gone for good."""
        self.origin = secrets.token_hex(8)
        """Names this connection (its atomic batches' ids)."""
        self.inbox_writes = SharedWrites(self.inbox_stream, self.publish_batch, self.publish_each)
        """Publishes of messages into inboxes, shared by the sends at about the same time (shared_writes.py)."""
        self.event_writes = SharedWrites(self.event_stream, self.publish_batch, self.publish_each)
        """Publishes of events (not the copies: those go one at a time)."""
        self.shared_writes = {bucket: SharedWrites(self.kv_stream(bucket), self.publish_batch, self.publish_each)
                              for bucket in ATOMIC_BUCKETS}
        """The writes of kv.write_many and kv.put_many into each of ATOMIC_BUCKETS."""
        self.msgs_writes = self.shared_writes["msgs"]
        """Writes into the msgs bucket (idempotency records, message states)."""

    async def open(self) -> None:
        """Connect, and create (or update) the streams and buckets."""
        urls = list(self.config.nats_urls)
        if not urls:
            raise errors.InvalidArgument("the jetstream store needs NATS server URLs (--nats)",
                                         reason=Reason.BAD_CONFIG)
        context = ssl_context(self.config.nats_tls, "the NATS connection")  # bad files: BAD_CONFIG, not NATS_DOWN
        try:  # nats-py tries a server that fails the TLS handshake again and again: bounded here
            options: dict[str, Any] = {"tls": context} if context is not None else {}
            self.nc = await self._first_connection(functools.partial(
                nats.connect, connect_timeout=5, max_reconnect_attempts=-1, reconnect_time_wait=0.2, name="inboxmesh",
                no_echo=True, error_cb=self._on_error, disconnected_cb=self._on_disconnected,
                reconnected_cb=self._on_reconnected, closed_cb=self._on_closed, **options), urls)
        except TimeoutError:
            last = self._last_error
            within = ("a server's certificate is not trusted, and no other server answered"
                      if self._untrusted.is_set() else f"no connection within {CONNECT_TIMEOUT_S:g} s")
            raise errors.Unavailable(
                f"cannot reach NATS at {', '.join(urls)}: {within}"
                f"{f'; the last error: {errors.clip(last, 300)}' if last else ''}"
                f"{' (a server that requires TLS needs --nats-tls-ca)' if 'SSL' in last and context is None else ''}",
                reason=Reason.NATS_DOWN) from None
        except Exception as exc:
            raise errors.Unavailable(f"cannot reach NATS at {', '.join(urls)}: {exc}",
                                     reason=Reason.NATS_DOWN) from None
        try:
            await check_durability(self.config)
        except errors.MeshError:
            await self.close()
            raise
        self.js = self.nc.jetstream(timeout=self.config.nats_timeout_s)
        self._reply_prefix = self.nc.new_inbox()
        await self.nc.subscribe(f"{self._reply_prefix}.*", cb=self._on_reply)
        replicas = self.config.nats_replicas
        ns = self.ns
        await self._ensure_stream(StreamConfig(
            name=self.inbox_stream, subjects=[f"{ns}.inbox.*"], storage=StorageType.FILE, num_replicas=replicas,
            max_msgs_per_subject=self.config.max_inbox_capacity, discard=DiscardPolicy.NEW,
            discard_new_per_subject=True, duplicate_window=self.config.nats_duplicate_window_s, allow_direct=True,
            allow_atomic=True))
        await self._ensure_stream(StreamConfig(
            name=self.event_stream, subjects=[f"{ns}.ev.>"], storage=StorageType.FILE, num_replicas=replicas,
            allow_direct=True, duplicate_window=EVENT_DEDUP_WINDOW_S, allow_atomic=True))
        await self._ensure_stream(StreamConfig(
            name=self.outbox_stream, subjects=[self.outbox_subject], storage=StorageType.FILE,
            num_replicas=replicas, allow_direct=True))
        for bucket in BUCKETS:
            self._kv[bucket] = await self._ensure_bucket(bucket, replicas)
        log.info("jetstream store on %s (replicas=%d)", ", ".join(urls), replicas)

    async def _ensure_bucket(self, bucket: str, replicas: int) -> Any:
        """Create the bucket, or bind to it as it is, with the settings below. The msgs bucket allows direct
        gets (a delivery asks which of its messages have state entries in one batched direct get,
        kv.last_many) and atomic batches (kv.write_many), and so do the other ATOMIC_BUCKETS (new records and
        index entries, kv.index_add). With one replica every bucket is read by direct
        gets, which the stream answers itself (0.5 ms here against 0.8 ms through the JetStream API);
        with more, a follower may answer a direct get a moment behind its leader, so the reads that settle
        races (an agent's record after a publish) go to the leader."""
        name = f"{self.ns}_{bucket}"
        direct = bucket == "msgs" or replicas == 1
        try:
            found = await self.js.create_key_value(KeyValueConfig(
                bucket=name, history=1, storage=StorageType.FILE, replicas=replicas, direct=direct))
        except BadRequestError:  # it exists with other settings (made by this version, or an earlier one)
            found = None
        info = await self.js.stream_info(self.kv_stream(bucket))
        atomic = bucket in ATOMIC_BUCKETS
        if bool(info.config.allow_direct) != direct or (atomic and not info.config.allow_atomic):
            info.config.allow_direct = direct
            info.config.allow_atomic = atomic or info.config.allow_atomic
            await self.js.update_stream(info.config)
        return found if found is not None else await self.js.key_value(name)

    async def _ensure_stream(self, config: StreamConfig) -> None:
        try:
            await self.js.add_stream(config)
        except BadRequestError:
            await self.js.update_stream(config)

    async def _first_connection(self, connect: Callable[..., Coroutine[Any, Any, Any]], urls: list[str]) -> Any:
        """The client of `connect(servers=..., dont_randomize=...)` once connected; TimeoutError after
        CONNECT_TIMEOUT_S in all, or once every server had its turn and one refused with a certificate this
        mesh does not trust. nats-py (2.16) tries the servers in a shuffled order and goes on to the next one
        that is down, but stops at one whose certificate fails verification and tries no other (the first
        connection then hangs): so after such a refusal each server gets the first turn in one more attempt,
        UNTRUSTED_GRACE_S each at most."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONNECT_TIMEOUT_S
        turns: list[list[str] | None] = [None, *(urls[k:] + urls[:k] for k in range(len(urls)))] \
            if len(urls) > 1 else [None]
        for order in turns:
            self._untrusted.clear()
            connection = asyncio.ensure_future(connect(servers=order or urls, dont_randomize=order is not None))
            untrusted = asyncio.ensure_future(self._untrusted.wait())
            try:
                await asyncio.wait({connection, untrusted}, timeout=max(0.0, deadline - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if untrusted.done() and not connection.done():
                    await asyncio.wait({connection}, timeout=min(UNTRUSTED_GRACE_S, max(0.0, deadline - loop.time())))
                if connection.done():
                    return connection.result()
            finally:
                untrusted.cancel()
                if not connection.done():
                    connection.cancel()
                    await asyncio.gather(connection, return_exceptions=True)
            if not self._untrusted.is_set():
                break  # no server answered in time at all
        raise TimeoutError

    async def _on_error(self, exc: Exception) -> None:
        """nats-py's asynchronous errors, one line each: while a server is down the client meets one per
        reconnect attempt (every 0.2 s, per server), and its default logs each with a whole traceback.
        Another error of the same kind is logged once a minute at most."""
        kind = type(exc).__name__
        self._last_error = f"{kind}: {exc}"
        if isinstance(exc, ssl.SSLCertVerificationError):
            self._untrusted.set()
        now = asyncio.get_running_loop().time()
        if now - self._logged_errors.get(kind, -_ERROR_REPEAT_S) >= _ERROR_REPEAT_S:
            self._logged_errors[kind] = now
            log.warning("NATS: %s: %s", kind, exc)

    async def _on_disconnected(self) -> None:
        if self.nc is None:  # closed by close()
            return
        log.warning("NATS connection lost; reconnecting (store calls fail with STORE_UNAVAILABLE meanwhile)")

    async def _on_closed(self) -> None:
        """nats-py closed the connection for good, not close(): it does so on an error the server sends a
        connected client (an authorization the server's configuration no longer grants, after a reload, say),
        and never reconnects then. Nothing can be stored any more: the calls fail with NATS_DOWN, and
        `on_lost` hears of it (the mesh stops, so that its supervisor starts it again)."""
        if self.nc is None or self.lost:  # closed by close(), or told already
            return
        self.lost = (f"the NATS client closed its connection for good ({self._last_error or self.nc.last_error!r})"
                     " and does not reconnect")
        log.critical("%s: this mesh process can store nothing any more", self.lost)
        if self.on_lost is not None:
            self.on_lost(self.lost)

    async def _on_reconnected(self) -> None:
        self._logged_errors.clear()
        log.warning("NATS connection back (%s)", self.nc.connected_url.netloc if self.nc else "?")

    async def close(self) -> None:
        """Drain the connection (what is in flight is sent). Safe to call twice."""
        nc, self.nc = self.nc, None
        if nc is not None and not nc.is_closed:  # (closed for good by nats-py: nothing to drain)
            await nc.drain()

    def require_open(self) -> None:
        if self.nc is None or self.js is None:
            raise errors.Unavailable("the store is not running", reason=Reason.STORE_CLOSED)
        if self.lost:
            raise errors.Unavailable(f"{self.lost}; this mesh process stops: start it again",
                                     reason=Reason.NATS_DOWN)

    async def _on_reply(self, msg: Any) -> None:
        handler = self._replies.get(msg.subject[len(self._reply_prefix) + 1:])
        if handler is not None:
            handler(msg)

    async def request_many(self, requests: list[tuple[str, bytes, dict[str, str] | None]]) -> list[Any]:
        """Send the requests at once, pipelined on one reply subscription, and wait (one timeout for all)
        for each one's answer, in order. Cheaper for both sides than a request each (nc.request). The
        answers are gathered by the reply handler and the caller wakes once, when the last comes (before,
        a future each and a gather of them)."""
        if not requests:
            return []
        answers: list[Any] = [None] * len(requests)
        ended: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        waiting = _Answers(answers, ended)
        tokens = []
        try:
            for index, (subject, payload, headers) in enumerate(requests):
                token = str(next(self._tokens))
                self._replies[token] = functools.partial(waiting.answer, index)
                tokens.append(token)
                await self.nc.publish(subject, payload, reply=f"{self._reply_prefix}.{token}", headers=headers)
            timer = asyncio.get_running_loop().call_later(self.config.nats_timeout_s, _time_out, ended)
            try:
                await ended
            finally:
                timer.cancel()
            return answers
        finally:
            for token in tokens:
                self._replies.pop(token, None)

    async def publish_each(self, messages: list[tuple[str, bytes, dict[str, str]]]) -> list[Any]:
        """Publish the messages (subject, payload, headers) one at a time, pipelined, in order: for each, its
        PubAck or the error JetStream answered, as an APIError (one timeout for all: then a NATS
        TimeoutError). On request_many, not nats-py's publish_async: that leaves the future of a publish
        JetStream answers with an error unresolved (its reply handler raises the error into the
        connection's error callback instead), so every refusal (an inbox full, a message id in process
        elsewhere) waited out the whole timeout."""
        answers = await self.request_many([(subject, payload, headers or None)
                                           for subject, payload, headers in messages])
        return [_pub_ack(answer) for answer in answers]

    async def publish_batch(self, messages: list[tuple[str, bytes, dict[str, str]]]) -> list[int]:
        """Publish the messages (subject, payload, headers) into one stream as one atomic batch: stored all
        together, one after the other, or none of them (then an APIError names why; BATCH_REFUSED: a
        message at a time would store some). The batch costs the server one write and the client one
        answer, where a message at a time costs a write (fsynced) and an answer each: 11,300 against
        5,200 messages/s here (bench/nats_probe.py). Their sequences, in order. At most BATCH_MAX."""
        assert 0 < len(messages) <= BATCH_MAX
        batch_id = f"{self.origin}-{next(self._tokens)}"
        last = len(messages)
        for number, (subject, payload, headers) in enumerate(messages[:-1], 1):
            await self.nc.publish(subject, payload, headers={**headers, "Nats-Batch-Id": batch_id,
                                                             "Nats-Batch-Sequence": str(number)})
        subject, payload, headers = messages[-1]
        answer, = await self.request_many([(subject, payload, {**headers, "Nats-Batch-Id": batch_id,
                                                               "Nats-Batch-Sequence": str(last),
                                                               "Nats-Batch-Commit": "1"})])
        reply = json.loads(answer.data) if answer.data else {}
        if "error" in reply or "seq" not in reply:
            error = reply.get("error") or {}
            raise APIError(code=error.get("code"), err_code=error.get("err_code"),
                           description=str(error.get("description", "no answer to an atomic batch"))[:200])
        if int(reply.get("count", last)) != last:
            raise APIError(description=f"atomic batch stored {reply.get('count')} of {last} messages")
        end = int(reply["seq"])
        return list(range(end - last + 1, end + 1))

    async def direct_batch(self, stream: str, subject: str, seq: int, batch: int) -> tuple[list[Any], int]:
        """The messages of `stream` on `subject` (wildcards allowed) from sequence `seq` on, at most `batch`,
        in stream order, in one batched direct get (nats-server 2.11 and later); and how many more on the
        subject follow them. Each message's sequence is its header Nats-Sequence."""
        return await self.direct_get(stream, {"seq": seq, "next_by_subj": subject, "batch": batch})

    async def direct_get(self, stream: str, request: dict[str, Any]) -> tuple[list[Any], int]:
        """The messages a batched direct get of `stream` answers (a batch from a sequence on a subject, or
        the last message of each of several subjects: `multi_last`), and how many more follow them. The
        answers are gathered by the reply subscription's handler and the caller wakes once, at the end of
        the batch (one timeout for all of it): before, each answer went through a queue and a wait of its
        own, which made a count of one inbox (its first message and the end of the batch) cost as much
        client CPU as the JetStream API's stream info (bench/nats_probe.py)."""
        token = str(next(self._tokens))
        found: list[Any] = []
        ended: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._replies[token] = functools.partial(_gather_direct, found, ended, stream)
        try:
            await self.nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(),
                                  reply=f"{self._reply_prefix}.{token}")
            timer = asyncio.get_running_loop().call_later(self.config.nats_timeout_s, _time_out, ended)
            try:
                return found, await ended
            finally:
                timer.cancel()
        finally:
            self._replies.pop(token, None)

    def appended_subject(self, token: str) -> str:
        """The core NATS subject of the notices that an agent's inbox (its subject token) has new messages."""
        return f"{self.ns}.appended.{token}"

    def kv_subject(self, bucket: str, key: str) -> str:
        """The subject a bucket's key is written on."""
        return f"$KV.{self.ns}_{bucket}.{key}"

    def bucket(self, name: str) -> Any:
        """A key-value bucket (nats.js.kv.KeyValue) of BUCKETS."""
        try:
            return self._kv[name]
        except KeyError:
            raise errors.Unavailable("the store is not running", reason=Reason.STORE_CLOSED) from None

    @property
    def agents(self) -> Any:
        return self.bucket("agents")

    @property
    def msgs(self) -> Any:
        return self.bucket("msgs")

    @property
    def runs(self) -> Any:
        return self.bucket("runs")

    @property
    def runwork(self) -> Any:
        return self.bucket("runwork")

    @property
    def misc(self) -> Any:
        return self.bucket("misc")

    def kv_stream(self, bucket: str) -> str:
        """The stream behind a bucket (the keeper reads its writes in order)."""
        return f"KV_{self.ns}_{bucket}"
