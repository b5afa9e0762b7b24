"""The tools an agent's model can call, with their JSON schemas, and how the
host carries them out against the mesh. A tool is given a ToolContext
(below), never the runner. Every result is a JSON object the
model sees as the tool's answer; failures are {"error": ...} naming what was
wrong, never an exception into the loop.

| tool | does |
| --- | --- |
| spawn_agent(agent_name, task, mode[, agent]) | create a child (sync: returns its result; async/fork: at once) |
| send_message(to, text) | send to an agent by id or by name in this scope; returns the real receipt |
| reply(text, message_id) | answer a message this agent received (default: the newest; keeps the correlation) |
| list_agents() | this agent, its parent, children and siblings |
| close_agent(agent) | close a child (and its descendants) |
| finish(result) | complete the task: the result goes to the parent's inbox |
| wait() | end the turn; the next message wakes the agent (for models that always call a tool) |
| space_send(space, text) | post in a shared IOA space (when the mesh has an IOA relay) |
| space_read(space, after) | read a shared IOA space, explicitly |

spawn_agent's `agent` (the configured agent the child runs as) is offered only where a configured agent's
subagents.allowAgents gives a choice (agent_host/configured.py).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from agent_host.actions import NOT_ASKING, AgentActions
from agent_host.hoststore import HostedAgent
from agent_host.models.base import ToolCall
from agent_host.ports import AgentCalls, AgentHost
from inboxmesh.client import errors
from inboxmesh.client.addressing import A2A_PREFIX, IOA_PREFIX
from inboxmesh.client.errors import Reason
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.registry.v1 import registry_pb2 as reg

log = logging.getLogger(__name__)

_STRING = {"type": "string"}
SPECS: dict[str, dict[str, Any]] = {
    "spawn_agent": {
        "description": "Create a subagent with its own inbox and give it a task. mode sync waits for its result;"
                       " async returns at once (its result arrives later as a message); fork is async and starts"
                       " from a copy of your conversation.",
        "parameters": {"type": "object", "properties": {
            "agent_name": {"type": "string", "description": "A display name for the subagent."},
            "task": {"type": "string", "description": "The subagent's whole task in plain sentences, with every"
                                                       " fact it needs: it knows nothing but this."},
            "mode": {"type": "string", "enum": ["sync", "async", "fork"], "description": "Default async."},
            "agent": {"type": "string", "description": "The configured agent the subagent runs as (default: the"
                                                        " same as you)."},
        }, "required": ["agent_name", "task"]},
    },
    "send_message": {
        "description": "Send a message to another agent's inbox. `to` is an agent id or a name in your team.",
        "parameters": {"type": "object", "properties": {
            "to": {"type": "string", "description": "Agent id (agt_...) or name."},
            "text": {"type": "string", "description": "The message."},
        }, "required": ["to", "text"]},
    },
    "reply": {
        "description": "Answer a message you received; the answer goes to its sender.",
        "parameters": {"type": "object", "properties": {
            "text": {"type": "string", "description": "Your answer."},
            "message_id": {"type": "string",
                           "description": "The message_id of the message you answer (default: the newest one)."},
        }, "required": ["text"]},
    },
    "list_agents": {
        "description": "List yourself, your parent, your children and your siblings with their ids and states.",
        "parameters": {"type": "object", "properties": {}},
    },
    "close_agent": {
        "description": "Close one of your subagents (and its own subagents). It stops receiving messages.",
        "parameters": {"type": "object", "properties": {
            "agent": {"type": "string", "description": "Agent id or name of the subagent."},
        }, "required": ["agent"]},
    },
    "finish": {
        "description": "Finish your task. The result is sent to whoever gave you the task.",
        "parameters": {"type": "object", "properties": {
            "result": {"type": "string", "description": "Your result."},
        }, "required": ["result"]},
    },
}
SPECS["space_send"] = {
    "description": "Post a message in a shared IOA space (everyone in the space can read it).",
    "parameters": {"type": "object", "properties": {
        "space": {"type": "string", "description": "The space's name."},
        "text": {"type": "string", "description": "What to post."},
    }, "required": ["space", "text"]},
}
SPECS["space_read"] = {
    "description": "Read a shared IOA space's messages (after a position, to see only new ones).",
    "parameters": {"type": "object", "properties": {
        "space": {"type": "string", "description": "The space's name."},
        "after": {"type": "integer", "description": "Only messages after this position (default 0)."},
    }, "required": ["space"]},
}
SPECS["wait"] = {
    "description": "End your turn and wait: you are woken when a message arrives.",
    "parameters": {"type": "object", "properties": {}},
}
ALL_TOOLS = ("spawn_agent", "send_message", "reply", "list_agents", "close_agent", "finish", "wait")
SPACE_TOOLS = ("space_send", "space_read")


IOA_SEND = {"description": "Send a message to another agent's inbox. `to` is an agent id, a name in your team, or"
                           " an IOA address (ioa:<node>/<agent>) of an agent elsewhere.",
            "to": "Agent id (agt_...), name, or IOA address (ioa:...)."}
"""send_message as offered on a mesh with an IOA relay (HostConfig.offer_ioa_addresses)."""


def schemas(names: tuple[str, ...], targets: list[str] | None = None, *, ioa: bool = False,
            spawn_as: tuple[tuple[str, str], ...] = ()) -> list[dict[str, Any]]:
    """Tool schemas; `targets` (when given) are the only names send_message offers; `ioa`: send_message
    also takes IOA addresses (only on a mesh with a relay: a model offered them elsewhere invents some);
    `spawn_as`: (id, what it is) of the configured agents a child may run as: spawn_agent's `agent` is then
    a required choice of them (a model that may omit it gets the default it did not mean)."""
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; known: {sorted(SPECS)}")
    found = []
    for name in names:
        spec = SPECS[name]
        if name == "send_message" and ioa and not targets:
            params = spec["parameters"]
            spec = {**spec, "description": IOA_SEND["description"], "parameters": {**params, "properties": {
                **params["properties"], "to": {"type": "string", "description": IOA_SEND["to"]}}}}
        if name == "spawn_agent":  # `agent` only where the config lets the agent choose, as a choice
            params = spec["parameters"]
            properties = {k: v for k, v in params["properties"].items() if k != "agent"}
            required = list(params["required"])
            if spawn_as:
                properties["agent"] = {"type": "string", "enum": [ident for ident, _ in spawn_as],
                                       "description": "The configured agent the subagent runs as: " + "; ".join(
                                           f"{ident}: {what}" for ident, what in spawn_as) + "."}
                required.append("agent")
            spec = {**spec, "parameters": {**params, "properties": properties, "required": required}}
        if name == "send_message" and targets:
            params = spec["parameters"]
            spec = {**spec, "description": "Send a message to another agent of your team (by name).",
                    "parameters": {**params, "properties": {
                        **params["properties"], "to": {"type": "string", "enum": targets,
                                                       "description": "The agent's name."}}}}
        found.append({"type": "function", "function": {"name": name, **spec}})
    return found


@dataclass(frozen=True)
class ToolContext:
    """Everything a tool call is given: the agent it acts as, its mesh calls, its host, what it may do
    in its turn, and its limits. Built once per agent by its runner."""

    agent: HostedAgent
    """The agent's record: name, parent, task, tools, turn, completed, spawned."""
    handle: AgentCalls
    """Mesh calls as the agent."""
    host: AgentHost
    """The host's side: names, the team here, releasing closed agents."""
    actions: AgentActions
    """Send, reply, spawn, finish, wait; the messages the agent consumed."""
    max_spawns: int | None = None
    """Children the agent may start in all (None: no limit)."""
    max_working: int | None = None
    """Children it may have working (task not finished) at once (a configured agent's maxChildrenPerAgent)."""
    max_depth: int | None = None
    """How deep the tree may go (a configured agent's maxSpawnDepth): no spawn_agent at that depth."""
    min_task_words: int = 0
    """A subagent's task is all it knows: shorter than this many words it is a label ("send_code"), refused
    (HostConfig.min_task_words)."""
    refuse_own_task: bool = False
    """A subagent's task holding the agent's own whole task is refused (HostConfig.refuse_own_task)."""
    max_messages_per_peer: int = 0
    """Messages to one agent since a third party last wrote to this one (HostConfig.max_messages_per_peer;
    0: no limit)."""


def available(agent: HostedAgent, max_spawns: int | None, *, working: int = 0,
              max_working: int | None = None) -> tuple[str, ...]:
    """The tools the agent needs now: `finish` only while its task is open, `spawn_agent` only while it
    may start more children (in all, and with `working` of them still at their task)."""
    hidden = set()
    if agent.completed:
        hidden.add("finish")
    if max_spawns is not None and agent.spawned >= max_spawns:
        hidden.add("spawn_agent")
    if max_working is not None and working >= max_working:
        hidden.add("spawn_agent")
    return tuple(t for t in agent.tools if t not in hidden)


def offered(ctx: ToolContext) -> tuple[str, ...]:
    """The tools the agent of `ctx` is offered now (`available`, its working children counted; no spawn_agent
    at the deepest depth its tree may have)."""
    working = sum(1 for c in ctx.host.team(ctx.agent).children if not c.completed) if ctx.max_working else 0
    tools = available(ctx.agent, ctx.max_spawns, working=working, max_working=ctx.max_working)
    if ctx.max_depth is not None and ctx.agent.depth >= ctx.max_depth:
        tools = tuple(t for t in tools if t != "spawn_agent")
    return tools


def _check_arguments(name: str, arguments: dict[str, Any], params: dict[str, Any]) -> str | None:
    if "_unparsed" in arguments:
        return f"the arguments were not a JSON object: {str(arguments['_unparsed'])[:200]}"
    for field in params.get("required", ()):
        if field not in arguments:
            return f"missing argument {field!r}"
    for field, value in arguments.items():
        spec = params["properties"].get(field)
        if spec is None:
            return f"unknown argument {field!r}; {name} takes {sorted(params['properties'])}"
        if spec["type"] == "string" and not isinstance(value, str):
            return f"argument {field!r} must be a string"
        if spec["type"] == "integer" and (not isinstance(value, int) or isinstance(value, bool)):
            return f"argument {field!r} must be an integer"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {field!r} must be one of {spec['enum']}"
    return None


async def run_tool(ctx: ToolContext, call: ToolCall, given: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Carry out one call; its arguments are checked against the schema the model was `given` for that tool
    in this turn (its required arguments and choices), else against the tool's own."""
    now = offered(ctx)
    if given is not None:  # what the turn began with, of what is offered now
        began = {g["function"]["name"] for g in given}
        now = tuple(t for t in now if t in began)
    if call.name not in now:
        ctx.actions.wait_for_messages()
        return {"error": f"you have no tool {call.name!r} now; yours: {list(now)}"}
    params = next((t["function"]["parameters"] for t in given or () if t["function"]["name"] == call.name),
                  SPECS[call.name]["parameters"])
    problem = _check_arguments(call.name, call.arguments, params)
    if problem:
        return {"error": f"{call.name}: {problem}"}
    try:
        return await _HANDLERS[call.name](ctx, **call.arguments)
    except errors.MeshError as exc:
        return {"error": f"{exc.reason}: {exc.message}"}


_T = TypeVar("_T")


async def relay_call(call: Awaitable[_T]) -> _T:
    """A call to the mesh's IOA relay; on a mesh that has none (gRPC's UNIMPLEMENTED) FailedPrecondition
    NO_RELAY."""
    try:
        return await call
    except errors.MeshError as exc:
        if exc.reason == "UNIMPLEMENTED":
            raise errors.FailedPrecondition("this mesh has no IOA relay", reason="NO_RELAY") from None
        raise


async def resolve(ctx: ToolContext, target: str) -> reg.Agent | dict[str, Any]:
    """An agent by id, IOA or A2A address or name (in this agent's scope), or an
    error result."""
    target = target.strip()
    if target.startswith((IOA_PREFIX, A2A_PREFIX)):
        return reg.Agent(agent_id=target)  # a peer elsewhere: the relay or the A2A gateway answers for it
    if target.startswith("agt_"):
        try:
            return await ctx.handle.get(target)
        except errors.NotFound:
            return {"error": f"no agent with id {target}"}
    try:
        return await ctx.handle.resolve(target)
    except errors.FailedPrecondition as exc:
        if exc.reason == Reason.AMBIGUOUS_NAME:
            return {"error": f"several agents are named {target!r}; use an id: {exc.metadata.get('candidates')}"}
        raise
    except errors.NotFound:
        return {"error": f"no open agent named {target!r} in your team; list_agents shows who there is"}


def receipt_result(receipt: inbox_pb2.Receipt, to: reg.Agent | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {
        "status": inbox_pb2.ReceiptStatus.Name(receipt.status).removeprefix("RECEIPT_STATUS_").lower(),
        "message_id": receipt.message_id,
        "to": receipt.recipient,
    }
    if to is not None and to.name:
        result["to_name"] = to.name
    if receipt.sequence:
        result["sequence"] = receipt.sequence
    if receipt.detail:
        result["detail"] = receipt.detail
    return result


async def spawn_agent(ctx: ToolContext, agent_name: str, task: str, mode: str = "async",
                      agent: str = "") -> dict[str, Any]:
    # `agent_name`, not `name`: small models confuse a `name` argument with the tool call's own "name"
    about = _sentences_naming(ctx.agent.task_text, agent_name)
    quoted = (f". Your own task says about {agent_name}: \"{about}\" Give {agent_name} its task in such words."
              if about else "")
    if len(task.split()) < ctx.min_task_words:
        if not about:
            return {"error": f"the task {task[:80]!r} is not a task: write {agent_name}'s whole task in plain"
                             f" sentences, with every fact {agent_name} needs (it knows nothing but its task)"}
        # a label, and the agent's own task says what this subagent does: those sentences (the real model wrote
        # "Confirm K-7026" for B again after each refusal that quoted them, for 12 turns; given the label too,
        # B took the code in it for its own, though the task has A pass it to B)
        given = about
        result = await ctx.actions.spawn(agent_name, given, mode, config_id=agent)
        if "error" not in result:
            result["note"] = (f"the task {task[:80]!r} was too short to be a task: {agent_name} got what your own task"
                              f" says about {agent_name} instead: {given!r}")
        return result
    own = _words(ctx.agent.task_text)
    if ctx.refuse_own_task and own and f" {own} " in f" {_words(task)} ":
        return {"error": f"that task holds your own whole task: {agent_name} would do all of it again. Give"
                         f" {agent_name} only its own part{quoted or '.'}"}
    return await ctx.actions.spawn(agent_name, task, mode, config_id=agent)


def _words(text: str) -> str:
    """`text` as lower-case words joined by single spaces (to compare tasks, whatever their punctuation)."""
    return " ".join(re.findall(r"\w+", text.lower()))


def _sentences_naming(text: str, name: str) -> str:
    """The sentences of `text` that say what `name` does: those that begin with `name`, else those that name it
    as a word (at most 400 characters of them). A sentence about another subagent that names this one in
    passing is left out where one is about it: quoted every sentence naming B, the real model copied a
    sentence with A's code into B's task."""
    sentences = re.split(r"(?<=[.!?])\s+", text)
    word = rf"\b{re.escape(name)}\b"
    found = [s for s in sentences if re.match(rf"\W*{word}", s)] or [s for s in sentences if re.search(word, s)]
    return " ".join(found)[:400]


async def send_message(ctx: ToolContext, to: str, text: str) -> dict[str, Any]:
    target = await resolve(ctx, to)
    if isinstance(target, dict):
        if target["error"].startswith("no "):  # nobody of that name or id (yet): told if one joins the team
            ctx.actions.reached_for(to)
        return target
    if (refused := await _peer_limit(ctx, target.agent_id)) is not None:
        return refused
    receipt = await ctx.actions.send(target.agent_id, text)
    return receipt_result(receipt, target)


async def _peer_limit(ctx: ToolContext, peer: str) -> dict[str, Any] | None:
    """The refusal of one more message to `peer` past ctx.max_messages_per_peer (None: it may go)."""
    sent = ctx.actions.sent_to_peer(peer)
    if not ctx.max_messages_per_peer or sent < ctx.max_messages_per_peer:
        return None
    name = await ctx.host.name_of(peer)
    # waiting would be for a third party, and a subagent's parent waits for its report: finish, if it may
    then = ("call finish now with your report: what you sent, and what you received" if "finish" in offered(ctx)
            else _after_answering(ctx))
    return {"error": f"you have sent {name} {sent} message{'s' if sent > 1 else ''} since anyone else wrote to you:"
                     f" no more to {name} now; {then}"}


async def reply(ctx: ToolContext, text: str, message_id: str = "") -> dict[str, Any]:
    original = ctx.actions.message(message_id.strip() if message_id else None)
    if original is None and (not message_id or not ctx.actions.message()):
        if not ctx.actions.replied:
            ctx.actions.wait_for_messages()  # nothing to answer yet: the answer's question wakes the agent
            return {"error": "you have received no message to answer yet; end your turn and wait"}
        return {"error": f"you have no message left to answer; {_after_answering(ctx)}"}
    if original is None:
        choices = "; ".join(f"message_id {m.message_id!r} ({_gist(m.content.text)})"
                            for m in ctx.actions.answerable())
        return {"error": f"you received no message with message_id {message_id[:120]!r}; copy the message_id of"
                         f" the one you answer whole from this list, newest first: {choices}"}
    if (why := ctx.actions.not_answerable(original)) is not None:
        if (newest := ctx.actions.message()) is not None:
            return {"error": f"{why}; the newest message you may answer is message_id {newest.message_id!r}"
                             f" ({_gist(newest.content.text)})"}
        if not ctx.actions.replied:
            ctx.actions.wait_for_messages()
            return {"error": f"{why}; you have received no other message to answer yet: end your turn and wait"}
        return {"error": f"{why}; you have no message left to answer: {_after_answering(ctx)}"}
    if (refused := await _peer_limit(ctx, original.sender)) is not None:
        return refused
    receipt = await ctx.actions.reply(original, text)
    result = receipt_result(receipt)
    if result["status"] == "accepted" and ctx.actions.message() is None and "finish" in offered(ctx):
        # every message it holds is answered: the real model's B waited instead, with its task open, while its
        # parent spawned other helpers until its turn limit (docs/real-llm.md)
        result["next"] = "every message you received is answered; if your task is done, call finish now with your" \
                         " report (what you sent, and what you received)"
    return result


def _after_answering(ctx: ToolContext) -> str:
    """What an agent that answered every message it received does next."""
    if "finish" in offered(ctx):
        return "if your task is done, call finish with your report; otherwise end your turn and wait"
    ctx.actions.wait_for_messages()
    return "end your turn and wait"


def _gist(text: str, words: int = 8) -> str:
    """The first words of a message, to tell it apart in an error."""
    head = text.split()
    return repr(" ".join(head[:words]) + (" ..." if len(head) > words else ""))


async def list_agents(ctx: ToolContext) -> dict[str, Any]:
    def brief(agent: reg.Agent) -> dict[str, str]:
        return {"agent_id": agent.agent_id, "name": agent.name,
                "state": reg.AgentState.Name(agent.state).removeprefix("AGENT_STATE_").lower()}

    me = ctx.handle
    result: dict[str, Any] = {"self": {"agent_id": me.agent_id, "name": ctx.agent.name}}
    result["children"] = [brief(a) for a in await me.list_agents(parent_id=me.agent_id, include_closed=True)]
    if ctx.agent.parent_id:
        result["parent"] = brief(await me.get(ctx.agent.parent_id))
        siblings = await me.list_agents(parent_id=ctx.agent.parent_id, include_closed=True)
        result["siblings"] = [brief(a) for a in siblings if a.agent_id != me.agent_id]
    return result


async def close_agent(ctx: ToolContext, agent: str) -> dict[str, Any]:
    target = await resolve(ctx, agent)
    if isinstance(target, dict):
        return target
    if target.agent_id == ctx.handle.agent_id:
        return {"error": "close_agent closes your subagents; call finish to end your own task"}
    reason = f"closed by {ctx.agent.name}"
    response = await ctx.handle.close(target.agent_id, reason=reason)
    closed = list(response.closed_agent_ids)
    await ctx.host.release(closed, reason)  # the closed agents' runners stop here
    return {"closed": closed}


async def finish(ctx: ToolContext, result: str) -> dict[str, Any]:
    return await ctx.actions.finish(result)


async def space_send(ctx: ToolContext, space: str, text: str) -> dict[str, Any]:
    response = await relay_call(ctx.handle.space_send(space, text))
    status = net.PublishStatus.Name(response.status).removeprefix("PUBLISH_STATUS_").lower()
    return {"status": status, "ioa_message_id": response.ioa_message_id, **(
        {"detail": response.detail} if response.detail else {})}


async def space_read(ctx: ToolContext, space: str, after: int = 0) -> dict[str, Any]:
    response = await relay_call(ctx.handle.space_read(space, after))
    messages = []
    for m in response.messages:
        sender = getattr(m, "from")  # a Python keyword
        address = f"{IOA_PREFIX}{sender.node}/{sender.agent}"
        messages.append({"position": m.space_seq, "from": await ctx.host.name_of(address),
                         "from_address": address, "text": m.text})
    return {"space": space, "messages": messages}


async def wait(ctx: ToolContext) -> dict[str, Any]:
    agent = ctx.agent
    if agent.task_text and not agent.parent_id and not agent.completed and not ctx.actions.unanswered and not any(
            not c.completed for c in ctx.host.team(agent).children):
        # a top-level agent's task is open, no subagent of it is working and no message it sent waits for an
        # answer: nothing would ever wake it
        return {"error": "nothing will wake you: none of your subagents is working. Do your task now."}
    questions = ctx.actions.answerable(len(ctx.actions.received)) if agent.task_text and not agent.completed \
        and "reply" in offered(ctx) else []
    unanswered = next((m for m in questions if not m.in_reply_to and m.kind not in NOT_ASKING), None)
    if unanswered is not None:
        # its sender waits for the answer (a run yields after a send): waiting here, nobody moves (the real
        # model's B waited on A's message, and A, B and their parent idled until the budget ran out). An answer
        # or a report asks for nothing: its sender does not wait
        return {"error": f"nothing will wake you while you hold a message you have not answered: message_id"
                         f" {unanswered.message_id!r} from {await ctx.host.name_of(unanswered.sender)}"
                         f" ({_gist(unanswered.content.text)}). Answer it with reply, or finish your task."}
    ctx.actions.wait_for_messages()
    return {"status": "waiting"}


_HANDLERS: dict[str, Callable[..., Awaitable[dict[str, Any]]]] = {
    "spawn_agent": spawn_agent,
    "send_message": send_message,
    "reply": reply,
    "list_agents": list_agents,
    "close_agent": close_agent,
    "finish": finish,
    "wait": wait,
    "space_send": space_send,
    "space_read": space_read,
}
assert set(_HANDLERS) == set(SPECS)


def result_message(call: ToolCall, result: dict[str, Any]) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}
