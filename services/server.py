"""One mesh process: the store, the services the config names, one gRPC
server with health checking and reflection, and an orderly lifecycle."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.events.v1 import events_pb2, events_pb2_grpc
from inboxmesh.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from inboxmesh.inbox.v1 import inbox_pb2, inbox_pb2_grpc
from inboxmesh.ioa.v1 import relay_pb2, relay_pb2_grpc
from inboxmesh.registry.v1 import registry_pb2, registry_pb2_grpc
from inboxmesh.routing.v1 import routing_pb2, routing_pb2_grpc
from inboxmesh.runs.v1 import runs_pb2, runs_pb2_grpc
from services import settings, tls
from services.assembly import assemble, check
from services.config import MeshConfig
from services.events.grpc_handler import EventServicer
from services.gateway.grpc_handler import GatewayServicer
from services.grpc_common import mesh_interceptors, receive_limit
from services.inbox.grpc_handler import InboxServicer
from services.ioa.grpc_handler import IoaRelayServicer
from services.ioa.relay import IoaRelay
from services.registry.grpc_handler import RegistryServicer
from services.routing.grpc_handler import RoutingServicer
from services.routing.reload import RoutingReloader
from services.runs.grpc_handler import RunServicer
from services.store import open_store
from services.store.base import Store
from services.webview import WebView

log = logging.getLogger(__name__)

SERVICE_NAMES = {  # the names services.assembly.KNOWN_SERVICES allows
    "registry": registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name,
    "inbox": inbox_pb2.DESCRIPTOR.services_by_name["InboxService"].full_name,
    "events": events_pb2.DESCRIPTOR.services_by_name["EventService"].full_name,
    "relay": relay_pb2.DESCRIPTOR.services_by_name["IoaRelayService"].full_name,
}
RUNS_SERVICE = runs_pb2.DESCRIPTOR.services_by_name["SubagentRunService"].full_name
"""Served with the registry (children are registered with their runs)."""
GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
"""Served with the inbox (gateways to outside agent networks: A2A)."""
ROUTING_SERVICE = routing_pb2.DESCRIPTOR.services_by_name["RoutingService"].full_name
"""Served beside the inbox when the mesh has a routing config."""


def server_options(config: MeshConfig) -> list[tuple[str, int]]:
    return [
        # Refuse a port another process already serves (gRPC shares it by default).
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", receive_limit(config.max_request_bytes)),
        ("grpc.max_send_message_length", config.max_request_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def serve_reflection(names: list[str], server: grpc.aio.Server) -> None:
    """gRPC reflection, v1alpha and v1 (what newer tools ask first). grpcio-reflection ships only v1alpha,
    whose messages are v1's on the wire: the one servicer answers both."""
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}),))


class Mesh:
    """The mesh services of one process. `async with Mesh(config) as mesh:`.

    `config` is final: the Mesh applies nothing over it (services.settings merges flags, the environment
    and files into a MeshConfig). The services are built in one place, services.assembly."""

    def __init__(self, config: MeshConfig, store: Store | None = None):
        routing = settings.routing_rules(config)
        check(config, routing)
        self.config = config
        self.store = store or open_store(config.store)
        self.services = assemble(config, self.store, routing)
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.routing_reloader = (RoutingReloader(config.routing, self.services.routing)
                                 if config.routing is not None and self.services.routing is not None else None)
        """Watches the routing file (services/routing/reload.py)."""
        self.web = (WebView(config.web, config, self.services.events, self.services.registry, self.store,
                            routing=self.services.routing)
                    if config.web is not None else None)
        """The web view (services/webview), when the config asks for one; it lives and dies with the mesh."""
        self.health = health.aio.HealthServicer()
        self._stopped = asyncio.Event()
        self._state = "new"
        self.lost = ""
        """Why the mesh stopped by itself (its store lost for good: Store.on_lost); empty otherwise."""
        self._stopping_task: asyncio.Task[None] | None = None
        self.store.on_lost(self._store_lost)

    @property
    def relay(self) -> IoaRelay | None:
        """The IOA relay, when the mesh is on an IOA network."""
        return self.services.relay

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def _build_server(self) -> grpc.aio.Server:
        built = self.services
        directory = built.directory
        server = grpc.aio.server(options=server_options(self.config),
                                 interceptors=mesh_interceptors(self.config.max_request_bytes, directory,
                                                               bind=self.config.bind_credentials))
        wanted = self.config.services
        extra = []
        if "registry" in wanted:
            registry_pb2_grpc.add_RegistryServiceServicer_to_server(RegistryServicer(built.registry), server)
            runs_pb2_grpc.add_SubagentRunServiceServicer_to_server(RunServicer(built.runs), server)
            extra.append(RUNS_SERVICE)
        if built.routing is not None:
            routing_pb2_grpc.add_RoutingServiceServicer_to_server(RoutingServicer(built.routing), server)
            extra.append(ROUTING_SERVICE)
        if "inbox" in wanted:
            inbox_pb2_grpc.add_InboxServiceServicer_to_server(InboxServicer(built.inbox), server)
            gateway_pb2_grpc.add_GatewayServiceServicer_to_server(GatewayServicer(built.gateway), server)
            extra.append(GATEWAY_SERVICE)
        if "events" in wanted:
            events_pb2_grpc.add_EventServiceServicer_to_server(EventServicer(built.events), server)
        if built.relay is not None:
            relay_pb2_grpc.add_IoaRelayServiceServicer_to_server(IoaRelayServicer(built.relay, directory), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [SERVICE_NAMES[s] for s in wanted if s != "relay"] + (
            [SERVICE_NAMES["relay"]] if self.relay is not None else []) + extra
        serve_reflection([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                          reflection.SERVICE_NAME], server)
        return server

    async def start(self) -> int:
        if self._state != "new":
            raise RuntimeError(f"mesh already {self._state}")
        self._state = "starting"
        await self.store.start()
        try:
            self.server, self.port = create_server(self.config, self._build_server())
            await self.server.start()
            if self.web is not None:
                try:
                    await self.web.start()
                except BaseException:
                    await self.server.stop(0)
                    raise
        except BaseException:
            await self.store.close()
            self._state = "stopped"
            self._stopped.set()
            raise
        if self.relay is not None:
            await self.relay.start()
        if "registry" in self.config.services:
            self.services.runs.start()
        if self.routing_reloader is not None:
            self.routing_reloader.start()
        for service in self.config.services:
            await self.health.set(SERVICE_NAMES[service], health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._state = "running"
        log.info("mesh serving %s on %s", ", ".join(self.config.services), self.address)
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, let running ones finish within the grace
        period, end subscriptions, flush the store. Safe to call twice."""
        if self._state in ("stopping", "stopped", "new"):
            if self._state == "stopping":
                await self._stopped.wait()
            return
        self._state = "stopping"
        try:
            await self.health.enter_graceful_shutdown()
            if self.web is not None:  # its live streams end before the event service does
                await self.web.stop()
            if self.routing_reloader is not None:
                await self.routing_reloader.stop()
            self.services.hub.shutdown()
            self.services.events.shutdown()
            await self.services.runs.stop()
            if self.server is not None:
                await self.server.stop(self.config.grace_period_s if grace is None else grace)
            if self.relay is not None:
                await self.relay.stop()
        finally:
            try:
                await self.store.close()
            except Exception:  # (a store lost for good cannot flush): the mesh is stopped all the same
                log.exception("the store did not close cleanly")
            finally:
                self._state = "stopped"
                self._stopped.set()
                log.info("mesh on %s stopped", self.address)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def _store_lost(self, why: str) -> None:
        """The store cannot recover by itself: stop (health NOT_SERVING at once, calls in progress end
        within the grace period), so that the process ends and its supervisor starts it again
        (`inboxmesh up` exits with status 1)."""
        if self.lost or self._state != "running":
            return
        self.lost = why
        log.critical("the store is lost for good (%s): the mesh stops", why)
        self._stopping_task = asyncio.get_running_loop().create_task(self.stop(), name="mesh-stop-store-lost")

    async def __aenter__(self) -> Mesh:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()


def create_server(config: MeshConfig, server: grpc.aio.Server) -> tuple[grpc.aio.Server, int]:
    """Bind the server to the configured address, with TLS when configured (plaintext only on a loopback
    address unless config.insecure); returns it with its port."""
    credentials = tls.listen_credentials(config.tls, config.host, config.insecure, "the mesh")
    try:
        address = f"{config.host}:{config.port}"
        port = (server.add_secure_port(address, credentials) if credentials is not None else
                server.add_insecure_port(address))
    except RuntimeError as exc:
        raise errors.Unavailable(
            f"could not listen on {config.host}:{config.port} (in use by another process?): {exc}",
            reason=Reason.BIND_FAILED) from None
    return server, port

