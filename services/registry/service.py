"""Registry rules: registering agents into trees, finding and closing them.
Knows nothing of gRPC."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.registry.v1 import registry_pb2 as pb
from services import auth
from services.clock import now_us
from services.config import InboxLimits
from services.directory import Caller, Directory
from services.runs.service import CloseAgent, RunService
from services.store.base import AGENT_OPEN, AgentRecord, AgentStore, CloseOutcome, EventStore, RunStore
from services.validation import check_map, check_text, fitting, page_size

log = logging.getLogger(__name__)
CHILD_MODES = (pb.AGENT_MODE_SYNC, pb.AGENT_MODE_ASYNC, pb.AGENT_MODE_FORK)
MAX_CHILDREN_PER_CALL = 1_000
"""Entries of one RegisterChildren call at most (INVALID_ARGUMENT / BATCH_TOO_LARGE beyond)."""
Registered = tuple[AgentRecord, str, str]
"""(agent, credential, run_id)."""


class AgentCloser:
    """Closes an agent and its descendants as the mesh, without a caller's permission check: the registry
    calls it once it has checked the caller's, a run's cleanup (the mesh's own rule) directly. It stands
    apart from RegistryService so that RunService can close agents without holding the registry, which
    holds RunService (the registry <-> runs cycle, broken by this order: closer -> runs -> registry)."""

    def __init__(self, store: AgentStore, directory: Directory, listeners: Sequence[Callable[[CloseOutcome], None]]):
        self._store = store
        self._directory = directory
        self._listeners = tuple(listeners)
        """Told after every close, in order (the delivery hub ends the closed agents' subscriptions)."""

    async def close(self, agent_id: str, reason: str) -> CloseOutcome:
        outcome = await self._store.close_agent(agent_id, reason, now_us())
        self._directory.note_closed(outcome.closed)
        for record in outcome.closed:
            log.info("closed agent %s (%s)", record.agent_id, record.close_reason)
        if outcome.dead_lettered:
            log.info("dead-lettered %d queued messages of closed agents", len(outcome.dead_lettered))
        for listener in self._listeners:
            listener(outcome)
        return outcome


class RegistryService:
    def __init__(self, agents: AgentStore, runs_store: RunStore, events: EventStore, directory: Directory,
                 limits: InboxLimits, runs: RunService, close_agent: CloseAgent, bind_credentials: bool = False):
        self._agents = agents
        self._runs_store = runs_store
        self._events = events
        self._directory = directory
        self._limits = limits
        self._runs = runs
        """Children are registered with their runs; a close may end runs, which it then announces."""
        self._close_agent = close_agent
        self._bind = bind_credentials
        """Agents registered from a certified connection are bound to it (auth.BOUND_TO)."""

    async def register(
        self,
        caller: Caller | None,
        *,
        name: str,
        mode: int,
        parent_id: str,
        metadata: dict[str, str],
        inbox_capacity: int,
        run: pb.RunSpec | None = None,
        request_id: str = "",
        peer: str = "",
    ) -> tuple[AgentRecord, str, str]:
        """Returns (agent, credential, run_id). `peer`: the identity the registering connection's client
        certificate proves; with binding on, the agent's credential works only where it is proven again."""
        check_text("name", name, max_len=128, required=True)
        check_text("request_id", request_id, max_len=128)
        if request_id and len(request_id) < 16:
            raise errors.InvalidArgument(
                f"request_id has {len(request_id)} characters; at least 16 (it is the secret the credential is"
                " derived from: use a random value such as a uuid4)", reason=Reason.REQUEST_ID_TOO_SHORT)
        check_map("metadata", metadata)
        if mode not in pb.AgentMode.values():
            raise errors.InvalidArgument(
                f"unknown mode {mode}; one of {', '.join(pb.AgentMode.keys())}", reason=Reason.BAD_MODE,
                metadata={"field": "mode"})
        if inbox_capacity > self._limits.max_capacity:
            raise errors.InvalidArgument(
                f"inbox_capacity {inbox_capacity} is above the mesh maximum {self._limits.max_capacity}",
                reason=Reason.CAPACITY_TOO_LARGE,
            )
        if parent_id:
            if caller is None:
                raise errors.Unauthenticated(
                    f"registering a child of {parent_id} needs the parent's credential",
                    reason=Reason.MISSING_CREDENTIAL)
            if caller.agent is None or caller.agent.agent_id != parent_id:
                raise errors.PermissionDenied(
                    f"only agent {parent_id} itself may register its children; the credential is {caller}'s",
                    reason=Reason.NOT_PARENT,
                    metadata={"parent_id": parent_id},
                )
            if mode not in CHILD_MODES:
                raise errors.InvalidArgument(
                    f"a child needs mode SYNC, ASYNC or FORK, not {pb.AgentMode.Name(mode)}", reason=Reason.BAD_MODE
                )
            parent = caller.agent
            scope_id, depth = parent.scope_id, parent.depth + 1
        else:
            if mode not in (pb.AGENT_MODE_UNSPECIFIED, pb.AGENT_MODE_MAIN):
                raise errors.InvalidArgument(
                    f"a top-level agent has mode MAIN; {pb.AgentMode.Name(mode)} needs a parent_id",
                    reason=Reason.BAD_MODE)
            mode, scope_id, depth = pb.AGENT_MODE_MAIN, "", 0
        if request_id:
            agent_id = auth.agent_id_for(parent_id, request_id)
            credential = auth.credential_for(agent_id, request_id)
            existing = await self._agents.get_agent(agent_id)
            if existing is not None:
                return await self._registered_before(existing, credential, name, parent_id, run)
        else:
            agent_id = auth.new_agent_id()
            credential = auth.new_credential(agent_id)
        record = AgentRecord(
            agent_id=agent_id,
            name=name,
            mode=mode,
            parent_id=parent_id,
            scope_id=scope_id or agent_id,
            depth=depth,
            state=AGENT_OPEN,
            metadata={**{k: v for k, v in metadata.items() if k != auth.BOUND_TO},
                      **({auth.BOUND_TO: peer} if self._bind and peer else {})},
            inbox_capacity=inbox_capacity or self._limits.default_capacity,
            created_at_us=now_us(),
            credential_hash=auth.credential_hash(credential),
        )
        run_id = ""
        if parent_id:
            run_record, child_metadata = self._runs.new_run(parent, record, run or pb.RunSpec(),
                                                            idempotent=bool(request_id))
            record = replace(record, metadata=child_metadata)
            try:
                await self._runs_store.create_child(record, run_record, self._runs.limits_for(parent))
            except errors.ResourceExhausted as exc:
                await self._events.record_events([ev.Event(
                    at_us=now_us(), kind=ev.EVENT_KIND_LIMIT_REFUSED, agent_id=parent_id, sender=parent_id,
                    detail=f"{exc.reason}: {exc.message}")])
                log.info("spawn of %r by %s refused: %s", name, parent_id, exc.message)
                raise
            run_id = run_record.run_id
        else:
            if run is not None and run.ByteSize():
                raise errors.InvalidArgument("run is only for children (give parent_id)",
                                             reason=Reason.RUN_WITHOUT_PARENT)
            await self._agents.create_agent(record)
        self._directory.remember(record)
        log.info(
            "registered agent %s name=%r mode=%s parent=%s scope=%s%s",
            agent_id, name, pb.AgentMode.Name(mode), parent_id or "-", record.scope_id,
            f" run={run_id}" if run_id else "",
        )
        return record, credential, run_id

    async def register_children(self, caller: Caller, children: Sequence[pb.RegisterAgentRequest], peer: str = ""
                                ) -> list[Registered | errors.MeshError]:
        """Many children of the calling agent, each registered as `register` registers one (in order, so
        limits refuse the later ones) and stored together: the writes of every entry are queued before the
        store commits. One result per entry: what it was registered as, or its own refusal."""
        parent = caller.require_agent("registering children")
        if not children:
            raise errors.InvalidArgument("the request holds no children", reason=Reason.MISSING_FIELD,
                                         metadata={"field": "children"})
        if len(children) > MAX_CHILDREN_PER_CALL:
            raise errors.InvalidArgument(f"{len(children)} children in one request; at most {MAX_CHILDREN_PER_CALL}",
                                         reason=Reason.BATCH_TOO_LARGE, metadata={"limit": str(MAX_CHILDREN_PER_CALL)})

        async def one(child: pb.RegisterAgentRequest) -> Registered | errors.MeshError:
            try:
                return await self.register(
                    caller, name=child.name, mode=child.mode or pb.AGENT_MODE_ASYNC,
                    parent_id=child.parent_id or parent.agent_id, metadata=dict(child.metadata),
                    inbox_capacity=child.inbox_capacity, run=child.run if child.HasField("run") else None,
                    request_id=child.request_id, peer=peer)
            except errors.MeshError as exc:
                return exc

        return list(await asyncio.gather(*(one(child) for child in children)))

    async def _registered_before(self, existing: AgentRecord, credential: str, name: str, parent_id: str,
                                 run: pb.RunSpec | None) -> tuple[AgentRecord, str, str]:
        """A retry of a registration that was stored (its answer was lost):
        the same agent, credential and run. A first attempt that stopped
        between the agent and its run record (JetStream: two writes) gets
        its run now."""
        agent_id = existing.agent_id
        if existing.name != name or existing.parent_id != parent_id \
                or not auth.hashes_match(credential, existing.credential_hash):
            raise errors.FailedPrecondition(
                f"request_id was used before to register {existing.name!r} ({agent_id}), not this registration;"
                " use a new request_id for a new agent", reason=Reason.REQUEST_ID_REUSED,
                metadata={"agent_id": agent_id})
        if not existing.is_open:
            raise errors.FailedPrecondition(
                f"this registration was made before, and agent {agent_id} is closed since ({existing.close_reason})",
                reason=Reason.AGENT_CLOSED, metadata={"agent_id": agent_id})
        run_id = ""
        if parent_id:
            found = await self._runs_store.get_run(child_id=agent_id)
            if found is None:
                parent = await self._directory.fresh(parent_id)
                run_record, _ = self._runs.new_run(parent, existing, run or pb.RunSpec(), idempotent=True)
                await self._runs_store.create_child(existing, run_record, self._runs.limits_for(parent),
                                                    resume=True)
                found = run_record
            run_id = found.run_id
        self._directory.remember(existing)
        log.info("registration of %s (%r) repeated: the same agent again", agent_id, name)
        return existing, credential, run_id

    async def get(self, caller: Caller, agent_id: str) -> AgentRecord:
        check_text("agent_id", agent_id, max_len=128, required=True)
        record = await self._directory.fresh(agent_id)
        self._directory.check_reach(caller, record, "read")
        return record

    async def resolve(self, caller: Caller, name: str, scope_id: str, include_closed: bool) -> AgentRecord:
        check_text("name", name, max_len=128, required=True)
        scope_id = await self._scope_for(caller, scope_id)
        found = await self._agents.find_agents(scope_id, name, include_closed)
        if not found:
            raise errors.NotFound(
                f"no {'' if include_closed else 'open '}agent named {name!r} in scope {scope_id}",
                reason=Reason.NAME_NOT_FOUND,
                metadata={"name": name, "scope_id": scope_id},
            )
        if len(found) > 1:
            ids = [a.agent_id for a in found]
            raise errors.FailedPrecondition(
                f"name {name!r} is ambiguous in scope {scope_id}: {len(ids)} agents ({', '.join(ids)});"
                " address one by agent_id",
                reason=Reason.AMBIGUOUS_NAME,
                metadata={"name": name, "candidates": ",".join(ids)},
            )
        return found[0]

    async def list(
        self, caller: Caller, *, scope_id: str, parent_id: str, include_closed: bool, size: int, page_token: str
    ) -> tuple[list[AgentRecord], str]:
        if scope_id and parent_id:
            raise errors.InvalidArgument("give scope_id or parent_id, not both", reason=Reason.CONFLICTING_FIELDS)
        limit = page_size(size)
        if parent_id:
            parent = await self._directory.require(parent_id)
            self._directory.check_reach(caller, parent, "list the children of")
            found = await self._agents.list_agents(
                parent_id=parent_id, include_closed=include_closed, after_key=page_token, limit=limit
            )
        else:
            scope_id = await self._scope_for(caller, scope_id)
            found = await self._agents.list_agents(
                scope_id=scope_id, include_closed=include_closed, after_key=page_token, limit=limit
            )
        fit = fitting(_agent_bytes(a) for a in found)
        if fit < len(found):  # cut by bytes: the next page starts after the last agent shown
            return found[:fit], found[fit - 1].agent_id
        return found, (found[-1].agent_id if len(found) == limit else "")

    async def close(self, caller: Caller, agent_id: str, reason: str) -> CloseOutcome:
        check_text("agent_id", agent_id, max_len=128, required=True)
        check_text("reason", reason, max_len=1024)
        target = await self._directory.require(agent_id)
        if not await self._directory.is_self_or_ancestor(caller, target):
            raise errors.PermissionDenied(
                f"{caller} may not close {agent_id}: only the agent itself or an ancestor may",
                reason=Reason.NOT_ANCESTOR,
                metadata={"agent_id": agent_id},
            )
        outcome = await self._close_agent(agent_id, reason or "closed")
        self._runs.on_closed(outcome)  # closed children ended their runs (CLOSED): to be announced
        return outcome

    async def _scope_for(self, caller: Caller, scope_id: str) -> str:
        if not scope_id:
            return caller.require_agent("naming no scope").scope_id
        root = await self._directory.require(scope_id)
        if root.scope_id != scope_id:
            raise errors.InvalidArgument(
                f"{scope_id} is not a scope: scopes are named by their top-level agent ({root.scope_id})",
                reason=Reason.NOT_A_SCOPE,
            )
        self._directory.check_reach(caller, root, "look into scope")
        return scope_id


def _agent_bytes(agent: AgentRecord) -> int:
    """About the size of the Agent message (ids, name, reason and metadata dominate)."""
    return 256 + len(agent.name) + len(agent.close_reason) + sum(len(k) + len(v) + 8 for k, v in agent.metadata.items())
