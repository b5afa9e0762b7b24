"""Shared fixtures, loaded by the root conftest.py: a real mesh (gRPC on a free
loopback port, SQLite in tmp_path), clients, and an in-memory span exporter
installed once for the session."""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inboxmesh.client.mesh import MeshClient
from services.config import InboxLimits, MeshConfig, StoreConfig, WebConfig
from services.directory import Caller
from services.inbox.service import StreamSenders
from services.server import Mesh

if TYPE_CHECKING:
    from harness.nats import NatsNode

ADMIN_TOKEN = "test-admin-token"
_EXPORTER = InMemorySpanExporter()


def pytest_configure(config):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)


@pytest.fixture
def spans():
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


STORE = os.environ.get("INBOXMESH_TEST_STORE", "sqlite")
"""Which store the mesh fixtures use: sqlite (default) or jetstream (a
nats-server started once for the session; each config gets its own
namespace on it)."""
_NATS: dict[str, NatsNode] = {}


def store_config(tmp_path: Path) -> StoreConfig:
    if STORE != "jetstream":
        return StoreConfig(path=tmp_path / "mesh.db")
    if "node" not in _NATS:
        from harness.nats import NatsNode

        node = NatsNode(Path(tempfile.mkdtemp(prefix="inboxmesh-nats-"))).start()
        atexit.register(node.kill)
        _NATS["node"] = node
    namespace = "t" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]
    return _NATS["node"].store_config(nats_namespace=namespace, path=tmp_path / "mesh.db")  # the same directory
    # is the same mesh, as with SQLite


def store_args(store: StoreConfig) -> tuple[str, ...]:
    """The `inboxmesh up` flags of a mesh process on `store` (a store_config): none for SQLite (its file is
    in the process's data directory), the NATS servers and namespace for JetStream."""
    if store.backend != "jetstream":
        return ()
    return ("--store", "jetstream", "--nats", ",".join(store.nats_urls), "--nats-monitor",
            ",".join(store.nats_monitor_urls), "--nats-namespace", store.nats_namespace)


def contiguous_sequences() -> bool:
    """Inbox sequences run 1, 2, 3, ... on SQLite; on JetStream they are the
    stream's sequences: increasing within an inbox, with gaps."""
    return STORE != "jetstream"


def make_config(tmp_path: Path, **limits) -> MeshConfig:
    return MeshConfig(
        port=0,
        store=store_config(tmp_path),
        limits=replace(InboxLimits(), **limits),
        admin_token=ADMIN_TOKEN,
        heartbeat_interval_s=0.5,
        grace_period_s=1.0,
    )


@pytest.fixture
def mesh_config(tmp_path) -> MeshConfig:
    return make_config(tmp_path)


@pytest.fixture
async def mesh(mesh_config):
    instance = Mesh(mesh_config)
    await instance.start()
    try:
        yield instance
    finally:
        await instance.stop(grace=0.5)


def web_config(config: MeshConfig) -> MeshConfig:
    """The config with the web view on a free port."""
    return replace(config, web=WebConfig(port=0))


@pytest.fixture
async def web_mesh(tmp_path):
    """A mesh on the test's store serving the web view (tests/test_webview.py, tests/test_metrics.py)."""
    mesh = Mesh(web_config(make_config(tmp_path)))
    await mesh.start()
    try:
        yield mesh
    finally:
        await mesh.stop(grace=0.5)


@pytest.fixture
async def client(mesh):
    async with MeshClient(mesh.address, timeout=10.0, admin_token=ADMIN_TOKEN) as c:
        yield c


async def eventually(predicate, timeout: float = 10.0, interval: float = 0.01, message: str = "condition"):
    """Poll an async or sync predicate until it returns truthy, with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        await asyncio.sleep(interval)


@pytest.fixture(autouse=True)
def no_unhandled_servicer_errors(caplog):
    """Fail any test during which gRPC reported an exception our servicers
    let escape (it would otherwise only show in the log)."""
    yield
    escaped = [r.getMessage() for r in caplog.records
               if r.name.startswith("grpc") and r.levelname in ("ERROR", "CRITICAL")]
    assert not escaped, f"servicer exceptions escaped to gRPC: {escaped}"


async def consumed_event_ids(reader, agent_id: str, count: int) -> list[int] | None:
    """The ids of the agent's MESSAGE_CONSUMED events as `reader` (an AgentHandle, or a MeshClient with the
    admin token) lists them, once there are `count` of them (None before)."""
    from inboxmesh.events.v1 import events_pb2

    list_events = reader.admin_events if isinstance(reader, MeshClient) else reader.events
    found: list[int] = []
    after = 0
    while True:
        page = await list_events(agent_id=agent_id, after=after, limit=1000)
        if not page:
            break
        found += [e.event_id for e in page if e.kind == events_pb2.EVENT_KIND_MESSAGE_CONSUMED]
        after = page[-1].event_id
    return found if len(found) >= count else None


def stream_senders(mesh: Mesh) -> StreamSenders:
    """What InboxService.send_requests takes for a call authenticated by no agent (the admin's): each
    request's credentials proven through the mesh's directory, as the interceptor would."""
    directory = mesh.services.directory

    async def prove(credentials):
        return tuple([await directory.authenticate(c) for c in credentials])

    return StreamSenders(Caller(agent=None), prove)
