"""OpenTelemetry for the mesh: one tracer, and W3C trace context carried in
message envelopes so a trace survives the queue.

Without a configured SDK the OpenTelemetry API is a no-op (spans cost next to
nothing) but incoming trace context still propagates through envelopes.
`configure_tracing` installs the SDK with the exporters that `--traces`,
INBOXMESH_TRACES or the standard OTEL_* variables ask for (`tracing_settings`),
once per process, before its servers and channels are made.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.common.v1 import envelope_pb2

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

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


EXPORTERS = ("otlp", "console")
"""What spans can be exported with: OTLP over gRPC (to a collector or any backend that speaks it), or
printed as JSON on stderr."""

OTLP_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
"""Either of these set turns OTLP export on (the first wins, as in the exporter)."""

_NUMBERS = {"OTEL_BSP_SCHEDULE_DELAY": (int, "milliseconds between exports"),
            "OTEL_BSP_EXPORT_TIMEOUT": (int, "milliseconds an export may take"),
            "OTEL_BSP_MAX_QUEUE_SIZE": (int, "spans queued at most"),
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": (int, "spans in one export at most"),
            "OTEL_EXPORTER_OTLP_TIMEOUT": (float, "seconds an OTLP export may take"),
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": (float, "seconds an OTLP export may take")}
"""Variables the SDK reads as numbers, and what they count: it falls back to a default on a bad one with a log
line, or fails with a traceback at the first export; here a bad one stops the process at start, naming it."""

_FILES = tuple(f"OTEL_EXPORTER_OTLP{signal}_{what}" for signal in ("_TRACES", "")
               for what in ("CERTIFICATE", "CLIENT_CERTIFICATE", "CLIENT_KEY"))
"""TLS files of the OTLP connection: the exporter logs a missing one and carries on without it."""


@dataclass(frozen=True)
class TracingSettings:
    """What a process exports its spans with, read once at its start (`tracing_settings`)."""

    exporters: tuple[str, ...]
    """Some of EXPORTERS; empty: no SDK is installed, spans are no-ops (trace context still passes through)."""
    chosen_by: str
    """The flag or variable that chose them (named in errors and in the start-up log line)."""
    default_service_name: str
    """service.name when neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES names one."""


def _exporters(value: str, where: str) -> tuple[str, ...]:
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    if names == ["none"]:
        return ()
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown or not names:
        raise errors.InvalidArgument(f"{where}={value!r}: trace exporters are otlp, console (comma-separated) or"
                                     " none", reason=Reason.BAD_VALUE)
    return tuple(dict.fromkeys(names))


def tracing_settings(flag: str | None, environ: Mapping[str, str], default_service_name: str) -> TracingSettings:
    """Which exporters this process uses: `--traces` (flag) wins, then INBOXMESH_TRACES, then the standard
    OTEL_TRACES_EXPORTER; without any of them OTLP is on when OTEL_EXPORTER_OTLP_ENDPOINT or
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (and OTEL_SDK_DISABLED is not true), else tracing is off.
    A bad value is an InvalidArgument naming its flag or variable."""
    for value, where in ((flag, "--traces"), (environ.get("INBOXMESH_TRACES"), "INBOXMESH_TRACES"),
                         (environ.get("OTEL_TRACES_EXPORTER"), "OTEL_TRACES_EXPORTER")):
        if value:
            chosen = TracingSettings(_exporters(value, where), where, default_service_name)
            break
    else:
        endpoint = next((name for name in OTLP_ENDPOINTS if environ.get(name)), "")
        disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
        chosen = TracingSettings(("otlp",) if endpoint and not disabled else (), endpoint or "default",
                                 default_service_name)
    if chosen.exporters:
        _check_sdk_variables(environ)
    if "otlp" in chosen.exporters:
        _check_otlp_variables(environ)
    return chosen


def _check_sdk_variables(environ: Mapping[str, str]) -> None:
    for name, (kind, meaning) in _NUMBERS.items():
        value = environ.get(name, "").strip()
        try:
            ok = not value or kind(value) >= 0
        except ValueError:
            ok = False
        if not ok:
            raise errors.InvalidArgument(f"{name}={value[:60]!r}: not a{'n integer' if kind is int else ' number'}"
                                         f" ({meaning})", reason=Reason.BAD_VALUE)
    attributes = environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    bad = [item for item in attributes.split(",")
           if item.strip() and ("=" not in item or not item.partition("=")[0].strip())]
    if bad:
        raise errors.InvalidArgument(f"OTEL_RESOURCE_ATTRIBUTES: {bad[0][:60]!r} is not key=value (the variable is"
                                     " comma-separated key=value pairs, e.g. deployment.environment=prod)",
                                     reason=Reason.BAD_VALUE)


def _check_otlp_variables(environ: Mapping[str, str]) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = environ.get(name, "").strip()
        if protocol and protocol != "grpc":
            raise errors.InvalidArgument(f"{name}={protocol[:60]!r}: inboxmesh exports OTLP over gRPC only; set it"
                                         " to grpc or unset it, and point the endpoint at the collector's gRPC port"
                                         " (4317 by default)", reason=Reason.BAD_VALUE)
        if protocol:
            break
    for name in OTLP_ENDPOINTS:
        endpoint = environ.get(name, "").strip()
        if endpoint:
            _check_endpoint(name, endpoint)
            break
    for name in _FILES:
        path = environ.get(name, "")
        if path and not Path(path).is_file():
            raise errors.InvalidArgument(f"{name}: no file {path[:200]!r} (a PEM file for the OTLP connection's"
                                         " TLS)", reason=Reason.BAD_VALUE)


def _check_endpoint(name: str, endpoint: str) -> None:
    """An OTLP/gRPC endpoint as the exporter takes it: http://host:port (plaintext), https://host:port,
    host:port (TLS unless OTEL_EXPORTER_OTLP_INSECURE=true) or unix:PATH."""
    if endpoint.startswith("unix:"):
        return
    scheme = endpoint.partition("://")[0].lower() if "://" in endpoint else ""
    if scheme not in ("", "http", "https"):
        raise errors.InvalidArgument(f"{name}={endpoint[:100]!r}: an OTLP/gRPC endpoint is http://HOST:PORT,"
                                     " https://HOST:PORT or HOST:PORT", reason=Reason.BAD_VALUE)
    try:
        parts = urlsplit(endpoint if scheme else "//" + endpoint)
        ok = bool(parts.hostname) and (parts.port is not None or bool(scheme))
    except ValueError:  # a port that is not a number
        ok = False
    if not ok:
        raise errors.InvalidArgument(f"{name}={endpoint[:100]!r}: an OTLP/gRPC endpoint is http://HOST:PORT,"
                                     " https://HOST:PORT or HOST:PORT (e.g. http://127.0.0.1:4317)",
                                     reason=Reason.BAD_VALUE)


def configure_tracing(flag: str | None, default_service_name: str) -> TracerProvider | None:
    """Install the OpenTelemetry SDK with the exporters `tracing_settings` chooses from the process's
    environment. The resource is the SDK's (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME), with service.name
    `default_service_name` when neither names one; the exporter reads its OTEL_EXPORTER_OTLP_* itself.
    Returns the provider, which the caller shuts down at exit (that exports what is still queued), or None
    when tracing is off."""
    settings = tracing_settings(flag, os.environ, default_service_name)
    if not settings.exporters:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):  # the SDK's "no name given"
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    provider = TracerProvider(resource=resource)
    for name in settings.exporters:
        exporter: SpanExporter
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            try:
                exporter = OTLPSpanExporter()
            except Exception as exc:  # a setting the exporter rejects (compression, retryable codes, ...)
                raise errors.InvalidArgument(f"the OTLP exporter's settings (OTEL_EXPORTER_OTLP_*): {exc}",
                                             reason=Reason.BAD_VALUE) from exc
        else:
            exporter = ConsoleSpanExporter(out=sys.stderr)  # stdout may be a protocol (`inboxmesh mcp` on stdio)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing on (%s, chosen by %s) as service %s", ", ".join(settings.exporters), settings.chosen_by,
             resource.attributes.get(SERVICE_NAME))
    return provider
