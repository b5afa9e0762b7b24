"""What an agent's runner (agent_host/runner.py) and the tools its model calls (agent_host/tools.py)
need from the world around them, stated once:

- `AgentHost`: the host the runner runs in (`agent_host.host.Host` implements it);
- `AgentCalls`: the mesh calls made as the agent (`inboxmesh.client.AgentHandle` implements it);
- `Inbox`: the agent's inbox: its part of the host's inbox stream (`agent_host.inbox_hub.AgentInbox`
  implements it; so does an `inboxmesh.client.InboxStream` of the agent alone).

They are typing.Protocols: the real classes fit them by their shape, and tests/test_runner.py runs a
runner on small in-memory ones, without a mesh or a host. A tool gets a ToolContext
(agent_host/tools.py) built from them and the agent's AgentActions (agent_host/actions.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from agent_host.budget import TaskBudget
from agent_host.conversation import Conversation
from agent_host.hoststore import HostedAgent
from inboxmesh.client.stream import StreamItem
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.ioa.v1 import relay_pb2
from inboxmesh.registry.v1 import registry_pb2 as reg
from inboxmesh.runs.v1 import runs_pb2


@dataclass(frozen=True)
class Team:
    """An agent's relatives hosted on the same host, open ones only."""

    children: tuple[HostedAgent, ...] = ()
    siblings: tuple[HostedAgent, ...] = ()
    """The other children of its parent (none for a top-level agent)."""


class AgentHost(Protocol):
    """What a runner needs from its host: one implementation per host process (Host), shared by all
    the agents it runs."""

    # -- what happened: the live log and the host's own memory -------------------------------------
    def observe(self, agent: HostedAgent, kind: str, detail: str) -> None:
        """One line of the host's live log about `agent` (a HostEvent for the host's observers). The
        mesh's event record is written by the runner itself (AgentCalls.record_events)."""
        ...

    def save(self, agent: HostedAgent, conversation: Conversation) -> None:
        """Keep the agent's record and conversation (host.db), so that a restarted host resumes it
        from here."""
        ...

    # -- names and addresses ------------------------------------------------------------------------
    async def name_of(self, agent_id: str) -> str:
        """The display name of an agent id or IOA address, for the conversation and the live log (the
        id itself when the mesh does not know it)."""
        ...

    async def address_for(self, sender: AgentCalls, to: str) -> str:
        """Where `sender`'s message to the agent `to` goes: `to` itself, or (route_via_ioa) its IOA
        address. A mesh without an IOA relay is FailedPrecondition NO_RELAY."""
        ...

    # -- the agent's team on this host ----------------------------------------------------------------
    def runners_on(self, budget: TaskBudget) -> list[Any]:
        """The runners (AgentRunner) of the agents working on `budget`, this one's included."""
        ...

    def team(self, agent: HostedAgent) -> Team:
        """The agent's open children and siblings hosted here."""
        ...

    async def start_child(self, parent: HostedAgent, *, name: str, task: str, mode: str,
                          history: list[dict[str, Any]], budget: TaskBudget, config_id: str = "") -> HostedAgent:
        """Register a child of `parent` (mode sync, async or fork) with its run in the mesh (running as the
        configured agent `config_id`, default the parent's), as
        `parent`, count it in `parent.spawned`, and host it: its conversation is its own system prompt
        and then `history`, it shares `budget`, and its inbox is subscribed when this returns (before
        its task is sent). Returns the child's record (its task_message_id and conversation_id are
        the ones its task must carry). The mesh's refusals raise MeshError."""
        ...

    # -- the end of a task, of an agent -----------------------------------------------------------------
    def task_ended(self, agent: HostedAgent, budget: TaskBudget, error: Exception | None = None) -> None:
        """The turn in which `agent` finished its task has ended (`error` None; the result is
        `agent.result`), or its run failed for good (budget or model: the whole task fails, and every
        other run on `budget` is cancelled)."""
        ...

    def close_soon(self, agent_id: str, reason: str) -> None:
        """Close the agent (and its descendants) in the mesh and stop them here, in the background: the
        keep-alive policies ask this from the agent's own runner, which cannot wait for its own stop.
        Nothing happens when this host no longer runs the agent."""
        ...

    async def release(self, agent_ids: list[str], reason: str) -> None:
        """These agents were closed in the mesh (by one of them, an ancestor, an operator): stop their
        runners here and forget them; whoever waits for their task or their completion is told."""
        ...


class AgentCalls(Protocol):
    """The mesh calls a runner and its tools make as their agent, with its credential. Failures are
    MeshError (inboxmesh.client.errors)."""

    @property
    def agent_id(self) -> str: ...

    async def send(self, recipient: str, text: str = "", **fields: Any) -> inbox_pb2.Receipt:
        """Send one message (fields as inboxmesh.client.envelope()); its receipt."""
        ...

    async def end_run(self, result: str) -> runs_pb2.EndRunResponse:
        """End this agent's run with its result; the mesh announces it to the parent, once."""
        ...

    async def record_events(self, events: list[ev.Event], timeout: float | None = None) -> None:
        """Record runtime events about this agent in the mesh's event record."""
        ...

    async def get(self, agent_id: str | None = None) -> reg.Agent:
        """An agent by id (this one by default)."""
        ...

    async def resolve(self, name: str) -> reg.Agent:
        """An open agent by name in this agent's scope (FailedPrecondition AMBIGUOUS_NAME, NotFound)."""
        ...

    async def list_agents(self, *, parent_id: str = "", include_closed: bool = False) -> list[reg.Agent]:
        """Agents of this agent's scope (the children of `parent_id` when given)."""
        ...

    async def close(self, agent_id: str | None = None, reason: str = "") -> reg.CloseAgentResponse:
        """Close an agent and its descendants; the ids closed."""
        ...

    async def map_address(self, agent_id: str) -> str:
        """The IOA address of a local agent (the mesh's IOA relay)."""
        ...

    async def space_send(self, space: str, text: str) -> relay_pb2.SpaceSendResponse:
        """Post in a shared IOA space."""
        ...

    async def space_read(self, space: str, after: int = 0) -> relay_pb2.SpaceReadResponse:
        """A shared IOA space's messages after a position."""
        ...


class Inbox(Protocol):
    """The agent's inbox: its deliveries and subscription events, and its acks."""

    def __aiter__(self) -> AsyncGenerator[StreamItem, None]:
        """Deliveries and subscription events (ATTACHED first, again after each reconnect; CLOSED or
        SUPERSEDED last), until stop()."""
        ...

    async def consume(self, agent_id: str, messages: list[env_pb.Envelope], turn: int = 0,
                      taken: set[tuple[str, str]] | None = None) -> list[env_pb.Envelope]:
        """Ack `messages` for `turn`; the ones this ack won (InboxStream.consume). Unavailable when the
        stream was lost: they come again."""
        ...

    def stop(self) -> None:
        """End the inbox here: the iteration ends and the agent is detached from the stream (what was
        delivered and not acked goes to its next subscriber)."""
        ...
