"""Which local agents the IOA network can reach (docs/ioa.md, "Exposure"): the mesh's rule
(`--ioa-expose`: all, none, or listed agents and scopes), and each agent's own word at registration
(metadata `inboxmesh.ioa_exposed`: "true" or "false"). A message for an agent the rule hides is answered
NOT_PERMITTED and not stored."""

from __future__ import annotations

from dataclasses import dataclass

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from services.store.base import AgentRecord

EXPOSED = "inboxmesh.ioa_exposed"
"""Agent metadata: "true" or "false", the agent's own word (set at registration)."""


@dataclass(frozen=True)
class Exposure:
    """The mesh's rule. `mode` "all": every agent unless it said false; "none": no agent; "listed": the
    agents in `agents`, the agents of the scopes in `scopes`, and those that said true."""

    mode: str = "all"
    agents: frozenset[str] = frozenset()
    scopes: frozenset[str] = frozenset()

    @staticmethod
    def parse(text: str) -> Exposure:
        """`all`, `none`, or a comma list of `agent:<id>` and `scope:<id>` (listed)."""
        text = text.strip()
        if text in ("all", "none"):
            return Exposure(text)
        agents: set[str] = set()
        scopes: set[str] = set()
        for item in filter(None, (part.strip() for part in text.split(","))):
            kind, _, value = item.partition(":")
            if kind not in ("agent", "scope") or not value:
                raise errors.InvalidArgument(
                    f"--ioa-expose: {errors.clip(item, 100)!r} is not all, none, agent:<id> or scope:<id>",
                    reason=Reason.BAD_VALUE, metadata={"setting": "--ioa-expose"})
            (agents if kind == "agent" else scopes).add(value)
        if not agents and not scopes:
            raise errors.InvalidArgument("--ioa-expose: empty; all, none, or agent:<id> and scope:<id> items",
                                         reason=Reason.BAD_VALUE, metadata={"setting": "--ioa-expose"})
        return Exposure("listed", frozenset(agents), frozenset(scopes))

    def refusal(self, agent: AgentRecord) -> str | None:
        """Why a message from the IOA network may not reach this agent, or None."""
        said = agent.metadata.get(EXPOSED, "")
        if self.mode == "none":
            return f"agent {agent.agent_id} is not reachable from the IOA network (this mesh exposes no agent)"
        if said == "false":
            return f"agent {agent.agent_id} is not reachable from the IOA network (it said so at registration)"
        if self.mode == "all" or said == "true" or agent.agent_id in self.agents or agent.scope_id in self.scopes:
            return None
        return f"agent {agent.agent_id} is not reachable from the IOA network (not listed in this mesh's --ioa-expose)"
