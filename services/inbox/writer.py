"""Storing messages in inboxes by the ordinary path: one commit per call, the store's receipts, an
`enqueue` span per message, and a wake-up for the subscribers of what was accepted. Knows nothing of
gRPC.

Three senders use it: local agents' sends (InboxService), messages the IOA relay received, and messages
the routing ingress received. It sends nothing onwards itself, so the IOA relay (which stores what it
receives through it) and the InboxService (which forwards IOA recipients to the relay) are built in the
order writer -> relay -> inbox, without a cycle (services.assembly)."""

from __future__ import annotations

import asyncio
import logging

from opentelemetry import trace

from inboxmesh.client import errors
from inboxmesh.client.tracing import context_of, inject, message_attributes, tracer
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.clock import now_us
from services.config import InboxLimits
from services.directory import Directory
from services.inbox.delivery import DeliveryHub
from services.ioa.exposure import Exposure
from services.store.base import (
    A2A_PREFIX,
    ACCEPTED,
    CHANNEL_PREFIX,
    IOA_PREFIX,
    NOT_PERMITTED,
    RECEIPT_ENUM_NAME,
    UNKNOWN_TARGET,
    AppendItem,
    InboxStore,
    SendOutcome,
)

log = logging.getLogger(__name__)


class InboxWriter:
    def __init__(self, store: InboxStore, directory: Directory, limits: InboxLimits, hub: DeliveryHub,
                 exposure: Exposure | None = None):
        self._store = store
        self._directory = directory
        self._limits = limits
        self._hub = hub
        self._exposure = exposure or Exposure()
        """Which agents messages from the IOA network may reach."""

    def loop_rejection(self, env: envelope_pb2.Envelope) -> tuple[int, str] | None:
        """The loop guard's refusal of a message whose hop count and trail are set, or None."""
        limits = self._limits
        if env.hop_count > limits.max_hops:
            return NOT_PERMITTED, f"loop guard: hop_count {env.hop_count} is over the limit of {limits.max_hops}"
        if len(env.trail) > limits.max_hops:
            return NOT_PERMITTED, f"loop guard: the message's trail is {len(env.trail)} agents long; at most" \
                                  f" {limits.max_hops}"
        visits = list(env.trail).count(env.recipient)
        if visits >= limits.max_trail_visits:
            return NOT_PERMITTED, (f"loop guard: {env.recipient} already appears {visits} times in this message's"
                                   f" chain (at most {limits.max_trail_visits}): the agents are going round"
                                   " in a loop")
        return None

    async def deliver_from_channel(self, envelopes: list[envelope_pb2.Envelope]) -> list[SendOutcome]:
        """Store messages the routing ingress received, by the ordinary path.
        Their senders are channel addresses and their message ids the
        channel's, so a redelivered message is a duplicate."""
        now = now_us()
        for env in envelopes:
            if not env.sender.startswith(CHANNEL_PREFIX) or env.origin.kind != envelope_pb2.ORIGIN_KIND_CHANNEL:
                raise errors.Internal(f"ingress delivered {env.message_id} without a channel sender and origin")
            env.created_at_us = env.created_at_us or now
            env.sequence = env.stored_at_us = env.delivery_attempt = 0
        return await self.store([[AppendItem(e)] for e in envelopes], now)

    async def deliver_from_a2a(self, envelopes: list[envelope_pb2.Envelope]) -> list[SendOutcome]:
        """Store messages the A2A gateway delivered (services.gateway.service), in order, by the ordinary path.
        Their senders are `a2a:` addresses and their message ids the gateway's idempotency keys, so a
        retried delivery is a DUPLICATE. The chain the gateway names (hop_count, trail: the message an
        answer answers) continues with the sender; unknown recipients are UNKNOWN_TARGET."""
        now = now_us()
        items = []
        for env in envelopes:
            if not env.sender.startswith(A2A_PREFIX) or env.origin.kind != envelope_pb2.ORIGIN_KIND_A2A:
                raise errors.Internal(f"the A2A gateway delivered {env.message_id} without an a2a: sender and origin")
            env.created_at_us = env.created_at_us or now
            env.sequence = env.stored_at_us = env.delivery_attempt = 0
            env.hop_count = max(env.hop_count, 1)
            env.trail.append(env.sender)
            rejection = self.loop_rejection(env)
            if rejection is None and await self._directory.get(env.recipient) is None:
                rejection = (UNKNOWN_TARGET, f"no agent {errors.clip(env.recipient)}")
            items.append(AppendItem(env, rejection))
        by_sender: dict[str, list[AppendItem]] = {}
        for item in items:
            by_sender.setdefault(item.envelope.sender, []).append(item)
        stored = await self.store(list(by_sender.values()), now)
        outcome_of = dict(zip((id(i) for group in by_sender.values() for i in group), stored))
        return [outcome_of[id(item)] for item in items]

    async def deliver_from_ioa(self, envelopes: list[envelope_pb2.Envelope]) -> list[SendOutcome]:
        """Store messages the IOA relay received, in order, by the ordinary
        path (same receipts, same events). Their senders are IOA addresses and
        their message ids IOA message ids, so redeliveries are duplicates.
        Each sender's messages go as one group, in the order given (the
        relay hands them over in per-pair order); the outcomes come in the
        order of `envelopes`."""
        by_sender: dict[str, list[tuple[int, AppendItem]]] = {}
        for index, env in enumerate(envelopes):
            if not env.sender.startswith(IOA_PREFIX) or env.origin.kind != envelope_pb2.ORIGIN_KIND_IOA:
                raise errors.Internal(f"relay delivered {env.message_id} without an IOA sender and origin")
            env.sequence = env.stored_at_us = env.delivery_attempt = 0
            rejection = self.loop_rejection(env)
            if rejection is None:
                target = await self._directory.get(env.recipient)
                hidden = self._exposure.refusal(target) if target is not None else None
                if target is None:
                    rejection = (UNKNOWN_TARGET, f"no agent {env.recipient}")
                elif hidden is not None:
                    rejection = (NOT_PERMITTED, hidden)
            by_sender.setdefault(env.sender, []).append((index, AppendItem(env, rejection)))
        groups = list(by_sender.values())
        stored = await self.store([[item for _, item in group] for group in groups], now_us())
        outcomes: list[SendOutcome | None] = [None] * len(envelopes)
        for (index, _), outcome in zip((entry for group in groups for entry in group), stored):
            outcomes[index] = outcome
        return [outcome for outcome in outcomes if outcome is not None]

    async def deliver_notice(self, envelope: envelope_pb2.Envelope) -> SendOutcome:
        """Store a notice the mesh made (origin MESH) in a local agent's inbox, by the ordinary path, from
        the sender it names (for the IOA outbox's outcomes, the IOA address the message was for). Its
        message id is the notice's idempotency key: stored again, it is a DUPLICATE."""
        return (await self.store([[AppendItem(envelope, None)]], now_us()))[0]

    async def store(self, groups: list[list[AppendItem]], now: int, *, in_order: bool = False) -> list[SendOutcome]:
        """Append groups of messages (one sender per group) in one commit, in
        order; trace, log and wake subscribers.

        in_order: the groups are sends that must be accepted in the order given (the requests of one
        SendStream): the store appends them as one after the other (InboxStore.append_groups: on SQLite
        one write, on JetStream one append with each inbox's messages published in that order)."""
        spans = []
        for group in groups:
            for item in group:
                env = item.envelope
                span = tracer.start_span("enqueue", context=context_of(env), attributes=message_attributes(env))
                if not env.trace.traceparent and span.get_span_context().is_valid:
                    inject(env, trace.set_span_in_context(span))
                spans.append(span)
        try:
            if len(groups) == 1:  # the usual case: no task to schedule, straight to the writer
                results = [await self._store.append(groups[0][0].envelope.sender, groups[0], now)]
            elif in_order:
                results = await self._store.append_groups([(g[0].envelope.sender, g) for g in groups], now)
            else:  # every group's append is queued before the writer flushes: one commit, in order
                results = await asyncio.gather(*(self._store.append(g[0].envelope.sender, g, now) for g in groups))
        except BaseException as exc:
            for span in spans:
                span.record_exception(exc)
                span.end()
            raise
        outcomes = [o for group in results for o in group]
        accepted: list[envelope_pb2.Envelope] = []
        for span, outcome, item in zip(spans, outcomes, (i for g in groups for i in g)):
            span.set_attribute("inboxmesh.receipt", RECEIPT_ENUM_NAME[outcome.status])
            span.set_attribute("inboxmesh.sequence", outcome.sequence)
            span.end()
            if outcome.status == ACCEPTED and outcome.envelope is not None:  # an accepted outcome holds it
                accepted.append(outcome.envelope)
            elif log.isEnabledFor(logging.INFO):
                log.info("send %s from %s to %s: %s (%s)", outcome.message_id, item.envelope.sender,
                         outcome.recipient, pb.ReceiptStatus.Name(outcome.status), outcome.detail)
        if accepted:
            if log.isEnabledFor(logging.DEBUG):
                for env in accepted:
                    log.debug("stored %s from %s in %s's inbox at seq %d", env.message_id, env.sender,
                              env.recipient, env.sequence)
            self._hub.on_appended(accepted)
        return outcomes
