"""What registers an agent on behalf of runs and routing on SQLite: a child with its run (spawn) and the
agent of a routing session, each in one transaction (the writer's)."""

from __future__ import annotations

import sqlite3

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from services.store.base import AgentRecord, EventRow, RunRecord, SpawnLimits
from services.store.sqlite import agents, runs


def create_child(conn: sqlite3.Connection, events: list[EventRow], record: AgentRecord, run: RunRecord,
                 limits: SpawnLimits) -> AgentRecord:
    if record.depth > limits.max_depth:
        raise errors.ResourceExhausted(
            f"spawn refused: {record.name!r} would be at depth {record.depth}; the most is {limits.max_depth}",
            reason=Reason.SPAWN_DEPTH, metadata={"depth": str(record.depth), "max_depth": str(limits.max_depth)})
    active = runs.active_children(conn, record.parent_id)
    if active >= limits.max_active_children:
        raise errors.ResourceExhausted(
            f"spawn refused: {record.parent_id} already has {active} running children; the most is"
            f" {limits.max_active_children} (wait for one to finish)",
            reason=Reason.TOO_MANY_CHILDREN, metadata={"active": str(active), "max": str(limits.max_active_children)})
    agents.create_agent(conn, events, record)
    runs.insert(conn, events, run)
    return record


def session_agent(conn: sqlite3.Connection, events: list[EventRow], session_key: str,
                  new_agent: AgentRecord) -> tuple[AgentRecord, bool]:
    row = conn.execute("SELECT agent_id FROM sessions WHERE session_key = ?", (session_key,)).fetchone()
    if row is not None:
        agent = agents.get_agent(conn, row[0])
        if agent is not None and agent.is_open:
            return agent, False
        conn.execute("DELETE FROM sessions WHERE session_key = ?", (session_key,))  # a closed session starts anew
    agents.create_agent(conn, events, new_agent)
    conn.execute("INSERT INTO sessions (session_key, agent_id) VALUES (?, ?)", (session_key, new_agent.agent_id))
    return new_agent, True
