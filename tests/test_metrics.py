"""Metrics for Prometheus (docs/metrics.md), checked against the event record on a real mesh (each store): the
web view's /metrics scraped over real HTTP with the operator token after the sibling scenario and a few
sends that end every way (refused, duplicate, redelivered, consumed outside a turn, dead-lettered by a
close, left waiting), parsed with prometheus_client's own parser; every count, depth and histogram agrees
with the record up to the event the metrics say they include. An agent host's model requests and tokens per
agent and per model agree with its MODEL_CALLED events; `inboxmesh run --metrics-port` serves and prints them."""

from __future__ import annotations

import asyncio
import collections
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_host import runner as runner_module
from agent_host.metrics import HostMetrics, MetricsServer
from agent_host.model_usage import TRACKED_AGENTS, ModelUsage
from agent_host.models.base import ModelReply, Usage
from agent_host.models.scripted import ScriptedModel
from harness.evidence import Record
from harness.hosts import scripted_host
from harness.policies import SIBLING_POLICIES
from inboxmesh.client.mesh import MeshClient, envelope
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.webview.metrics import MeshMetrics
from tests.fixtures import ADMIN_TOKEN
from tests.streams import Collector
from tests.test_webview import run_sibling_scenario

ROOT = Path(__file__).resolve().parent.parent
K = ev.EventKind
BEARER = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, by (sample name, labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: value for (n, labels), value in samples.items() if n == name}


async def scrape(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(url, headers=BEARER) as response:
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse(await response.text())


async def messages_that_end_every_way(client: MeshClient) -> None:
    """After the scenario: refused sends (unknown target, inbox full), a duplicate, three messages delivered
    twice and one of them consumed outside any turn, two dead-lettered by a close (their sender gets a notice
    each), the rest left waiting."""
    outsider = await client.register("outsider")
    quiet = await outsider.spawn("quiet")
    doomed = await outsider.spawn("doomed")
    small = await outsider.spawn("small", inbox_capacity=1)
    unknown = await outsider.send("agt_nobody", "to no one")
    assert unknown.status == pb.RECEIPT_STATUS_UNKNOWN_TARGET
    assert [(await outsider.send(small.agent_id, text)).status for text in ("fits", "does not")] == [
        pb.RECEIPT_STATUS_ACCEPTED, pb.RECEIPT_STATUS_INBOX_FULL]
    first = await outsider.send_batch([envelope(quiet.agent_id, "once", message_id="m-once")])
    again = await outsider.send_batch([envelope(quiet.agent_id, "once", message_id="m-once")])
    assert (first[0].status, again[0].status) == (pb.RECEIPT_STATUS_ACCEPTED, pb.RECEIPT_STATUS_DUPLICATE)
    for text in ("two", "three"):
        await outsider.send(quiet.agent_id, text)
    for _ in range(2):  # delivered, not acked, delivered again to the next subscriber
        collector = Collector(quiet)
        try:
            await collector.wait_for(3)
        finally:
            await collector.stop()
    await quiet.record_events([ev.Event(kind=K.EVENT_KIND_TURN_STARTED, turn=1)])  # a host ran a turn of it once
    (acked,) = await quiet.ack([first[0].sequence])  # and now an ack outside any turn: no wake-up to measure
    assert acked.status == pb.ACK_STATUS_CONSUMED
    for text in ("four", "five"):
        await outsider.send(doomed.agent_id, text)
    await doomed.close(reason="closed by the metrics test")


def expected(events: list[ev.Event]) -> dict[str, Any]:
    """What the record says the metrics must be (computed here from the events, independently of the code)."""
    of = collections.defaultdict(list)
    for e in events:
        of[e.kind].append(e)
    depth: collections.Counter[str] = collections.Counter()
    stored_at: dict[tuple[str, int], int] = {}
    waiting: dict[tuple[str, int], int] = {}
    for e in events:
        key = (e.agent_id, e.sequence)
        if e.kind == K.EVENT_KIND_MESSAGE_STORED:
            depth[e.agent_id] += 1
            stored_at[key] = waiting[key] = e.at_us
        elif e.kind in (K.EVENT_KIND_MESSAGE_CONSUMED, K.EVENT_KIND_MESSAGE_DEAD_LETTERED):
            depth[e.agent_id] -= 1
            del waiting[key]
    last_turn: dict[str, ev.Event] = {}
    consume, wakeup = [], []
    for e in events:
        if e.kind == K.EVENT_KIND_TURN_STARTED:
            last_turn[e.agent_id] = e
        elif e.kind == K.EVENT_KIND_MESSAGE_CONSUMED:
            stored = stored_at[(e.agent_id, e.sequence)]
            consume.append(max(0, e.at_us - stored) / 1e6)
            turn = last_turn.get(e.agent_id)
            if e.turn and turn is not None and turn.turn == e.turn:
                wakeup.append(max(0, turn.at_us - stored) / 1e6)
    return {
        "receipts": collections.Counter(e.detail.split(" ")[0] for e in of[K.EVENT_KIND_MESSAGE_SENT]),
        "stored": len(of[K.EVENT_KIND_MESSAGE_STORED]),
        "deliveries": len(of[K.EVENT_KIND_MESSAGE_DELIVERED]),
        "redeliveries": sum(e.detail != "attempt=1" for e in of[K.EVENT_KIND_MESSAGE_DELIVERED]),
        "consumed": len(of[K.EVENT_KIND_MESSAGE_CONSUMED]),
        "dead": collections.Counter(e.detail for e in of[K.EVENT_KIND_MESSAGE_DEAD_LETTERED]),
        "depth": {agent: n for agent, n in depth.items() if n},
        "oldest": {agent: min(at for (a, _), at in waiting.items() if a == agent) for agent, n in depth.items() if n},
        "consume": consume, "wakeup": wakeup,
    }


async def test_the_mesh_metrics_agree_with_the_event_record(web_mesh, tmp_path):
    assert web_mesh.web is not None
    url = web_mesh.web.url + "metrics"
    async with MeshClient(web_mesh.address, timeout=10.0, admin_token=ADMIN_TOKEN) as client:
        await run_sibling_scenario(web_mesh, client, tmp_path)
        await messages_that_end_every_way(client)
        async with aiohttp.ClientSession() as session:
            for headers, path in (({}, url), ({"Authorization": "Bearer wrong"}, url),
                                  ({}, f"{url}?token={ADMIN_TOKEN}")):  # a token in a URL is not taken here
                async with session.get(path, headers=headers) as response:
                    assert response.status == 401, (headers, path)
            samples = await scrape(session, url)
        folded = int(samples[("inboxmesh_record_folded_event_id", frozenset())])
        record = await Record.read(client)
        events = [e for e in record.events if e.event_id <= folded]
    assert events and events[-1].event_id == folded, "the metrics say which event of the record they include"
    want = expected(events)

    receipts = by_label(samples, "inboxmesh_receipts_total", "status")
    assert {s: n for s, n in receipts.items() if n} == dict(want["receipts"])
    assert {"accepted", "duplicate", "unknown_target", "inbox_full", "other"} <= set(receipts), "every status, 0 too"
    assert receipts["duplicate"] == receipts["unknown_target"] == receipts["inbox_full"] == 1
    for name, key in (("inboxmesh_messages_stored_total", "stored"), ("inboxmesh_deliveries_total", "deliveries"),
                      ("inboxmesh_redeliveries_total", "redeliveries"),
                      ("inboxmesh_messages_consumed_total", "consumed")):
        assert samples[(name, frozenset())] == want[key], name
    assert want["redeliveries"] == 3
    dead = by_label(samples, "inboxmesh_dead_letters_total", "reason")
    assert dead == {"recipient closed": 2, "too many delivery attempts": 0, "expired": 0, "other": 0}
    assert dict(want["dead"]) == {"recipient closed": 2}

    depths = want["depth"]
    assert isinstance(depths, dict) and len(depths) >= 2, depths  # quiet's two, the outsider's two notices
    assert by_label(samples, "inboxmesh_inbox_depth", "agent_id") == depths
    assert samples[("inboxmesh_inboxes_depth", frozenset())] == sum(depths.values())
    assert samples[("inboxmesh_inboxes_nonempty", frozenset())] == len(depths)
    ages = by_label(samples, "inboxmesh_inbox_oldest_age_seconds", "agent_id")
    assert set(ages) == set(depths) and all(age > 0 for age in ages.values())
    oldest = want["oldest"]
    assert isinstance(oldest, dict) and set(oldest) == set(depths)
    assert max(ages, key=ages.__getitem__) == min(oldest, key=oldest.__getitem__), "the oldest message is oldest"

    for name, key in (("inboxmesh_message_consume_latency_seconds", "consume"),
                      ("inboxmesh_message_wakeup_latency_seconds", "wakeup")):
        measured = want[key]
        assert isinstance(measured, list)
        assert samples[(f"{name}_count", frozenset())] == len(measured), name
        assert samples[(f"{name}_sum", frozenset())] == pytest.approx(sum(measured), abs=1e-6), name
        assert samples[(f"{name}_bucket", frozenset({("le", "+Inf")}))] == len(measured)
    assert len(want["consume"]) == want["consumed"]
    assert len(want["wakeup"]) == want["consumed"] - 1, "every consumption but quiet's ack outside a turn"

    # bounded: with room for one agent, one series (the deepest), and the same totals
    narrow = MeshMetrics(top_agents=1)
    try:
        narrow.fold(events)
        small = parse(narrow.exposition().decode())
    finally:
        narrow.shutdown()
    (only,) = by_label(small, "inboxmesh_inbox_depth", "agent_id").items()
    assert only[1] == max(depths.values())
    assert small[("inboxmesh_inboxes_depth", frozenset())] == sum(depths.values())
    assert len(by_label(small, "inboxmesh_inbox_oldest_age_seconds", "agent_id")) == 1


class CountedModel(ScriptedModel):
    """The sibling scenario's scripted model, saying how many tokens it took as a served model does (a
    character count of the conversation and of its answer)."""

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, max_output_tokens: int,
                       max_requests: int) -> ModelReply:
        reply = await super().complete(messages, tools, max_output_tokens=max_output_tokens,
                                       max_requests=max_requests)
        answer = len(reply.text) + sum(len(str(call.arguments)) for call in reply.tool_calls)
        return replace(reply, usage=Usage(prompt_tokens=sum(len(str(m.get("content") or "")) for m in messages),
                                          completion_tokens=answer))


async def test_host_metrics_count_model_requests_per_agent_as_the_record_does(mesh, client, tmp_path, monkeypatch):
    models = {name: CountedModel(policy, name=f"counted:{name}") for name, policy in SIBLING_POLICIES.items()}
    # the usage of a host process of its own: the suite's process has run many agents and models before this
    # test (in CI, busier agents pushed this test's out of the 20 listed, and over 100 models made its own
    # `other`), so the runner counts into a fresh ModelUsage here, as a new `inboxmesh host` would
    usage = ModelUsage()
    monkeypatch.setattr(runner_module, "MODEL_USAGE", usage)
    async with MetricsServer(0, HostMetrics(usage, top_agents=TRACKED_AGENTS)) as server, \
            aiohttp.ClientSession() as session:
        before = await scrape_plain(session, server.url)
        async with scripted_host(mesh.address, tmp_path / "host", models) as host:
            outcome = await host.run_task("parent", "Coordinate A and B. The secret code for A is SEC-000042.",
                                          timeout=30)
            assert outcome.ok, outcome.error
        after = await scrape_plain(session, server.url)
    called = [e for e in (await Record.read(client)).events if e.kind == K.EVENT_KIND_MODEL_CALLED]
    assert called
    pattern = re.compile(r"^model=(\S+) outcome=(ok|failed) requests=(\d+)(?: tokens=(\d+)/(\d+))?")
    requests: collections.Counter[str] = collections.Counter()
    tokens: collections.Counter[tuple[str, str]] = collections.Counter()
    by_model: collections.Counter[tuple[str, str]] = collections.Counter()
    model_tokens: collections.Counter[tuple[str, str]] = collections.Counter()
    for e in called:
        found = pattern.match(e.detail)
        assert found, e.detail
        model, result, n, prompt, output = found.groups()
        requests[e.agent_id] += int(n)
        tokens[(e.agent_id, "prompt")] += int(prompt or 0)
        tokens[(e.agent_id, "output")] += int(output or 0)
        by_model[(model, result)] += int(n)
        model_tokens[(model, "prompt")] += int(prompt or 0)
        model_tokens[(model, "output")] += int(output or 0)
    assert set(requests) == {r.agent_id for r in host.runners.values()} and sum(tokens.values()) > 0
    assert {m for m, _ in by_model} == {f"counted:{name}" for name in SIBLING_POLICIES}
    # only this test's agents are counted (a fresh ModelUsage)
    per_agent = by_label(after, "inboxmesh_host_agent_model_requests_total", "agent_id")
    assert {a: n for a, n in per_agent.items() if a in requests} == dict(requests)
    agent_tokens = {(dict(labels)["agent_id"], dict(labels)["type"]): value for (name, labels), value in after.items()
                    if name == "inboxmesh_host_agent_model_tokens_total" and dict(labels)["agent_id"] in requests}
    assert agent_tokens == dict(tokens)

    def grown(name: str, label: str) -> dict[tuple[str, str], float]:
        def per_model(samples: Samples) -> dict[tuple[str, str], float]:
            return {(dict(labels)["model"], dict(labels)[label]): value for (n, labels), value in samples.items()
                    if n == name}

        old = per_model(before)
        return {key: value - old.get(key, 0) for key, value in per_model(after).items() if value - old.get(key, 0)}

    assert grown("inboxmesh_host_model_requests_total", "outcome") == dict(by_model)
    assert grown("inboxmesh_host_model_tokens_total", "type") == dict(model_tokens)


async def scrape_plain(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(url) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse(await response.text())


async def test_run_serves_its_metrics_on_the_port_asked_and_says_where(mesh, tmp_path):
    async def run(*extra: str) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "warning", "run", "--mesh", mesh.address,
            "--data-dir", str(tmp_path / "run"), "--policies", "harness.policies:SIBLING_POLICIES", "--name",
            "parent", "--quiet", *extra, "Coordinate A and B. The secret code for A is SEC-000042.",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode is not None
        return process.returncode, out.decode(), err.decode()

    code, out, err = await run("--metrics-port", "0")
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if "metrics at" in line]
    assert re.fullmatch(r"inboxmesh run: metrics at http://127\.0\.0\.1:\d+/metrics", line), line
    async with MetricsServer(0) as taken:
        code, out, err = await run("--metrics-port", str(taken.port))
    assert code == 2 and f"--metrics-port {taken.port}: cannot listen on 127.0.0.1" in err, err
    code, out, err = await run()
    assert code == 0 and "metrics at" not in out, "no metrics unless asked"
