"""Configured agents: the routing config's `agents.list` (read from the mesh, ListConfiguredAgents) as
the profiles a host runs its agents with (docs/routing.md "What a host does with it").

An agent runs as a configured agent when its record names one (`HostedAgent.config_id`: a session agent
claimed from ingress, `inboxmesh run --agent <id>`, or a child of such an agent, which runs as its
parent's configured agent). Its profile:

- models: the references it was spawned with (its parent's `subagents.model`), else its own `model`
  (primary, then fallbacks), else the host's default; built by the ModelCatalog;
- tools: `tools.allow` (all the host's usual tools when not given), plus the tools its skills need,
  minus `tools.deny` (deny wins);
- skills: the named skill bundles (every one the host has when `skills` is not given), whose
  instructions go into its system prompt;
- its children's models: its `subagents.model`;
- which configured agents its children may run as: its own and its `subagents.allowAgents` (spawn_agent
  offers the choice as an `agent` argument when there is one).
"""

from __future__ import annotations

from agent_host.catalog import ModelCatalog, ModelConfigError
from agent_host.host import AgentProfile
from agent_host.hoststore import HostedAgent
from agent_host.skills import Skill, SkillError, SkillLibrary
from agent_host.tools import ALL_TOOLS
from inboxmesh.routing.v1 import routing_pb2 as route_pb

CONFIG_KEY = "inboxmesh-agent"
"""The agent metadata naming its configured agent (the mesh's services.runs.service.AGENT_KEY)."""


class ConfiguredAgentError(ValueError):
    """A configured agent the host cannot run as configured; the message names the agent and the setting."""


def tools_for(agent: route_pb.ConfiguredAgent, skills: list[Skill], base: tuple[str, ...] = ALL_TOOLS
              ) -> tuple[str, ...]:
    """allow (or `base`), then what the skills need, minus deny."""
    allowed = list(agent.tools.allow) if agent.tools.restricted else list(base)
    for skill in skills:
        allowed += [t for t in skill.tools if t not in allowed]
    denied = set(agent.tools.deny)
    return tuple(t for t in dict.fromkeys(allowed) if t not in denied)


class ConfiguredAgents:
    """A ProfileFactory for a Host: profiles of configured agents, from a ListConfiguredAgents answer."""

    def __init__(self, listing: route_pb.ListConfiguredAgentsResponse, catalog: ModelCatalog,
                 skills: SkillLibrary | None = None, *, default_model: str = "",
                 base_tools: tuple[str, ...] = ALL_TOOLS):
        self.use(listing)
        self.catalog = catalog
        self.skills = skills or SkillLibrary()
        self.default_model = default_model
        self.base_tools = base_tools

    def use(self, listing: route_pb.ListConfiguredAgentsResponse) -> None:
        """A newer config (the mesh reloaded its routing file): agents started from now on get its settings;
        running ones keep theirs until the host starts them again."""
        self.listing = listing
        self.version = listing.config_version
        self.agents = {a.id: a for a in listing.agents}
        self.default_id = listing.default_id

    def agent(self, config_id: str) -> route_pb.ConfiguredAgent:
        wanted = (config_id or self.default_id).strip().lower()
        found = self.agents.get(wanted)
        if found is None:
            raise ConfiguredAgentError(f"no configured agent {wanted!r} (agents.list has {sorted(self.agents)})")
        return found

    def summary(self, agent: route_pb.ConfiguredAgent) -> str:
        """What a configured agent is, for a model choosing one: its name and the tools it gets."""
        tools = ", ".join(tools_for(agent, [], self.base_tools))
        return f"{agent.name or agent.id} (tools: {tools})"

    def models_of(self, agent: route_pb.ConfiguredAgent) -> tuple[str, ...]:
        if agent.model:
            return (agent.model, *agent.model_fallbacks)
        if self.default_model:
            return (self.default_model,)
        raise ConfiguredAgentError(f"agent {agent.id!r} has no model (set agents.list[].model or"
                                   " agents.defaults.model) and the host has no default model")

    def __call__(self, record: HostedAgent) -> AgentProfile:
        agent = self.agent(record.config_id)
        refs = record.models or self.models_of(agent)
        try:
            chain = self.catalog.chain(refs[0], refs[1:])
            skills = self.skills.select(None if agent.all_skills else list(agent.skills))
        except (ModelConfigError, SkillError) as exc:
            raise ConfiguredAgentError(f"agent {agent.id!r}: {exc}") from None
        sub = agent.subagents
        role = f"Your workspace is {agent.workspace}." if agent.workspace else ""
        allowed = sub.allow_agents
        others = sorted(self.agents) if "*" in allowed else [a for a in allowed if a in self.agents]
        ids = tuple(dict.fromkeys((*others, agent.id)))  # the agents it may choose first, its own last
        spawn_as = tuple((i, self.summary(self.agents[i])) for i in ids)
        return AgentProfile(model=chain, tools=tools_for(agent, skills, self.base_tools), role=role,
                            instructions="\n\n".join(s.prompt() for s in skills),
                            spawn_as=spawn_as if len(spawn_as) > 1 else (),
                            max_working_children=sub.max_children_per_agent or None,
                            max_spawn_depth=sub.max_spawn_depth or None,
                            subagent_models=(sub.model, *sub.model_fallbacks) if sub.model else (),
                            team_targets={"team": True, "any": False}.get(agent.tools.send_to))
