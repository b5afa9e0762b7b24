"""The seed's three-agent example end to end (issue 17): channel messages from Telegram, Slack and
Discord go through Ingress to the sessions of three configured agents (home, work, code); a host serving
sessions (agent_host/sessions.py) claims each and runs it with its own configured model; each answers on
its channel through the channel's gateway. The work agent's primary model fails (an endpoint that refuses
connections) and its fallback answers; a denied tool is never offered; a reload moves a binding with no
message lost. All from the record, the gateways' inboxes and what each model was given.

The same example with the project's real local model as the code agent's model is in
harness/test_real_llm.py (the real-model lane)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

from agent_host.catalog import ModelCatalog
from agent_host.config import Budget, HostConfig
from agent_host.configured import ConfiguredAgents
from agent_host.host import Host
from agent_host.models.scripted import ContextView, Decision, say
from agent_host.sessions import MARK, SessionHost
from harness.evidence import Record
from harness.nats import free_port
from inboxmesh.client.mesh import MeshClient
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.routing.v1 import routing_pb2 as route
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, eventually, make_config
from tests.streams import Collector

K = ev.EventKind
TOKEN = "home-work-code"
CONFIG = """
models:
  providers:
    down: {{baseUrl: "http://127.0.0.1:{port}/v1", timeoutSeconds: 2}}
agents:
  list:
    - id: home
      default: true
      name: Home helper
      identity: {{name: Claw, emoji: "H"}}
      model: scripted/home
      tools: {{allow: [reply, wait, list_agents], deny: [list_agents]}}
    - id: work
      model: {{primary: down/big-model, fallbacks: [scripted/work]}}
      tools: {{allow: [reply, wait, close_agent], deny: [close_agent]}}
    - id: code
      model: {code_model}
      tools: {{allow: [reply, wait]}}
bindings:
  - agentId: home
    match: {{channel: telegram, accountId: personal}}
  - agentId: {slack_agent}
    match: {{channel: slack, teamId: T1}}
  - agentId: code
    match: {{channel: discord, guildId: "42"}}
ingress:
  tokens: [{token}]
"""
OFFERED: dict[str, set[frozenset[str]]] = {}
"""Configured agent -> the tool sets its model was offered."""


def answering(agent: str):
    def policy(view: ContextView) -> Decision:
        OFFERED.setdefault(agent, set()).add(frozenset(view.tools))
        if view.new:
            return Decision(calls=[("reply", {"message_id": m.message_id, "text": f"{agent} answers: {m.text}"})
                                   for m in view.new if m.kind == "text"])
        return say("waiting")
    return policy


@dataclass
class Example:
    mesh: Mesh
    client: MeshClient
    host: Host
    sessions: SessionHost
    path: Path
    port: int
    code_model: str

    def write(self, slack_agent: str) -> None:
        self.path.write_text(CONFIG.format(port=self.port, code_model=self.code_model, slack_agent=slack_agent,
                                           token=TOKEN))


@contextlib.asynccontextmanager
async def home_work_code(tmp_path: Path, *, code_model: str = "scripted/code",
                         local_url: str = "") -> AsyncIterator[Example]:
    OFFERED.clear()
    path, port = tmp_path / "routing.yaml", free_port()  # nothing listens there: an endpoint that refuses connections
    path.write_text(CONFIG.format(port=port, code_model=code_model, slack_agent="work", token=TOKEN))
    async with Mesh(replace(make_config(tmp_path), routing=path)) as mesh:
        async with MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            listing = await client.configured_agents()
            catalog = ModelCatalog(listing.providers, local_url=local_url,
                                   policies={name: answering(name) for name in ("home", "work", "code")})
            config = HostConfig(mesh_address=mesh.address, data_dir=tmp_path / "host", show_ids=False,
                                budget=Budget(max_model_requests=30, max_wall_time_s=600, max_requests_per_reply=2))
            async with Host(config, ConfiguredAgents(listing, catalog)) as host:
                async with SessionHost(host, client, TOKEN) as sessions:
                    yield Example(mesh, client, host, sessions, path=path, port=port, code_model=code_model)
            await catalog.close()


TELEGRAM = dict(source=route.RouteInput(channel="telegram", account_id="personal",
                                        peer=route.Peer(kind=route.PEER_KIND_DM, id="ann")))
SLACK = dict(source=route.RouteInput(channel="slack", team_id="T1",
                                     peer=route.Peer(kind=route.PEER_KIND_CHANNEL, id="C9")))
DISCORD = dict(source=route.RouteInput(channel="discord", guild_id="42",
                                       peer=route.Peer(kind=route.PEER_KIND_CHANNEL, id="dev")))


async def answers(client: MeshClient, gateway_key: str, count: int, timeout: float = 30) -> list[env_pb.Envelope]:
    """The channel adapter's side: what the gateway of a channel account holds (claimed, then read)."""
    gateway = await client.claim_session(TOKEN, gateway_key)
    inbox = Collector(gateway, auto_ack=True)
    try:
        return await inbox.wait_for(count, timeout=timeout)
    finally:
        await inbox.stop()


async def test_three_channels_reach_three_configured_agents_each_answering_with_its_own_model(tmp_path):
    async with home_work_code(tmp_path) as example:
        client = example.client
        sent = {
            "home": await client.ingress(TOKEN, message_id="tg-1", text="buy milk", **TELEGRAM),
            "work": await client.ingress(TOKEN, message_id="sl-1", text="ship it", **SLACK),
            "code": await client.ingress(TOKEN, message_id="dc-1", text="fix the bug", **DISCORD),
        }
        assert {k: r.route.agent_id for k, r in sent.items()} == {"home": "home", "work": "work", "code": "code"}
        got = {
            "home": await answers(client, "channel:telegram/personal", 1),
            "work": await answers(client, "channel:slack/default", 1),
            "code": await answers(client, "channel:discord/default", 1),
        }
        for agent, (answer,) in got.items():
            assert answer.content.text == f"{agent} answers: {sent_text(agent)}"
            assert answer.in_reply_to == sent[agent].receipt.message_id
            assert answer.sender == sent[agent].session_agent_id, "answered by the routed session agent"
        assert got["home"][0].headers["inboxmesh-channel-to"] == "channel:telegram/personal/dm:ann"
        record = await Record.read(client)

        def models(agent: str) -> list[str]:
            return [e.detail.split(" ")[0] + " " + e.detail.split(" ")[1]
                    for e in record.of(K.EVENT_KIND_MODEL_CALLED, agent_id=sent[agent].session_agent_id)]

        assert models("home")[0] == "model=scripted/home outcome=ok"
        assert models("work")[:2] == ["model=down/big-model outcome=failed", "model=scripted/work outcome=ok"], \
            "the work agent's primary failed and its fallback answered"
        assert models("code")[0] == "model=scripted/code outcome=ok"
        # denied tools were never offered
        assert OFFERED["home"] == {frozenset({"reply", "wait"})}
        assert OFFERED["work"] == {frozenset({"reply", "wait"})}
        consumed = {e.message_id for e in record.of(K.EVENT_KIND_MESSAGE_CONSUMED)}
        assert {"tg-1", "sl-1", "dc-1"} <= consumed


def sent_text(agent: str) -> str:
    return {"home": "buy milk", "work": "ship it", "code": "fix the bug"}[agent]


async def test_a_reload_moves_a_binding_and_no_message_is_lost(tmp_path):
    async with home_work_code(tmp_path) as example:
        client = example.client
        before = await client.ingress(TOKEN, message_id="sl-1", text="first", **SLACK)
        assert before.route.agent_id == "work"
        old_version = before.route.config_version
        example.write(slack_agent="home")

        async def reloaded():
            listing = await client.configured_agents()
            return listing.config_version != old_version

        await eventually(reloaded, timeout=15, message="the mesh reloaded the routing file")
        after = await client.ingress(TOKEN, message_id="sl-2", text="second", **SLACK)
        assert after.route.agent_id == "home" and after.route.config_version != old_version
        got = await answers(client, "channel:slack/default", 2)
        assert sorted(m.content.text for m in got) == ["home answers: second", "work answers: first"]
        assert {m.in_reply_to for m in got} == {"sl-1", "sl-2"}
        record = await Record.read(client)
        routed = {e.message_id: e for e in record.of(K.EVENT_KIND_ROUTED)}
        assert routed["sl-1"].detail.endswith(f"config={old_version}")
        assert routed["sl-2"].detail.endswith(f"config={after.route.config_version}")
        for message_id in ("sl-1", "sl-2"):
            assert len(record.of(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=message_id)) == 1, "each once"
        assert not record.of(K.EVENT_KIND_MESSAGE_DEAD_LETTERED)
        assert example.sessions.failures == []


async def test_a_restarted_session_host_follows_the_record_from_where_it_stopped(tmp_path):
    """host.db keeps the last ROUTED event the session host handled: a new one (a restarted host) does not
    read the record from its start again, and serves the sessions routed after."""
    async with home_work_code(tmp_path) as example:
        client = example.client
        first = await client.ingress(TOKEN, message_id="tg-1", text="buy milk", **TELEGRAM)
        assert [m.content.text for m in await answers(client, "channel:telegram/personal", 1)] == \
            ["home answers: buy milk"]
        await example.sessions.stop()
        record = await Record.read(client)
        [routed] = record.of(K.EVENT_KIND_ROUTED)
        assert example.host.store.mark(MARK) == routed.event_id and example.sessions.handled == 1
        async with SessionHost(example.host, client, TOKEN) as again:
            await client.ingress(TOKEN, message_id="dc-1", text="fix the bug", **DISCORD)
            assert [m.content.text for m in await answers(client, "channel:discord/default", 1)] == \
                ["code answers: fix the bug"]
            assert again.handled == 1, "only the new ROUTED event: the first was handled before the restart"
        assert first.session_agent_id in example.host.runners


async def test_the_session_host_follows_the_record_across_a_restart_of_the_mesh(tmp_path):
    """The watch of the record ends when the mesh stops: the session host follows it again from its mark
    once the mesh is back, and serves the sessions routed after. (It stopped for good, and sessions routed
    after a mesh restart were never claimed.)"""
    async with home_work_code(tmp_path) as example:
        client = example.client
        await client.ingress(TOKEN, message_id="tg-1", text="buy milk", **TELEGRAM)
        assert [m.content.text for m in await answers(client, "channel:telegram/personal", 1)] == \
            ["home answers: buy milk"]
        config = replace(example.mesh.config, port=int(example.mesh.address.rpartition(":")[2]))
        await example.mesh.stop()
        async with Mesh(config):
            await client.ingress(TOKEN, message_id="dc-1", text="fix the bug", **DISCORD)
            assert [m.content.text for m in await answers(client, "channel:discord/default", 1)] == \
                ["code answers: fix the bug"]
            assert example.sessions.handled == 2 and example.sessions.failures == []
