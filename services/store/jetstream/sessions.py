"""What registers an agent on behalf of runs and routing on JetStream: a child with its run (spawn) and
the agent of a routing session. Each is several writes, every one of which can be repeated, so a retry
after a crash in between completes it."""

from __future__ import annotations

import functools

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from services.faults import crash_point
from services.store.base import AgentRecord, RunRecord, SpawnLimits
from services.store.jetstream import kv
from services.store.jetstream.agents import Agents
from services.store.jetstream.connection import JetStreamConnection
from services.store.jetstream.runs import Runs


def _claim(current: str | None, seen: str | None, agent_id: str) -> str | None:
    """The session's agent becomes `agent_id` if it is still the one seen."""
    return agent_id if current == seen else None


class Sessions:
    def __init__(self, conn: JetStreamConnection, agents: Agents, runs: Runs):
        self.conn = conn
        self.agents = agents
        self.runs = runs

    async def create_child(self, record: AgentRecord, run: RunRecord, limits: SpawnLimits, *,
                           resume: bool = False) -> AgentRecord:
        """The child's slot among its parent's active children, the agent,
        then its run: every step can be repeated, so a retry after a crash
        in between (resume) completes it."""
        if record.depth > limits.max_depth:
            raise errors.ResourceExhausted(
                f"spawn refused: {record.name!r} would be at depth {record.depth}; the most is {limits.max_depth}",
                reason=Reason.SPAWN_DEPTH, metadata={"depth": str(record.depth), "max_depth": str(limits.max_depth)})
        active = await self.runs.take_slot(record, limits.max_active_children)
        if active is not None:
            raise errors.ResourceExhausted(
                f"spawn refused: {record.parent_id} already has {active} running children; the most is"
                f" {limits.max_active_children} (wait for one to finish)",
                reason=Reason.TOO_MANY_CHILDREN, metadata={"active": str(active),
                                                      "max": str(limits.max_active_children)})
        if not resume:
            try:
                await self.agents.create(record)
            except BaseException:
                await self.runs.release_slot(record.parent_id, record.agent_id)
                raise
            crash_point("child-stored")  # the agent is stored, its run not yet
        await self.runs.create(run)
        return record

    async def session_agent(self, session_key: str, new_agent: AgentRecord) -> tuple[AgentRecord, bool]:
        key = f"session.{kv.token(session_key)}"
        registered = False
        for _ in range(kv.MAX_CAS_TRIES):
            found = await kv.get(self.conn.misc, key, kv.JSON)
            current = found.value if found else None
            if current:
                agent = await self.agents.get(current)
                if agent is not None and agent.is_open:
                    if registered:  # another process's agent won the session
                        await self.agents.close(new_agent.agent_id, "lost a race for its session",
                                                new_agent.created_at_us)
                    return agent, False
            if not registered:  # no agent yet, or a closed one: the session starts anew
                await self.agents.create(new_agent)
                registered = True
            claim = functools.partial(_claim, seen=current, agent_id=new_agent.agent_id)
            if await kv.cas(self.conn.misc, key, claim, kv.JSON):
                return new_agent, True
        raise errors.Unavailable(f"too much contention on session {session_key}", reason=Reason.CONTENTION)
