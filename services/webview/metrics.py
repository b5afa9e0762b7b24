"""The mesh's metrics for Prometheus (docs/metrics.md), derived from the event record: the web view's one
in-process watch of the record (app.py `_follow_record`) folds every event into a `Tally` as well as into the
board, and `/metrics` reads the tally out through the OpenTelemetry metrics SDK (observable instruments and
two histograms on a MeterProvider of this web view's own, never the global one) and its Prometheus exporter (a
CollectorRegistry of its own: two meshes in one process never mix).

Why from the record and not counted on the hot paths: the record is what every test and every operator's
question is answered from, so the counts agree with it by construction (the metrics test compares them
event for event), the send, delivery and ack paths pay nothing, and on JetStream every mesh process folds
the same shared record, so each reports the whole mesh (scrape any one of them; docs/metrics.md).

Bounded: per-agent series only for the `top_agents` agents with the deepest inboxes (plus totals over
all); label values come from fixed sets (receipt statuses, dead-letter reasons) or are agent ids the mesh
issued; the timestamps kept to measure latencies are at most `timed_messages` messages' (the messages stored
beyond that are counted but not timed).
"""

from __future__ import annotations

import collections
import heapq
import time
from collections.abc import Iterable

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from inboxmesh.events.v1 import events_pb2 as ev
from services.store.base import REASON_ATTEMPTS, REASON_CLOSED, REASON_EXPIRED, RECEIPT_NAME

K = ev.EventKind

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""The text format 0.0.4 (what every Prometheus reads; the names are plain, so it is also 1.0.0 text)."""
OTHER = "other"
"""The label value of a receipt status or dead-letter reason this build does not know (never the raw text)."""
RECEIPT_STATUSES = tuple(sorted(name for name in RECEIPT_NAME.values() if name != "unspecified")) + (OTHER,)
"""The `status` label's values: the receipt statuses of the contract (a sent event's detail starts with one)."""
DEAD_LETTER_REASONS = (REASON_CLOSED, REASON_ATTEMPTS, REASON_EXPIRED, OTHER)
"""The `reason` label's values: the dead-letter reasons the stores write."""
TOP_AGENTS = 20
"""Per-agent series (depth, oldest age) for this many agents, the deepest inboxes."""
TIMED_MESSAGES = 100_000
"""Stored, not yet consumed messages whose store time is kept for the latency histograms and the oldest age."""
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                     300.0, 1800.0)
"""Histogram bounds, seconds: a millisecond (a local delivery) to half an hour (an agent busy with a long task)."""


def receipt_status(detail: str) -> str:
    """A sent event's receipt status ("accepted", "inbox_full", ...): its detail's first word ("accepted (via
    IOA)" too); OTHER for anything else."""
    word = detail.split(" ", 1)[0]
    return word if word in RECEIPT_STATUSES else OTHER


def dead_letter_reason(detail: str) -> str:
    return detail if detail in DEAD_LETTER_REASONS else OTHER


def _agent(agent_id: str) -> bool:
    """An inbox of this mesh (not an IOA or channel address)."""
    return bool(agent_id) and not agent_id.startswith(("ioa:", "channel:"))


class Tally:
    """The fold of the record that the metrics read: counts, each inbox's depth and its unconsumed messages'
    store times, each agent's last turn start. Knows nothing of OpenTelemetry: `fold` returns the latencies
    (seconds) it measured, for the histograms."""

    def __init__(self, timed_messages: int = TIMED_MESSAGES):
        self.last_event_id = 0
        self.receipts: collections.Counter[str] = collections.Counter({s: 0 for s in RECEIPT_STATUSES})
        self.dead_letters: collections.Counter[str] = collections.Counter({r: 0 for r in DEAD_LETTER_REASONS})
        self.stored = self.deliveries = self.redeliveries = self.consumed = 0
        self.depth: dict[str, int] = {}
        """Stored less consumed and dead-lettered, per inbox; only inboxes that hold something."""
        self.pending: dict[str, collections.OrderedDict[int, int]] = {}
        """Per inbox, sequence -> store time (us) of its unconsumed messages, oldest first (at most timed_messages
        in all)."""
        self.timed = 0
        self.untimed = 0
        """Messages stored while timed_messages were already timed: counted, never measured."""
        self.turn_started: dict[str, tuple[int, int]] = {}
        """Per agent, its last TURN_STARTED: (turn, time in us)."""
        self._timed_messages = timed_messages

    def fold(self, events: Iterable[ev.Event]) -> tuple[list[float], list[float]]:
        """Fold events in record order; returns (send->consume latencies, wake-up latencies) of the messages
        consumed among them, in seconds."""
        consume: list[float] = []
        wakeup: list[float] = []
        for event in events:
            self.last_event_id = event.event_id
            kind = event.kind
            if kind == K.EVENT_KIND_MESSAGE_SENT:
                self.receipts[receipt_status(event.detail)] += 1
            elif kind == K.EVENT_KIND_MESSAGE_DELIVERED:
                self.deliveries += 1
                if event.detail != "attempt=1":
                    self.redeliveries += 1
            elif kind == K.EVENT_KIND_TURN_STARTED:
                self.turn_started[event.agent_id] = (event.turn, event.at_us)
            elif kind == K.EVENT_KIND_AGENT_CLOSED:
                self.turn_started.pop(event.agent_id, None)
            elif not _agent(event.agent_id):
                continue
            elif kind == K.EVENT_KIND_MESSAGE_STORED:
                self._stored(event)
            elif kind == K.EVENT_KIND_MESSAGE_CONSUMED:
                self.consumed += 1
                stored_at = self._taken(event)
                if stored_at is not None:
                    consume.append(max(0, event.at_us - stored_at) / 1e6)
                    turn = self.turn_started.get(event.agent_id)
                    if event.turn and turn is not None and turn[0] == event.turn:
                        wakeup.append(max(0, turn[1] - stored_at) / 1e6)  # 0: it came during that turn
            elif kind == K.EVENT_KIND_MESSAGE_DEAD_LETTERED:
                self.dead_letters[dead_letter_reason(event.detail)] += 1
                self._taken(event)
        return consume, wakeup

    def _stored(self, event: ev.Event) -> None:
        self.stored += 1
        self.depth[event.agent_id] = self.depth.get(event.agent_id, 0) + 1
        if self.timed >= self._timed_messages:
            self.untimed += 1
            return
        self.pending.setdefault(event.agent_id, collections.OrderedDict())[event.sequence] = event.at_us
        self.timed += 1

    def _taken(self, event: ev.Event) -> int | None:
        """A message left its inbox (consumed or dead-lettered): its store time, when it was timed."""
        depth = self.depth.get(event.agent_id, 0) - 1
        if depth > 0:
            self.depth[event.agent_id] = depth
        else:
            self.depth.pop(event.agent_id, None)
        waiting = self.pending.get(event.agent_id)
        stored_at = waiting.pop(event.sequence, None) if waiting is not None else None
        if stored_at is not None:
            self.timed -= 1
            if not waiting:
                del self.pending[event.agent_id]
        return stored_at

    def top(self, n: int) -> list[tuple[str, int]]:
        """The n deepest inboxes, (agent id, depth), deepest first (ties by agent id)."""
        return heapq.nsmallest(n, self.depth.items(), key=lambda item: (-item[1], item[0]))

    def oldest_us(self, agent_id: str) -> int | None:
        """When the oldest timed unconsumed message of this inbox was stored."""
        waiting = self.pending.get(agent_id)
        return next(iter(waiting.values())) if waiting else None


class MeshMetrics:
    """The tally of one web view, read out as Prometheus metrics (`exposition()`). `fold` is called with
    every batch the web view's watch reads; `shutdown()` with the web view's stop."""

    def __init__(self, top_agents: int = TOP_AGENTS, timed_messages: int = TIMED_MESSAGES,
                 service_name: str = "inboxmesh-mesh"):
        self.tally = Tally(timed_messages)
        self.top_agents = top_agents
        self._shut = False
        self.registry = CollectorRegistry(auto_describe=True)
        self._reader = PrometheusMetricReader(scope_info_enabled=False, registry=self.registry)
        self._provider = MeterProvider(metric_readers=[self._reader],
                                       resource=Resource.create({"service.name": service_name}))
        meter = self._provider.get_meter("inboxmesh.mesh")
        tally = self.tally

        def counter(name: str, description: str, read) -> None:
            meter.create_observable_counter(name, [read], unit="{message}", description=description)

        counter("inboxmesh.receipts", "Receipts given to sends, by status (MESSAGE_SENT events)",
                lambda _: [Observation(n, {"status": s}) for s, n in tally.receipts.items()])
        counter("inboxmesh.messages.stored", "Messages stored in an inbox (MESSAGE_STORED events)",
                lambda _: [Observation(tally.stored)])
        counter("inboxmesh.deliveries", "Deliveries of messages to a subscriber, every attempt (MESSAGE_DELIVERED)",
                lambda _: [Observation(tally.deliveries)])
        counter("inboxmesh.redeliveries", "Deliveries after the first attempt (MESSAGE_DELIVERED, attempt > 1)",
                lambda _: [Observation(tally.redeliveries)])
        counter("inboxmesh.messages.consumed", "Messages consumed by an ack (MESSAGE_CONSUMED events)",
                lambda _: [Observation(tally.consumed)])
        counter("inboxmesh.dead_letters", "Messages dead-lettered, by reason (MESSAGE_DEAD_LETTERED events)",
                lambda _: [Observation(n, {"reason": r}) for r, n in tally.dead_letters.items()])
        meter.create_observable_gauge("inboxmesh.inbox.depth", [self._depths], unit="{message}",
                                      description=f"Unconsumed messages of the {top_agents} deepest inboxes")
        meter.create_observable_gauge("inboxmesh.inbox.oldest_age", [self._ages], unit="s",
                                      description=f"Age of the oldest unconsumed message of the {top_agents}"
                                                  " deepest inboxes")
        meter.create_observable_gauge("inboxmesh.inboxes.depth", [lambda _: [Observation(sum(tally.depth.values()))]],
                                      unit="{message}", description="Unconsumed messages of all inboxes")
        meter.create_observable_gauge("inboxmesh.inboxes.nonempty", [lambda _: [Observation(len(tally.depth))]],
                                      unit="{inbox}", description="Inboxes holding unconsumed messages")
        meter.create_observable_gauge("inboxmesh.inboxes.oldest_age", [self._oldest], unit="s",
                                      description="Age of the oldest unconsumed message of all inboxes")
        meter.create_observable_gauge("inboxmesh.record.folded_event_id",
                                      [lambda _: [Observation(tally.last_event_id)]],
                                      description="The last event of the record these metrics include")
        self._consume = meter.create_histogram(
            "inboxmesh.message.consume_latency", unit="s", explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
            description="From a message stored to consumed (MESSAGE_STORED to MESSAGE_CONSUMED)")
        self._wakeup = meter.create_histogram(
            "inboxmesh.message.wakeup_latency", unit="s", explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
            description="From a message stored to the start of its recipient's turn that consumed it"
                        " (MESSAGE_STORED to TURN_STARTED; 0 when it came during that turn)")

    def fold(self, events: list[ev.Event]) -> None:
        consume, wakeup = self.tally.fold(events)
        for seconds in consume:
            self._consume.record(seconds)
        for seconds in wakeup:
            self._wakeup.record(seconds)

    def exposition(self) -> bytes:
        """The metrics in Prometheus's text format, as of now (ages) and the tally's last event."""
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        """Safe to call twice (the SDK only warns)."""
        if not self._shut:
            self._shut = True
            self._provider.shutdown()

    # -- what the gauges read at a scrape ---------------------------------------------------------------------
    def _depths(self, _: CallbackOptions) -> list[Observation]:
        return [Observation(depth, {"agent_id": agent}) for agent, depth in self.tally.top(self.top_agents)]

    def _ages(self, _: CallbackOptions) -> list[Observation]:
        now = time.time() * 1e6
        found = []
        for agent, _depth in self.tally.top(self.top_agents):
            oldest = self.tally.oldest_us(agent)
            if oldest is not None:
                found.append(Observation(max(0.0, now - oldest) / 1e6, {"agent_id": agent}))
        return found

    def _oldest(self, _: CallbackOptions) -> list[Observation]:
        oldest = min((next(iter(w.values())) for w in self.tally.pending.values() if w), default=None)
        return [Observation(0.0 if oldest is None else max(0.0, time.time() * 1e6 - oldest) / 1e6)]
