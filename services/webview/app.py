"""The web view's HTTP server (aiohttp): a few static files, a snapshot, a live event stream and a message's
path, for the operator token only. Read-only: nothing here changes the mesh.

Routes:
    GET /?token=T            sets the session cookie (HttpOnly, SameSite=Strict) and redirects to /
    GET /, /message/<id>     the page (static/index.html; app.js shows the tree and the sequence diagram, or
                             one message's path)
    GET /static/<file>       app.js, style.css
    GET /api/snapshot        the agent tree (registry), live states and inbox depths (the board), newest events
    GET /api/events          server-sent events after ?after=N or the Last-Event-ID header (the event id)
    GET /api/message/<id>    every event of one message, in order, with the replies its recipient stored
    GET /metrics             the mesh's metrics in Prometheus's text format (metrics.py, docs/metrics.md)

Every route but the static files needs the operator token: the cookie, or `Authorization: Bearer <token>`;
anything else is 401 with a short JSON error (/metrics, like /api/, never takes ?token=: a token in a scrape
URL would end up in logs). The token is never logged (the access log is off: its request
lines would carry ?token=).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.events.v1 import events_pb2 as ev
from services import tls
from services.config import MeshConfig, WebConfig
from services.directory import Caller
from services.events.service import EventsService
from services.registry.service import RegistryService
from services.routing.service import RoutingService
from services.store.base import AGENT_CLOSED, AgentRecord, EventStore
from services.webview.board import Board, LiveAgent, event_json
from services.webview.identities import Identities
from services.webview.metrics import CONTENT_TYPE, MeshMetrics

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
COOKIE = "inboxmesh_web"
OPERATOR = Caller(agent=None)
"""The web view reads as the operator: only callers who proved the operator token reach it."""
_MESSAGE_PAGES = 5
"""Pages of 1,000 events a message's path (and the search for its replies) reads at most."""
_MODES = {1: "main", 2: "sync", 3: "async", 4: "fork"}
FOLLOW_RETRY_S = 2.0
"""How soon the board's watch of the record starts again after reading the store failed."""
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def session_value(admin_token: str) -> str:
    """The cookie's value: derived from the token (the token itself never goes into a cookie), the same for
    every session, so a restarted mesh with the same token keeps its pages signed in; a new token signs
    every page out."""
    return hmac.new(admin_token.encode(), b"inboxmesh web view session v1", hashlib.sha256).hexdigest()


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status, headers={"Cache-Control": "no-store"})


class WebView:
    """The web view of one mesh process: `start()` after the mesh's gRPC server, `stop()` before its services
    shut down (services.server.Mesh does both). `url` is where it serves."""

    def __init__(self, config: WebConfig, mesh: MeshConfig, events: EventsService, registry: RegistryService,
                 record: EventStore, routing: RoutingService | None = None):
        if not mesh.admin_token:
            raise errors.InvalidArgument("the web view is for the operator token, and this mesh has none: give"
                                         " --admin-token, or turn the web view off (--no-web)",
                                         reason=Reason.BAD_CONFIG, metadata={"setting": "--web-port"})
        self.config = config
        self._mesh = mesh
        self._token = mesh.admin_token
        self._session = session_value(mesh.admin_token)
        self._events = events
        self._registry = registry
        self._record = record
        self.identities = Identities(routing)
        """The configured agents' identities shown beside the agents that run as one (the routing service's
        current config; none without one)."""
        self.board = Board(config.recent_events, config.tracked_agents)
        self.metrics = MeshMetrics()
        """The metrics of /metrics, folded from the same watch of the record as the board."""
        self._runner: web.AppRunner | None = None
        self._follow: asyncio.Task[None] | None = None
        self._follow_error: BaseException | None = None
        self._folded = asyncio.Event()
        """Set whenever the board folded a batch (a snapshot waiting for it to catch up looks again)."""
        self._streams: set[asyncio.Task[Any]] = set()
        self._pumps: set[asyncio.Task[None]] = set()
        """Each live stream's watch of the record (its own, stopped with it; the rest at stop())."""
        self._closing = asyncio.Event()
        self.port = 0
        self.scheme = "http"

    @property
    def url(self) -> str:
        host = self._mesh.host
        return f"{self.scheme}://{f'[{host}]' if ':' in host else host}:{self.port}/"

    @property
    def following(self) -> bool:
        """Whether the board follows the record (from the first signed-in request on)."""
        return self._follow is not None and not self._follow.done()

    # -- lifecycle ------------------------------------------------------------------------------------------
    def _ssl_context(self) -> ssl.SSLContext | None:
        """TLS with the mesh's own certificate when it has one (no client certificate asked: the token is the
        proof); plaintext beyond loopback only with --insecure, as for the gRPC port."""
        files = self._mesh.tls
        if files.cert is None or files.key is None:
            tls.listen_credentials(files, self._mesh.host, self._mesh.insecure, "the web view")  # refuses or None
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(files.cert), str(files.key))
        return context

    async def start(self) -> None:
        context = self._ssl_context()
        self.scheme = "https" if context is not None else "http"
        app = web.Application(middlewares=[self._headers])
        app.router.add_get("/", self._page)
        app.router.add_get("/message/{message_id:.+}", self._page)
        app.router.add_get("/api/snapshot", self._snapshot)
        app.router.add_get("/api/events", self._stream)
        app.router.add_get("/api/message/{message_id:.+}", self._message)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_static("/static/", STATIC, show_index=False, follow_symlinks=False)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=self._mesh.grace_period_s)
        await runner.setup()
        try:
            self.port = await self._listen(runner, context)
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        log.info("web view at %s", self.url)

    async def _listen(self, runner: web.AppRunner, context: ssl.SSLContext | None) -> int:
        port = self.config.port
        for attempt in (port, 0) if self.config.any_port_if_taken and port else (port,):
            site = web.TCPSite(runner, self._mesh.host, attempt, ssl_context=context)
            try:
                await site.start()
            except OSError as exc:
                await site.stop()  # never started: only leaves the runner
                if attempt == 0 or not self.config.any_port_if_taken:
                    raise errors.Unavailable(
                        f"the web view could not listen on {self._mesh.host}:{attempt} (in use by another"
                        f" process?): {exc}. Use --web-port 0 for any free port, or --no-web",
                        reason=Reason.BIND_FAILED, metadata={"setting": "--web-port"}) from None
                log.info("web view: port %d is taken; serving on a free port instead", attempt)
                continue
            return int(runner.addresses[0][1])
        raise AssertionError("unreachable: the last attempt raises")

    def _start_following(self) -> None:
        """The board follows the whole record from its first event, from the first signed-in request on for as
        long as the web view runs: a mesh nobody looks at pays for an open port only."""
        if self._follow is None and not self._closing.is_set():
            self._follow = asyncio.create_task(self._follow_record(), name="webview-board")

    async def _follow_record(self) -> None:
        """Fold the record into the board until the events service shuts down. When reading the store fails
        (NATS away), snapshots say so (503) instead of serving a board that stopped, and the watch starts
        again after the board's last event every FOLLOW_RETRY_S: the fold goes on where it was."""
        while not self._closing.is_set():
            try:
                async for batch in self._events.watch(OPERATOR, ev.EventFilter(), self.board.last_event_id, False):
                    self.board.fold(batch)
                    self.metrics.fold(batch)
                    self._follow_error = None
                    self._folded.set()
                return
            except Exception as exc:
                self._follow_error = exc
                self._folded.set()
                log.warning("web view: reading the event record failed (again in %.0f s): %s", FOLLOW_RETRY_S, exc)
            await asyncio.sleep(FOLLOW_RETRY_S)

    async def stop(self) -> None:
        """End the live streams, stop serving, stop following the record. Safe to call twice."""
        self._closing.set()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        follow, self._follow = self._follow, None
        for task in [*self._pumps, *([follow] if follow is not None else [])]:
            await _stop(task)
        self.metrics.shutdown()

    # -- auth and headers ---------------------------------------------------------------------------------------
    def _signed_in(self, request: web.Request) -> bool:
        cookie = request.cookies.get(COOKIE, "")
        if cookie and hmac.compare_digest(cookie.encode(), self._session.encode()):
            return True
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token.encode())

    def _token_given(self, request: web.Request) -> bool | None:
        """Whether ?token= is this mesh's operator token; None when there is no ?token= or not on a page."""
        given = request.query.get("token")
        if given is None or request.path.startswith(("/api/", "/static/", "/metrics")):
            return None
        return hmac.compare_digest(given.encode(), self._token.encode())

    @web.middleware
    async def _headers(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/static/"):
            pass
        elif self._signed_in(request) or self._token_given(request):
            self._start_following()
        else:
            return _error(401, "the web view needs the operator token: open it once as /?token=<admin token>"
                               " (mesh.json's admin_token), or send Authorization: Bearer <admin token>")
        response = await handler(request)
        if not response.prepared:
            response.headers.update(_SECURITY_HEADERS)
        return response

    async def _page(self, request: web.Request) -> web.StreamResponse:
        if self._token_given(request):  # the token once in the address: a cookie instead, and the token out of it
            response = web.Response(status=302, headers={"Location": request.path})
            response.set_cookie(COOKIE, self._session, httponly=True, samesite="Strict", path="/",
                                secure=self.scheme == "https")
            return response
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    # -- data ---------------------------------------------------------------------------------------------------
    async def _snapshot(self, request: web.Request) -> web.Response:
        caught_up = await self._catch_up()
        if self._follow_error is not None:
            return _error(503, f"the web view lost the event record: {self._follow_error}")
        records, listed_all = await self._tree()
        board = self.board  # read at once, with no await in between: one consistent fold at last_event_id
        by_id = {r.agent_id: r for r in records}
        agents = [{**self._agent_json(r, board.agents.get(r.agent_id)),
                   "identity": self.identities.of(r, by_id.get(r.parent_id))} for r in records]
        return web.json_response({
            "services": list(self._mesh.services),
            "last_event_id": board.last_event_id, "caught_up": caught_up, "agents": agents,
            "all_agents_listed": listed_all,
            "untracked_agents": board.untracked, "events": [event_json(e) for e in board.recent],
        }, headers={"Cache-Control": "no-store"})

    async def _metrics(self, request: web.Request) -> web.Response:
        """The metrics as of the record's last event when the scrape came (waiting for the fold as a snapshot
        does; a fold still behind after that answers what it has, and inboxmesh_record_folded_event_id says
        where it is)."""
        await self._catch_up()
        if self._follow_error is not None:
            return _error(503, f"the web view lost the event record: {self._follow_error}")
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-store"})

    async def _catch_up(self) -> bool:
        """Wait (at most catch_up_s) for the board to reach the record's last event as of now: right after the
        board started it is still reading the record. Whether it did; a snapshot of a board behind is still
        consistent (the fold up to its last_event_id), and the page follows the stream from there."""
        target = await self._record.last_event_id()
        try:
            async with asyncio.timeout(self.config.catch_up_s):
                while self.board.last_event_id < target and self._follow_error is None:
                    self._folded.clear()
                    await self._folded.wait()
        except TimeoutError:
            return False
        return self.board.last_event_id >= target

    async def _tree(self) -> tuple[list[AgentRecord], bool]:
        """The agents of the newest trees, from the registry (each tree by its scope), at most
        snapshot_agents; and whether that was all of them."""
        found: list[AgentRecord] = []
        limit = self.config.snapshot_agents
        for scope in reversed(list(self.board.scopes)):
            token = ""
            while True:
                try:
                    page, token = await self._registry.list(OPERATOR, scope_id=scope, parent_id="",
                                                            include_closed=True, size=1000, page_token=token)
                except errors.NotFound:  # registered in the record, gone from the store (a wiped store)
                    break
                found += page
                if len(found) >= limit:
                    return found[:limit], False
                if not token:
                    break
        return found, True

    @staticmethod
    def _agent_json(record: AgentRecord, live: LiveAgent | None) -> dict[str, Any]:
        state = "closed" if record.state == AGENT_CLOSED else (live.state if live is not None else "registered")
        return {"id": record.agent_id, "name": record.name, "parent_id": record.parent_id,
                "scope_id": record.scope_id, "mode": _MODES.get(record.mode, str(record.mode)), "state": state,
                "done": bool(live and live.done), "depth": live.depth if live is not None else 0,
                "capacity": record.inbox_capacity, "created_at_us": record.created_at_us}

    async def _message(self, request: web.Request) -> web.Response:
        message_id = request.match_info["message_id"]
        sender = request.query.get("sender", "")
        events: list[ev.Event] = []
        after, complete = 0, False
        for _ in range(_MESSAGE_PAGES):
            page = await self._events.list(OPERATOR, ev.EventFilter(message_id=message_id), after, 1000)
            if not page:
                complete = True
                break
            events += [e for e in page if not sender or e.sender in (sender, "")]
            after = page[-1].event_id
        replies, replies_complete = await self._replies(message_id, events)
        return web.json_response({
            "message_id": message_id, "sender": sender, "events": [event_json(e) for e in events],
            "complete": complete, "replies": replies, "replies_complete": replies_complete,
            "names": await self._names({e.sender for e in events} | {e.recipient for e in events}),
        }, headers={"Cache-Control": "no-store"})

    async def _names(self, agent_ids: set[str]) -> dict[str, str]:
        """The names of the agents among these ids (at most 20: a message has a sender and a recipient)."""
        names = {}
        for agent_id in sorted(a for a in agent_ids if a.startswith("agt_"))[:20]:
            try:
                names[agent_id] = (await self._registry.get(OPERATOR, agent_id)).name
            except errors.MeshError:  # not an agent of this mesh
                continue
        return names

    async def _replies(self, message_id: str, events: list[ev.Event]) -> tuple[list[dict[str, Any]], bool]:
        """The messages its recipient stored in answer to it (in_reply_to), found in the record after it."""
        stored = next((e for e in events if e.kind == ev.EVENT_KIND_MESSAGE_STORED), None)
        if stored is None or not stored.recipient or stored.recipient.startswith(("ioa:", "channel:")):
            return [], True
        found: list[dict[str, Any]] = []
        after = stored.event_id
        query = ev.EventFilter(agent_id=stored.recipient, kinds=[ev.EVENT_KIND_MESSAGE_STORED])
        for _ in range(_MESSAGE_PAGES):
            page = await self._events.list(OPERATOR, query, after, 1000)
            if not page:
                return found, True
            found += [{"message_id": e.message_id, "sender": e.sender, "recipient": e.recipient, "event_id": e.event_id}
                      for e in page if e.in_reply_to == message_id and e.sender == stored.recipient]
            after = page[-1].event_id
        return found, False

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: one `id: <event id>` message per event, after the Last-Event-ID header (a
        reconnecting EventSource) or ?after=N, or from now without either."""
        if len(self._streams) >= self.config.max_streams:
            return web.json_response({"error": f"{len(self._streams)} live streams already; try again later"},
                                     status=503, headers={"Retry-After": "5"})
        given = request.headers.get("Last-Event-ID") or request.query.get("after")
        try:
            after = int(given) if given else 0
            if after < 0:
                raise ValueError
        except ValueError:
            return _error(400, "Last-Event-ID and ?after= are event ids (integers from 0)")
        task = asyncio.current_task()
        assert task is not None, "aiohttp runs each request in a task"
        self._streams.add(task)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                               "X-Accel-Buffering": "no", **_SECURITY_HEADERS})
        try:
            await response.prepare(request)
            await self._send(response, b"retry: 2000\n\n")
            async for chunk in self._chunks(after, from_now=not given):
                await self._send(response, chunk)
        except (ConnectionError, TimeoutError) as exc:  # gone, or not reading: its EventSource comes back
            log.debug("web view: live stream ended: %r", exc)
        finally:
            self._streams.discard(task)
        return response

    async def _send(self, response: web.StreamResponse, chunk: bytes) -> None:
        async with asyncio.timeout(self.config.write_timeout_s):
            await response.write(chunk)

    async def _chunks(self, after: int, from_now: bool) -> AsyncIterator[bytes]:
        """What a stream writes: its events (read by a pump task into a bounded queue), a comment line when
        nothing happened for keepalive_s; until the web view stops or the record fails."""
        queue: asyncio.Queue[list[ev.Event]] = asyncio.Queue(self.config.stream_queue)

        async def pump() -> None:
            async for batch in self._events.watch(OPERATOR, ev.EventFilter(), after, from_now):
                await queue.put(batch)

        pumping = asyncio.create_task(pump(), name="webview-stream")
        self._pumps.add(pumping)
        pumping.add_done_callback(self._pumps.discard)
        closing = asyncio.create_task(self._closing.wait())
        try:
            while True:
                taking = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({taking, pumping, closing}, timeout=self.config.keepalive_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if taking not in done:
                    taking.cancel()
                if taking in done:
                    batch = taking.result()
                    yield b"".join([_sse(e, await self._registered_identity(e)) for e in batch])
                elif closing in done:
                    return
                elif pumping in done:
                    pumping.result()  # raises what ended the watch
                    return
                else:
                    yield b": keepalive\n\n"
        finally:
            await _stop(closing)
            await _stop(pumping)


    async def _registered_identity(self, event: ev.Event) -> dict[str, Any] | None:
        """For an AGENT_REGISTERED event on a mesh with a routing config, the identity its agent shows (so a
        page learns it of agents registered after its snapshot): its record, and its parent's when that
        decides (Identities.runs_as); one read each per registration. None otherwise."""
        if event.kind != ev.EVENT_KIND_AGENT_REGISTERED or not self.identities.routed:
            return None
        try:
            record = await self._registry.get(OPERATOR, event.agent_id)
            parent = await self._registry.get(OPERATOR, record.parent_id) \
                if record.parent_id and self.identities.needs_parent(record) else None
        except errors.MeshError:  # gone from the store (a wiped store): shown plain
            return None
        return self.identities.of(record, parent)


async def _stop(task: asyncio.Task[Any]) -> None:
    """Cancel a task and wait for its end; cancel it again if it swallowed the cancellation (Python 3.11's
    asyncio.wait_for does when its inner future completes at that moment, and a watch then waits on), so that
    no task outlives its owner."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    if not task.cancelled() and task.exception() is not None:
        log.debug("web view: %s ended with %r", task.get_name(), task.exception())


def _sse(event: ev.Event, identity: dict[str, Any] | None = None) -> bytes:
    """One server-sent event (type "message"); its id is the event id, which a reconnecting EventSource sends
    back as Last-Event-ID. An AGENT_REGISTERED event on a mesh with a routing config carries its agent's
    `identity` (an object or null)."""
    shown = event_json(event)
    if identity is not None:
        shown["identity"] = identity
    data = json.dumps(shown, separators=(",", ":"))
    return f"id: {event.event_id}\ndata: {data}\n\n".encode()
