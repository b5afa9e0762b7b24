"""The agent scenarios over an IOA network: the sibling exchange with every
message going through the network (B never polls, the parent never
relays), two meshes on two nodes, the shared-space tools, and a network
that delivers messages twice."""

import contextlib
import secrets
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import trustme

from agent_host.config import Budget, HostConfig
from agent_host.host import Host
from agent_host.models.scripted import call, say
from agent_host.tools import ALL_TOOLS, SPACE_TOOLS
from harness.evidence import K, Record
from harness.hosts import by_name, scripted_profiles
from harness.policies import SIBLING_POLICIES
from harness.test_addressing import tool_results
from inboxmesh.client.mesh import MeshClient, tls_credentials
from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.ioa.v1 import network_pb2_grpc
from services.config import RELAY_TLS_NAMES, SERVER_TLS_NAMES, IoaConfig
from services.ioa_network.server import NetworkConfig, NetworkServer
from services.server import Mesh
from services.tls import TlsFiles
from tests.fixtures import ADMIN_TOKEN, eventually, make_config

TOOLS = ALL_TOOLS + SPACE_TOOLS


@pytest.fixture
async def network():
    async with NetworkServer(NetworkConfig()) as server:
        yield server


class Certificates:
    """TLS everywhere, made at test time: one CA; the network's and each mesh's server certificate; each
    relay's client certificate naming its node id; a host certificate for clients (mutual TLS)."""

    def __init__(self, root: Path):
        self.root = root
        self.ca = trustme.CA()
        self.ca_file = self._write("ca.pem", self.ca.cert_pem.bytes())
        self.host = self.issue("host", "host")

    def issue(self, name: str, *identities: str) -> tuple[Path, Path]:
        leaf = self.ca.issue_cert(*identities)
        return (self._write(f"{name}.pem", b"".join(b.bytes() for b in leaf.cert_chain_pems)),
                self._write(f"{name}.key", leaf.private_key_pem.bytes()))

    def server(self, name: str) -> TlsFiles:
        """A server's files: its certificate, and the CA its clients' certificates come from."""
        return TlsFiles(*self.issue(name, "127.0.0.1", "localhost"), self.ca_file, SERVER_TLS_NAMES)

    def relay(self, node_id: str) -> TlsFiles:
        return TlsFiles(*self.issue(f"relay-{node_id}", node_id), self.ca_file, RELAY_TLS_NAMES)

    def client(self) -> grpc.ChannelCredentials:
        return tls_credentials(self.ca_file, *self.host)

    def _write(self, name: str, data: bytes) -> Path:
        (self.root / name).write_bytes(data)
        return self.root / name


@contextlib.asynccontextmanager
async def ioa_mesh(network, tmp_path, node_id, certificates: Certificates | None = None):
    config = replace(make_config(tmp_path / node_id), ioa=IoaConfig(node_id=node_id, network=network.address))
    if certificates is not None:
        config = replace(config, tls=certificates.server(f"mesh-{node_id}"),
                         ioa=IoaConfig(node_id=node_id, network=network.address, tls=certificates.relay(node_id)))
    mesh = Mesh(config)
    await mesh.start()
    assert mesh.relay is not None, "the mesh's config names the network"
    await mesh.relay.wait_connected(10)
    client = MeshClient(mesh.address, admin_token=ADMIN_TOKEN,
                        tls=certificates.client() if certificates is not None else None)
    try:
        yield mesh, client
    finally:
        await client.close()
        await mesh.stop(grace=0.2)


@contextlib.asynccontextmanager
async def ioa_host(mesh, tmp_path, policies, certificates: Certificates | None = None):
    config = HostConfig(mesh_address=mesh.address, data_dir=tmp_path, route_via_ioa=True,
                        budget=Budget(max_wall_time_s=60),
                        tls=certificates.client() if certificates is not None else None)
    host = Host(config, scripted_profiles(policies, tools=TOOLS))
    await host.start()
    try:
        yield host
    finally:
        await host.stop()


async def test_the_sibling_exchange_goes_through_the_network(network, tmp_path):
    secret = f"SEC-{secrets.randbelow(10**6):06d}"
    async with ioa_mesh(network, tmp_path, "solo") as (mesh, client):
        async with ioa_host(mesh, tmp_path / "host", SIBLING_POLICIES) as host:
            outcome = await host.run_task("parent", f"Coordinate A and B. The secret code for A is {secret}.",
                                          timeout=30)
            assert outcome.ok, outcome.error
            parent, a, b = (by_name(host, n) for n in ("parent", "A", "B"))
            assert not [c for c in tool_results(b, "space_read")], "B never polled a read tool"
            parent_tools = {c["function"]["name"] for m in parent.conversation.messages
                            for c in m.get("tool_calls") or []}
            assert parent_tools == {"spawn_agent", "finish"}, "the parent never relayed anything"
        record = await Record.read(client)
        b_view = client.agent(b.agent_id, b.record.credential)
        consumed_texts = {e.message_id: (await b_view.inbox_status(e.sequence)).envelope.content.text
                          for e in record.of(K.EVENT_KIND_MESSAGE_CONSUMED, agent_id=b.agent_id)}
    address = {r.record.name: f"ioa:solo/{r.agent_id}" for r in (parent, a, b)}
    # A -> B went out to the network and came back in through the relay into B's inbox
    stored = record.one(K.EVENT_KIND_MESSAGE_STORED, sender=address["A"], recipient=b.agent_id, in_reply_to="")
    received = record.one(K.EVENT_KIND_IOA_RECEIVED, message_id=stored.message_id)
    assert received.event_id < stored.event_id and received.detail == "from node solo"
    (published,) = [e for e in record.of(K.EVENT_KIND_IOA_PUBLISHED, sender=a.agent_id, recipient=address["B"])
                    if stored.message_id == f"solo:{a.agent_id}:{e.message_id}"]
    assert published.event_id < received.event_id, "published on one side, received on the other"
    consumed = record.one(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=stored.message_id, agent_id=b.agent_id)
    assert consumed.turn > 0
    assert secret in consumed_texts[stored.message_id], "the secret is in what B consumed"
    # B's reply came back to A, correlated with A's own message id
    reply = record.one(K.EVENT_KIND_MESSAGE_STORED, sender=address["B"], recipient=a.agent_id)
    a_sent = tool_results(a, "send_message")[0][1]["message_id"]
    assert reply.in_reply_to == a_sent, "the reply names the id A used"
    assert record.one(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=reply.message_id, agent_id=a.agent_id)
    # both reports are announces of the children's runs (the run registry lives in this mesh, beside the
    # parent), and were consumed before the parent completed
    reports = record.of(K.EVENT_KIND_MESSAGE_STORED, recipient=parent.agent_id)
    assert {e.sender for e in reports} == {a.agent_id, b.agent_id}
    assert all(e.message_id.startswith("inboxmesh:announce:run-") for e in reports)
    done = record.one(K.EVENT_KIND_TASK_COMPLETED, agent_id=parent.agent_id)
    assert all(record.one(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=e.message_id).event_id < done.event_id
               for e in reports)
    assert secret in outcome.result
    for runner in (parent, a, b):
        assert record.turns_alternate(runner.agent_id) and runner.max_runs_active == 1


def caller(view):
    target = view.task.split()[-1]
    if not view.called("send_message"):
        return call("send_message", to=target, text="hello from the other node")
    mine = view.called("send_message")[0].result["message_id"]
    answer = next((m for m in view.inbox if m.kind == "reply" and m.in_reply_to == mine), None)
    if answer and not view.called("finish"):
        return call("finish", result=f"{answer.sender} answered: {answer.text}")
    return say("waiting")


def callee(view):
    if view.new:
        return call("reply", message_id=view.new[0].message_id, text=f"hi {view.new[0].sender}")
    return say("waiting")


async def test_agents_on_two_meshes_talk_through_one_network(network, tmp_path):
    await _two_meshes(network, tmp_path)


async def test_two_meshes_and_the_sibling_exchange_over_an_authenticated_network_with_tls_everywhere(tmp_path):
    """The same across an IOA network that requires relay certificates naming their node ids, meshes that
    serve mutual TLS, relays and hosts that present certificates; and the sibling exchange through it."""
    certificates = Certificates(tmp_path)
    async with NetworkServer(NetworkConfig(tls=certificates.server("network"))) as network:
        await _two_meshes(network, tmp_path, certificates)
        async with ioa_mesh(network, tmp_path, "solo", certificates) as (mesh, client):
            async with ioa_host(mesh, tmp_path / "host", SIBLING_POLICIES, certificates) as host:
                outcome = await host.run_task("parent", "Coordinate A and B. The secret code for A is SEC-777777.",
                                              timeout=30)
                assert outcome.ok, outcome.error
                assert "SEC-777777" in outcome.result
            record = await Record.read(client)
        b = by_name(host, "B")
        assert record.of(K.EVENT_KIND_IOA_RECEIVED, recipient=b.agent_id), "B's message came through the network"


async def _two_meshes(network, tmp_path, certificates: Certificates | None = None) -> None:
    async with ioa_mesh(network, tmp_path, "alpha", certificates) as (mesh_a, client_a), \
            ioa_mesh(network, tmp_path, "beta", certificates) as (mesh_b, client_b):
        async with ioa_host(mesh_b, tmp_path / "host-b", {"callee": callee}, certificates) as host_b, \
                ioa_host(mesh_a, tmp_path / "host-a", {"caller": caller}, certificates) as host_a:
            far = await host_b.start_task("callee", "answer whoever writes")
            far_address = f"ioa:beta/{far.agent_id}"
            outcome = await host_a.run_task("caller", f"Write to {far_address}", timeout=30)
            assert outcome.ok, outcome.error
            near = by_name(host_a, "caller")
            assert outcome.result == f"{far_address} answered: hi ioa:alpha/{near.agent_id}", \
                "each side saw the other's real identity"
            (_, sent), = tool_results(near, "send_message")
            assert sent["status"] == "accepted" and sent["to"] == far_address and sent["sequence"] >= 1
        record_b = await Record.read(client_b)
        record_a = await Record.read(client_a)
    inbound = record_b.one(K.EVENT_KIND_MESSAGE_STORED, sender=f"ioa:alpha/{near.agent_id}")
    assert inbound.recipient == far.agent_id
    assert record_b.one(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=inbound.message_id).turn >= 1
    answer = record_a.one(K.EVENT_KIND_MESSAGE_STORED, sender=far_address)
    assert answer.in_reply_to == sent["message_id"], "correlation preserved across meshes"


def poster(view):
    if not view.called("space_send"):
        return call("space_send", space="lobby", text="A was here")
    return call("finish", result="posted") if not view.called("finish") else say("done")


def reader(view):
    seen = view.called("space_read")
    if not seen or not any(m["text"] == "A was here" for r in seen for m in r.result.get("messages", [])):
        return call("space_read", space="lobby") if len(seen) < 50 else say("gave up")
    return call("finish", result="read A's post") if not view.called("finish") else say("done")


def space_parent(view):
    if not view.called("spawn_agent"):
        from agent_host.models.scripted import Decision

        return Decision(calls=[("spawn_agent", {"agent_name": "A", "task": "post"}),
                               ("spawn_agent", {"agent_name": "B", "task": "read"})])
    return call("finish", result="ok") if len([m for m in view.inbox if m.kind == "completion"]) == 2 \
        else say("waiting")


async def test_the_space_tools_are_a_second_explicit_way(network, tmp_path):
    async with ioa_mesh(network, tmp_path, "solo") as (mesh, client):
        async with ioa_host(mesh, tmp_path / "host", {"parent": space_parent, "A": poster, "B": reader}) as host:
            outcome = await host.run_task("parent", "let A post and B read", timeout=30)
            assert outcome.ok, outcome.error
            a, b = by_name(host, "A"), by_name(host, "B")
            posted = tool_results(a, "space_send")[0][1]
            assert posted["status"] == "ok"
            found = [m for _, r in tool_results(b, "space_read") for m in r["messages"] if m["text"] == "A was here"]
            assert found and found[0]["from_address"] == f"ioa:solo/{a.agent_id}" and found[0]["from"] == "A@solo"


async def test_messages_the_network_delivers_twice_are_consumed_once(network, tmp_path):
    secret = "SEC-000042"
    async with ioa_mesh(network, tmp_path, "solo") as (mesh, client):
        async with grpc.aio.insecure_channel(network.address) as channel:
            await network_pb2_grpc.IoaNetworkStub(channel).InjectFault(
                net.InjectFaultRequest(node_id="solo", kind=net.FAULT_KIND_DUPLICATE, count=100))
        async with ioa_host(mesh, tmp_path / "host", SIBLING_POLICIES) as host:
            outcome = await host.run_task("parent", f"Coordinate A and B. The secret code for A is {secret}.",
                                          timeout=30)
            assert outcome.ok, outcome.error
        await eventually(lambda: mesh.relay.counts["duplicates"] > 0, message="the network did duplicate")
        record = await Record.read(client)
    stored = record.of(K.EVENT_KIND_MESSAGE_STORED)
    assert stored
    for message in stored:
        assert len(record.of(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=message.message_id)) <= 1
    assert len(record.of(K.EVENT_KIND_IOA_DUPLICATE)) == mesh.relay.counts["duplicates"]


async def test_one_trace_runs_from_send_through_the_network_to_the_reply(network, tmp_path, spans):
    async with ioa_mesh(network, tmp_path, "alpha") as (mesh_a, client_a), \
            ioa_mesh(network, tmp_path, "beta") as (mesh_b, client_b):
        async with ioa_host(mesh_b, tmp_path / "host-b", {"callee": callee}) as host_b, \
                ioa_host(mesh_a, tmp_path / "host-a", {"caller": caller}) as host_a:
            far = await host_b.start_task("callee", "answer whoever writes")
            outcome = await host_a.run_task("caller", f"Write to ioa:beta/{far.agent_id}", timeout=30)
            assert outcome.ok, outcome.error
            near = by_name(host_a, "caller")
            (_, sent), = tool_results(near, "send_message")
    finished = spans.get_finished_spans()
    send = next(s for s in finished
                if s.name == "send" and s.attributes.get("messaging.message.id") == sent["message_id"])
    in_trace = [s for s in finished if s.context.trace_id == send.context.trace_id]
    names = [s.name for s in in_trace]
    for step in ("send", "ioa.publish", "ioa.receive", "enqueue", "deliver", "consume", "reply", "ack"):
        assert step in names, (step, sorted(set(names)))
    reply = next(s for s in in_trace if s.name == "reply")
    consume = next(s for s in in_trace
                   if s.name == "consume" and s.attributes.get("inboxmesh.recipient") == far.agent_id)
    assert reply.parent.span_id == consume.context.span_id, "the reply continues the trace on the far side"
    assert names.count("ioa.publish") >= 2 and names.count("ioa.receive") >= 2, "there and back in one trace"
