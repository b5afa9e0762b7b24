"""The web view (services/webview, docs/webview.md) on a real mesh: the operator token guards it, its live
stream resumes after Last-Event-ID without gaps or repeats, its snapshot and message pages agree with the
event record in the sibling scenario (on each store), and a real headless Chromium shows the scenario:
both children under the parent, A's message to B and B's reply consumed, both reports, the states the
record says (SQLite only: the browser reads what the web view serves, which the tests before check on
both stores). `up` prints the web view's address and writes it to mesh.json."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import ssl
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from harness.browser import CHROMIUM_ARGS, chromium_path
from harness.hosts import scripted_host
from harness.policies import SIBLING_POLICIES
from inboxmesh.cli.main import build_parser
from inboxmesh.client import errors
from inboxmesh.client.mesh import MeshClient
from inboxmesh.events.v1 import events_pb2 as ev
from services import settings
from services.config import MeshConfig, StoreConfig, WebConfig
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, eventually, make_config, web_config
from tests.test_tls import Pki

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "webview"
K = ev.EventKind
BEARER = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ATTRIBUTES = "(nodes, names) => nodes.map(n => Object.fromEntries(names.map(k => [k, n.getAttribute(k)])))"
"""Reads the named attributes of every node a selector finds, in the page."""

LIFECYCLE = {K.EVENT_KIND_AGENT_WOKEN: "running", K.EVENT_KIND_TURN_STARTED: "running",
             K.EVENT_KIND_RUN_STARTED: "running", K.EVENT_KIND_AGENT_IDLE: "idle",
             K.EVENT_KIND_TASK_FAILED: "failed", K.EVENT_KIND_RUN_CANCELLED: "cancelled"}
"""What the record says an agent is doing after each of these events (docs/webview.md "States")."""




async def all_events(client: MeshClient) -> list[ev.Event]:
    found: list[ev.Event] = []
    while page := await client.admin_events(after=found[-1].event_id if found else 0, limit=1000):
        found += page
    return found


def expected_state(events: list[ev.Event], agent_id: str) -> str:
    """The state the record gives an agent: closed once closed, else its last lifecycle event's."""
    state = "registered"
    for e in events:
        if e.agent_id != agent_id:
            continue
        if e.kind == K.EVENT_KIND_AGENT_CLOSED:
            return "closed"
        state = LIFECYCLE.get(e.kind, state)
    return state


def expected_depth(events: list[ev.Event], agent_id: str) -> int:
    stored = sum(e.kind == K.EVENT_KIND_MESSAGE_STORED for e in events if e.agent_id == agent_id)
    taken = sum(e.kind in (K.EVENT_KIND_MESSAGE_CONSUMED, K.EVENT_KIND_MESSAGE_DEAD_LETTERED)
                for e in events if e.agent_id == agent_id)
    return stored - taken


class Sibling:
    """What the sibling scenario left in the record: the agents and the messages a viewer must see."""

    def __init__(self, events: list[ev.Event], ids: dict[str, str]):
        self.events = events
        self.parent, self.a, self.b = ids["parent"], ids["A"], ids["B"]

        def stored(**match: str) -> list[ev.Event]:
            return [e for e in events if e.kind == K.EVENT_KIND_MESSAGE_STORED
                    and all(getattr(e, k) == v for k, v in match.items())]

        (self.a_to_b,) = stored(sender=self.a, recipient=self.b, in_reply_to="")
        (self.reply,) = stored(sender=self.b, recipient=self.a, in_reply_to=self.a_to_b.message_id)
        self.reports = stored(recipient=self.parent)
        assert {r.sender for r in self.reports} == {self.a, self.b}, "both children reported"


async def run_sibling_scenario(mesh: Mesh, client: MeshClient, tmp_path: Path) -> Sibling:
    secret = f"SEC-{secrets.randbelow(10**6):06d}"
    async with scripted_host(mesh.address, tmp_path / "host", SIBLING_POLICIES) as host:
        outcome = await host.run_task("parent", f"Coordinate A and B. The secret code for A is {secret}.",
                                      timeout=30)
        assert outcome.ok, outcome.error
        ids = {r.record.name: r.agent_id for r in host.runners.values()}
    return Sibling(await all_events(client), ids)


async def read_stream(session: aiohttp.ClientSession, url: str, count: int | None, until_id: int | None = None,
                      headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Events of the web view's live stream: `count` of them, or up to event `until_id`; each checked to carry
    its event id as the SSE id."""
    found: list[dict[str, Any]] = []
    async with session.get(url, headers={**BEARER, **(headers or {})}) as response:
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("text/event-stream")
        sse_id = None
        async for raw in response.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("id: "):
                sse_id = int(line[4:])
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["id"] == sse_id, "the SSE id is the event id (what Last-Event-ID resumes from)"
                found.append(event)
                if (count is not None and len(found) >= count) or (until_id is not None and event["id"] >= until_id):
                    return found
    raise AssertionError(f"the stream ended after {len(found)} events")


# -- settings and `up` ------------------------------------------------------------------------------------
@pytest.mark.store_independent
def test_up_serves_a_web_view_by_default_and_its_flags_move_or_remove_it():
    def up(*argv: str, env: dict[str, str] | None = None) -> WebConfig | None:
        return settings.mesh_config(vars(build_parser().parse_args(["up", *argv])), env or {}).web

    assert up() == WebConfig(port=settings.DEFAULT_WEB_PORT, any_port_if_taken=True)
    assert up("--web-port", "0") == WebConfig(port=0)
    assert up("--web-port", "7999") == WebConfig(port=7999), "a port given is never changed"
    assert up(env={"INBOXMESH_WEB_PORT": "7998"}) == WebConfig(port=7998)
    assert up("--web-port", "7997", env={"INBOXMESH_WEB_PORT": "7998"}) == WebConfig(port=7997)
    assert up("--web-port", "off") is None and up("--no-web") is None
    assert up(env={"INBOXMESH_WEB_PORT": "OFF"}) is None
    assert MeshConfig().web is None, "a Mesh built in code serves no web view unless asked"
    for argv, env, starts in ((("--web-port", "http"), {}, "--web-port: cannot read 'http'"),
                              (("--web-port", "70000"), {}, "--web-port: must be at most 65535"),
                              ((), {"INBOXMESH_WEB_PORT": "-3"}, "INBOXMESH_WEB_PORT: must be at least 0"),
                              (("--no-web", "--web-port", "7000"), {}, "--no-web: --web-port asks for")):
        with pytest.raises(errors.InvalidArgument) as caught:
            up(*argv, env=env)
        assert caught.value.message.startswith(starts), caught.value.message


@pytest.mark.store_independent
def test_up_prints_the_web_view_and_writes_it_to_mesh_json(tmp_path):
    def up(*extra: str) -> tuple[str, dict[str, Any]]:
        data = tmp_path / str(len(extra))
        done = subprocess.run([sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "warning", "up", "--port",
                               "0", "--data-dir", str(data), "--exit-after-demo", "--admin-token", "cli-token",
                               *extra], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        assert "cli-token" not in done.stdout + done.stderr, "the token is never printed or logged"
        return done.stdout, json.loads((data / "mesh.json").read_text())

    out, state = up("--web-port", "0")
    line = next(line for line in out.splitlines() if line.startswith("inboxmesh: web view at "))
    url = line.split()[4]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/") and state["web"] == url
    out, state = up("--no-web")
    assert "web view" not in out and "web" not in state


async def test_the_web_view_refuses_to_start_on_a_taken_port_it_was_given(tmp_path):
    async with Mesh(web_config(make_config(tmp_path / "one"))) as first:
        assert first.web is not None
        taken = first.web.port
        second = Mesh(replace(make_config(tmp_path / "two"), web=WebConfig(port=taken)))
        with pytest.raises(errors.Unavailable, match="the web view could not listen") as caught:
            await second.start()
        assert caught.value.reason == errors.Reason.BIND_FAILED
        moved = Mesh(replace(make_config(tmp_path / "three"), web=WebConfig(port=taken, any_port_if_taken=True)))
        async with moved:
            assert moved.web is not None and moved.web.port not in (0, taken), "the default port moves aside"


async def test_a_mesh_with_a_certificate_serves_its_web_view_over_tls(tmp_path):
    pki = Pki(tmp_path)
    async with Mesh(replace(web_config(make_config(tmp_path)), tls=pki.server())) as mesh:
        assert mesh.web is not None and mesh.web.url.startswith("https://127.0.0.1:")
        trusting = ssl.create_default_context(cafile=str(pki.ca_file))
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{mesh.web.url}?token={ADMIN_TOKEN}", ssl=trusting,
                                   allow_redirects=False) as response:
                assert response.status == 302 and "Secure" in response.headers["Set-Cookie"]
            with pytest.raises(aiohttp.ClientConnectorCertificateError):  # not without trusting its CA
                await session.get(mesh.web.url + "api/snapshot", headers=BEARER)
            plain = mesh.web.url.replace("https://", "http://") + "api/snapshot"
            with pytest.raises(aiohttp.ClientError):  # and not in plaintext
                await session.get(plain, headers=BEARER)


# -- auth -------------------------------------------------------------------------------------------------
async def test_everything_but_the_static_files_needs_the_operator_token(web_mesh, caplog):
    caplog.set_level(logging.DEBUG)
    assert web_mesh.web is not None
    base = web_mesh.web.url.rstrip("/")
    assert not web_mesh.web.following, "nobody signed in yet: the web view reads nothing"
    async with aiohttp.ClientSession() as anonymous:
        for path in ("/", "/message/m1", "/api/snapshot", "/api/events", "/api/message/m1", "/?token=wrong",
                     "/api/snapshot?token=" + ADMIN_TOKEN):
            async with anonymous.get(base + path) as response:
                assert response.status == 401, path
                body = await response.json()
                assert "operator token" in body["error"], body
        for header in ("Bearer wrong", "Basic " + ADMIN_TOKEN, ADMIN_TOKEN):
            async with anonymous.get(base + "/api/snapshot", headers={"Authorization": header}) as response:
                assert response.status == 401, header
        async with anonymous.get(base + "/static/app.js") as response:
            assert response.status == 200, "the page's code holds nothing secret"
        assert not web_mesh.web.following, "refused requests start nothing"
        async with anonymous.get(base + "/api/snapshot", headers=BEARER) as response:
            assert response.status == 200
            assert (await response.json())["agents"] == []
    # what a browser does: the token once, then the cookie (a jar that keeps cookies of an IP address)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.get(f"{base}/?token={ADMIN_TOKEN}", allow_redirects=False) as response:
            assert response.status == 302 and response.headers["Location"] == "/"
            cookie = response.headers["Set-Cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and ADMIN_TOKEN not in cookie
        async with browser.get(base + "/api/snapshot") as response:
            assert response.status == 200, "the cookie stands for the token"
        async with browser.get(base + "/") as response:
            assert response.status == 200 and "<title>inboxmesh</title>" in await response.text()
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert ADMIN_TOKEN not in logged, "the token is never logged"


# -- the live stream --------------------------------------------------------------------------------------
async def test_the_live_stream_resumes_after_last_event_id_without_gaps_or_repeats(web_mesh):
    assert web_mesh.web is not None
    url = web_mesh.web.url + "api/events"
    async with MeshClient(web_mesh.address, timeout=10.0, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead")
        worker = await lead.spawn("worker")
        for n in range(5):
            await lead.send(worker.agent_id, f"first {n}")
        async with aiohttp.ClientSession() as session:
            first = await read_stream(session, url + "?after=0", count=7)
            for n in range(5):  # written while no stream is open
                await lead.send(worker.agent_id, f"second {n}")
            record = await all_events(client)
            rest = await read_stream(session, url + "?after=0", count=None, until_id=record[-1].event_id,
                                     headers={"Last-Event-ID": str(first[-1]["id"])})
            assert [e["id"] for e in first + rest] == [e.event_id for e in record], \
                "the stream and the record hold the same events, each once, in order"
            assert [e["kind"] for e in first + rest].count("message_stored") == 10
            # live: an event recorded while the stream waits arrives on it
            last = record[-1].event_id
            reading = asyncio.create_task(read_stream(session, f"{url}?after={last}", count=2))
            await lead.send(worker.agent_id, "live")
            live = await reading
            assert [e["id"] for e in live] == [e.event_id for e in (await all_events(client))[len(record):][:2]]
            assert {e["kind"] for e in live} == {"message_sent", "message_stored"}


async def test_a_stream_of_a_web_view_that_stops_ends(tmp_path):
    mesh = Mesh(web_config(make_config(tmp_path)))
    await mesh.start()
    try:
        assert mesh.web is not None
        async with aiohttp.ClientSession() as session, session.get(mesh.web.url + "api/events",
                                                                   headers=BEARER) as response:
            assert (await response.content.readline()).startswith(b"retry:")
            await mesh.stop(grace=0.5)
            assert await response.content.read() in (b"", b"\n"), "the stream ends with the mesh"
    finally:
        await mesh.stop(grace=0.5)


# -- the sibling scenario, as data ------------------------------------------------------------------------
async def test_snapshot_and_message_pages_agree_with_the_record_in_the_sibling_scenario(web_mesh, tmp_path):
    assert web_mesh.web is not None
    base = web_mesh.web.url
    async with MeshClient(web_mesh.address, timeout=10.0, admin_token=ADMIN_TOKEN) as client:
        run = await run_sibling_scenario(web_mesh, client, tmp_path)
        last = run.events[-1].event_id
        async with aiohttp.ClientSession(headers=BEARER) as session:
            async def snapshot() -> dict[str, Any] | None:
                async with session.get(base + "api/snapshot") as response:
                    found = await response.json()
                return found if found["last_event_id"] >= last else None

            shot = await eventually(snapshot, message="the web view's board to reach the record's last event")
            agents = {a["name"]: a for a in shot["agents"]}
            assert set(agents) == {"parent", "A", "B"}
            assert (agents["parent"]["mode"], agents["parent"]["parent_id"]) == ("main", "")
            for child in ("A", "B"):
                assert (agents[child]["mode"], agents[child]["parent_id"]) == ("async", run.parent)
            # the record as far as the board had read it: a late marker may be recorded after the snapshot
            record = [e for e in await all_events(client) if e.event_id <= shot["last_event_id"]]
            for name, agent in agents.items():
                assert agent["state"] == expected_state(record, agent["id"]), name
                assert agent["depth"] == expected_depth(record, agent["id"]) == 0, name
                assert agent["done"], f"{name} completed its task"
            assert [e["id"] for e in shot["events"]] == [e.event_id for e in record][-len(shot["events"]):]

            async with session.get(f"{base}api/message/{run.a_to_b.message_id}?sender={run.a}") as response:
                page = await response.json()
            kinds = [e["kind"] for e in page["events"]]
            assert kinds[:2] == ["message_sent", "message_stored"] and kinds[-1] == "message_consumed", kinds
            assert "message_delivered" in kinds and page["complete"]
            assert {e["trace_id"] for e in page["events"]} == {run.a_to_b.trace_id} != {""}
            assert [r["message_id"] for r in page["replies"]] == [run.reply.message_id]


# -- in a real browser ------------------------------------------------------------------------------------
@pytest.mark.store_independent  # the browser reads the web view, not the store: its mesh is always SQLite
async def test_a_browser_shows_the_sibling_scenario_as_the_record_has_it(tmp_path):
    from playwright.async_api import async_playwright

    browser_path = chromium_path()  # fails, naming the set-up, when chromium is not installed; never skips
    config = replace(make_config(tmp_path), store=StoreConfig(path=tmp_path / "mesh.db"), web=WebConfig(port=0))
    RESULTS.mkdir(parents=True, exist_ok=True)
    async with Mesh(config) as mesh, async_playwright() as playwright:
        assert mesh.web is not None
        browser = await playwright.chromium.launch(executable_path=str(browser_path), args=list(CHROMIUM_ARGS))
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 860})
            problems: list[str] = []
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            await page.goto(f"{mesh.web.url}?token={ADMIN_TOKEN}")
            assert page.url == mesh.web.url, "the token left the address bar"
            await page.wait_for_selector('#connection[data-connection="live"]')
            async with MeshClient(mesh.address, timeout=10.0, admin_token=ADMIN_TOKEN) as client:
                run = await run_sibling_scenario(mesh, client, tmp_path)  # while the page watches
            last = run.events[-1].event_id

            async def shown_up_to_last() -> bool:  # polled from here: Playwright's own polling evaluates a string,
                # which the page's Content-Security-Policy (no eval) refuses
                return int(await page.get_attribute("#last-event", "data-last-event-id") or 0) >= last

            await eventually(shown_up_to_last, message=f"the page to show the record up to event {last}")

            async def attrs(selector: str, *names: str) -> list[dict[str, str]]:
                return await page.eval_on_selector_all(selector, ATTRIBUTES, list(names))

            agent_attrs = ("data-agent-id", "data-agent-name", "data-parent-id", "data-mode", "data-state",
                           "data-depth", "data-done")
            rows = {r["data-agent-name"]: r for r in await attrs("li.agent", *agent_attrs)}
            assert set(rows) == {"parent", "A", "B"}, rows
            children = await attrs(f'li.agent[data-agent-id="{run.parent}"] > ul > li.agent', "data-agent-name")
            assert sorted(c["data-agent-name"] for c in children) == ["A", "B"], "both children under the parent"
            for name in ("A", "B"):
                assert rows[name]["data-mode"] == "async" and rows[name]["data-parent-id"] == run.parent
            for name, row in rows.items():
                assert row["data-state"] == expected_state(run.events, row["data-agent-id"]), (name, row)
                assert row["data-depth"] == "0" and row["data-done"] == "true", (name, row)

            arrow_attrs = ("data-message-id", "data-kind", "data-from", "data-to", "data-status", "data-replied",
                           "data-in-reply-to", "data-trace-id")
            arrows = await attrs("g.arrow", *arrow_attrs)
            by_id = {a["data-message-id"]: a for a in arrows}
            a_to_b, reply = by_id[run.a_to_b.message_id], by_id[run.reply.message_id]
            assert (a_to_b["data-from"], a_to_b["data-to"], a_to_b["data-status"], a_to_b["data-replied"]) == \
                (run.a, run.b, "consumed", "true")
            assert a_to_b["data-trace-id"] == run.a_to_b.trace_id != ""
            assert (reply["data-kind"], reply["data-from"], reply["data-to"], reply["data-status"],
                    reply["data-in-reply-to"]) == ("reply", run.b, run.a, "consumed", run.a_to_b.message_id)
            reports = [a for a in arrows if a["data-kind"] == "report"]
            assert sorted((a["data-from"], a["data-to"], a["data-status"]) for a in reports) == \
                sorted((sender, run.parent, "consumed") for sender in (run.a, run.b)), reports
            assert {a["data-message-id"] for a in reports} == {r.message_id for r in run.reports}
            await page.screenshot(path=str(RESULTS / "sibling.png"), full_page=True)

            # an arrow opens the message's path: every event of it in order, with its trace id
            await page.click(f'g.arrow[data-message-id="{run.a_to_b.message_id}"] text')
            await page.wait_for_selector('body[data-loaded="message"]')
            assert f"/message/{run.a_to_b.message_id}" in page.url
            path = await attrs("#message-events tr.event", "data-event-id", "data-kind", "data-trace-id")
            record_path = [e for e in run.events if e.message_id == run.a_to_b.message_id and e.sender == run.a]
            assert [(int(p["data-event-id"]), p["data-kind"]) for p in path] == \
                [(e.event_id, K.Name(e.kind).removeprefix("EVENT_KIND_").lower()) for e in record_path]
            assert {p["data-trace-id"] for p in path} == {run.a_to_b.trace_id}
            replies = await attrs("#message-replies li.reply", "data-message-id")
            assert [r["data-message-id"] for r in replies] == [run.reply.message_id]
            await page.screenshot(path=str(RESULTS / "message.png"), full_page=True)
            assert not problems, problems
        finally:
            await browser.close()



# -- configured agents' identities ------------------------------------------------------------------------
ROUTED_TOKEN = "web-ingress"
ROUTING = """
agents:
  list:
    - id: home
      default: true
      identity: {{name: {home_name}, emoji: "\\U0001F3E0"}}
      subagents: {{allowAgents: [work, code]}}
    - id: work
      identity: {{name: Worky, emoji: "\\U0001F6E0"}}
    - id: code
ingress: {{tokens: [{token}]}}
"""


def routed_web_config(tmp_path: Path, home_name: str = "Claw", **changes: Any) -> MeshConfig:
    path = tmp_path / "routing.yaml"
    path.write_text(ROUTING.format(home_name=home_name, token=ROUTED_TOKEN))
    return replace(web_config(make_config(tmp_path)), routing=path, **changes)


async def routed_agents(client: MeshClient) -> dict[str, str]:
    """A session agent of `home` (by ingress) and its children: one spawned as `work`, one as `code` (no
    identity), one as its parent's; a plain top-level agent and its child (the mesh gives that child the
    default agent's id for its spawn policy, but it runs as none). Their ids by name."""
    from inboxmesh.registry.v1 import registry_pb2 as reg
    from inboxmesh.routing.v1 import routing_pb2 as route

    sent = await client.ingress(ROUTED_TOKEN, route.RouteInput(channel="telegram", peer=route.Peer(
        kind=route.PEER_KIND_DM, id="ann")), "tg-1", "hello")
    session = await client.claim_session(ROUTED_TOKEN, sent.route.session_key)
    ids = {"session": sent.session_agent_id}
    for name, config_id in (("helper", "work"), ("coder", "code"), ("inherits", "")):
        ids[name] = (await session.spawn(name, run=reg.RunSpec(task="help", agent_config_id=config_id))).agent_id
    lead = await client.register("lead")
    ids["lead"], ids["kid"] = lead.agent_id, (await lead.spawn("kid")).agent_id
    return ids


HOME = {"agent": "home", "name": "Claw", "emoji": "\U0001F3E0"}
WORK = {"agent": "work", "name": "Worky", "emoji": "\U0001F6E0"}
EXPECTED_IDENTITIES = {"session": HOME, "helper": WORK, "coder": None, "inherits": HOME, "lead": None, "kid": None}


async def test_agents_that_run_as_a_configured_agent_carry_its_identity_and_a_reload_changes_it(tmp_path):
    async with Mesh(routed_web_config(tmp_path)) as mesh, \
            MeshClient(mesh.address, timeout=10.0, admin_token=ADMIN_TOKEN) as client:
        assert mesh.web is not None
        base = mesh.web.url
        ids = await routed_agents(client)
        names = {agent_id: name for name, agent_id in ids.items()}
        last = (await all_events(client))[-1].event_id
        async with aiohttp.ClientSession(headers=BEARER) as session:
            async def snapshot(newer_than: Any = "") -> dict[str, Any] | None:
                async with session.get(base + "api/snapshot") as response:
                    found = await response.json()
                if found["last_event_id"] < last:
                    return None
                identities = {names[a["id"]]: a["identity"] for a in found["agents"] if a["id"] in names}
                return identities if identities["session"] != newer_than else None

            shown = await eventually(snapshot, message="the web view's board to reach the record's last event")
            assert shown == EXPECTED_IDENTITIES

            # the live stream: each agent's registration carries the identity it shows (a page learns it of
            # agents registered after its snapshot)
            streamed = await read_stream(session, base + "api/events?after=0", count=None, until_id=last)
            registered = {names[e["agent_id"]]: e.get("identity") for e in streamed
                          if e["kind"] == "agent_registered" and e["agent_id"] in names}
            assert registered == EXPECTED_IDENTITIES

            # a reload that renames home's identity: the next snapshot shows the new name
            (tmp_path / "routing.yaml").write_text(ROUTING.format(home_name="Clawdia", token=ROUTED_TOKEN))
            renamed = await eventually(lambda: snapshot(newer_than=HOME), timeout=10, message="the reload shown")
            assert renamed == {**EXPECTED_IDENTITIES, "session": {**HOME, "name": "Clawdia"},
                               "inherits": {**HOME, "name": "Clawdia"}}


async def test_a_mesh_without_routing_shows_no_identity(web_mesh):
    assert web_mesh.web is not None
    async with MeshClient(web_mesh.address, timeout=10.0, admin_token=ADMIN_TOKEN) as client:
        lead = await client.register("lead", metadata={"inboxmesh-agent": "home"})  # names one; none is loaded
        await lead.spawn("kid")
        async with aiohttp.ClientSession(headers=BEARER) as session:
            async with session.get(web_mesh.web.url + "api/snapshot") as response:
                agents = (await response.json())["agents"]
    assert [a["identity"] for a in agents] == [None, None]


@pytest.mark.store_independent  # the browser reads the web view, not the store: its mesh is always SQLite
async def test_a_browser_shows_the_identity_of_configured_agents_beside_their_names(tmp_path):
    from playwright.async_api import async_playwright

    browser_path = chromium_path()
    config = routed_web_config(tmp_path, store=StoreConfig(path=tmp_path / "mesh.db"))
    async with Mesh(config) as mesh, async_playwright() as playwright, \
            MeshClient(mesh.address, timeout=10.0, admin_token=ADMIN_TOKEN) as client:
        assert mesh.web is not None
        browser = await playwright.chromium.launch(executable_path=str(browser_path), args=list(CHROMIUM_ARGS))
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 860})
            problems: list[str] = []
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            await page.goto(f"{mesh.web.url}?token={ADMIN_TOKEN}")
            await page.wait_for_selector('#connection[data-connection="live"]')
            ids = await routed_agents(client)  # while the page watches: it learns them from the stream
            last = (await all_events(client))[-1].event_id

            async def shown_up_to_last() -> bool:
                return int(await page.get_attribute("#last-event", "data-last-event-id") or 0) >= last

            await eventually(shown_up_to_last, message=f"the page to show the record up to event {last}")

            async def identities(selector: str) -> dict[str, dict[str, str] | None]:
                found = await page.eval_on_selector_all(selector, ATTRIBUTES,
                                                        ["data-agent-id", "data-identity-name", "data-identity-emoji"])
                return {f["data-agent-id"]: ({"name": f["data-identity-name"], "emoji": f["data-identity-emoji"]}
                                             if f["data-identity-name"] is not None else None) for f in found}

            def expected(agent_ids: set[str]) -> dict[str, dict[str, str] | None]:
                return {i: (lambda v: {"name": v["name"], "emoji": v["emoji"]} if v else None)(EXPECTED_IDENTITIES[n])
                        for n, i in ids.items() if i in agent_ids}

            live = await identities("li.agent")
            assert live == expected(set(ids.values())), "learnt from the live stream"
            session_row = await page.text_content(f'li.agent[data-agent-id="{ids["session"]}"] > .agent-line')
            assert session_row is not None and "\U0001F3E0 Claw" in session_row
            lanes = await identities("g.lifeline")
            assert lanes[ids["session"]] == {"name": "Claw", "emoji": "\U0001F3E0"}, "the channel's message to it"
            head = await page.text_content(f'g.lifeline[data-agent-id="{ids["session"]}"] text')
            assert head is not None and head.startswith("\U0001F3E0 Claw (")

            await page.reload()  # from the snapshot this time
            await page.wait_for_selector('#connection[data-connection="live"]')
            assert await identities("li.agent") == live, "the snapshot says the same"
            RESULTS.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(RESULTS / "identities.png"), full_page=True)
            assert not problems, problems
        finally:
            await browser.close()
