"""What an agent host keeps on disk so that a restarted host resumes its
agents: who they are (with their credentials), where their task stands,
and their conversations. One SQLite file per host (host.db)."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass
from pathlib import Path

from agent_host.conversation import Conversation

SCHEMA = """
CREATE TABLE IF NOT EXISTS agents (
    agent_id TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS conversations (
    agent_id TEXT PRIMARY KEY,
    messages TEXT NOT NULL,
    injected TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS marks (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
"""


@dataclass
class HostedAgent:
    """A hosted agent as the host remembers it (the mesh's own record of an agent is
    services.store's AgentRecord)."""

    agent_id: str
    name: str
    credential: str
    mode: str
    """main, sync, async or fork."""
    parent_id: str = ""
    role: str = ""
    """The policy or model role this agent runs with (hosts map it back to a model)."""
    task_message_id: str = ""
    """The TASK message this agent works on (empty for a top-level agent)."""
    task_text: str = ""
    conversation_id: str = ""
    run_id: str = ""
    """The mesh's run record of this child (inboxmesh.runs.v1); its result is announced through it."""
    keep_alive: str = "until_closed"
    turn: int = 0
    spawned: int = 0
    """Children this agent has started."""
    running: bool = False
    """A run was in progress (a restarted host starts a new one)."""
    completed: bool = False
    result: str = ""
    closed: bool = False
    tools: tuple[str, ...] = ()
    depth: int = 0
    """0 for a top-level agent, its parent's + 1 for a child."""
    config_id: str = ""
    """The configured agent (the routing config's agents.list id) it runs as; empty: the host's own profile."""
    models: tuple[str, ...] = ()
    """Model references it was given at spawn (its parent's subagents.model, then fallbacks); empty: its
    configured agent's."""


class HostStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(path), isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.executescript(SCHEMA)

    def save(self, record: HostedAgent, conversation: Conversation | None = None) -> None:
        with self._conn:
            self._conn.execute("INSERT OR REPLACE INTO agents VALUES (?, ?)",
                               (record.agent_id, json.dumps(asdict(record))))
            if conversation is not None:
                self._conn.execute("INSERT OR REPLACE INTO conversations VALUES (?, ?, ?)",
                                   (record.agent_id, json.dumps(conversation.messages),
                                    json.dumps(sorted(conversation.injected))))

    def load_open(self) -> list[tuple[HostedAgent, Conversation]]:
        found = []
        rows = self._conn.execute(
            "SELECT a.record, c.messages, c.injected FROM agents a LEFT JOIN conversations c USING (agent_id)"
            " ORDER BY a.rowid").fetchall()
        for record_json, messages, injected in rows:
            data = json.loads(record_json)
            data["tools"] = tuple(data.get("tools", ()))
            data["models"] = tuple(data.get("models", ()))
            record = HostedAgent(**data)
            if record.closed:
                continue
            conversation = Conversation(messages=json.loads(messages or "[]"),
                                        injected=set(json.loads(injected or "[]")))
            found.append((record, conversation))
        return found

    def mark(self, name: str) -> int:
        """A position the host keeps (such as the last event of the mesh's record it handled); 0 at first."""
        row = self._conn.execute("SELECT value FROM marks WHERE name = ?", (name,)).fetchone()
        return int(row[0]) if row else 0

    def set_mark(self, name: str, value: int) -> None:
        with self._conn:
            self._conn.execute("INSERT OR REPLACE INTO marks VALUES (?, ?)", (name, value))

    def close(self) -> None:
        self._conn.close()
