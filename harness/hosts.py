"""Agent hosts for harness scenarios: a real Host against a real mesh, with
scripted profiles chosen by agent name."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent_host.config import Budget, HostConfig
from agent_host.host import AgentProfile, Host, HostEvent
from agent_host.hoststore import HostedAgent
from agent_host.models.base import ModelReply
from agent_host.models.scripted import Policy, ScriptedModel, say
from agent_host.tools import ALL_TOOLS


class GatedModel(ScriptedModel):
    """A scripted model that, on the model requests named in `gates`, waits
    until the test opens the gate: how a scenario holds a run in progress
    (a slow model call) at a moment it chooses."""

    def __init__(self, policy: Policy, gates: dict[int, asyncio.Event], name: str = "gated"):
        super().__init__(policy, name)
        self.gates = gates
        self.waiting = asyncio.Event()

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, max_output_tokens: int,
                       max_requests: int) -> ModelReply:
        gate = self.gates.get(self.requests + 1)
        if gate is not None:
            self.waiting.set()
            await gate.wait()
            self.waiting.clear()
        return await super().complete(messages, tools, max_output_tokens=max_output_tokens,
                                      max_requests=max_requests)


def scripted_profiles(policies: Mapping[str, Policy | ScriptedModel], tools: tuple[str, ...] = ALL_TOOLS,
                      default: Policy | None = None) -> Callable[[HostedAgent], AgentProfile]:
    """Profiles by agent name: a policy (one ScriptedModel per agent) or a
    ready model instance."""
    models: dict[str, ScriptedModel] = {}

    def profile(record: HostedAgent) -> AgentProfile:
        chosen = policies.get(record.name, default or (lambda view: say("no policy")))
        if isinstance(chosen, ScriptedModel):
            return AgentProfile(model=chosen, tools=tools)
        model = models.setdefault(record.agent_id, ScriptedModel(chosen, name=f"scripted:{record.name}"))
        return AgentProfile(model=model, tools=tools)

    return profile


class ScriptedHost(Host):
    """A Host that keeps its live log (`log`) for the scenario to read."""

    log: list[HostEvent]


@contextlib.asynccontextmanager
async def scripted_host(address: str, data_dir: Path, policies: Mapping[str, Policy | ScriptedModel],
                        **config: Any) -> AsyncIterator[ScriptedHost]:
    budget = config.pop("budget", Budget(max_wall_time_s=60))
    host = ScriptedHost(replace(HostConfig(mesh_address=address, data_dir=data_dir, budget=budget), **config),
                        scripted_profiles(policies))
    host.log = []
    host.observers.append(host.log.append)
    await host.start()
    try:
        yield host
    finally:
        await host.stop()


def by_name(host: Host, name: str):  # -> AgentRunner[AgentHandle]; untyped: scenarios read its AgentInbox
    return next(r for r in host.runners.values() if r.record.name == name)
