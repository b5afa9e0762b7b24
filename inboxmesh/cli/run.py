"""`inboxmesh run`: run a top-level agent with a task on a host against the
mesh, show agents, messages and turns live, and end with a summary of the
exchange taken from the mesh's event record."""

from __future__ import annotations

import contextlib
import importlib
import sys
import time
import unicodedata
from dataclasses import replace
from pathlib import Path

import grpc

from agent_host.catalog import LOCAL_TIMEOUT_S, ModelCatalog
from agent_host.config import Budget, HostConfig
from agent_host.configured import ConfiguredAgentError, ConfiguredAgents
from agent_host.host import AgentProfile, Host, HostEvent, ProfileFactory, TaskOutcome
from agent_host.hoststore import HostedAgent
from agent_host.local_model import LocalModelMissing, cached_server
from agent_host.models.scripted import POLICIES, ScriptedModel
from agent_host.settings import model_settings, openai_model
from agent_host.skills import SkillLibrary
from agent_host.tools import ALL_TOOLS
from inboxmesh.client.mesh import AgentHandle, MeshClient
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.routing.v1 import routing_pb2 as route_pb

_SHOWN = {"registered", "agent_spawned", "agent_woken", "turn_started", "turn_ended", "consumed", "sent", "tool",
          "task_completed", "agent_idle", "closed", "run_cancelled", "failed", "model", "resumed", "recovered"}


LOCAL_TOOLS = ("spawn_agent", "send_message", "reply", "finish", "wait")
"""What `--model local` offers by default: every tool schema is part of each request's prompt, and on 2 CPU
cores a request's time grows with it; list_agents (ids, which the small model is not shown) and close_agent
(children end with their task) are left out. `--tools` or a configured agent's tools.allow give them back."""


def tools_offered(listed: str | None, model: str) -> tuple[str, ...]:
    """The tools of `--tools` (comma-separated), else the default for the model."""
    if listed:
        return tuple(t.strip() for t in listed.split(",") if t.strip())
    return LOCAL_TOOLS if model == "local" else ALL_TOOLS


def small_model_rules(config: HostConfig) -> HostConfig:
    """The host rules the real-model scenarios found for the small local model (docs/real-llm.md): names
    instead of ids, send_message's targets as a choice of the team's names, a run ends after a send, a
    subagent's task of fewer than 3 words refused (a label is not a task), and one that holds the agent's own
    whole task, at most 2 messages to one agent until a third party writes (two small models thanked each other
    until the budget ran out), a subagent left with its task open when its whole tree has been idle for 5 s
    woken once to finish, and no spawn_agent in a turn that begins while a child works."""
    return replace(config, show_ids=False, team_targets=True, yield_after_send=True, min_task_words=3,
                   refuse_own_task=True, max_messages_per_peer=2, quiet_wake_s=5.0,
                   spawn_while_children_work=False)


async def _profiles(args, client: MeshClient, stack: contextlib.AsyncExitStack) -> tuple[ProfileFactory, str]:
    """The agents' profiles and a description of the model(s), starting the local model server when one is
    needed (stopped by `stack`)."""
    tools = tools_offered(args.tools, args.model)
    if args.policies:
        module, _, name = args.policies.partition(":")
        policies = getattr(importlib.import_module(module), name)
        models: dict[str, ScriptedModel] = {}

        def by_name(record: HostedAgent) -> AgentProfile:
            policy = policies.get(record.name) or POLICIES["finish"]
            return AgentProfile(models.setdefault(record.agent_id, ScriptedModel(policy, f"scripted:{record.name}")),
                                tools)

        return by_name, "scripted policies " + args.policies
    if args.model.startswith("scripted:"):
        policy = POLICIES[args.model.split(":", 1)[1]]
        return (lambda record: AgentProfile(ScriptedModel(policy, args.model), tools)), args.model
    if args.agent:
        configured = await configured_agents(args, client, stack, tools=tools,
                                             default_model=f"local/{args.local_model}" if args.model == "local" else "")
        configured(HostedAgent(agent_id="", name=args.name, credential="", mode="main", config_id=args.agent))
        agent = configured.agent(args.agent)
        return configured, f"configured agent {agent.id!r} (config {configured.version}), models " + (
            " > ".join(configured.models_of(agent)))
    local_url = await start_local_model(args.local_model, stack) if args.model == "local" else ""
    if args.model == "local":
        from agent_host.models.openai_chat import OpenAIChatModel  # (the OpenAI client only when a model needs it)

        model = OpenAIChatModel(base_url=local_url, api_key="local", model=args.local_model,
                                timeout_s=args.model_timeout or LOCAL_TIMEOUT_S,
                                tool_choice=args.tool_choice or "required")
    else:
        settings = model_settings(args.base_url, args.api_key, args.model_name, args.model_timeout, args.tool_choice)
        model = openai_model(settings)
    stack.push_async_callback(model.close)
    return (lambda record: AgentProfile(model, tools)), f"{model.model} at {model.base_url}"


async def start_local_model(name: str, stack: contextlib.AsyncExitStack) -> str:
    """Start the cached local model server (stopped by `stack`); its base URL."""
    server = cached_server(name)
    print(f"inboxmesh: starting the local model {name} (llama-server, log {server.log_path})", flush=True)
    return (await stack.enter_async_context(server)).base_url


async def configured_agents(args, client: MeshClient, stack: contextlib.AsyncExitStack, *,
                            tools: tuple[str, ...] = ALL_TOOLS, default_model: str = "") -> ConfiguredAgents:
    """The mesh's configured agents as a host's profiles (args: skills, local_model), with the local model
    server started when an agent's models name it."""
    listing = await client.configured_agents()
    wants_local = default_model.startswith("local/") or any(
        ref.startswith("local/") for a in listing.agents
        for ref in (a.model, *a.model_fallbacks, a.subagents.model, *a.subagents.model_fallbacks))
    local_url = await start_local_model(args.local_model, stack) if wants_local else ""
    catalog = ModelCatalog(listing.providers, local_url=local_url)
    stack.push_async_callback(catalog.close)
    dirs = [Path(d) for d in args.skills] if args.skills else [p for p in [Path("skills")] if p.is_dir()]
    return ConfiguredAgents(listing, catalog, SkillLibrary(dirs), default_model=default_model, base_tools=tools)


NAME_WIDTH = 12
"""The live lines' agent column, in terminal cells, for a plain name (longer names push the line on)."""


def cells(text: str) -> int:
    """How many terminal cells `text` takes: wide characters (most emoji, CJK) two, combining marks and
    format characters (variation selectors, zero-width joiners) none."""
    return sum(0 if unicodedata.category(c) in ("Mn", "Me", "Cf") else
               2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)


def identity_text(identity: route_pb.Identity) -> str:
    """`🏠 Claw` for a configured agent's identity (emoji, then display name); empty when it has neither."""
    return " ".join(part.strip() for part in (identity.emoji, identity.name) if part.strip())


class AgentLabels:
    """The live lines' agent column for a host that runs configured agents: `🏠 Claw (home)` (the identity's
    emoji and name, then the agent's own name) for an agent whose record names a configured agent with an
    identity (HostedAgent.config_id: `--agent`, its children, a claimed session), the plain name otherwise.
    The configured agents are read at each line, so a config the host took up later (SessionHost) counts."""

    def __init__(self, host: Host, configured: ConfiguredAgents):
        self._host = host
        self._configured = configured
        self._labels: dict[str, str] = {}
        """The label of each agent shown and not closed (a closed agent's runner is gone by its last line)."""

    @property
    def width(self) -> int:
        """The column's width: a plain name's, plus the widest identity and its parentheses when there is one,
        so that plain lines and identity lines stay aligned."""
        widest = max((cells(identity_text(a.identity)) for a in self._configured.agents.values()), default=0)
        return NAME_WIDTH + (widest + 3 if widest else 0)

    def __call__(self, event: HostEvent) -> str:
        runner = self._host.runners.get(event.agent_id)
        if runner is not None:
            found = self._configured.agents.get(runner.record.config_id) if runner.record.config_id else None
            shown = identity_text(found.identity) if found is not None else ""
            self._labels[event.agent_id] = f"{shown} ({event.agent_name})" if shown else event.agent_name
        if event.kind == "closed":
            return self._labels.pop(event.agent_id, event.agent_name)
        return self._labels.get(event.agent_id, event.agent_name)


def printer(started: float, labels: AgentLabels | None = None):
    """One line per shown host event: time, agent (with its identity when `labels` gives one), kind, detail."""
    width = labels.width if labels is not None else NAME_WIDTH

    def show(event: HostEvent) -> None:
        if event.kind in _SHOWN:
            name = labels(event) if labels is not None else event.agent_name
            name += " " * max(0, width - cells(name))
            print(f"+{event.at - started:7.3f}s  {name} {event.kind:<15} {event.detail}", flush=True)
    return show


async def run(args, mesh_address: str, data_dir: Path, tls: grpc.ChannelCredentials | None = None) -> int:
    budget = Budget(max_model_requests=args.max_requests, max_wall_time_s=args.max_seconds,
                    max_output_tokens=args.max_output_tokens)
    config = replace(HostConfig(mesh_address=mesh_address, data_dir=Path(args.host_dir or data_dir / "host"),
                                budget=budget), keep_alive=args.keep_alive, route_via_ioa=args.via_ioa, tls=tls)
    if args.model == "local":
        config = small_model_rules(config)
    started = time.time()
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(MeshClient(mesh_address, timeout=config.call_timeout_s, tls=tls))
        try:
            profiles, described = await _profiles(args, client, stack)
        except (ConfiguredAgentError, LocalModelMissing) as exc:
            raise ValueError(str(exc)) from None
        print(f"inboxmesh run: {args.name!r} on {mesh_address}, model: {described}", flush=True)
        async with Host(config, profiles, client=client) as host:
            if not args.quiet:
                host.observers.append(printer(started, AgentLabels(host, profiles)
                                              if isinstance(profiles, ConfiguredAgents) else None))
            runner = await host.start_task(args.name, args.task, config_id=args.agent or "")
            outcome = await host.outcome(runner.agent_id)
            top = runner.handle
            lines = await exchange_summary(top, started)
            await host.close(runner.agent_id, reason=close_reason(outcome))
    print("\n".join(lines))
    _print_outcome(outcome)
    return 0 if outcome.ok else 4


def close_reason(outcome: TaskOutcome) -> str:
    """The close reason of a task's top-level agent when its run is over: success and failure differ
    (`task completed`, `task failed: <why>`)."""
    return "task completed" if outcome.ok else " ".join(f"task failed: {outcome.error}".split())[:500]


def _print_outcome(outcome: TaskOutcome) -> None:
    b = outcome.budget
    print(f"\nbudget: {b.get('model_requests', 0)} of {b.get('max_model_requests', 0)} model requests,"
          f" {b.get('elapsed_s', 0):.1f}s of {b.get('max_wall_time_s', 0):.0f}s,"
          f" at most {b.get('most_output_tokens_in_a_request', 0)} of {b.get('max_output_tokens_per_request', 0)}"
          " output tokens in a request")
    if outcome.ok:
        print(f"result: {outcome.result}")
    else:
        print(f"FAILED: {outcome.error}", file=sys.stderr)


async def exchange_summary(top: AgentHandle, started: float) -> list[str]:
    """Who sent what to whom and when it was consumed, from the event record."""
    agents = await top.list_agents(include_closed=True)
    names = {a.agent_id: a.name for a in agents}
    events: dict[int, ev.Event] = {}
    for agent in agents:
        for event in await top.events(agent_id=agent.agent_id, limit=1000):
            events[event.event_id] = event
    ordered = sorted(events.values(), key=lambda e: e.event_id)
    consumed = {(e.sender, e.message_id): e for e in ordered if e.kind == ev.EVENT_KIND_MESSAGE_CONSUMED}
    lines = ["", "agents:"]
    for a in agents:
        parent = f", child of {names.get(a.parent_id, a.parent_id)}" if a.parent_id else ""
        lines.append(f"  {a.name} ({a.agent_id}) {_mode(a.mode)}{parent}")
    lines.append("messages (stored -> consumed):")
    for stored in (e for e in ordered if e.kind == ev.EVENT_KIND_MESSAGE_STORED):
        status = await top.status(stored.message_id, sender=stored.sender)
        kind = env_pb.MessageKind.Name(status.envelope.kind).removeprefix("MESSAGE_KIND_").lower()
        text = status.envelope.content.text.replace("\n", " ")
        if stored.sender.startswith("ioa:") and stored.sender not in names:
            node, _, local = stored.sender.removeprefix("ioa:").partition("/")
            if local in names:
                names[stored.sender] = f"{names[local]}@{node}"
        taken = consumed.get((stored.sender, stored.message_id))
        when = (f"consumed +{_offset(taken.at_us, started)} (turn {taken.turn})" if taken
                else "not consumed")
        reply = f" in reply to {stored.in_reply_to[:12]}" if stored.in_reply_to else ""
        lines.append(f"  +{_offset(stored.at_us, started)} {names.get(stored.sender, stored.sender)} -> "
                     f"{names.get(stored.recipient, stored.recipient)} [{kind}{reply}] {text[:80]!r}: {when}")
    return lines


def _mode(mode: int) -> str:
    from inboxmesh.registry.v1 import registry_pb2 as reg

    return "[" + reg.AgentMode.Name(mode).removeprefix("AGENT_MODE_").lower() + "]"


def _offset(at_us: int, started: float) -> str:
    return f"{at_us / 1e6 - started:.3f}s"



