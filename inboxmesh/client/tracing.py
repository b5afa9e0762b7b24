"""OpenTelemetry for the mesh: one tracer, and W3C trace context carried in
message envelopes so a trace survives the queue.

Without a configured SDK the OpenTelemetry API is a no-op (spans cost next to
nothing) but incoming trace context still propagates through envelopes.
`configure_tracing` installs the SDK with an exporter.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from inboxmesh.common.v1 import envelope_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer("inboxmesh")
_propagator = TraceContextTextMapPropagator()


def trace_id_of(traceparent: str) -> str:
    """The 32-hex trace id of a W3C traceparent, or "" when absent/invalid."""
    if len(traceparent) >= 55 and traceparent[2] == "-" and traceparent[35] == "-":
        return traceparent[3:35]
    return ""


def context_of(envelope: envelope_pb2.Envelope) -> otel_context.Context | None:
    """The trace context an envelope carries (None when it carries none)."""
    if not envelope.trace.traceparent:
        return None
    carrier = {"traceparent": envelope.trace.traceparent}
    if envelope.trace.tracestate:
        carrier["tracestate"] = envelope.trace.tracestate
    return _propagator.extract(carrier)


def _carrier(ctx: otel_context.Context | None) -> dict[str, str]:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return carrier


def traceparent(ctx: otel_context.Context | None = None) -> str:
    """The W3C traceparent of the current (or given) span ("" without one)."""
    return _carrier(ctx).get("traceparent", "")


def inject(envelope: envelope_pb2.Envelope, ctx: otel_context.Context | None = None) -> None:
    """Write the current (or given) span's context into the envelope."""
    carrier = _carrier(ctx)
    if "traceparent" in carrier:
        envelope.trace.traceparent = carrier["traceparent"]
        envelope.trace.tracestate = carrier.get("tracestate", "")


def message_attributes(envelope: envelope_pb2.Envelope) -> dict[str, str | int]:
    return {
        "messaging.system": "inboxmesh",
        "messaging.message.id": envelope.message_id,
        "inboxmesh.sender": envelope.sender,
        "inboxmesh.recipient": envelope.recipient,
        "inboxmesh.sequence": envelope.sequence,
    }


def configure_tracing(exporter_name: str | None = None, service_name: str = "inboxmesh") -> bool:
    """Install the OpenTelemetry SDK with the named exporter ("console", or
    "otlp" when opentelemetry-exporter-otlp is installed). Reads
    INBOXMESH_TRACES when no name is given. Returns whether tracing is on."""
    exporter_name = exporter_name or os.environ.get("INBOXMESH_TRACES", "")
    if not exporter_name or exporter_name == "none":
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter,  # optional: not installed by the project's set-up
            )
        except ImportError as exc:
            raise SystemExit(
                "INBOXMESH_TRACES=otlp needs `pip install opentelemetry-exporter-otlp-proto-grpc`"
            ) from exc
        exporter = OTLPSpanExporter()
    else:
        raise SystemExit(f"unknown trace exporter {exporter_name!r}: use console, otlp or none")
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing on, exporting to %s", exporter_name)
    return True
