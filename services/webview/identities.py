"""Which configured agent (the routing config's `agents.list`) each agent runs as, and its `identity`, for the
web view's agent rows and lifelines (docs/routing.md, docs/webview.md).

An agent runs as the configured agent its record's metadata names (`inboxmesh-agent`, services.runs.service
AGENT_KEY): a session agent created by ingress routing, a top-level agent registered as one (`inboxmesh run
--agent`), a child spawned with `RunSpec.agent_config_id` or of such a parent (the mesh gives it its parent's).
The mesh also gives the default agent's id to a child of an agent that runs as none (for its spawn policy);
such a child runs with its host's own profile (agent_host: `config_id or parent.config_id`), so it shows none.

The identity is the routing service's current config (in process, no RPC), read when a snapshot or an event
is made: a reload that changes an identity shows from the next one on.
"""

from __future__ import annotations

from typing import Any

from services.routing.service import RoutingService
from services.runs.service import AGENT_KEY
from services.store.base import AgentRecord


class Identities:
    """The identities of agents, from the mesh's routing service (None: the mesh has no routing config)."""

    def __init__(self, routing: RoutingService | None):
        self._routing = routing

    @property
    def routed(self) -> bool:
        """Whether the mesh has a routing config (without one no agent runs as a configured agent)."""
        return self._routing is not None

    def needs_parent(self, record: AgentRecord) -> bool:
        """Whether runs_as needs `record`'s parent to decide (a child the default agent's id was given)."""
        return bool(self._routing is not None and record.parent_id
                    and record.metadata.get(AGENT_KEY, "").strip().lower() == self._routing.config.default_agent_id)

    def runs_as(self, record: AgentRecord, parent: AgentRecord | None) -> str:
        """The configured agent `record` runs as ("" for none); `parent` is its parent's record when it has one
        (None when it is not at hand: the metadata is taken as it is)."""
        named = record.metadata.get(AGENT_KEY, "").strip().lower()
        if not named or self._routing is None:
            return ""
        if record.parent_id and parent is not None and not parent.metadata.get(AGENT_KEY, "") \
                and named == self._routing.config.default_agent_id:
            return ""  # the mesh's default for a plain agent's child, not what its host runs it as
        return named

    def of(self, record: AgentRecord, parent: AgentRecord | None) -> dict[str, Any] | None:
        """`{"agent", "name", "emoji"}` of the identity of the configured agent `record` runs as; None when it
        runs as none, or as one without an identity (or one a reload removed)."""
        agent_id = self.runs_as(record, parent)
        found = self._routing.config.agent(agent_id) if agent_id and self._routing is not None else None
        if found is None:
            return None
        name, emoji = (found.identity.name or "").strip(), (found.identity.emoji or "").strip()
        return {"agent": found.id, "name": name, "emoji": emoji} if name or emoji else None
