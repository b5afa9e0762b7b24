"""Serving the gateway: the Agent Card (/.well-known/agent-card.json), the JSON-RPC binding (POST /) over
HTTP with server-sent events for streams, and the gRPC binding (a2a.v1.A2AService), all through a2a-sdk's
own route and servicer code around inboxmesh.a2a.gateway.Gateway."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import grpc
import uvicorn
from a2a.server.request_handlers.grpc_handler import GrpcHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.types import a2a_pb2 as a2a
from a2a.types import a2a_pb2_grpc
from starlette.applications import Starlette

from inboxmesh.a2a import errors as a2a_errors
from inboxmesh.a2a.gateway import A2aConfig, Gateway

log = logging.getLogger(__name__)


def agent_card(config: A2aConfig, name: str, http_url: str, grpc_target: str) -> a2a.AgentCard:
    card = a2a.AgentCard(
        name=name or config.agent_id, version="1.0.0",
        description=config.description or f"Agent {name or config.agent_id} of an inboxmesh mesh: every message is"
                                          " stored in its durable inbox and answered from it",
        capabilities=a2a.AgentCapabilities(streaming=True, push_notifications=False),
        default_input_modes=["text/plain", "application/json"], default_output_modes=["text/plain"],
        supported_interfaces=[
            a2a.AgentInterface(url=http_url, protocol_binding="JSONRPC", protocol_version="1.0"),
            a2a.AgentInterface(url=grpc_target, protocol_binding="GRPC", protocol_version="1.0")],
        skills=[a2a.AgentSkill(id=skill_id, name=skill_id, description=text, tags=["inboxmesh"])
                for skill_id, text in config.skills] or [
            a2a.AgentSkill(id="message", name="message", tags=["inboxmesh"],
                           description=f"Send {name or 'the agent'} a message; its answer completes the task")],
    )
    if not config.anonymous:
        card.security_schemes["bearer"].http_auth_security_scheme.scheme = "Bearer"
        card.security_requirements.add().schemes["bearer"].SetInParent()
    return card


class A2aServer:
    """The gateway and its two listeners; `start()`, then `stop()`."""

    def __init__(self, config: A2aConfig):
        a2a_errors.register()
        self.config = config
        self.gateway = Gateway(config)
        self.http_url = ""
        self.grpc_target = ""
        self._grpc: grpc.aio.Server | None = None
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task | None = None

    async def start(self) -> None:
        config = self.config
        await self.gateway.start()
        self._grpc = grpc.aio.server()
        a2a_pb2_grpc.add_A2AServiceServicer_to_server(GrpcHandler(self.gateway), self._grpc)
        grpc_port = self._grpc.add_insecure_port(f"{config.host}:{config.grpc_port}")
        await self._grpc.start()
        sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((config.host, config.http_port))
        http_port = sock.getsockname()[1]
        self.http_url = (config.public_url or f"http://{config.host}:{http_port}").rstrip("/") + "/"
        self.grpc_target = f"{config.host}:{grpc_port}"
        card = agent_card(config, self.gateway.exposed_name, self.http_url, self.grpc_target)
        app = Starlette(routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(self.gateway, rpc_url="/")])
        self._http = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]), name="a2a-http")
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()
            await asyncio.sleep(0.02)
        log.info("A2A gateway serving %s (JSON-RPC) and %s (gRPC)", self.http_url, self.grpc_target)

    async def stop(self) -> None:
        if self._http is not None:
            self._http.should_exit = True
        if self._http_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._http_task, 5.0)
        if self._grpc is not None:
            await self._grpc.stop(1.0)
        await self.gateway.stop()
