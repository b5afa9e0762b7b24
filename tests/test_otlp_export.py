"""Traces to any backend: every process the CLI starts exports its spans over OTLP/gRPC when the standard
OTEL_* variables ask for it, and one trace runs across the processes from A's send to B's reply.

The backend is a real OTLP/gRPC receiver in the test process: the collector's TraceService from the official
opentelemetry-proto definitions on a free loopback port, keeping every span it is sent with its resource. The
sibling scenario runs in two processes of its own: a mesh (`inboxmesh up`, on the test's store) and an agent
host (`inboxmesh run` with the scripted sibling policies).
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

from inboxmesh.client import errors
from inboxmesh.client.mesh import MeshClient
from inboxmesh.client.tracing import tracing_settings
from inboxmesh.events.v1 import events_pb2 as ev
from tests.fixtures import ADMIN_TOKEN, store_args, store_config
from tests.processes import MeshProcess

ROOT = Path(__file__).resolve().parent.parent
K = ev.EventKind


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as an OTLP backend received it, with its resource's attributes."""

    resource: dict[str, str]
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, str | int]

    @property
    def service(self) -> str:
        return self.resource.get("service.name", "")


def _value(value: common_pb2.AnyValue) -> str | int:
    return value.int_value if value.WhichOneof("value") == "int_value" else value.string_value


def received_spans(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    found = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: str(_value(kv.value)) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                found.append(ReceivedSpan(resource, span.name, span.trace_id.hex(), span.span_id.hex(),
                                          span.parent_span_id.hex(), {kv.key: _value(kv.value)
                                                                      for kv in span.attributes}))
    return found


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on a free loopback port: what a collector or a tracing backend is to the
    exporter. Keeps every span it is sent (`spans`), or only counts them (`keep=False`: `bench/mesh_bench.py
    --traces` runs one in a process of its own)."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.spans: list[ReceivedSpan] = []
        self.count = 0
        self._server: grpc.aio.Server | None = None
        self.endpoint = ""

    async def Export(self, request, context):  # noqa: N802 (the proto's method name)
        self.count += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        if self.keep:
            self.spans += received_spans(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    async def start(self) -> str:
        """Serve; the endpoint to give OTEL_EXPORTER_OTLP_ENDPOINT (http://127.0.0.1:PORT)."""
        self._server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        return self.endpoint

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=1)
            self._server = None


def otel_env(endpoint: str, service_name: str | None, **more: str) -> dict[str, str]:
    """A process's environment exporting to `endpoint`, with the test runner's own tracing variables left out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "INBOXMESH_TRACES"}
    env.update(PYTHONPATH=str(ROOT), OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
               OTEL_RESOURCE_ATTRIBUTES="deployment.environment=otlp-test", **more)
    if service_name:
        env["OTEL_SERVICE_NAME"] = service_name
    return env


def hosted_agents(host_dir: Path) -> dict[str, str]:
    """Agent id by name, from the host's own database."""
    with sqlite3.connect(host_dir / "host.db") as db:
        records = [json.loads(row[0]) for row in db.execute("SELECT record FROM agents")]
    return {r["name"]: r["agent_id"] for r in records}


async def test_one_trace_runs_from_a_send_to_the_reply_across_the_mesh_and_host_processes(tmp_path):
    receiver = OtlpReceiver()
    endpoint = await receiver.start()
    store = store_config(tmp_path / "mesh")
    # The mesh batches its spans for a minute: they can only reach the receiver through the export that a
    # clean stop (SIGTERM) makes. The host exports every 100 ms and at its exit.
    mesh = MeshProcess(tmp_path / "mesh", *store_args(store))
    mesh.env = otel_env(endpoint, "otlp-test-mesh", OTEL_BSP_SCHEDULE_DELAY="60000")  # exactly (not on top of ours)
    try:
        address = await asyncio.to_thread(mesh.start)
        host_dir = tmp_path / "host"
        # no OTEL_SERVICE_NAME for the host: it is named by the CLI's default for `run`
        run = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "warning", "run", "--mesh", address,
            "--host-dir", str(host_dir), "--name", "parent", "--policies", "harness.policies:SIBLING_POLICIES",
            "--quiet", "Your secret code is ABC-12345. Start A and B; A tells B the code, B confirms.",
            cwd=ROOT, env=otel_env(endpoint, None, OTEL_BSP_SCHEDULE_DELAY="100"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(run.communicate(), timeout=90)
        finally:
            if run.returncode is None:
                run.kill()
                await run.wait()
        assert run.returncode == 0, out.decode()[-3000:]
        async with MeshClient(address, admin_token=ADMIN_TOKEN) as client:
            events = await client.admin_events(limit=1000)
        code = await asyncio.to_thread(mesh.terminate)
        assert code == 0, mesh.output()
    finally:
        await asyncio.to_thread(mesh.__exit__, None, None, None)
        await receiver.stop()

    agents = hosted_agents(host_dir)
    a, b = agents["A"], agents["B"]
    (a_to_b,) = [e for e in events if e.kind == K.EVENT_KIND_MESSAGE_STORED and e.sender == a and e.recipient == b
                 and not e.in_reply_to]
    (reply,) = [e for e in events if e.kind == K.EVENT_KIND_MESSAGE_STORED and e.sender == b
                and e.in_reply_to == a_to_b.message_id]
    spans = receiver.spans
    assert spans, "the receiver got no span"

    def every(name: str, service: str, **attributes) -> list[ReceivedSpan]:
        found = [s for s in spans if s.name == name and s.service == service
                 and all(s.attributes.get(k) == v for k, v in attributes.items())]
        assert found, (name, service, attributes, sorted({(s.service, s.name) for s in spans}))
        return found

    def one(name: str, service: str, **attributes) -> ReceivedSpan:
        found = every(name, service, **attributes)
        assert len(found) == 1, (name, service, attributes, found)
        return found[0]

    mesh_service, host_service = "otlp-test-mesh", "inboxmesh-host"
    # A's send of the message to B (the host process) starts the trace
    send = one("send", host_service, **{"messaging.message.id": a_to_b.message_id, "inboxmesh.sender": a,
                                         "inboxmesh.recipient": b})
    trace_id = send.trace_id
    assert trace_id == a_to_b.trace_id, "the mesh's event record names the same trace"
    # the mesh process stores it, delivers it to B (again, were B's stream lost before its ack) and records
    # B's ack, all under A's send
    enqueue = one("enqueue", mesh_service, **{"messaging.message.id": a_to_b.message_id, "inboxmesh.recipient": b})
    for span in [enqueue, *every("deliver", mesh_service, **{"messaging.message.id": a_to_b.message_id,
                                                             "inboxmesh.recipient": b})]:
        assert (span.trace_id, span.parent_span_id) == (trace_id, send.span_id), span
    ack = one("ack", mesh_service, **{"messaging.message.id": a_to_b.message_id})
    assert (ack.trace_id, ack.parent_span_id) == (trace_id, send.span_id)
    # B consumes it (the host process) and replies, in the same trace
    consume = one("consume", host_service, **{"messaging.message.id": a_to_b.message_id, "inboxmesh.recipient": b})
    assert (consume.trace_id, consume.parent_span_id) == (trace_id, send.span_id)
    answer = one("reply", host_service, **{"inboxmesh.in_reply_to": a_to_b.message_id})
    assert (answer.trace_id, answer.parent_span_id) == (trace_id, consume.span_id)
    reply_send = one("send", host_service, **{"messaging.message.id": reply.message_id, "inboxmesh.sender": b})
    assert (reply_send.trace_id, reply_send.parent_span_id) == (trace_id, answer.span_id)
    # the reply's way back to A: stored and delivered by the mesh, consumed by A
    enqueue = one("enqueue", mesh_service, **{"messaging.message.id": reply.message_id, "inboxmesh.recipient": a})
    for span in [enqueue, *every("deliver", mesh_service, **{"messaging.message.id": reply.message_id,
                                                             "inboxmesh.recipient": a})]:
        assert (span.trace_id, span.parent_span_id) == (trace_id, reply_send.span_id), span
    arrival = one("consume", host_service, **{"messaging.message.id": reply.message_id, "inboxmesh.recipient": a})
    assert (arrival.trace_id, arrival.parent_span_id) == (trace_id, reply_send.span_id)

    in_trace = [s for s in spans if s.trace_id == trace_id]
    assert {s.service for s in in_trace} == {mesh_service, host_service}, "one trace, two processes"
    assert all(s.resource.get("deployment.environment") == "otlp-test" for s in spans), "OTEL_RESOURCE_ATTRIBUTES"


@pytest.mark.store_independent
@pytest.mark.parametrize(("flag", "environ", "exporters"), [
    (None, {}, ()),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, ("otlp",)),
    (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector:4317"}, ("otlp",)),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_SDK_DISABLED": "true"}, ()),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_TRACES_EXPORTER": "none"}, ()),
    (None, {"OTEL_TRACES_EXPORTER": "console,otlp"}, ("console", "otlp")),
    (None, {"OTEL_TRACES_EXPORTER": "otlp", "INBOXMESH_TRACES": "console"}, ("console",)),
    ("none", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "INBOXMESH_TRACES": "otlp"}, ()),
    ("otlp", {"INBOXMESH_TRACES": "console"}, ("otlp",)),
])
def test_the_flag_wins_then_inboxmesh_traces_then_the_standard_variables(flag, environ, exporters):
    assert tracing_settings(flag, environ, "inboxmesh-mesh").exporters == exporters


ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}


@pytest.mark.store_independent
@pytest.mark.parametrize(("environ", "named"), [
    ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER"),
    ({"INBOXMESH_TRACES": "otlp,zipkin"}, "INBOXMESH_TRACES"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "grpc://collector:4317"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
    ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({**ENDPOINT, "OTEL_BSP_SCHEDULE_DELAY": "soon"}, "OTEL_BSP_SCHEDULE_DELAY"),
    ({**ENDPOINT, "OTEL_EXPORTER_OTLP_TIMEOUT": "-1"}, "OTEL_EXPORTER_OTLP_TIMEOUT"),
    ({**ENDPOINT, "OTEL_RESOURCE_ATTRIBUTES": "team=a,oops"}, "OTEL_RESOURCE_ATTRIBUTES"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/no/such.pem"},
     "OTEL_EXPORTER_OTLP_CERTIFICATE"),
])
def test_a_bad_setting_is_refused_naming_its_variable(environ, named):
    with pytest.raises(errors.InvalidArgument) as refused:
        tracing_settings(None, environ, "inboxmesh-mesh")
    assert refused.value.message.startswith(named), refused.value.message


@pytest.mark.store_independent
def test_a_process_with_a_bad_setting_stops_at_start_with_a_line_not_a_traceback():
    env = {**otel_env("http://127.0.0.1:4317", "x"), "OTEL_EXPORTER_OTLP_COMPRESSION": "zip"}
    done = subprocess.run([sys.executable, "-m", "inboxmesh.cli.main", "ioa-server", "--port", "0"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "OTEL_EXPORTER_OTLP_COMPRESSION" in done.stderr, done.stderr
