"""Authentication is one table (services/auth_policy.py METHOD_POLICIES) applied by one server interceptor:
every RPC the mesh serves has a row, a served method without one is refused before its handler runs, and
each policy refuses exactly as the handlers used to (codes, reasons, texts), on unary calls and on every
kind of stream, with and without call metadata. Raw gRPC calls through a real mesh that serves every
service (routing config, IOA relay on a reference network)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message

import inboxmesh
from inboxmesh.client import errors
from inboxmesh.client.mesh import MeshClient
from inboxmesh.client.status import error_info
from inboxmesh.events.v1 import events_pb2
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.registry.v1 import registry_pb2
from services import auth_policy
from services.auth_policy import METHOD_POLICIES, Policy, method_name
from services.config import IoaConfig
from services.ioa_network.server import SERVICE_NAME as NETWORK_SERVICE
from services.ioa_network.server import NetworkConfig, NetworkServer
from services.server import GATEWAY_SERVICE, ROUTING_SERVICE, RUNS_SERVICE, SERVICE_NAMES, Mesh
from tests.fixtures import ADMIN_TOKEN, make_config

ROOT = Path(__file__).resolve().parent.parent
INGRESS_TOKEN = "auth-policy-ingress-token"
ROUTING = f"""
agents:
  list:
    - id: home
      default: true
ingress:
  tokens: [{INGRESS_TOKEN}]
"""
GET_AGENT = method_name(registry_pb2, "RegistryService", "GetAgent")
WATCH_EVENTS = method_name(events_pb2, "EventService", "WatchEvents")
SUBSCRIBE = method_name(inbox_pb2, "InboxService", "Subscribe")
CONSUME = method_name(inbox_pb2, "InboxService", "Consume")
Metadata = Sequence[tuple[str, str]] | None


# -- the table covers the protos -------------------------------------------------------------------------
def generated_services() -> dict[str, list[str]]:
    """Every service of the generated packages (inboxmesh.<service>.v1 *_pb2), with its methods' full names."""
    found: dict[str, list[str]] = {}
    for module in pkgutil.walk_packages(inboxmesh.__path__, "inboxmesh."):
        parts = module.name.split(".")
        if len(parts) != 4 or parts[2] != "v1" or not parts[3].endswith("_pb2"):
            continue
        for service in importlib.import_module(module.name).DESCRIPTOR.services_by_name.values():
            found[service.full_name] = [f"/{service.full_name}/{m.name}" for m in service.methods]
    return found


MESH_SERVICES = {*SERVICE_NAMES.values(), RUNS_SERVICE, ROUTING_SERVICE, GATEWAY_SERVICE}
NOT_THE_MESHS = {NETWORK_SERVICE: "the reference IOA network: a separate program, which authenticates nobody"}


def test_every_rpc_the_mesh_serves_has_a_policy():
    services = generated_services()
    assert MESH_SERVICES <= set(services), "the mesh serves a service the generated packages do not have"
    unclassified = set(services) - MESH_SERVICES - set(NOT_THE_MESHS)
    assert not unclassified, f"services in the protos that the mesh neither serves nor leaves to another program:" \
                             f" {sorted(unclassified)} (serve them, with rows in METHOD_POLICIES, or list them here)"
    served = [method for name in sorted(MESH_SERVICES) for method in services[name]]
    assert len(served) >= 27
    missing = [method for method in served if method not in METHOD_POLICIES]
    assert not missing, f"RPCs without a row in services/auth_policy.py METHOD_POLICIES: {missing}"


def test_the_table_names_only_methods_that_exist():
    protos = {method for methods in generated_services().values() for method in methods}
    for method in METHOD_POLICIES:
        if not method.startswith(("/grpc.health.v1.", "/grpc.reflection.")):
            assert method in protos, f"{method} is in METHOD_POLICIES but in no proto"
    assert METHOD_POLICIES["/grpc.health.v1.Health/Check"].policy is Policy.PUBLIC  # standard tools need no key


def test_the_methods_open_without_a_credential_are_these():
    """Loosening a rule is a decision: this list changes with it."""
    open_ = {m for m, rule in METHOD_POLICIES.items() if rule.policy in (Policy.PUBLIC, Policy.CALLER_OR_ANONYMOUS)}
    assert open_ == {
        "/inboxmesh.registry.v1.RegistryService/RegisterAgent",  # a top-level agent registers with nothing
        "/inboxmesh.routing.v1.RoutingService/ResolveRoute",
        "/inboxmesh.routing.v1.RoutingService/ListConfiguredAgents",
        "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }


def test_no_handler_reads_credentials_itself():
    for path in sorted((ROOT / "services").rglob("grpc_handler.py")):
        source = path.read_text()
        for name in ("invocation_metadata", "bearer_from_metadata", "authenticate"):
            used = [node.lineno for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.Attribute | ast.Name) and name in (getattr(node, "attr", None),
                                                                               getattr(node, "id", None))]
            assert not used, f"{path.relative_to(ROOT)}:{used[0]} reads credentials ({name}); use authenticated()"


def test_asking_who_calls_outside_a_call_is_an_internal_error():
    with pytest.raises(errors.Internal):
        auth_policy.authenticated()


# -- calling through a real mesh ---------------------------------------------------------------------------
def rpc(method: str) -> MethodDescriptor:
    _, service, name = method.split("/")
    if service == "grpc.reflection.v1.ServerReflection":  # served with v1alpha's messages (services/server.py)
        service = "grpc.reflection.v1alpha.ServerReflection"
    return descriptor_pool.Default().FindServiceByName(service).methods_by_name[name]


def first_request(method: str) -> Message:
    """The least request that reaches authentication (Consume authenticates its `subscribe`)."""
    if method == CONSUME:
        return inbox_pb2.ConsumeRequest(subscribe=inbox_pb2.SubscribeRequest())
    return message_factory.GetMessageClass(rpc(method).input_type)()


def least_requests(method: str) -> list[Message]:
    """What a call sends before it reads: none on a stream whose refusal needs none (SendStream is refused
    before it reads anything, and a write racing that refusal makes grpc report "Internal error from Core"
    instead of the status), else the first request."""
    rule = METHOD_POLICIES[method]
    if rpc(method).client_streaming and rule.policy is not Policy.PUBLIC and rule.credentials_of is None:
        return []
    return [first_request(method)]


async def outcome(channel: grpc.aio.Channel, method: str, requests: Sequence[Message],
                  metadata: Metadata, half_close: bool = False) -> grpc.aio.AioRpcError | None:
    """How the call ended: its error, or None once it answered (a stream: its first response, or its end).
    A client stream is half-closed only when asked (a half-close racing the server's refusal can turn the
    status into "Internal error from Core" on the client side)."""
    desc = rpc(method)
    deserialize = message_factory.GetMessageClass(desc.output_type).FromString
    try:
        if not desc.client_streaming:
            [request] = requests
            if not desc.server_streaming:
                await channel.unary_unary(method, serialize, deserialize)(request, metadata=metadata, timeout=10)
                return None
            call = channel.unary_stream(method, serialize, deserialize)(request, metadata=metadata, timeout=10)
        else:
            call = channel.stream_stream(method, serialize, deserialize)(metadata=metadata, timeout=10)
            for request in requests:
                await call.write(request)
            if half_close:
                await call.done_writing()
        async for _ in call:
            call.cancel()
            return None
        return None
    except grpc.aio.AioRpcError as exc:
        return exc


def serialize(message: Message) -> bytes:
    return message.SerializeToString()


def bearer(credential: str) -> Metadata:
    return (("authorization", f"Bearer {credential}"),)


def refused(exc: grpc.aio.AioRpcError | None, code: grpc.StatusCode, reason: str, text: str, method: str) -> None:
    assert exc is not None, f"{method} answered instead of refusing with {reason}"
    info = error_info(exc)
    assert (exc.code(), info.reason if info else None) == (code, reason), f"{method}: {exc.code()} {exc.details()}"
    assert text in exc.details(), f"{method}: {exc.details()!r} does not say {text!r}"


def not_refused_for_credentials(exc: grpc.aio.AioRpcError | None, method: str) -> None:
    assert exc is None or exc.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                                             grpc.StatusCode.INTERNAL), f"{method}: {exc.code()} {exc.details()}"


@pytest.fixture
async def mesh(tmp_path):
    """A mesh serving every service: registry, runs, inbox, events, routing and the IOA relay."""
    routing = tmp_path / "routing.yaml"
    routing.write_text(ROUTING)
    async with NetworkServer(NetworkConfig()) as network:
        config = replace(make_config(tmp_path), routing=routing,
                         ioa=IoaConfig(node_id="auth-policy", network=network.address))
        async with Mesh(config) as served:
            yield served


@pytest.fixture
async def channel(mesh):
    async with grpc.aio.insecure_channel(mesh.address) as ch:
        yield ch


@pytest.fixture
async def lead(mesh):
    async with MeshClient(mesh.address, timeout=10.0, admin_token=ADMIN_TOKEN) as client:
        yield await client.register("lead")


NO_METADATA = "no metadata"
WRONG_SCHEME = "Basic scheme"
NO_DOT = "no dot"
UNKNOWN_AGENT = "unknown agent"
CREDENTIALS: dict[str, Metadata] = {
    NO_METADATA: None, WRONG_SCHEME: (("authorization", "Basic c2VjcmV0"),), NO_DOT: bearer("nodot"),
    UNKNOWN_AGENT: bearer("agt_0.secret")}
AGENT_REFUSALS = {
    NO_METADATA: ("MISSING_CREDENTIAL", "no credential: send gRPC metadata 'authorization: Bearer <credential>'"),
    WRONG_SCHEME: ("MALFORMED_CREDENTIAL", "authorization metadata must be 'Bearer <credential>'"),
    NO_DOT: ("MALFORMED_CREDENTIAL", "malformed credential: expected '<agent_id>.<secret>'"),
    UNKNOWN_AGENT: ("BAD_CREDENTIAL", "credential for 'agt_0' is not valid"),
}
INGRESS_REFUSALS = {
    NO_METADATA: ("MISSING_CREDENTIAL", "needs an ingress token: send 'authorization: Bearer <token>'"),
    WRONG_SCHEME: ("MALFORMED_CREDENTIAL", "authorization metadata must be 'Bearer <credential>'"),
    NO_DOT: ("BAD_CREDENTIAL", "the ingress token is not one of ingress.tokens"),
    UNKNOWN_AGENT: ("BAD_CREDENTIAL", "the ingress token is not one of ingress.tokens"),
}


def expected_refusal(policy: Policy, credential: str) -> tuple[str, str] | None:
    if policy is Policy.PUBLIC or (policy is Policy.CALLER_OR_ANONYMOUS and credential == NO_METADATA):
        return None
    return (INGRESS_REFUSALS if policy is Policy.INGRESS_TOKEN else AGENT_REFUSALS)[credential]


async def test_every_policy_refuses_a_missing_or_bad_credential_as_before(channel):
    """Every RPC of the table (unary, server stream, client and bidi streams), four bad credentials each."""
    checked = 0
    for method, rule in METHOD_POLICIES.items():
        for credential, metadata in CREDENTIALS.items():
            exc = await outcome(channel, method, least_requests(method), metadata)
            expected = expected_refusal(rule.policy, credential)
            if expected is None:
                not_refused_for_credentials(exc, f"{method} ({credential})")
            else:
                refused(exc, grpc.StatusCode.UNAUTHENTICATED, *expected, f"{method} ({credential})")
            checked += 1
    assert checked == 4 * len(METHOD_POLICIES)


async def test_the_admin_token_cannot_act_as_an_agent_and_an_agent_cannot_sweep(channel, lead):
    agent_only = {m: rule for m, rule in METHOD_POLICIES.items() if rule.policy is Policy.AGENT}
    assert set(agent_only) == {"/inboxmesh.inbox.v1.InboxService/Ack", "/inboxmesh.ioa.v1.IoaRelayService/SpaceSend",
                               "/inboxmesh.registry.v1.RegistryService/RegisterChildren",
                               "/inboxmesh.gateway.v1.GatewayService/Deliver"}
    for method, rule in agent_only.items():
        refused(await outcome(channel, method, least_requests(method), bearer(ADMIN_TOKEN)),
                grpc.StatusCode.PERMISSION_DENIED, "AGENT_CREDENTIAL_REQUIRED",
                f"{rule.action} needs an agent's credential; the admin token cannot act as an agent", method)
    sweep = "/inboxmesh.runs.v1.SubagentRunService/SweepRuns"
    refused(await outcome(channel, sweep, [first_request(sweep)], bearer(lead.credential)),
            grpc.StatusCode.PERMISSION_DENIED, "NOT_ADMIN", "running the sweeper needs the admin token", sweep)
    assert await outcome(channel, sweep, [first_request(sweep)], bearer(ADMIN_TOKEN)) is None
    claim = "/inboxmesh.gateway.v1.GatewayService/ClaimGateway"
    refused(await outcome(channel, claim, [first_request(claim)], bearer(lead.credential)),
            grpc.StatusCode.PERMISSION_DENIED, "NOT_ADMIN", "claiming a gateway needs the admin token", claim)


def subscribing(method: str, *credentials: str) -> list[Message]:
    request = inbox_pb2.SubscribeRequest(credentials=list(credentials))
    return [inbox_pb2.ConsumeRequest(subscribe=request) if method == CONSUME else request]


async def test_a_subscription_authenticates_the_credentials_it_carries(channel, lead):
    """Subscribe and Consume: the request's credentials, each of them, in place of the metadata's (which is
    not even read then); the metadata's when the request has none."""
    for method in (SUBSCRIBE, CONSUME):
        refused(await outcome(channel, method, subscribing(method, "agt_0.secret"), bearer(lead.credential)),
                grpc.StatusCode.UNAUTHENTICATED, "BAD_CREDENTIAL", "credential for 'agt_0' is not valid", method)
        refused(await outcome(channel, method, subscribing(method, lead.credential, "nodot"), None),
                grpc.StatusCode.UNAUTHENTICATED, "MALFORMED_CREDENTIAL", "malformed credential", method)
        assert await outcome(channel, method, subscribing(method, lead.credential), CREDENTIALS[WRONG_SCHEME]) is None
        assert await outcome(channel, method, subscribing(method), bearer(lead.credential)) is None


async def test_a_consume_stream_that_subscribes_nobody_is_judged_by_its_protocol(channel):
    """No subscribe, no authentication: an empty stream ends cleanly, an ack first is SUBSCRIBE_FIRST."""
    assert await outcome(channel, CONSUME, [], None, half_close=True) is None
    refused(await outcome(channel, CONSUME, [inbox_pb2.ConsumeRequest(ack=inbox_pb2.AckRequest())], None),
            grpc.StatusCode.INVALID_ARGUMENT, "SUBSCRIBE_FIRST", "the first ConsumeRequest must be `subscribe`",
            CONSUME)


async def test_a_credential_reaches_the_handler(channel, lead):
    """The caller the interceptor proved is the one the service sees."""
    get_agent = registry_pb2.GetAgentRequest(agent_id=lead.agent_id)
    reply = await channel.unary_unary(GET_AGENT, serialize, registry_pb2.GetAgentResponse.FromString)(
        get_agent, metadata=bearer(lead.credential), timeout=10)
    assert reply.agent.agent_id == lead.agent_id
    register = "/inboxmesh.registry.v1.RegistryService/RegisterAgent"
    child = registry_pb2.RegisterAgentRequest(name="child", parent_id=lead.agent_id,
                                              mode=registry_pb2.AGENT_MODE_ASYNC)
    answer = await channel.unary_unary(register, serialize,
                                       registry_pb2.RegisterAgentResponse.FromString)(
        child, metadata=bearer(lead.credential), timeout=10)
    assert answer.agent.parent_id == lead.agent_id and answer.agent.scope_id == lead.info.scope_id


async def test_a_served_method_without_a_policy_is_refused(tmp_path, monkeypatch):
    """A unary method, a server stream and a bidi stream lose their rows: the mesh refuses them to every
    caller, with ErrorInfo, and goes on serving the others."""
    lacking = {GET_AGENT, WATCH_EVENTS, CONSUME}
    monkeypatch.setattr(auth_policy, "METHOD_POLICIES",
                        {m: rule for m, rule in METHOD_POLICIES.items() if m not in lacking})
    async with Mesh(make_config(tmp_path)) as mesh, \
            MeshClient(mesh.address, timeout=10.0, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")  # RegisterAgent keeps its row
        async with grpc.aio.insecure_channel(mesh.address) as channel:
            requests: dict[str, list[Message]] = {  # the refused stream reads nothing: the client sends nothing
                GET_AGENT: [registry_pb2.GetAgentRequest(agent_id=lead.agent_id)],
                WATCH_EVENTS: [events_pb2.WatchEventsRequest()], CONSUME: []}
            for method, sent in requests.items():
                for metadata in (bearer(lead.credential), bearer(ADMIN_TOKEN), None):
                    refused(await outcome(channel, method, sent, metadata), grpc.StatusCode.INTERNAL,
                            "INTERNAL", f"{method} has no authentication policy on this mesh", method)
        assert (await lead.resolve("lead")).agent_id == lead.agent_id  # the others are served as before
        assert [a.agent_id for a in await lead.list_agents()] == [lead.agent_id]
