"""Configured agents run as their config says (docs/routing.md "What a host does with it"): each with its
own models (a primary that fails gives way to its fallback, each attempt a MODEL_CALLED event naming the
model), its tools (deny wins; a denied tool is never offered to the model), its skills (their instructions
in its system prompt, their tools offered), and its children with its subagents.model. Everything is
read back from the mesh's record and from what the model was actually given."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent_host.catalog import ModelCatalog
from agent_host.config import Budget, HostConfig
from agent_host.configured import ConfiguredAgentError, ConfiguredAgents
from agent_host.host import Host
from agent_host.models.scripted import ContextView, Decision, call, say
from agent_host.skills import SkillLibrary
from harness.evidence import Record
from harness.hosts import by_name
from harness.nats import free_port
from harness.test_addressing import tool_results
from inboxmesh.client.mesh import MeshClient
from inboxmesh.events.v1 import events_pb2 as ev
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, make_config

K = ev.EventKind


CONFIG = """
models:
  providers:
    down: {{baseUrl: "http://127.0.0.1:{port}/v1", timeoutSeconds: 2}}
agents:
  list:
    - id: home
      default: true
      model: scripted/answer
      tools: {{deny: [close_agent, spawn_agent], sendTo: any}}
    - id: work
      model: {{primary: down/big-model, fallbacks: [scripted/answer]}}
      tools: {{allow: [finish, wait, close_agent], deny: [close_agent]}}
      skills: [triage]
    - id: code
      model: scripted/delegate
      subagents: {{model: scripted/finish}}
    - id: boss
      model: scripted/boss
      subagents: {{allowAgents: [work]}}
      tools: {{sendTo: team}}
"""
TRIAGE = """---
description: sort incoming requests
tools: [reply]
---
Sort each request into urgent or later before you answer it.
"""
SEEN: list[tuple[str, frozenset[str], str]] = []
"""(agent name, tools offered, system prompt) of every model request the scripted policies answered."""


def answer(view: ContextView) -> Decision:
    SEEN.append((view.system.split(",")[0], frozenset(view.tools), view.system))
    return say("done") if view.called("finish") else call("finish", result=f"answered: {view.task}")


def delegate(view: ContextView) -> Decision:
    if not view.called("spawn_agent"):
        return call("spawn_agent", agent_name="helper", task="look it up", mode="sync")
    return say("done") if view.called("finish") else call("finish", result="delegated")


def boss(view: ContextView) -> Decision:
    spawns = view.called("spawn_agent")
    if not spawns:
        return call("spawn_agent", agent_name="worker", task="triage", mode="sync", agent="work")
    if len(spawns) == 1:
        return call("spawn_agent", agent_name="coder", task="code", mode="sync", agent="code")
    return say("done") if view.called("finish") else call("finish", result="bossed")


@pytest.fixture
async def configured(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text(CONFIG.format(port=free_port()))  # nothing listens there: an endpoint that refuses connections
    skills = tmp_path / "skills"
    (skills / "triage").mkdir(parents=True)
    (skills / "triage" / "SKILL.md").write_text(TRIAGE)
    SEEN.clear()
    async with Mesh(replace(make_config(tmp_path), routing=path)) as mesh:
        async with MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            listing = await client.configured_agents()
            catalog = ModelCatalog(listing.providers, policies={"answer": answer, "delegate": delegate,
                                                                        "boss": boss})
            profiles = ConfiguredAgents(listing, catalog, SkillLibrary([skills]))
            config = HostConfig(mesh_address=mesh.address, data_dir=tmp_path / "host",
                                budget=Budget(max_model_requests=20, max_wall_time_s=60, max_requests_per_reply=2))
            async with Host(config, profiles) as host:
                yield host, client
            await catalog.close()


async def test_a_failing_primary_gives_way_to_its_fallback_and_the_record_names_each_model(configured):
    host, client = configured
    outcome = await host.run_task("triager", "a request came in", config_id="work", timeout=30)
    assert outcome.ok, outcome.error
    runner = by_name(host, "triager")
    record = await Record.read(client)
    calls = [e.detail for e in record.of(K.EVENT_KIND_MODEL_CALLED, agent_id=runner.agent_id)]
    assert calls[0].startswith("model=down/big-model outcome=failed requests=2 error="), calls
    assert calls[1].startswith("model=scripted/answer outcome=ok requests=1"), calls
    assert outcome.budget["model_requests"] == 3, "the failed primary's requests count in the budget"
    # tools: allow minus deny, plus what the skill needs; the denied tool was never offered
    assert {tools for name, tools, _ in SEEN if "triager" in name} == {frozenset({"finish", "wait", "reply"})}
    system = next(prompt for name, _, prompt in SEEN if "triager" in name)
    assert "## Skill: triage (sort incoming requests)" in system and "urgent or later" in system


async def test_the_default_agent_is_offered_what_its_deny_leaves(configured):
    host, client = configured
    outcome = await host.run_task("helper", "say hi", config_id="home", timeout=30)
    assert outcome.ok, outcome.error
    [(_, tools, _)] = [s for s in SEEN if "helper" in s[0]]
    assert tools == {"send_message", "reply", "list_agents", "finish", "wait"}, "spawn_agent, close_agent denied"
    record = await Record.read(client)
    [called] = record.of(K.EVENT_KIND_MODEL_CALLED, agent_id=by_name(host, "helper").agent_id)
    assert called.detail.startswith("model=scripted/answer outcome=ok")


async def test_children_run_with_the_parents_subagent_model_as_the_same_configured_agent(configured):
    host, client = configured
    outcome = await host.run_task("coder", "fix it", config_id="code", timeout=30)
    assert outcome.ok, outcome.error
    child = by_name(host, "helper")
    assert child.record.config_id == "code" and child.record.models == ("scripted/finish",)
    record = await Record.read(client)
    [called] = record.of(K.EVENT_KIND_MODEL_CALLED, agent_id=child.agent_id)
    assert called.detail.startswith("model=scripted/finish outcome=ok"), called.detail
    info = await client.agent(child.agent_id, child.record.credential).get()
    assert info.metadata["inboxmesh-agent"] == "code", "the mesh knows it as the configured agent too"


async def test_a_child_runs_as_a_configured_agent_its_parent_may_spawn_and_no_other(configured):
    host, client = configured
    outcome = await host.run_task("chief", "organise", config_id="boss", timeout=30)
    assert outcome.ok, outcome.error
    chief, worker = by_name(host, "chief"), by_name(host, "worker")
    assert worker.record.config_id == "work"
    info = await client.agent(worker.agent_id, worker.record.credential).get()
    assert info.metadata["inboxmesh-agent"] == "work"
    record = await Record.read(client)
    calls = [e.detail for e in record.of(K.EVENT_KIND_MODEL_CALLED, agent_id=worker.agent_id)]
    assert calls[0].startswith("model=down/big-model outcome=failed") and "model=scripted/answer outcome=ok" in calls[1]
    (_, first), (_, second) = tool_results(chief, "spawn_agent")
    assert first["status"] == "completed" and first["agent"] == "work"
    # not a choice it was given (the mesh would refuse it too: tests/test_routing_ingress.py)
    assert second["error"] == "spawn_agent: argument 'agent' must be one of ['work', 'boss']", second
    offered = [ident for ident, _ in chief.profile.spawn_as]
    assert offered == ["work", "boss"], "its allowAgents first, then its own, offered as a choice"
    assert dict(chief.profile.spawn_as)["work"] == "work (tools: finish, wait)"


async def test_an_agent_that_cannot_run_as_configured_is_refused_with_the_reason(configured):
    host, _ = configured
    with pytest.raises(ConfiguredAgentError, match="no configured agent 'ghost'"):
        host.profiles(replace(by_name_record(), config_id="ghost"))


def by_name_record():
    from agent_host.hoststore import HostedAgent

    return HostedAgent(agent_id="agt_x", name="x", credential="c", mode="main")


async def test_which_targets_send_message_offers_comes_from_tools_send_to(configured):
    """tools.sendTo is served (ListConfiguredAgents) and becomes the agent's profile: "team" a choice of its
    team's names, "any" free text, unset the host's rule (tests/test_runner.py runs both through a turn)."""
    host, client = configured
    served = {a.id: a.tools.send_to for a in (await client.configured_agents()).agents}
    assert served == {"home": "any", "work": "", "code": "", "boss": "team"}
    profiles = {config_id: host.profiles(replace(by_name_record(), config_id=config_id)).team_targets
                for config_id in served}
    assert profiles == {"home": False, "work": None, "code": None, "boss": True}
