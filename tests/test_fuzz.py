"""Fuzzing every RPC the project serves, generated from the descriptors (a new
RPC is covered without editing this file): the mesh (with a routing config
and an IOA network, so every one of its services is up) and the reference
IOA network server.

Each RPC gets three batches:
- fields at their limits: a plausible request, then that request with each
  field in turn empty, huge, not ASCII, an unknown enum number, an integer at
  the end of its range, a repeated field or map with far too many entries
  (deterministic; every distinct failure is reported at once);
- generated requests (hypothesis, from the descriptor: random values, huge
  and empty strings, unknown enums, random bytes, long repeated fields and
  maps; no credential, a garbage one or a real one; a few on a stream);
- raw request bytes that are not a protobuf message;
and each server gets a request one byte over the mesh's size limit.
Every answer must keep `tests.fuzzing.check`: never INTERNAL or UNKNOWN, every
refusal with a google.rpc.ErrorInfo that has a reason, trailers under 8 KiB.
After each batch both servers still answer health checks and ordinary calls,
the relay kept its IOA connection, and a canary message sent before the
batch is delivered and consumed exactly once (servers left broken are
started afresh for the next batch).

INBOXMESH_FUZZ_EXAMPLES sets the generated examples per RPC (raw bytes get a
third as many); INBOXMESH_FUZZ_SEED explores another seed (without it the
run is derandomized: the same examples every time).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from dataclasses import dataclass, replace

import grpc
import pytest
import pytest_asyncio
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from inboxmesh.client.mesh import AgentHandle, MeshClient
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.ioa.v1 import network_pb2_grpc, relay_pb2, relay_pb2_grpc
from inboxmesh.registry.v1 import registry_pb2 as reg
from services.config import IoaConfig, RunsConfig
from services.ioa.relay import IoaRelay
from services.ioa_network.server import NetworkConfig, NetworkServer
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, eventually, make_config
from tests.fuzz_messages import Pool, Rpc, all_rpcs, at_limits, filled, replace_text, show
from tests.fuzzing import Case, Findings, FuzzFailure, Outcome, Timing, cases, check, invoke
from tests.streams import Collector

EXAMPLES = int(os.environ.get("INBOXMESH_FUZZ_EXAMPLES", "40"))
"""Generated requests per unary RPC (streams get half as many: each waits for
its stream to go quiet). 40 keeps the file within two minutes per store on a
shared 2-core machine; a benchmark machine runs thousands."""
RAW_EXAMPLES = max(3, EXAMPLES // 3)
SEED = os.environ.get("INBOXMESH_FUZZ_SEED")
"""Unset: derandomized (the same examples on every run with the same EXAMPLES)."""

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(max(120, 2 * EXAMPLES)),  # the streams' examples take up to a second or two each
    # The servers run on the test's loop while hypothesis draws in its worker thread; their own use of the
    # random module (OpenTelemetry span ids, the relay's backoff) is not the strategies' doing.
    pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies"),
]
NODE = "alpha"
"""The mesh's IOA node."""
INGRESS_TOKEN = "fuzz-ingress-token"
ROUTING = f"""
agents:
  list:
    - id: home
      default: true
      subagents: {{allowAgents: [work]}}
    - id: work
bindings:
  - agentId: work
    match: {{channel: slack, teamId: T1}}
ingress:
  tokens: [{INGRESS_TOKEN}]
"""
RPCS = all_rpcs()
NETWORK_SERVICE = net.DESCRIPTOR.services_by_name["IoaNetwork"].full_name
OWN_SERVICES = {health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name}
"""Served beside ours by the gRPC libraries; not fuzzed here."""
_CHANNEL_OPTIONS = [
    # Receive trailers of any size, so an oversized one is measured instead of failing the call.
    ("grpc.max_metadata_size", 4 * 1024 * 1024),
    ("grpc.absolute_max_metadata_size", 4 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
]


class World:
    """The servers under test: the mesh (routing and an IOA network, so it
    serves all its services) and the reference IOA network, with channels
    that accept trailers of any size and a canary pair of agents. Started
    once for the module, and afresh (in a new directory) after a batch that
    left them broken, so that the RPCs after it are still fuzzed."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self.broken = False
        self.events_seen = 0
        """The last event of the last canary checked."""

    async def start(self) -> None:
        tmp_path = self._tmp.mktemp("fuzz")
        (tmp_path / "routing.yaml").write_text(ROUTING)
        self.network = NetworkServer(NetworkConfig(history=20, reconnect_grace_s=0))  # no node: at once
        await self.network.start()
        config = replace(make_config(tmp_path), routing=tmp_path / "routing.yaml",
                         ioa=IoaConfig(node_id=NODE, network=self.network.address, receipt_timeout_s=2),
                         runs=RunsConfig(max_active_children=100_000))  # the fuzzer registers many children
        self.mesh = Mesh(config)
        await self.mesh.start()
        await self.relay.wait_connected(10)
        self.mesh_channel = grpc.aio.insecure_channel(self.mesh.address, options=_CHANNEL_OPTIONS)
        self.network_channel = grpc.aio.insecure_channel(self.network.address, options=_CHANNEL_OPTIONS)
        self.channels = {name: self.mesh_channel for name in await served_services(self.mesh_channel)}
        """Channel per served service name (from each server's reflection)."""
        self.channels |= {name: self.network_channel for name in await served_services(self.network_channel)}
        self.client = MeshClient(self.mesh.address, admin_token=ADMIN_TOKEN)
        self.canary_sender = await self.client.register("canary-sender")
        self.canary_inbox = await self.canary_sender.spawn("canary-inbox")
        self.broken = False
        self.events_seen = 0

    async def stop(self) -> None:
        for channel in (self.client, self.mesh_channel, self.network_channel):
            await channel.close()
        await self.mesh.stop(grace=0.5)
        await self.network.stop(grace=0.2)

    @property
    def relay(self) -> IoaRelay:
        """The mesh's IOA relay (its config names the network)."""
        assert self.mesh.relay is not None, "the mesh has an IOA config, hence a relay"
        return self.mesh.relay


async def served_services(channel: grpc.aio.Channel) -> set[str]:
    call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    async for response in call:
        return {s.name for s in response.list_services_response.service}
    raise AssertionError("no reflection answer")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory):
    servers = World(tmp_path_factory)
    await servers.start()
    try:
        yield servers
    finally:
        await servers.stop()


# -- what the fuzzer knows ---------------------------------------------------
UNIQUE = "@unique"
"""Placeholder for ids that must be new in every request (message_id, request_id)."""
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@dataclass
class Actors:
    """A fresh team per RPC batch, whose ids and credentials the fuzzer uses
    (never the canary's)."""

    lead: AgentHandle
    child: AgentHandle
    sibling: AgentHandle
    sent_id: str

    def credentials(self) -> dict[str, str]:
        return {"agent": self.lead.credential, "child": self.child.credential, "admin": ADMIN_TOKEN,
                "ingress": INGRESS_TOKEN}

    def pool(self) -> Pool:
        ids = [self.lead.agent_id, self.child.agent_id, self.sibling.agent_id]
        return Pool(strings=(
            *ids, self.lead.credential, self.child.credential, self.child.run_id, self.sent_id,
            *(f"ioa:{NODE}/{i}" for i in ids), "ioa:nowhere/agt_0", "ioa:no-slash", NODE, "fuzz-space",
            "slack", "T1", "agent:home:main", "agent:work:slack:group:g1", INGRESS_TOKEN, ADMIN_TOKEN,
            "inboxmesh-notice", TRACEPARENT,
        ), integers=(0, 1, 2, 3, 5, 10, 100, 1000))

    def plausible(self, fd: FieldDescriptor) -> str:
        """A string field's value in a plausible request, by the field's name
        (`filled`); empty where empty is the ordinary choice."""
        lead, child = self.lead.agent_id, self.child.agent_id
        return {
            "agent_id": lead, "parent_id": lead, "requester_id": lead, "recipient": child, "child_id": child,
            "agent": lead, "run_id": self.child.run_id, "credentials": self.lead.credential, "message_id": UNIQUE,
            "request_id": UNIQUE, "task_message_id": UNIQUE, "ioa_message_id": UNIQUE, "name": "fuzz",
            "text": "fuzz", "task": "fuzz", "space": "fuzz-space", "address": f"ioa:{NODE}/{lead}",
            "node_id": "fuzz-node-9", "node": NODE, "channel": "slack", "team_id": "T1", "id": "p1",
            "session_key": "agent:home:main", "traceparent": TRACEPARENT, "conversation_id": "fuzz-conversation",
        }.get(fd.name, "")


async def actors(world: World) -> Actors:
    lead = await world.client.register("fuzz-lead")
    child = await lead.spawn("fuzz-child", reg.AGENT_MODE_ASYNC, run=reg.RunSpec(task="fuzz"))
    sibling = await lead.spawn("fuzz-sibling")
    receipt = await lead.send(child.agent_id, "something already sent")
    back = await child.send(lead.agent_id, "something to consume")
    assert receipt.status == back.status == pb.RECEIPT_STATUS_ACCEPTED
    return Actors(lead, child, sibling, receipt.message_id)


def openers(team: Actors) -> dict[str, list]:
    """Valid first messages for the streams whose protocol starts with one,
    so that what follows them reaches the stream's later stages (acks after
    a subscribe, publishes after a hello)."""
    subscribe = pb.SubscribeRequest
    return {
        "inboxmesh.inbox.v1.InboxService.Consume": [
            pb.ConsumeRequest(subscribe=subscribe(credentials=[team.lead.credential])),
            pb.ConsumeRequest(subscribe=subscribe(credentials=[team.lead.credential, team.child.credential],
                                                  max_in_flight=1)),
            pb.ConsumeRequest(subscribe=subscribe()),  # the call's credential
        ],
        "inboxmesh.ioa.v1.IoaNetwork.Connect": [net.NodeFrame(hello=net.Hello(node_id=f"fuzz-node-{n}"))
                                                for n in range(4)],
    }


def keep_network_nodes_apart(message) -> None:
    """The reference network has no authentication by design: a node that
    says hello as another takes over its connection, and anyone may inject
    faults for any node. So the fuzzer never says hello as the mesh's node
    nor injects faults for it (it still sends to it)."""
    fields = message.DESCRIPTOR.fields_by_name
    if "hello" in fields and message.HasField("hello") and message.hello.node_id == NODE:
        message.hello.node_id = "fuzz-" + NODE
    if "node_id" in fields and message.node_id == NODE:
        message.node_id = "fuzz-" + NODE


def fix_for(rpc: Rpc):
    return keep_network_nodes_apart if rpc.service == NETWORK_SERVICE else None


# -- running the calls -------------------------------------------------------
def fuzz_settings(examples: int):
    chosen = settings(max_examples=examples, deadline=None, derandomize=SEED is None, database=None,
                      suppress_health_check=list(HealthCheck), print_blob=False,
                      phases=(Phase.explicit, Phase.generate, Phase.shrink))
    return (lambda test: seed(int(SEED))(chosen(test))) if SEED is not None else chosen


async def call(channel: grpc.aio.Channel, case: Case, timing: Timing) -> Outcome:
    outcome = await invoke(channel, case, timing)
    if outcome.client_side:  # the server's status was lost to a write race: once more, slowly
        outcome = await invoke(channel, case, timing, careful=True)
    return outcome


def report(rpc: Rpc, findings: Findings, again: str | None) -> None:
    """Printed: shown with -s or -rA, and on failure (with `again`, how to
    run the failures again)."""
    print(f"{rpc}: the calls got {dict(findings.seen.most_common())}")
    if findings.first and again is not None:
        print(f"distinct failures of {rpc} (again: {again} pytest tests/test_fuzz.py -k '{rpc}'):\n"
              f"{findings.summary()}")


async def fuzz(world: World, rpc: Rpc, strategy, examples: int) -> None:
    """Run hypothesis over `strategy` against the server of `rpc`. Hypothesis
    drives its examples synchronously, so it runs in a worker thread and each
    call is made on this loop, where the servers live."""
    channel = world.channels[rpc.service]
    loop = asyncio.get_running_loop()
    findings = Findings()
    timing = Timing()

    @fuzz_settings(examples)
    @given(case=strategy)
    def run(case: Case) -> None:
        outcome = asyncio.run_coroutine_threadsafe(call(channel, case, timing), loop).result(timeout=120)
        findings.seen[f"{case.credential}: {outcome.summary()}"] += 1
        check(case, outcome, findings)

    try:
        await asyncio.to_thread(run)
    finally:
        report(rpc, findings, f"INBOXMESH_FUZZ_EXAMPLES={EXAMPLES}" + (f" INBOXMESH_FUZZ_SEED={SEED}" if SEED else "")
               + "; the shrunk examples are in the failure above, these are the first seen")


def _rank(outcome: Outcome) -> int:
    """How far a call got: answered, refused for its content, not allowed, not authenticated."""
    return {grpc.StatusCode.OK: 0, grpc.StatusCode.PERMISSION_DENIED: 2,
            grpc.StatusCode.UNAUTHENTICATED: 3}.get(outcome.code, 1)


async def sweep(world: World, rpc: Rpc, team: Actors) -> None:
    """A plausible request (`filled`), then that request with each field in
    turn at each of its extremes (`at_limits`); for a stream with an opener,
    each also after the opener. Made with the credential that gets the
    plausible request furthest. Every distinct failure is collected, then
    all are reported at once."""
    channel, fix = world.channels[rpc.service], fix_for(rpc)
    timing = Timing(step_s=0.05, idle_s=0.1)
    findings = Findings()
    base = filled(rpc.method.input_type, team.plausible)
    opener = openers(team).get(str(rpc), [None])[0]

    def case_of(label: str, metadata: tuple, items: list) -> Case:
        items = [copy_of(m) for m in items]
        for item in items:
            replace_text(item, UNIQUE, lambda: uuid.uuid4().hex)
            if fix is not None:
                fix(item)
        return Case(rpc, label, metadata, [m.SerializeToString() for m in items], [show(m) for m in items])

    async def one(case: Case, where: str) -> Outcome:
        outcome = await call(channel, case, timing)
        findings.seen[outcome.summary()] += 1
        with contextlib.suppress(FuzzFailure):  # collected in findings
            check(case, outcome, findings, where)
        return outcome

    prefixes = [[]] + ([[opener]] if opener is not None and rpc.method.client_streaming else [])
    chosen: tuple[str, tuple[tuple[str, str], ...]] = ("none", ())
    best = 9
    for label, value in [("none", None), *team.credentials().items()]:
        metadata = (("authorization", "Bearer " + value),) if value else ()
        rank = _rank(await one(case_of(label, metadata, prefixes[-1] + [base]), "(plausible request)"))
        if rank < best:
            chosen, best = (label, metadata), rank
    for where, request in at_limits(base, team.plausible):
        for prefix in prefixes:
            await one(case_of(*chosen, prefix + [request]), where)
    report(rpc, findings, None)
    if findings.first:
        pytest.fail(f"{len(findings.first)} distinct failures of {rpc}:\n{findings.summary()}", pytrace=False)


def copy_of(message):
    copy = type(message)()
    copy.CopyFrom(message)
    return copy


# -- what must hold after a batch ------------------------------------------------
async def send_canary(world: World) -> pb.Receipt:
    receipt = await world.canary_sender.send(world.canary_inbox.agent_id, f"canary {uuid.uuid4().hex}")
    assert receipt.status == pb.RECEIPT_STATUS_ACCEPTED, receipt
    return receipt


async def check_still_serving(world: World, reconnects: int) -> None:
    """Health checks on both servers, ordinary calls, and the relay kept its
    IOA connection (`reconnects` is its count before the batch)."""
    for channel in (world.mesh_channel, world.network_channel):
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    agent = await world.canary_sender.get(world.canary_inbox.agent_id)
    assert agent.state == reg.AGENT_STATE_OPEN
    relay = relay_pb2_grpc.IoaRelayServiceStub(world.mesh_channel)

    async def relay_connected() -> bool:
        status = await relay.RelayStatus(relay_pb2.RelayStatusRequest(), timeout=10,
                                         metadata=world.canary_sender.metadata)
        return status.connected

    await eventually(relay_connected, timeout=15, interval=0.1, message="the relay connected to the IOA network")
    nodes = await network_pb2_grpc.IoaNetworkStub(world.network_channel).NetworkStatus(
        net.NetworkStatusRequest(), timeout=10)
    assert any(n.node_id == NODE and n.connected for n in nodes.nodes), nodes
    assert world.relay.reconnects == reconnects, (
        f"the relay lost its IOA connection during the batch ({world.relay.reconnects - reconnects} times)")


async def check_canary(world: World, receipt: pb.Receipt) -> None:
    """The canary is delivered, consumed by exactly one ack, and the record
    shows it stored once and consumed once."""
    inbox = world.canary_inbox
    collector = Collector(inbox)
    try:
        await eventually(lambda: any(m.message_id == receipt.message_id for m in collector.messages) or
                         collector.ended.is_set(), timeout=15, message="the canary's delivery")
        assert collector.error is None, f"the canary's subscription failed: {collector.error!r}"
        (canary,) = [m for m in collector.messages if m.message_id == receipt.message_id]
        assert canary.sequence == receipt.sequence
        first = await inbox.ack([canary.sequence])
        again = await inbox.ack([canary.sequence])
    finally:
        await collector.stop()
    assert [r.status for r in first] == [pb.ACK_STATUS_CONSUMED]
    assert [r.status for r in again] == [pb.ACK_STATUS_ALREADY_CONSUMED]

    async def consumed_events():  # by agent and after the last canary's: the JetStream store scans less
        events = await world.client.admin_events(agent_id=inbox.agent_id, message_id=receipt.message_id,
                                                 after=world.events_seen)
        return events if any(e.kind == ev.EVENT_KIND_MESSAGE_CONSUMED for e in events) else None

    events = await eventually(consumed_events, timeout=15, message="the canary's CONSUMED event")
    kinds = [e.kind for e in events if e.sender == world.canary_sender.agent_id]
    assert kinds.count(ev.EVENT_KIND_MESSAGE_STORED) == 1, events
    assert kinds.count(ev.EVENT_KIND_MESSAGE_CONSUMED) == 1, events
    world.events_seen = max(e.event_id for e in events)


@contextlib.asynccontextmanager
async def batch(world: World, rpc: Rpc):
    """A fresh team for the batch's calls; a canary sent before them; after
    them (failed or not) the servers still serve and the canary is consumed
    exactly once."""
    if world.broken:  # by an earlier batch, which failed for it
        with contextlib.suppress(Exception):
            await world.stop()
        await world.start()
    assert rpc.service in world.channels, f"no server here serves {rpc.service}"
    team = await actors(world)
    canary = await send_canary(world)
    reconnects = world.relay.reconnects
    failed: BaseException | None = None
    try:
        yield team
    except BaseException as exc:
        failed = exc
        raise
    finally:
        try:
            async with asyncio.TaskGroup() as checks:
                checks.create_task(check_still_serving(world, reconnects))
                checks.create_task(check_canary(world, canary))
        except BaseException as broken:
            world.broken = True
            if failed is None:
                raise
            raise BaseExceptionGroup(f"{rpc}: the batch failed, and the servers were broken after it",
                                     [failed, broken]) from None


# -- the tests ---------------------------------------------------------------
async def test_every_served_service_is_fuzzed(world):
    served = set(world.channels) - OWN_SERVICES
    assert served == {rpc.service for rpc in RPCS}, "the fuzzer covers every service the servers serve"


@pytest.mark.parametrize("server", ["mesh", "network"])
async def test_a_request_over_the_size_limit_is_refused_with_error_info(world, server):
    """One byte over the mesh's max_request_bytes (the network server's limit
    is lower): the refusal must be a mesh refusal like any other, with
    ErrorInfo, whatever the transport's own limit is. The same for every RPC
    of a server, so its first unary RPC stands for all."""
    channel = world.mesh_channel if server == "mesh" else world.network_channel
    rpc = next(r for r in RPCS if world.channels.get(r.service) is channel and r.kind == "unary")
    size = world.mesh.config.max_request_bytes + 1
    length = size - 1 - len(_varint(size))
    payload = b"\x0a" + _varint(length) + b"x" * length  # field 1, one long string
    assert len(payload) == size
    async with batch(world, rpc) as team:
        case = Case(rpc, "agent", (("authorization", "Bearer " + team.lead.credential),), [payload],
                    [f"bytes {len(payload)} (field 1 as one long string)"])
        outcome = await call(channel, case, Timing())
        assert outcome.code != grpc.StatusCode.OK, outcome.summary()
        check(case, outcome)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


async def fields_at_their_limits(world: World, rpc: Rpc, team: Actors) -> None:
    await sweep(world, rpc, team)


async def generated_requests(world: World, rpc: Rpc, team: Actors) -> None:
    opener = openers(team).get(str(rpc))
    strategy = cases(rpc, team.credentials(), team.pool(), raw=False, fix=fix_for(rpc),
                     opener=st.sampled_from(opener) if opener else None)
    streams = rpc.method.client_streaming or rpc.method.server_streaming
    await fuzz(world, rpc, strategy, max(3, EXAMPLES // 2) if streams else EXAMPLES)


async def raw_request_bytes(world: World, rpc: Rpc, team: Actors) -> None:
    opener = openers(team).get(str(rpc))
    strategy = cases(rpc, team.credentials(), team.pool(), raw=True, fix=fix_for(rpc),
                     opener=st.sampled_from(opener) if opener else None)
    await fuzz(world, rpc, strategy, RAW_EXAMPLES)


BATCHES = [fields_at_their_limits, generated_requests, raw_request_bytes]


# One RPC's batches after each other, in the order of the services' names (the event record, which some
# RPCs scan, is shortest early on).
@pytest.mark.parametrize(("rpc", "kind"), [(rpc, kind) for rpc in RPCS for kind in BATCHES],
                         ids=lambda value: value.__name__ if callable(value) else str(value))
async def test_fuzz(world, rpc, kind):
    async with batch(world, rpc) as team:
        await kind(world, rpc, team)
