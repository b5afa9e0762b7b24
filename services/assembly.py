"""The one place where a mesh process's services are built, each through its constructor with only what
it uses. Nothing sets an attribute on a service after it was built; where two services need each other,
the cycle is broken here, and said where:

- registry <-> runs: the registry registers children with their runs (RunService.new_run, limits_for) and
  tells it of closes; a run's cleanup closes its child. Closing as the mesh is its own small object,
  AgentCloser, so the order is closer -> runs (given closer.close, a callable) -> registry (given runs and
  closer.close). No cycle.
- inbox <-> IOA relay: a local send to an IOA address goes out through the relay, and the relay stores
  what it receives by the ordinary inbox path. That path is InboxWriter, which sends nothing onwards: the
  order is writer -> relay (given writer.deliver_from_ioa, a callable) -> inbox (given writer and
  relay.forward, a callable). No cycle.
- runs -> routing config: the RunService takes the loaded routing config (configured agents' spawn
  policies) in its constructor; so does the RoutingService. Plain order.

The store is one object; each constructor names the store interfaces it uses (services.store.base:
AgentStore, InboxStore, RunStore, EventStore) and is handed that same object for each.
"""

from __future__ import annotations

from dataclasses import dataclass

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from services.config import MeshConfig
from services.directory import Directory
from services.events.service import EventsService
from services.gateway.service import GatewayService, gateway_agent_id
from services.inbox.delivery import DeliveryHub
from services.inbox.service import InboxService
from services.inbox.writer import InboxWriter
from services.ioa.exposure import Exposure
from services.ioa.relay import IoaRelay
from services.registry.service import AgentCloser, RegistryService
from services.routing.config import RoutingConfig
from services.routing.service import RoutingService
from services.runs.service import RunService
from services.store.base import Store

KNOWN_SERVICES = ("registry", "inbox", "events", "relay")
"""What MeshConfig.services may name (runs are served with the registry, routing beside the inbox)."""


@dataclass(frozen=True)
class Services:
    """Every service of one mesh process, as assemble() built them."""

    directory: Directory
    """Agents by id and credential (cached), and who may reach whom: the services' and the server's."""
    hub: DeliveryHub
    """Subscriptions: delivery streams, woken by appends and acks, ended by closes."""
    registry: RegistryService
    runs: RunService
    inbox: InboxService
    events: EventsService
    routing: RoutingService | None
    """Present when the mesh has a routing config."""
    relay: IoaRelay | None
    """Present when the mesh is on an IOA network (MeshConfig.ioa)."""
    gateway: GatewayService
    """Gateways to outside agent networks (A2A): served with the inbox."""


def check(config: MeshConfig, routing: RoutingConfig | None) -> None:
    """Refuse a combination of services the mesh cannot serve (BAD_CONFIG), before anything is built."""
    unknown = set(config.services) - set(KNOWN_SERVICES)
    if unknown:
        raise errors.InvalidArgument(f"unknown services {sorted(unknown)}; known: {sorted(KNOWN_SERVICES)}",
                                     reason=Reason.BAD_CONFIG)
    if routing is not None and "inbox" not in config.services:
        raise errors.InvalidArgument("routing needs the inbox service", reason=Reason.BAD_CONFIG)
    if ("relay" in config.services or config.ioa is not None) and (
            config.ioa is None or "inbox" not in config.services):
        raise errors.InvalidArgument("the IOA relay needs an IOA network (ioa) and the inbox service",
                                     reason=Reason.BAD_CONFIG)
    if config.bind_credentials and config.tls.ca is None:
        raise errors.InvalidArgument("--bind-credentials binds agents to client certificates: it needs mutual TLS"
                                     " (--tls-cert, --tls-key and --tls-client-ca)", reason=Reason.BAD_CONFIG,
                                     metadata={"setting": "--bind-credentials"})


def assemble(config: MeshConfig, store: Store, routing: RoutingConfig | None) -> Services:
    """Build the services of `config` on `store` (not started; the Mesh starts and stops them).
    `routing` is the routing config MeshConfig.routing names, loaded (services.settings.routing_rules)."""
    check(config, routing)
    limits = config.limits
    directory = Directory(store, admin_token=config.admin_token, allow_cross_scope=limits.allow_cross_scope)
    hub = DeliveryHub(store, limits, config.heartbeat_interval_s)
    # appends made by other processes on a shared store wake this process's subscriptions
    store.add_append_listener(hub.wake_agent)

    closer = AgentCloser(store, directory, listeners=(hub.on_closed,))
    runs = RunService(store, store, directory, hub, config.runs, routing, close_agent=closer.close)
    registry = RegistryService(store, store, store, directory, limits, runs, close_agent=closer.close,
                               bind_credentials=config.bind_credentials)

    writer = InboxWriter(store, directory, limits, hub,
                         Exposure.parse(config.ioa.expose) if config.ioa is not None else None)
    relay = None
    if config.ioa is not None:
        relay = IoaRelay(config.ioa, store, limits.max_hops, deliver=writer.deliver_from_ioa,
                         stored=store.get_message_by_sender, outbox=store, store_notice=writer.deliver_notice)
    routing_service = None
    if routing is not None:
        routing_service = RoutingService(routing, agents=store, sessions=store, events=store, directory=directory,
                                         deliver=writer.deliver_from_channel, limits=limits,
                                         admin_token=config.admin_token)
        routing_service.on_change(runs.use_routing)
    a2a_agent_id = gateway_agent_id("a2a")

    async def a2a_gateway():
        return await directory.get(a2a_agent_id)

    inbox = InboxService(store, store, directory, limits, hub, writer,
                         forward_to_ioa=relay.start_forward if relay is not None else None,
                         channel_gateway=routing_service.gateway if routing_service is not None else None,
                         a2a_gateway=a2a_gateway)
    gateway = GatewayService(store, directory, limits, validate=inbox.validate_external,
                             deliver=writer.deliver_from_a2a)
    return Services(directory=directory, hub=hub, registry=registry, runs=runs, inbox=inbox,
                    events=EventsService(store, directory), routing=routing_service, relay=relay, gateway=gateway)
