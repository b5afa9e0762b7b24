"""An A2A agent built with a2a-sdk alone (its DefaultRequestHandler, InMemoryTaskStore, Agent Card and
JSON-RPC routes, served by uvicorn on loopback): the far side of the gateway's outbound tests, and the
"SDK alone" column of the retry and resume comparison (harness/a2a_compare.py).

What it does with a message's text: `fail ...` fails the task, `slow ...` answers after `slow_s`, anything
else is answered `pong: <text>` as an artifact and the task completes. With `token` set, a request without
`Authorization: Bearer <token>` is answered 401 before the SDK sees it. It counts the executions it ran,
by messageId, so a test can tell a retry that became a second execution from one that did not."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import uvicorn
from a2a.helpers.proto_helpers import get_message_text, new_text_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue_v2 import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import a2a_pb2 as a2a
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import JSONResponse


@dataclass
class PongExecutor(AgentExecutor):
    slow_s: float = 3.0
    executions: collections.Counter = field(default_factory=collections.Counter)
    """messageId -> how many times it was executed."""
    seen_metadata: list[dict] = field(default_factory=list)

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        assert message is not None and context.task_id and context.context_id
        self.executions[message.message_id] += 1
        self.seen_metadata.append(dict(message.metadata))
        text = get_message_text(message)
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        if context.current_task is None:  # the SDK wants the Task first, then its updates
            await event_queue.enqueue_event(a2a.Task(
                id=context.task_id, context_id=context.context_id, history=[message],
                status=a2a.TaskStatus(state=a2a.TASK_STATE_SUBMITTED)))
        await updater.start_work()
        if text.startswith("fail"):
            await updater.failed(new_text_message(f"cannot: {text}", role=a2a.ROLE_AGENT))
            return
        if text.startswith("slow"):
            await asyncio.sleep(self.slow_s)
        await updater.add_artifact([a2a.Part(text=f"pong: {text}")], name="answer")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        await TaskUpdater(event_queue, context.task_id or "", context.context_id or "").cancel()


class _Bearer(BaseHTTPMiddleware):
    def __init__(self, app, token: str):
        super().__init__(app)
        self._token = token

    async def dispatch(self, request, call_next):
        if request.url.path.startswith("/.well-known/"):
            return await call_next(request)
        if request.headers.get("authorization") != f"Bearer {self._token}":
            return JSONResponse({"error": "a bearer token is required"}, status_code=401)
        return await call_next(request)


@contextlib.asynccontextmanager
async def pong_agent(*, token: str | None = None, slow_s: float = 3.0) -> AsyncIterator[tuple[str, PongExecutor]]:
    """Serve the agent; yields (its base URL, its executor). Stopped when the block ends."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    card = a2a.AgentCard(
        name="pong", description="answers pong", version="1.0.0",
        capabilities=a2a.AgentCapabilities(streaming=True), default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        supported_interfaces=[a2a.AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")],
        skills=[a2a.AgentSkill(id="pong", name="pong", description="answers pong", tags=["test"])])
    if token:
        card.security_schemes["bearer"].http_auth_security_scheme.scheme = "Bearer"
        card.security_requirements.add().schemes["bearer"].SetInParent()
    executor = PongExecutor(slow_s=slow_s)
    handler = DefaultRequestHandler(agent_executor=executor, task_store=InMemoryTaskStore(), agent_card=card)
    app = Starlette(routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, rpc_url="/")])
    if token:
        app.add_middleware(_Bearer, token=token)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    try:
        yield url, executor
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5.0)
