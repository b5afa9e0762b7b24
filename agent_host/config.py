"""Configuration of an agent host. Frozen dataclasses; environment reading
lives in agent_host.settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

KEEP_UNTIL_CLOSED = "until_closed"
CLOSE_ON_COMPLETE = "close_on_complete"
IDLE_TIMEOUT = "idle_timeout"
KEEP_ALIVE_POLICIES = (KEEP_UNTIL_CLOSED, CLOSE_ON_COMPLETE, IDLE_TIMEOUT)


@dataclass(frozen=True)
class Budget:
    """Limits of one top-level task (the whole tree of agents working on it)."""

    max_model_requests: int = 200
    """Model requests in all, failed ones that were retried included."""
    max_wall_time_s: float = 600.0
    """From the task's start until its result."""
    max_output_tokens: int = 512
    """Per model request."""
    max_requests_per_reply: int = 3
    """Attempts for one model reply (retries of failed requests), within the total."""
    max_turns_per_agent: int = 50
    """Turns one agent may take (guards against an agent looping)."""


@dataclass(frozen=True)
class HostConfig:
    mesh_address: str
    """host:port of the mesh (Registry, Inbox and Events)."""
    tls: grpc.ChannelCredentials | None = None
    """Connect with TLS (inboxmesh.client.mesh.tls_credentials); plaintext when None."""
    data_dir: Path = Path(".inboxmesh/host")
    """Where the host keeps its agents and their conversations (host.db)."""
    keep_alive: str = KEEP_UNTIL_CLOSED
    """What a child does after finishing its task: until_closed (keeps
    receiving until it or an ancestor is closed), close_on_complete, or
    idle_timeout (closes after `idle_timeout_s` without messages)."""
    idle_timeout_s: float = 60.0
    max_in_flight: int = 64
    """Delivered-but-unconsumed messages per agent (the pending bound; 0 = the mesh's default, 256)."""
    agents_per_inbox_stream: int = 10_000
    """Agents one inbox stream carries; the host opens another past it (agent_host/inbox_hub.py). A
    reconnect writes one subscribe with every credential of the stream: 10,000 are about 1 MB, well
    within the mesh's request limit."""
    child_inbox_capacity: int = 0
    """Inbox capacity of spawned agents (0 = the mesh default)."""
    budget: Budget = field(default_factory=Budget)
    call_timeout_s: float = 10.0
    """Deadline of each call to the mesh."""
    yield_after_send: bool = False
    """End a run after a turn that sent a message (send_message): the agent
    then waits for the answer instead of going on (helps small models)."""
    restate_task: bool = False
    """End every injected user turn with the agent's task, so the newest
    work and the task sit together (helps small models)."""
    show_ids: bool = True
    """Show agent ids in system prompts and message headers. Small models
    tend to invent ids when they see some; names are enough for them."""
    team_targets: bool = False
    """Offer send_message's `to` as a choice (a JSON-schema enum) of the
    names of the agent's siblings and children on this host: a small model
    cannot invent a name or message its parent, which hears from it through
    finish (the run's announce)."""
    route_via_ioa: bool = False
    """Send every message between agents through the mesh's IOA relay
    (to the recipient's IOA address) instead of directly."""
    min_task_words: int = 0
    """A subagent task of fewer words (0: any) is a label ("send_code") where the child needs its whole task:
    spawn_agent completes it with what the agent's own task says about that subagent, or refuses it when that
    says nothing (agent_host/tools.py spawn_agent)."""
    refuse_own_task: bool = False
    """spawn_agent refuses a subagent task that holds the agent's own whole task (the subagent would do all
    of it again, and learn every fact meant for its siblings): a small model gave one child the plain task
    it had itself been given (docs/real-llm.md)."""
    max_messages_per_peer: int = 0
    """send_message and reply refuse a message to an agent that already has this many from this agent since
    a third party last wrote to it (0: no limit): a per-pair ping-pong limit, as OpenClaw's
    maxPingPongTurns. Two small models thanked and welcomed each other for the rest of the budget (20
    messages, docs/real-llm.md), which the mesh's loop guard, counting visits per causal chain, let through."""
    spawn_while_children_work: bool = True
    """Offer spawn_agent in a turn that begins while a child of the agent is still at its task (False: only
    in a turn that begins with none working; a spawn of several children in one answer is unaffected). A
    small model's lead, woken by one child's report while the other worked, spawned that child again every
    turn, or new helpers that echoed messages with it, until its turn limit (docs/real-llm.md)."""
    quiet_wake_s: float = 0.0
    """When every agent of a task tree on this host (the runners on one budget) has been idle this long
    (seconds; 0: never) with nothing pending, none of them consuming a message meanwhile, and no message any
    of them sent waiting for an answer, nothing will ever wake them: each subagent whose task is open and
    whose own subagents have all finished is woken once (AGENT_WOKEN with the note), told that no message is
    on its way and to finish with its report. Once per quiet spell: it is not woken again until a message is
    consumed in the tree. A small model's B answered A and then waited, with its task open, while A and the
    lead waited for its report (docs/real-llm.md)."""
    offer_ioa_addresses: bool = False
    """Tell models that send_message takes IOA addresses (ioa:<node>/<agent>): only for a mesh with an IOA
    relay (route_via_ioa implies it); elsewhere a model offered them invents some."""
