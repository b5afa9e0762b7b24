"""TLS and mutual TLS on the mesh and the IOA network (services/tls.py, docs/security.md), with certificates
made at test time by trustme: the happy paths, and what is refused (a plaintext client, a wrong CA, a
missing or foreign client certificate, an expired certificate, a key of another certificate, a missing
file, plaintext beyond loopback)."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import sqlite3
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import trustme

from harness.nats import NatsNode
from inboxmesh.client import errors
from inboxmesh.client.mesh import MeshClient, tls_credentials
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.ioa.v1 import network_pb2_grpc
from inboxmesh.registry.v1 import registry_pb2 as reg
from services.config import SERVER_TLS_NAMES, IoaConfig
from services.ioa_network.server import NetworkConfig, NetworkServer
from services.server import Mesh
from services.tls import TlsFiles
from tests.fixtures import ADMIN_TOKEN, make_config
from tests.ioa_nodes import NodeClient, start_node
from tests.processes import MeshProcess
from tests.streams import Collector

pytestmark = pytest.mark.timeout(60)


class Pki:
    """A CA and what it signed, as PEM files in a directory."""

    def __init__(self, root: Path, name: str = "ca", **issue):
        self.root = root
        self.ca = trustme.CA()
        self.ca_file = self._write(f"{name}.pem", self.ca.cert_pem.bytes())
        self.cert_file, self.key_file = self.issue(f"{name}-server", "127.0.0.1", "localhost", **issue)

    def issue(self, name: str, *identities: str, **issue) -> tuple[Path, Path]:
        leaf = self.ca.issue_cert(*identities, **issue)
        return (self._write(f"{name}.pem", b"".join(blob.bytes() for blob in leaf.cert_chain_pems)),
                self._write(f"{name}.key", leaf.private_key_pem.bytes()))

    def server(self, client_ca: Path | None = None) -> TlsFiles:
        return TlsFiles(self.cert_file, self.key_file, client_ca, SERVER_TLS_NAMES)

    def _write(self, name: str, data: bytes) -> Path:
        path = self.root / name
        path.write_bytes(data)
        return path


@pytest.fixture
def pki(tmp_path) -> Pki:
    return Pki(tmp_path)


async def _refused(address: str, credentials: grpc.ChannelCredentials | None) -> None:
    async with MeshClient(address, timeout=3, wait_for_ready=False, tls=credentials) as client:
        with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
            await client.register("should-not-register")


async def test_tls_serves_a_client_that_trusts_its_ca_and_refuses_the_others(tmp_path, pki):
    config = replace(make_config(tmp_path), tls=pki.server())
    async with Mesh(config) as mesh:
        async with MeshClient(mesh.address, tls=tls_credentials(pki.ca_file), admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            kid = await lead.spawn("kid")
            assert (await lead.send(kid.agent_id, "over TLS")).status == pb.RECEIPT_STATUS_ACCEPTED
            stream = Collector(kid, auto_ack=True)
            try:
                assert [m.content.text for m in await stream.wait_for(1)] == ["over TLS"]
            finally:
                await stream.stop()
        await _refused(mesh.address, None)  # a plaintext client
        other = Pki(tmp_path, "other")
        await _refused(mesh.address, tls_credentials(other.ca_file))  # a client that trusts another CA


async def test_mutual_tls_requires_a_client_certificate_from_its_ca(tmp_path, pki):
    clients = Pki(tmp_path, "clients")
    cert, key = clients.issue("host-a", "host-a.example")
    config = replace(make_config(tmp_path), tls=pki.server(client_ca=clients.ca_file))
    async with Mesh(config) as mesh:
        async with MeshClient(mesh.address, tls=tls_credentials(pki.ca_file, cert, key)) as client:
            assert (await client.register("proven")).agent_id
        await _refused(mesh.address, tls_credentials(pki.ca_file))  # no client certificate
        stranger = Pki(tmp_path, "stranger")
        foreign_cert, foreign_key = stranger.issue("host-b", "host-b.example")
        await _refused(mesh.address, tls_credentials(pki.ca_file, foreign_cert, foreign_key))
        expired_cert, expired_key = clients.issue(
            "host-old", "host-old.example", not_before=datetime.datetime(2019, 1, 1, tzinfo=datetime.UTC),
            not_after=datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC))
        await _refused(mesh.address, tls_credentials(pki.ca_file, expired_cert, expired_key))


async def test_bad_tls_files_are_refused_at_start_naming_the_setting_and_the_file(tmp_path, pki):
    base = make_config(tmp_path)
    expired = Pki(tmp_path, "expired", not_after=datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
                  not_before=datetime.datetime(2019, 1, 1, tzinfo=datetime.UTC))
    other = Pki(tmp_path, "other")
    cases = {
        "expired": (replace(base, tls=expired.server()), "--tls-cert", "not now"),
        "foreign key": (replace(base, tls=TlsFiles(pki.cert_file, other.key_file, None, SERVER_TLS_NAMES)),
                        "--tls-key", "is not the key of the certificate"),
        "missing": (replace(base, tls=TlsFiles(tmp_path / "nope.pem", pki.key_file, None, SERVER_TLS_NAMES)),
                    "--tls-cert", "cannot read --tls-cert"),
        "no key": (replace(base, tls=TlsFiles(pki.cert_file, None, None, SERVER_TLS_NAMES)),
                   "--tls-key", "--tls-cert needs --tls-key"),
        "not pem": (replace(base, tls=TlsFiles(pki.key_file, pki.key_file, None, SERVER_TLS_NAMES)),
                    "--tls-cert", "holds no PEM certificate"),
        "client ca alone": (replace(base, tls=TlsFiles(None, None, pki.ca_file, SERVER_TLS_NAMES)),
                            "--tls-client-ca", "needs --tls-cert and --tls-key"),
        "plaintext beyond loopback": (replace(base, host="0.0.0.0"), "--insecure", "in plaintext"),
    }
    for name, (config, setting, text) in cases.items():
        with pytest.raises(errors.InvalidArgument) as caught:
            mesh = Mesh(config)
            await mesh.start()
            await mesh.stop()
        assert caught.value.reason == errors.Reason.BAD_CONFIG, name
        assert caught.value.metadata["setting"] == setting, (name, caught.value)
        assert text in caught.value.message, (name, caught.value.message)
        assert "BEGIN" not in caught.value.message, "no file content in the message"


async def test_the_ioa_network_and_the_relay_over_mutual_tls(tmp_path, pki):
    relays = Pki(tmp_path, "relays")
    relay_cert, relay_key = relays.issue("relay", "north")  # the node id, as a subject alternative name
    network_config = NetworkConfig(tls=pki.server(client_ca=relays.ca_file))
    async with NetworkServer(network_config) as network:
        tls = TlsFiles(relay_cert, relay_key, pki.ca_file, ("--ioa-tls-cert", "--ioa-tls-key", "--ioa-tls-ca"))
        config = replace(make_config(tmp_path / "north"),
                         ioa=IoaConfig(node_id="north", network=network.address, receipt_timeout_s=5, tls=tls))
        async with Mesh(config) as mesh, MeshClient(mesh.address) as client:
            assert mesh.relay is not None
            await mesh.relay.wait_connected(10)
            lead = await client.register("lead")
            kid = await lead.spawn("kid")
            receipt = await lead.send(f"ioa:north/{kid.agent_id}", "through the network, over mutual TLS")
            assert receipt.status == pb.RECEIPT_STATUS_ACCEPTED
        plain = replace(config, ioa=IoaConfig(node_id="south", network=network.address))
        async with Mesh(plain) as mesh:  # a relay without a certificate never gets in
            assert mesh.relay is not None
            with pytest.raises(TimeoutError):
                await mesh.relay.wait_connected(2)


def test_the_command_line_serves_tls_and_its_client_commands_use_it(tmp_path, pki):
    with MeshProcess(tmp_path / "mesh", "--tls-cert", str(pki.cert_file), "--tls-key", str(pki.key_file)) as mesh:
        assert "(TLS;" in mesh.output(), mesh.output()
        command = [sys.executable, "-m", "inboxmesh.cli.main", "register", "cli-agent", "--mesh", mesh.address,
                   "--timeout", "5", "--data-dir", str(tmp_path / "cli")]  # no mesh.json of another mesh
        done = subprocess.run([*command, "--tls-ca", str(pki.ca_file)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "agt_" in done.stdout, done.stderr
        plain = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert plain.returncode != 0, "a plaintext client command is refused"


async def test_the_network_authenticates_nodes_by_their_certificates(tmp_path, pki):
    """With a client CA the network takes a node id only from a certificate that names it: a node cannot
    connect as another, so cannot read its messages; its own reconnect still gets its recent messages
    again. Fault injection is off unless turned on."""
    nodes = Pki(tmp_path, "nodes")
    north_cert, north_key = nodes.issue("north", common_name="north")
    config = NetworkConfig(tls=pki.server(client_ca=nodes.ca_file), faults=False)
    async with NetworkServer(config) as network:
        credentials = tls_credentials(pki.ca_file, north_cert, north_key)
        async with grpc.aio.secure_channel(network.address, credentials) as channel:
            north = NodeClient(channel, "north")
            assert (await north.connect()).node_id == "north"
            impostor = NodeClient(channel, "south")  # north's certificate, south's name
            await impostor.call.write(net.NodeFrame(hello=net.Hello(node_id="south")))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in impostor.call:
                    pass
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "does not name node 'south'" in (caught.value.details() or "")
            assert (await north.publish("m1", to=("north", "x"), text="to myself")).status == net.PUBLISH_STATUS_OK
            assert (await north.next("message")).ioa_message_id == "m1"
            north.close()
            again = NodeClient(channel, "north")
            await again.connect()
            assert (await again.next("message")).ioa_message_id == "m1", "redelivered on reconnect"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await network_pb2_grpc.IoaNetworkStub(channel).InjectFault(
                    net.InjectFaultRequest(node_id="north", kind=net.FAULT_KIND_DROP_CONNECTION))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            again.close()


async def test_a_relay_refuses_a_message_whose_relay_header_names_another_node(network, tmp_path):
    beta = await start_node(network, tmp_path, "beta")
    try:
        kid = await (await beta.client.register("lead")).spawn("kid")
        async with grpc.aio.insecure_channel(network.address) as channel:
            raw = NodeClient(channel, "raw")
            await raw.connect()
            await raw.publish("forged", to=("beta", kid.agent_id), text="as if from alpha",
                              headers={"inboxmesh-relay": "alpha/abc", "inboxmesh-attempt": "a1"})
            answer = await raw.next("message", timeout=10)
            assert b'"not_permitted"' in answer.data and b"names another node" in answer.data
            raw.close()
        assert await beta.mesh.store.get_message_by_sender("ioa:raw/me", "forged") is None
    finally:
        await beta.stop()


async def test_a_bound_credential_is_refused_from_another_certified_host(tmp_path, pki):
    """--bind-credentials: an agent registered over mutual TLS from host A is refused from host B (another
    certificate of the same client CA), even with the right credential; a registration cannot bind
    itself to another host by its metadata."""
    clients = Pki(tmp_path, "clients")
    host_a, host_b = clients.issue("host-a", "host-a"), clients.issue("host-b", "host-b")
    config = replace(make_config(tmp_path), tls=pki.server(client_ca=clients.ca_file), bind_credentials=True)
    async with Mesh(config) as mesh:
        on_a = MeshClient(mesh.address, tls=tls_credentials(pki.ca_file, *host_a))
        on_b = MeshClient(mesh.address, tls=tls_credentials(pki.ca_file, *host_b))
        async with on_a, on_b:
            lead = await on_a.register("lead", metadata={"inboxmesh.bound_to": "host-b"})
            assert (await lead.get()).metadata["inboxmesh.bound_to"] == "host-a", "the mesh's, not the request's"
            kid = await lead.spawn("kid")
            assert (await lead.send(kid.agent_id, "from host A")).status == pb.RECEIPT_STATUS_ACCEPTED
            stolen = on_b.agent(lead.info, lead.credential)
            with pytest.raises(errors.PermissionDenied) as caught:
                await stolen.send(kid.agent_id, "from host B")
            assert caught.value.reason == errors.Reason.CREDENTIAL_BOUND
            assert "'host-a'" in caught.value.message and "'host-b'" in caught.value.message
            assert lead.credential not in caught.value.message
            with pytest.raises(errors.PermissionDenied):
                await on_b.agent(kid.info, kid.credential).get()  # a child is bound to where it was spawned
            assert (await on_b.register("b's own")).agent_id, "host B registers its own agents"
    unbound = replace(config, tls=pki.server(), bind_credentials=True)
    with pytest.raises(errors.InvalidArgument) as refused:
        async with Mesh(unbound):
            pass
    assert refused.value.metadata["setting"] == "--bind-credentials"


def test_no_credential_reaches_a_log_an_event_or_an_error_text_in_a_whole_scenario(tmp_path, pki):
    """The sibling scenario (a parent and two children, scripted) run by `inboxmesh run` against a mesh
    over mutual TLS with debug logging, plus refused calls: no credential the mesh issued, and not the
    operator token, appears in either process's output, in the event record, or in an error text."""
    clients = Pki(tmp_path, "clients")
    host_cert, host_key = clients.issue("host", "host")
    admin = "operator-token-" + "x" * 24
    with MeshProcess(tmp_path / "mesh", "--tls-cert", str(pki.cert_file), "--tls-key", str(pki.key_file),
                     "--tls-client-ca", str(clients.ca_file), admin_token=admin, log_level="debug",
                     kept_lines=1_000_000) as mesh:
        assert "(mutual TLS;" in mesh.output()
        assert (tmp_path / "mesh" / "mesh.json").stat().st_mode & 0o777 == 0o600, "the token file is the owner's"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
               "INBOXMESH_TLS_CA": str(pki.ca_file), "INBOXMESH_TLS_CLIENT_CERT": str(host_cert),
               "INBOXMESH_TLS_CLIENT_KEY": str(host_key)}
        run = subprocess.run(
            [sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "debug", "run", "--mesh", mesh.address,
             "--host-dir", str(tmp_path / "host"), "--name", "parent",
             "--policies", "harness.policies:SIBLING_POLICIES",
             "Your secret code is ABC-12345. Start A and B; A tells B the code, B confirms."],
            capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        issued = {json.loads(row[0])["credential"] for row in
                  sqlite3.connect(tmp_path / "host" / "host.db").execute("SELECT record FROM agents")}
        assert len(issued) == 3, issued

        async def record_and_refusals() -> str:
            credentials = tls_credentials(pki.ca_file, host_cert, host_key)
            async with MeshClient(mesh.address, admin_token=admin, tls=credentials) as client:
                events = await client.admin_events(limit=1000)
                texts = [str(e) for e in events]
                for bad in (admin + "x", next(iter(issued)) + "x"):
                    async with MeshClient(mesh.address, tls=credentials) as other:
                        try:
                            await other.agent(reg.Agent(agent_id="agt_x"), bad).get()
                        except errors.MeshError as exc:
                            texts.append(exc.message)
                return "\n".join(texts)

        seen = asyncio.run(record_and_refusals())
        outputs = {"mesh output": mesh.output(), "host stdout": run.stdout, "host stderr": run.stderr,
                   "event record and error texts": seen}
        assert "registered agent" in outputs["mesh output"], "debug logging was on"
        for secret in (*issued, admin):
            for where, text in outputs.items():
                assert secret not in text, f"a credential in the {where}"


@pytest.mark.store_independent
def test_the_jetstream_pair_behind_tls_on_nats_over_mutual_tls(tmp_path, pki):
    """Two mesh processes serving TLS, on a nats-server that serves TLS and requires client certificates:
    an agent registered and sending on one is consumed on the other. A mesh without the NATS CA does not
    start, and says why, as soon as the server's certificate is refused."""
    clients = Pki(tmp_path, "clients")
    nats_cert, nats_key = pki.issue("nats", "127.0.0.1", "localhost")
    mesh_client_cert, mesh_client_key = clients.issue("mesh-to-nats", "mesh")
    with NatsNode(tmp_path / "nats", tls=(nats_cert, nats_key), tls_client_ca=clients.ca_file) as node:
        assert node.url.startswith("tls://")
        nats_tls = ["--nats-tls-ca", str(pki.ca_file), "--nats-tls-cert", str(mesh_client_cert),
                    "--nats-tls-key", str(mesh_client_key)]
        serve = ["--tls-cert", str(pki.cert_file), "--tls-key", str(pki.key_file)]
        with MeshProcess(tmp_path / "r1", *node.mesh_args(), *nats_tls, *serve) as r1, \
                MeshProcess(tmp_path / "r2", *node.mesh_args(), *nats_tls, *serve) as r2:

            async def exchange() -> list[str]:
                credentials = tls_credentials(pki.ca_file)
                async with MeshClient(r1.address, tls=credentials) as on_1, \
                        MeshClient(r2.address, tls=credentials) as on_2:
                    lead = await on_1.register("lead")
                    kid = await lead.spawn("kid")
                    assert (await lead.send(kid.agent_id, "across TLS twice")).status == pb.RECEIPT_STATUS_ACCEPTED
                    stream = Collector(on_2.agent(kid.info, kid.credential), auto_ack=True)
                    try:
                        return [m.content.text for m in await stream.wait_for(1, timeout=20)]
                    finally:
                        await stream.stop()

            assert asyncio.run(exchange()) == ["across TLS twice"]
        refused = MeshProcess(tmp_path / "r3", *node.mesh_args(), *serve)
        with pytest.raises(RuntimeError) as caught:
            refused.start()
        # at once (2 s after the refusal, not the 20 s a server that is not up yet gets), naming the cause
        assert "cannot reach NATS" in str(caught.value) and "--nats-tls-ca" in str(caught.value) and \
            "certificate is not trusted" in str(caught.value), str(caught.value)[-1500:]


@pytest.mark.store_independent
async def test_a_nats_server_whose_certificate_is_not_trusted_does_not_keep_the_mesh_from_another(tmp_path, pki,
                                                                                                   caplog):
    """nats-py stops at a server whose certificate it refuses and tries no other: the mesh gives each server
    the first turn then. Of two unrelated nats-servers, one with a certificate of a CA the mesh does not
    trust, the mesh connects to the other, whichever nats-py tried first (it shuffles them: the opens go on
    until one met the untrusted server, as its log says)."""
    from services.config import NATS_TLS_NAMES, StoreConfig
    from services.store.jetstream.connection import JetStreamConnection

    untrusted = Pki(tmp_path, "elsewhere").issue("untrusted-nats", "127.0.0.1", "localhost")
    trusted = pki.issue("nats", "127.0.0.1", "localhost")
    with NatsNode(tmp_path / "a", tls=untrusted) as a, NatsNode(tmp_path / "b", tls=trusted) as b:
        config = StoreConfig(backend="jetstream", nats_urls=(a.url, b.url),
                             nats_monitor_urls=(a.monitor_url, b.monitor_url),
                             nats_tls=TlsFiles(ca=pki.ca_file, names=NATS_TLS_NAMES))
        for _ in range(12):
            caplog.clear()
            connection = JetStreamConnection(config)
            await connection.open()
            try:
                assert connection.nc is not None and connection.nc.connected_url is not None
                assert connection.nc.connected_url.port == b.port
            finally:
                await connection.close()
            if "SSLCertVerificationError" in caplog.text:
                break
        else:
            pytest.fail("nats-py never tried the untrusted server first in 12 opens")
