"""Agent hosts for harness scenarios: a real Host against a real mesh, with
scripted profiles chosen by agent name."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from agent_host.config import Budget, HostConfig
from agent_host.host import AgentProfile, Host, HostEvent
from agent_host.hoststore import AgentRecord
from agent_host.models.scripted import Policy, ScriptedModel, say
from agent_host.tools import ALL_TOOLS


def scripted_profiles(policies: dict[str, Policy], tools: tuple[str, ...] = ALL_TOOLS,
                      default: Policy | None = None) -> Callable[[AgentRecord], AgentProfile]:
    models: dict[str, ScriptedModel] = {}

    def profile(record: AgentRecord) -> AgentProfile:
        policy = policies.get(record.name, default or (lambda view: say("no policy")))
        model = models.setdefault(record.agent_id, ScriptedModel(policy, name=f"scripted:{record.name}"))
        return AgentProfile(model=model, tools=tools)

    return profile


@contextlib.asynccontextmanager
async def scripted_host(address: str, data_dir: Path, policies: dict[str, Policy], **config):
    budget = config.pop("budget", Budget(max_wall_time_s=60))
    host = Host(replace(HostConfig(mesh_address=address, data_dir=data_dir, budget=budget), **config),
                scripted_profiles(policies))
    log: list[HostEvent] = []
    host.observers.append(log.append)
    host.log = log
    await host.start()
    try:
        yield host
    finally:
        await host.stop()
