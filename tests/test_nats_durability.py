"""The mesh starts on NATS only when every server fsyncs each JetStream write before acknowledging it
(`sync_interval: always`, read from the server's monitoring endpoint), or when told to accept less
(--nats-accept-lazy-fsync). Real nats-server processes: one with the shipped harness/nats-server.conf,
one with the server's own default (an fsync every two minutes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.nats import NatsNode, free_port
from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.mesh import MeshClient
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.config import StoreConfig
from services.store.jetstream.durability import monitor_urls
from services.store.jetstream.store import JetStreamStore
from tests.fixtures import ADMIN_TOKEN
from tests.processes import MeshProcess

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.store_independent, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def lazy(tmp_path_factory):
    """A nats-server with its default durability."""
    node = NatsNode(tmp_path_factory.mktemp("lazy"), durable=False).start()
    yield node
    node.kill()


@pytest.fixture(scope="module")
def durable(tmp_path_factory):
    node = NatsNode(tmp_path_factory.mktemp("durable")).start()
    yield node
    node.kill()


async def _refusal(store: StoreConfig) -> errors.MeshError:
    with pytest.raises(errors.FailedPrecondition) as refused:
        await JetStreamStore(store).start()
    assert refused.value.reason == Reason.NATS_NOT_DURABLE, refused.value
    return refused.value


async def test_a_server_that_does_not_fsync_every_write_is_refused_naming_it_and_the_fix(lazy):
    refused = await _refusal(lazy.store_config(nats_namespace="refused"))
    assert f"NATS server {lazy.name} ({lazy.monitor_url})" in refused.message
    assert "every 120 s" in refused.message, "the interval the server reports"
    assert "sync_interval: always" in refused.message and "--nats-accept-lazy-fsync" in refused.message


async def test_an_unreadable_monitoring_endpoint_is_refused_naming_the_flags(durable):
    nowhere = f"http://127.0.0.1:{free_port()}"
    refused = await _refusal(durable.store_config(nats_monitor_urls=(nowhere,), nats_namespace="unread"))
    assert f"{nowhere}/varz did not answer" in refused.message
    assert "--nats-monitor" in refused.message and "--nats-accept-lazy-fsync" in refused.message


async def test_a_server_that_fsyncs_every_write_is_accepted_and_nothing_is_left_open(durable):
    store = JetStreamStore(durable.store_config(nats_namespace="accepted"))
    await store.start()
    try:
        assert await store.get_agent("agt_none") is None
    finally:
        await store.close()


def test_inboxmesh_up_says_what_is_wrong_and_exits_1_on_a_lazy_server(lazy, tmp_path):
    up = subprocess.run([sys.executable, "-m", "inboxmesh.cli.main", "up", "--port", "0", "--no-demo",
                         "--data-dir", str(tmp_path), *lazy.mesh_args()], cwd=ROOT, capture_output=True,
                        text=True, timeout=60)
    assert up.returncode == 1, up.stdout + up.stderr
    assert up.stderr.startswith(f"inboxmesh: NATS server {lazy.name} ({lazy.monitor_url}) fsyncs"), up.stderr
    assert "Traceback" not in up.stderr and "--port 0" not in up.stderr


async def test_with_the_flag_a_mesh_runs_on_a_lazy_server(lazy, tmp_path):
    with MeshProcess(tmp_path, *lazy.mesh_args(), "--nats-accept-lazy-fsync") as mesh:
        async with MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            kid = await lead.spawn("kid")
            assert (await lead.send(kid.agent_id, "hello")).status == pb.RECEIPT_STATUS_ACCEPTED


def test_without_monitoring_urls_port_8222_of_each_nats_host_is_checked():
    store = StoreConfig(backend="jetstream", nats_urls=("nats://a.example:4222", "tls://b.example:4223",
                                                        "a.example:4224", "nats://u:p@c.example"))
    assert monitor_urls(store) == ("http://a.example:8222", "http://b.example:8222", "http://c.example:8222")
    given = StoreConfig(backend="jetstream", nats_urls=("nats://a:4222",), nats_monitor_urls=("http://m:1",))
    assert monitor_urls(given) == ("http://m:1",)
