"""Who is calling, and what they may touch.

A cache of agent records in front of the store, used for facts that never
change after registration (parent, scope, credential hash). Anything that
does change (open/closed) is decided again inside the store's transaction,
so a stale cache can never let a send through to a closed agent.
"""

from __future__ import annotations

from dataclasses import dataclass

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from services import auth
from services.store.base import AgentRecord, AgentStore

_MAX_CACHED = 100_000


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: an agent, or an operator with the admin token."""

    agent: AgentRecord | None

    @property
    def is_admin(self) -> bool:
        return self.agent is None

    def require_agent(self, action: str) -> AgentRecord:
        if self.agent is None:
            raise errors.PermissionDenied(
                f"{action} needs an agent's credential; the admin token cannot act as an agent",
                reason=Reason.AGENT_CREDENTIAL_REQUIRED,
            )
        return self.agent

    def __str__(self) -> str:
        return "admin" if self.agent is None else self.agent.agent_id


class Directory:
    def __init__(self, store: AgentStore, *, admin_token: str | None, allow_cross_scope: bool):
        self._store = store
        self._admin_token = admin_token
        self.allow_cross_scope = allow_cross_scope
        self._agents: dict[str, AgentRecord] = {}
        self._verified: dict[str, str] = {}

    # -- records ------------------------------------------------------------
    async def get(self, agent_id: str) -> AgentRecord | None:
        """The agent's record; its `state` may be stale (see module doc)."""
        record = self._agents.get(agent_id)
        if record is None:
            record = await self._store.get_agent(agent_id)
            if record is not None:
                self.remember(record)
        return record

    async def require(self, agent_id: str) -> AgentRecord:
        record = await self.get(agent_id)
        if record is None:
            raise errors.NotFound(f"no agent {agent_id!r}", reason=Reason.AGENT_NOT_FOUND,
                                  metadata={"agent_id": agent_id})
        return record

    async def fresh(self, agent_id: str) -> AgentRecord:
        """The record as stored now (state included)."""
        record = await self._store.get_agent(agent_id)
        if record is None:
            raise errors.NotFound(f"no agent {agent_id!r}", reason=Reason.AGENT_NOT_FOUND,
                                  metadata={"agent_id": agent_id})
        self.remember(record)
        return record

    def remember(self, record: AgentRecord) -> None:
        if len(self._agents) >= _MAX_CACHED:
            self._agents.pop(next(iter(self._agents)))
        self._agents[record.agent_id] = record

    def credential_changed(self, record: AgentRecord) -> None:
        """The agent has a new credential: earlier ones stop working here."""
        self._verified = {c: a for c, a in self._verified.items() if a != record.agent_id}
        self.remember(record)

    def note_closed(self, records: list[AgentRecord]) -> None:
        for record in records:
            if record.agent_id in self._agents:
                self._agents[record.agent_id] = record

    # -- authentication -----------------------------------------------------
    async def authenticate(self, credential: str | None, *, allow_anonymous: bool = False) -> Caller | None:
        """The caller a bearer credential proves, or an error naming why not."""
        if not credential:
            if allow_anonymous:
                return None
            raise errors.Unauthenticated(
                "no credential: send gRPC metadata 'authorization: Bearer <credential>' with the credential"
                " RegisterAgent returned",
                reason=Reason.MISSING_CREDENTIAL,
            )
        if self._admin_token and auth.secrets_match(credential, self._admin_token):
            return Caller(agent=None)
        agent_id = self._verified.get(credential)
        if agent_id is not None:
            record = await self.get(agent_id)
            if record is not None:
                return Caller(agent=record)
        agent_id = auth.agent_id_of(credential)
        record = await self.get(agent_id)
        if record is not None and not auth.hashes_match(credential, record.credential_hash):
            record = await self._store.get_agent(agent_id)  # replaced since it was cached (by another replica)?
            if record is not None:
                self.remember(record)
        if record is None or not auth.hashes_match(credential, record.credential_hash):
            raise errors.Unauthenticated(
                f"credential for {agent_id!r} is not valid", reason=Reason.BAD_CREDENTIAL,
                metadata={"agent_id": agent_id})
        if len(self._verified) >= _MAX_CACHED:
            self._verified.pop(next(iter(self._verified)))
        self._verified[credential] = agent_id
        return Caller(agent=record)

    # -- authorisation ------------------------------------------------------
    def in_reach(self, caller: Caller, target: AgentRecord) -> bool:
        """Whether caller may see or address target (same tree, or allowed)."""
        if caller.agent is None or self.allow_cross_scope:
            return True
        return caller.agent.scope_id == target.scope_id

    def check_reach(self, caller: Caller, target: AgentRecord, action: str) -> None:
        if not self.in_reach(caller, target):
            raise errors.PermissionDenied(
                f"{caller} may not {action} {target.agent_id}: it is outside the caller's scope"
                f" ({target.scope_id} vs {caller.agent.scope_id if caller.agent else '-'})",
                reason=Reason.OUT_OF_SCOPE,
                metadata={"agent_id": target.agent_id},
            )

    async def is_self_or_ancestor(self, caller: Caller, target: AgentRecord) -> bool:
        if caller.agent is None:
            return True
        node: AgentRecord | None = target
        while node is not None:
            if node.agent_id == caller.agent.agent_id:
                return True
            node = await self.get(node.parent_id) if node.parent_id else None
        return False
