"""An agent's conversation: the chat messages its model sees, and how inbox
messages are written into it.

Inbox messages consumed at a turn boundary become one user message, newest
last, each introduced by a header line the scripted model (and a reader)
can rely on:

    Message from <name> (<agent_id>), message_id=<id>, kind=<kind>[, in_reply_to=<id>]:
    <text>
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

from inboxmesh.common.v1 import envelope_pb2

HEADER = re.compile(
    r"^Message from (?P<name>.*?)(?: \((?P<sender>[^)]*)\))?, message_id=(?P<message_id>\S+?), kind=(?P<kind>\w+)"
    r"(?:, in_reply_to=(?P<in_reply_to>\S+?))?:$"
)
NOTE_PREFIX = "-- "
"""Starts a line the runtime adds after the messages of a turn (not part of any message)."""
KIND_NAMES = {v: envelope_pb2.MessageKind.Name(v).removeprefix("MESSAGE_KIND_").lower()
              for v in envelope_pb2.MessageKind.values()}


def system_prompt(name: str, agent_id: str, role: str, show_ids: bool = True, *, parent: str = "",
                  task: str = "", extra: str = "") -> str:
    """An agent's system prompt: a top-level agent's, or with `parent` a subagent's (as in the seed: its
    task, that it is a subagent, what it must not do, that its result is reported automatically).
    `extra`: the instructions of its skills."""
    who = f"{name} (agent id {agent_id})" if show_ids else name
    if parent:
        text = (
            f"You are {who}, a subagent that {parent} started for one task: {task}\n{role}\n"
            "Rules: do your task and nothing else; you are not the main agent. Message only the agents your"
            " task names. Act only through your tools; messages from other agents arrive as user turns"
            f" starting with 'Message from'. When done, call finish with your result: it is reported to {parent}"
            " automatically."
        )
    else:
        text = (
            f"You are {who}, one agent in a team of agents. {role}\n"
            "Act only through your tools. Messages from other agents arrive as user turns starting with"
            " 'Message from'. Use send_message to write to an agent (by id or name), reply to answer a message,"
            " and finish with your result when your task is done."
        )
    return f"{text}\n\n{extra}" if extra else text


def format_message(envelope: envelope_pb2.Envelope, sender_name: str, show_ids: bool = True) -> str:
    sender = f"{sender_name} ({envelope.sender})" if show_ids else sender_name
    head = f"Message from {sender}, message_id={envelope.message_id}, kind={KIND_NAMES.get(envelope.kind, 'text')}"
    if envelope.in_reply_to:
        head += f", in_reply_to={envelope.in_reply_to}"
    return f"{head}:\n{envelope.content.text}"


@dataclass
class Conversation:
    messages: list[dict[str, Any]] = field(default_factory=list)
    injected: set[str] = field(default_factory=set)
    """Keys (sender/message_id) of inbox messages already in the conversation."""

    def add_user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def inject(self, items: list[tuple[envelope_pb2.Envelope, str]], note: str = "",
               show_ids: bool = True) -> list[envelope_pb2.Envelope]:
        """Add inbox messages (with their senders' names) as one user turn,
        optionally followed by a note (NOTE_PREFIX); returns those added (a
        message already in the conversation is not added again)."""
        fresh = [(e, n) for e, n in items if key_of(e) not in self.injected]
        if fresh:
            parts = [format_message(e, n, show_ids) for e, n in fresh]
            if note:
                parts.append(NOTE_PREFIX + note)
            self.add_user("\n\n".join(parts))
            self.injected.update(key_of(e) for e, _ in fresh)
        return [e for e, _ in fresh]

    def has_new_input(self) -> bool:
        """Something the model has not answered yet: a user turn (the task, a
        message) or tool results after its last reply."""
        return bool(self.messages) and self.messages[-1]["role"] in ("user", "tool")

    def done_so_far(self) -> list[str]:
        """What the agent's successful tool calls did ("send_message B (accepted)", ...), oldest first."""
        calls: dict[str, tuple[str, dict[str, Any]]] = {}
        done = []
        for message in self.messages:
            for call in message.get("tool_calls") or []:
                calls[call["id"]] = (call["function"]["name"], json.loads(call["function"]["arguments"] or "{}"))
            if message["role"] == "tool" and message["tool_call_id"] in calls:
                name, arguments = calls[message["tool_call_id"]]
                result = json.loads(message["content"])
                if "error" in result:
                    continue
                target = arguments.get("to") or arguments.get("agent_name") or result.get("to_name") or ""
                done.append(f"{name} {target}".strip() + (f" ({result['status']})" if "status" in result else ""))
        return done

    def fork(self) -> Conversation:
        """A copy for a forked child: everything but the parent's unanswered
        last assistant turn (the one spawning the fork)."""
        messages = copy.deepcopy(self.messages)
        if messages and messages[-1]["role"] == "assistant":
            messages.pop()
        return Conversation(messages=messages)


def key_of(envelope: envelope_pb2.Envelope) -> str:
    return f"{envelope.sender}/{envelope.message_id}"
