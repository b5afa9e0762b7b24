"""Reloading the routing config while the mesh runs (docs/routing.md "Reload"): a changed file is
validated, then served (its version on every route and ROUTED event from then on); a bad file is refused
with the key path and the config in force stays; nothing already stored moves."""

from __future__ import annotations

from dataclasses import replace

from harness.evidence import Record
from inboxmesh.client.mesh import MeshClient
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.routing.v1 import routing_pb2 as route
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, eventually, make_config

TOKEN = "reload-token"
CONFIG = """
agents:
  list:
    - id: home
      default: true
    - id: work
      tools: {{deny: [{denied}]}}
bindings:
  - agentId: {slack_agent}
    match: {{channel: slack, teamId: T1}}
ingress:
  tokens: [{token}]
"""


def slack(message_id: str):
    return dict(source=route.RouteInput(channel="slack", team_id="T1"), message_id=message_id, text=message_id)


async def test_a_changed_file_moves_the_binding_and_a_bad_one_changes_nothing(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text(CONFIG.format(slack_agent="work", denied="close_agent", token=TOKEN))
    async with Mesh(replace(make_config(tmp_path), routing=path)) as mesh:
        async with MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            before = await client.configured_agents()
            first = await client.ingress(TOKEN, **slack("m1"))
            assert first.route.agent_id == "work" and first.route.config_version == before.config_version

            # the binding moves to home: the next message goes there, the first stays where it was stored
            path.write_text(CONFIG.format(slack_agent="home", denied="close_agent", token=TOKEN))
            after = await eventually(_newer(client, before.config_version), timeout=10,
                                     message="the reload taken")
            assert after.reload_error == ""
            second = await client.ingress(TOKEN, **slack("m2"))
            assert second.route.agent_id == "home" and second.route.config_version == after.config_version
            work = await client.claim_session(TOKEN, first.route.session_key)
            kept = await work.inbox_status(first.receipt.sequence)
            assert kept.envelope.message_id == "m1" and kept.state == pb.MESSAGE_STATE_QUEUED, "nothing moved"

            # a bad file: refused with the key path; the config in force stays (version, bindings, tools)
            path.write_text(CONFIG.format(slack_agent="home", denied="shell", token=TOKEN))
            refused = await eventually(_refused(client), timeout=10, message="the bad file refused")
            assert "agents.list[1].tools.deny[0]: unknown tool 'shell'" in refused.reload_error
            assert refused.config_version == after.config_version
            assert list(refused.agents[1].tools.deny) == ["close_agent"]
            third = await client.ingress(TOKEN, **slack("m3"))
            assert third.route.agent_id == "home" and third.receipt.status == pb.RECEIPT_STATUS_ACCEPTED

            # nested too deeply for the parser (it recursed, and the error ended the watching for good)
            path.write_text("agents: " + "[" * 5000 + "]" * 5000 + "\n")
            deep = await eventually(_refused(client, "nested too deeply"), timeout=10, message="the deep file refused")
            assert deep.config_version == after.config_version

            # fixed again: served, and the error is gone
            path.write_text(CONFIG.format(slack_agent="work", denied="spawn_agent", token=TOKEN))
            fixed = await eventually(_newer(client, after.config_version), timeout=10, message="the fix taken")
            assert fixed.reload_error == "" and list(fixed.agents[1].tools.deny) == ["spawn_agent"]

            record = await Record.read(client)
            versions = {e.message_id: e.detail.rsplit("config=", 1)[1] for e in record.of(ev.EVENT_KIND_ROUTED)}
            assert versions == {"m1": before.config_version, "m2": after.config_version,
                                "m3": after.config_version}


async def test_an_unreadable_file_is_refused_and_sighup_style_reload_reads_it_at_once(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text(CONFIG.format(slack_agent="work", denied="close_agent", token=TOKEN))
    async with Mesh(replace(make_config(tmp_path), routing=path)) as mesh:
        reloader, service = mesh.routing_reloader, mesh.services.routing
        assert reloader is not None and service is not None
        version = service.config.version
        path.unlink()
        assert reloader.reload() is False
        assert "cannot read" in service.reload_error
        assert service.config.version == version
        path.write_text(CONFIG.format(slack_agent="home", denied="close_agent", token=TOKEN))
        assert reloader.reload() is True, "read at once (what SIGHUP does in `inboxmesh up`)"
        assert service.config.version != version and service.reload_error == ""


def _newer(client, version):
    async def check():
        listing = await client.configured_agents()
        return listing if listing.config_version != version else None
    return check


def _refused(client, saying: str = ""):
    async def check():
        listing = await client.configured_agents()
        return listing if listing.reload_error and saying in listing.reload_error else None
    return check
