"""What the web view keeps in memory: every agent's live state and inbox depth, and the newest events, folded
from the event record as it is written (one in-process watch of the whole record, from its first event).

The page folds the same events by the same rules (static/app.js `fold`), starting from a snapshot of this
board taken at one event id and then following the live stream after that id; so the rules here and there
must agree (tests/test_webview.py compares both with the record).
"""

from __future__ import annotations

import collections
import logging
import re
from dataclasses import dataclass
from typing import Any

from inboxmesh.events.v1 import events_pb2 as ev

log = logging.getLogger(__name__)

K = ev.EventKind

LIVE_STATES: dict[int, str] = {
    K.EVENT_KIND_AGENT_WOKEN: "running",
    K.EVENT_KIND_TURN_STARTED: "running",
    K.EVENT_KIND_RUN_STARTED: "running",
    K.EVENT_KIND_AGENT_IDLE: "idle",
    K.EVENT_KIND_TASK_FAILED: "failed",
    K.EVENT_KIND_RUN_CANCELLED: "cancelled",
}
"""The state a runtime event puts its agent in (an agent no host has reported on is "registered"; a closed
one is "closed" whatever comes after)."""

DEPTH_UP = frozenset({K.EVENT_KIND_MESSAGE_STORED})
DEPTH_DOWN = frozenset({K.EVENT_KIND_MESSAGE_CONSUMED, K.EVENT_KIND_MESSAGE_DEAD_LETTERED})
"""An inbox's depth: messages stored in it, less those consumed or dead-lettered (each event's agent_id is
the inbox's agent)."""

_REGISTERED = re.compile(r"^name=(?P<name>.*) mode=(?P<mode>\d+) scope=(?P<scope>\S*)$")
"""The detail of an AGENT_REGISTERED event (both stores write it so)."""


def kind_name(kind: int) -> str:
    """"message_stored" for EVENT_KIND_MESSAGE_STORED; the number for a kind this build does not know."""
    return K.Name(kind).removeprefix("EVENT_KIND_").lower() if kind in K.values() else str(kind)


def event_json(event: ev.Event) -> dict[str, Any]:
    """An event as the page gets it (the proto's fields, the kind by name; `id` is the event id)."""
    return {"id": event.event_id, "at_us": event.at_us, "kind": kind_name(event.kind), "agent_id": event.agent_id,
            "message_id": event.message_id, "sender": event.sender, "recipient": event.recipient,
            "sequence": event.sequence, "detail": event.detail, "trace_id": event.trace_id, "turn": event.turn,
            "in_reply_to": event.in_reply_to, "conversation_id": event.conversation_id}


@dataclass
class LiveAgent:
    """What the record says of one agent so far."""

    parent_id: str = ""
    scope_id: str = ""
    state: str = "registered"
    done: bool = False
    """It completed a task (TASK_COMPLETED); its state goes on (idle, running again)."""
    depth: int = 0


class Board:
    """The fold of the record up to `last_event_id`. Bounded: at most `tracked_agents` agents (later ones are
    counted in `untracked` and have no live state here) and the newest `recent_events` events."""

    def __init__(self, recent_events: int, tracked_agents: int):
        self.agents: dict[str, LiveAgent] = {}
        self.scopes: dict[str, None] = {}
        """The top-level agents (roots of their scopes), in registration order."""
        self.recent: collections.deque[ev.Event] = collections.deque(maxlen=recent_events)
        """The newest events as they came (made into JSON only when a snapshot asks: most never are)."""
        self.last_event_id = 0
        self.untracked = 0
        self._tracked_agents = tracked_agents

    def _agent(self, agent_id: str) -> LiveAgent | None:
        agent = self.agents.get(agent_id)
        if agent is None and agent_id and not agent_id.startswith(("ioa:", "channel:")):
            if len(self.agents) >= self._tracked_agents:
                self.untracked += 1
                return None
            agent = self.agents[agent_id] = LiveAgent()
        return agent

    def fold(self, events: list[ev.Event]) -> None:
        for event in events:
            self._fold_one(event)
            self.recent.append(event)
            self.last_event_id = event.event_id

    def _fold_one(self, event: ev.Event) -> None:
        kind = event.kind
        if kind == K.EVENT_KIND_AGENT_REGISTERED:
            agent = self._agent(event.agent_id)
            found = _REGISTERED.match(event.detail)
            if agent is not None:
                agent.parent_id = event.sender
                agent.scope_id = found.group("scope") if found else ""
            if not event.sender:
                self.scopes[event.agent_id] = None
            return
        agent = self._agent(event.agent_id) if (kind in LIVE_STATES or kind in DEPTH_UP or kind in DEPTH_DOWN
                                                or kind in (K.EVENT_KIND_AGENT_CLOSED,
                                                            K.EVENT_KIND_TASK_COMPLETED)) else None
        if agent is None:
            return
        if kind == K.EVENT_KIND_AGENT_CLOSED:
            agent.state = "closed"
        elif kind == K.EVENT_KIND_TASK_COMPLETED:
            agent.done = True
        elif kind in LIVE_STATES and agent.state != "closed":
            agent.state = LIVE_STATES[kind]
        elif kind in DEPTH_UP:
            agent.depth += 1
        elif kind in DEPTH_DOWN:
            agent.depth = max(0, agent.depth - 1)
