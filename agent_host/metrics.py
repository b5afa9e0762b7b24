"""An agent host's metrics for Prometheus (docs/metrics.md): model requests and tokens, per model and for the
busiest agents, counted where the runner records its MODEL_CALLED events (one per model asked in a turn,
AgentRunner._hold_attempts), so they agree with the record's MODEL_CALLED events by construction.

`MODEL_USAGE` (agent_host/model_usage.py, which loads nothing heavy) counts in every host process, always (a
dictionary update per model reply, beside a model request); `MetricsServer` serves it on a loopback port as
the OpenTelemetry metrics SDK's Prometheus exporter reads it out (a MeterProvider and a CollectorRegistry of
its own), only when asked (`inboxmesh host` and `inboxmesh run` with `--metrics-port`): a host that serves no
metrics does not load this module, aiohttp or the exporter.
"""

from __future__ import annotations

import logging

from aiohttp import web
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from agent_host.model_usage import MODEL_USAGE, ModelUsage

log = logging.getLogger(__name__)

TOP_AGENTS = 20
"""Per-agent series for this many agents: those with the most model requests."""


class HostMetrics:
    """A ModelUsage read out as Prometheus metrics (`exposition()`)."""

    def __init__(self, usage: ModelUsage = MODEL_USAGE, top_agents: int = TOP_AGENTS,
                 service_name: str = "inboxmesh-host"):
        self.usage = usage
        self.top_agents = top_agents
        self.registry = CollectorRegistry(auto_describe=True)
        self._provider = MeterProvider(
            metric_readers=[PrometheusMetricReader(scope_info_enabled=False, registry=self.registry)],
            resource=Resource.create({"service.name": service_name}))
        self._shut = False
        meter = self._provider.get_meter("inboxmesh.host")
        meter.create_observable_counter(
            "inboxmesh.host.model.requests", [self._requests], unit="{request}",
            description="Model requests, by model reference and outcome (MODEL_CALLED events' requests=)")
        meter.create_observable_counter(
            "inboxmesh.host.model.tokens", [self._tokens], unit="{token}",
            description="Tokens of model replies, by model reference and type (prompt, output)")
        meter.create_observable_counter(
            "inboxmesh.host.agent.model.requests", [self._agent_requests], unit="{request}",
            description=f"Model requests of the {top_agents} agents that made the most")
        meter.create_observable_counter(
            "inboxmesh.host.agent.model.tokens", [self._agent_tokens], unit="{token}",
            description=f"Tokens of the {top_agents} agents that made the most model requests, by type")

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        """Safe to call twice."""
        if not self._shut:
            self._shut = True
            self._provider.shutdown()

    def _requests(self, _: CallbackOptions) -> list[Observation]:
        return [Observation(n, {"model": m, "outcome": o}) for (m, o), n in self.usage.requests.items()]

    def _tokens(self, _: CallbackOptions) -> list[Observation]:
        return [Observation(n, {"model": m, "type": t}) for (m, t), n in self.usage.tokens.items()]

    def _agent_requests(self, _: CallbackOptions) -> list[Observation]:
        return [Observation(c[0], {"agent_id": a}) for a, c in self.usage.top(self.top_agents)]

    def _agent_tokens(self, _: CallbackOptions) -> list[Observation]:
        return [Observation(c[i], {"agent_id": a, "type": t}) for a, c in self.usage.top(self.top_agents)
                for i, t in ((1, "prompt"), (2, "output"))]


class MetricsServer:
    """`GET /metrics` on 127.0.0.1:`port` (0: any free port), for a Prometheus on the same machine: no token,
    so never beyond loopback. `async with MetricsServer(port) as server:` ... `server.url`."""

    def __init__(self, port: int, metrics: HostMetrics | None = None):
        self.metrics = metrics or HostMetrics()
        self._port = port
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._serve)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", self._port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        log.info("host metrics at %s", self.url)

    async def stop(self) -> None:
        """Safe to call twice."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        self.metrics.shutdown()

    async def __aenter__(self) -> MetricsServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    async def _serve(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4, "Cache-Control": "no-store"})
