"""The routing ingress over gRPC: inbound channel messages are routed by the
bindings and stored in the chosen agent's session inbox with ordinary
receipts; agents.list; sessions taken over by hosts; spawn permissions."""

from dataclasses import replace

import pytest

from harness.evidence import Record
from inboxmesh.client import errors
from inboxmesh.client.mesh import MeshClient
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.registry.v1 import registry_pb2 as reg
from inboxmesh.routing.v1 import routing_pb2 as route
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, make_config
from tests.streams import Collector

TOKEN = "ingress-secret"
CONFIG = f"""
agents:
  defaults:
    subagents: {{maxSpawnDepth: 2, maxChildrenPerAgent: 3}}
  list:
    - id: Home
      default: true
      name: Home helper
      identity: {{name: Claw, emoji: "🏠"}}
      subagents: {{allowAgents: [work]}}
    - id: work
      model: {{primary: openai/gpt-4o, fallbacks: [local/qwen]}}
    - id: code
bindings:
  - agentId: work
    match: {{channel: slack, teamId: T123}}
  - agentId: code
    match: {{channel: discord, guildId: "42", peer: {{kind: channel, id: dev}}}}
  - agentId: code
    match: {{channel: discord, accountId: "*", peer: {{kind: channel, id: ops}}}}
  - agentId: ghost
    match: {{channel: telegram, accountId: spare}}
ingress:
  tokens: [{TOKEN}]
"""


@pytest.fixture
async def routed(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text(CONFIG)
    async with Mesh(replace(make_config(tmp_path), routing=path)) as mesh:
        async with MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            yield client


def source(channel, account="", peer=None, parent=None, **fields) -> route.RouteInput:
    return route.RouteInput(channel=channel, account_id=account, peer=peer, parent_peer=parent, **fields)


def peer(kind, pid):
    return route.Peer(kind={"dm": route.PEER_KIND_DM, "group": route.PEER_KIND_GROUP,
                            "channel": route.PEER_KIND_CHANNEL}[kind], id=pid)


async def test_ingress_routes_into_the_session_inbox_with_receipts(routed):
    client = routed
    first = await client.ingress(TOKEN, source("Slack", team_id="T123", peer=peer("group", "G1")), "slack-1",
                                 "hello work", author="ann")
    assert (first.route.agent_id, first.route.matched_by) == ("work", "binding.team")
    assert first.route.session_key == "agent:work:slack:group:g1"
    assert first.session_created and first.receipt.status == pb.RECEIPT_STATUS_ACCEPTED
    again = await client.ingress(TOKEN, source("slack", team_id="T123", peer=peer("group", "G1")), "slack-1",
                                 "hello work")
    assert again.receipt.status == pb.RECEIPT_STATUS_DUPLICATE and not again.session_created
    assert again.session_agent_id == first.session_agent_id and again.receipt.sequence == first.receipt.sequence
    second = await client.ingress(TOKEN, source("slack", team_id="T123", peer=peer("group", "G1")), "slack-2",
                                  "and again")
    assert (second.session_agent_id, second.receipt.sequence) == (first.session_agent_id, 2)
    thread = await client.ingress(TOKEN, source("discord", account="bot2", peer=peer("channel", "t-9"),
                                                parent=peer("channel", "ops")), "d-1", "in a thread")
    assert (thread.route.agent_id, thread.route.matched_by) == ("code", "binding.peer.parent")
    assert thread.session_agent_id != first.session_agent_id
    fallback = await client.ingress(TOKEN, source("telegram", account="spare"), "tg-1", "hi")
    assert fallback.route.agent_id == "home" and "ghost" in fallback.route.warning
    assert fallback.route.session_key == fallback.route.main_session_key == "agent:home:main"

    # the session agent is registered and its inbox holds the messages; a host takes it over
    session = await client.claim_session(TOKEN, first.route.session_key)
    assert session.agent_id == first.session_agent_id
    info = await session.get()
    assert info.name == "agent:work:slack:group:g1" and info.metadata["inboxmesh-agent"] == "work"
    inbox = Collector(session, auto_ack=True)
    try:
        got = await inbox.wait_for(2)
    finally:
        await inbox.stop()
    assert [m.content.text for m in got] == ["hello work", "and again"]
    assert got[0].origin.kind == env_pb.ORIGIN_KIND_CHANNEL and got[0].sender == "channel:slack/default/group:G1"
    assert got[0].headers["inboxmesh-route-matched-by"] == "binding.team"
    assert got[0].headers["inboxmesh-route-author"] == "ann"
    record = await Record.read(client)
    routed_events = record.of(ev.EVENT_KIND_ROUTED)
    assert [e.message_id for e in routed_events] == ["slack-1", "slack-1", "slack-2", "d-1", "tg-1"]
    assert all(record.one(ev.EVENT_KIND_MESSAGE_CONSUMED, message_id=m.message_id) for m in got)

    # claiming again revokes the earlier credential
    newer = await client.claim_session(TOKEN, first.route.session_key)
    with pytest.raises(errors.Unauthenticated):
        await session.get()
    assert (await newer.get()).agent_id == session.agent_id


async def test_ingress_needs_a_valid_token_and_input(routed):
    client = routed
    with pytest.raises(errors.Unauthenticated):
        await client.ingress("wrong", source("slack"), "x", "hi")
    with pytest.raises(errors.Unauthenticated):
        await client.ingress("", source("slack"), "x", "hi")
    with pytest.raises(errors.InvalidArgument) as no_channel:
        await client.ingress(TOKEN, source(""), "x", "hi")
    assert "source.channel" in no_channel.value.message
    with pytest.raises(errors.InvalidArgument) as no_id:
        await client.ingress(TOKEN, source("slack"), "", "hi")
    assert "message_id" in no_id.value.message
    with pytest.raises(errors.InvalidArgument) as bad_peer:
        await client.ingress(TOKEN, source("slack", peer=route.Peer(id="x")), "x", "hi")
    assert "source.peer" in bad_peer.value.message
    record = await Record.read(client)
    assert not record.of(ev.EVENT_KIND_ROUTED), "nothing was routed or stored"


async def test_agents_list_and_dry_run_resolution(routed):
    client = routed
    listed = await client.configured_agents()
    assert (listed.default_id, listed.main_key) == ("home", "main")
    assert [a.id for a in listed.agents] == ["home", "work", "code"]
    home = listed.agents[0]
    assert (home.name, home.identity.name, home.identity.emoji, home.is_default) == ("Home helper", "Claw", "🏠", True)
    assert (listed.agents[1].model, list(listed.agents[1].model_fallbacks)) == ("openai/gpt-4o", ["local/qwen"])
    resolved = await client.resolve_route(source("discord", peer=peer("channel", "dev"), guild_id="42"))
    assert (resolved.agent_id, resolved.matched_by, resolved.binding_index) == ("code", "binding.peer", 1)
    assert not (await Record.read(client)).of(ev.EVENT_KIND_ROUTED), "a dry run stores nothing"


async def test_allow_agents_and_configured_limits_govern_spawns(routed):
    client = routed
    home = await client.ingress(TOKEN, source("webchat"), "w-1", "hi")
    session = await client.claim_session(TOKEN, home.route.session_key)
    helper = await session.spawn("helper", run=reg.RunSpec(task="help", agent_config_id="work"))
    assert (await helper.get()).metadata["inboxmesh-agent"] == "work"
    with pytest.raises(errors.PermissionDenied) as denied:
        await session.spawn("coder", run=reg.RunSpec(task="code", agent_config_id="code"))
    assert denied.value.reason == "AGENT_NOT_ALLOWED" and "allowAgents" in denied.value.message
    with pytest.raises(errors.NotFound):
        await session.spawn("nobody", run=reg.RunSpec(task="x", agent_config_id="nobody"))
    # work's own policy (defaults: depth 2, 3 children) applies to the helper's spawns
    sub = await helper.spawn("sub", run=reg.RunSpec(task="s"))
    with pytest.raises(errors.ResourceExhausted) as deep:
        await sub.spawn("subsub", run=reg.RunSpec(task="t"))
    assert deep.value.reason == "SPAWN_DEPTH"
    run = await session.get_run(child_id=helper.agent_id)
    assert run.requester_origin["inboxmesh-route-session"] == "agent:home:main"
    assert run.agent_config_id == "work"


async def test_a_mesh_without_ingress_tokens_refuses_ingress(tmp_path):
    path = tmp_path / "routing.toml"
    path.write_text('[[agents.list]]\nid = "main"\n')
    async with Mesh(replace(make_config(tmp_path), routing=path)) as mesh:
        async with MeshClient(mesh.address) as client:
            with pytest.raises(errors.FailedPrecondition) as refused:
                await client.ingress("anything", source("slack"), "x", "hi")
            assert "ingress.tokens" in refused.value.message
            assert (await client.configured_agents()).default_id == "main"


async def test_a_closed_session_starts_anew(routed):
    client = routed
    first = await client.ingress(TOKEN, source("webchat"), "w-1", "hi")
    admin_view = client.agent(first.session_agent_id, ADMIN_TOKEN)
    await admin_view.close(first.session_agent_id, reason="conversation over")
    second = await client.ingress(TOKEN, source("webchat"), "w-2", "hello again")
    assert second.session_created and second.session_agent_id != first.session_agent_id
    assert second.route.session_key == first.route.session_key
    third = await client.ingress(TOKEN, source("webchat"), "w-3", "and again")
    assert not third.session_created and third.session_agent_id == second.session_agent_id


async def test_a_session_answers_on_its_channel_through_the_channels_gateway(routed):
    """A reply to a channel message goes to the channel account's gateway agent (registered on first
    use), with the channel address it answers in `inboxmesh-channel-to`; the channel's adapter claims the
    gateway and reads the answers like any inbox. Only a session's agents may answer on its channel."""
    client = routed
    first = await client.ingress(TOKEN, source("slack", team_id="T123", peer=peer("group", "G1")), "slack-1",
                                 "hello work")
    other = await client.ingress(TOKEN, source("discord", account="bot2", peer=peer("channel", "ops")), "d-1",
                                 "hello code")
    session = await client.claim_session(TOKEN, first.route.session_key)
    inbox = Collector(session, auto_ack=True)
    try:
        [question] = await inbox.wait_for(1)
    finally:
        await inbox.stop()
    answer = await session.send(question.sender, "on it", kind=env_pb.MESSAGE_KIND_REPLY,
                                in_reply_to=question.message_id)
    assert answer.status == pb.RECEIPT_STATUS_ACCEPTED
    helper = await session.spawn("helper")  # the session's own agents may answer too
    assert (await helper.send(question.sender, "me too")).status == pb.RECEIPT_STATUS_ACCEPTED

    # not a session of this channel: refused, nothing stored
    stranger = await client.register("stranger")
    refused = await stranger.send(question.sender, "hijack")
    assert refused.status == pb.RECEIPT_STATUS_NOT_PERMITTED and "only the agents of a session" in refused.detail
    code_session = await client.claim_session(TOKEN, other.route.session_key)
    assert (await code_session.send(question.sender, "cross")).status == pb.RECEIPT_STATUS_NOT_PERMITTED
    assert (await session.send("channel:slack", "no account")).status == pb.RECEIPT_STATUS_UNKNOWN_TARGET

    # the adapter reads the answers from the gateway
    gateway = await client.claim_session(TOKEN, "channel:slack/default")
    assert answer.recipient == gateway.agent_id
    info = await gateway.get()
    assert info.name == "channel:slack/default" and info.metadata["inboxmesh-channel"] == "slack/default"
    outbox = Collector(gateway, auto_ack=True)
    try:
        got = await outbox.wait_for(2)
    finally:
        await outbox.stop()
    assert [(m.content.text, m.headers["inboxmesh-channel-to"]) for m in got] == [
        ("on it", "channel:slack/default/group:G1"), ("me too", "channel:slack/default/group:G1")]
    assert got[0].in_reply_to == "slack-1" and got[0].sender == session.agent_id
    with pytest.raises(errors.InvalidArgument):
        await client.claim_session(TOKEN, "channel:slack")


async def test_without_routing_a_channel_address_is_an_unknown_target(client):
    agent = await client.register("lonely")
    receipt = await agent.send("channel:slack/default/dm:U1", "hello?")
    assert receipt.status == pb.RECEIPT_STATUS_UNKNOWN_TARGET and "routes no channels" in receipt.detail
