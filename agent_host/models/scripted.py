"""A scripted model: deterministic policies that read the conversation (the
same messages a language model would get) and choose tool calls. It goes
through exactly the same tools, scheduler and inbox path as a real model;
used where a test or demo must not depend on a language model.

A policy is a function `policy(view: ContextView) -> Decision`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent_host.conversation import HEADER, NOTE_PREFIX
from agent_host.models.base import ModelError, ModelReply, ToolCall


@dataclass(frozen=True)
class InboxItem:
    sender: str
    sender_name: str
    message_id: str
    kind: str
    text: str
    in_reply_to: str = ""


@dataclass(frozen=True)
class ToolResult:
    name: str
    arguments: dict[str, Any]
    result: dict[str, Any]


@dataclass
class ContextView:
    """The conversation, read back into facts a policy can decide on."""

    system: str
    task: str
    """The newest TASK message, else the first user turn (a top-level task)."""
    inbox: list[InboxItem] = field(default_factory=list)
    """Every inbox message in the conversation, oldest first."""
    new: list[InboxItem] = field(default_factory=list)
    """Those in the newest user turn when it is the last message."""
    results: list[ToolResult] = field(default_factory=list)
    """Every tool call made so far with its result, oldest first."""
    tools: set[str] = field(default_factory=set)
    assistant_turns: int = 0

    def called(self, name: str) -> list[ToolResult]:
        return [r for r in self.results if r.name == name]

    @staticmethod
    def parse(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ContextView:
        view = ContextView(system="", task="", tools={t["function"]["name"] for t in tools})
        pending_calls: dict[str, tuple[str, dict]] = {}
        first_plain = ""
        for index, message in enumerate(messages):
            role = message["role"]
            if role == "system":
                view.system = message["content"]
            elif role == "user":
                items = _inbox_items(message["content"] or "")
                view.inbox += items
                if not items and not first_plain:
                    first_plain = message["content"]
                if index == len(messages) - 1:
                    view.new = items
            elif role == "assistant":
                view.assistant_turns += 1
                for call in message.get("tool_calls") or []:
                    fn = call["function"]
                    pending_calls[call["id"]] = (fn["name"], json.loads(fn["arguments"] or "{}"))
            elif role == "tool":
                name, arguments = pending_calls.pop(message["tool_call_id"], ("?", {}))
                view.results.append(ToolResult(name, arguments, json.loads(message["content"])))
        tasks = [i for i in view.inbox if i.kind == "task"]
        view.task = tasks[-1].text if tasks else first_plain
        return view


def _inbox_items(content: str) -> list[InboxItem]:
    items: list[InboxItem] = []
    current: dict | None = None
    body: list[str] = []
    for line in content.split("\n"):
        if line.startswith(NOTE_PREFIX) and current is not None:
            items.append(InboxItem(text="\n".join(body).strip("\n"), **current))
            current, body = None, []
            continue
        match = HEADER.match(line)
        if match:
            if current is not None:
                items.append(InboxItem(text="\n".join(body).strip("\n"), **current))
            current = {"sender": match["sender"] or "", "sender_name": match["name"], "message_id": match["message_id"],
                       "kind": match["kind"], "in_reply_to": match["in_reply_to"] or ""}
            body = []
        elif current is not None:
            body.append(line)
    if current is not None:
        items.append(InboxItem(text="\n".join(body).strip("\n"), **current))
    return items


@dataclass(frozen=True)
class Decision:
    """What the scripted model answers: tool calls (name, arguments) and/or text."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    text: str = ""


def call(tool: str, /, **arguments: Any) -> Decision:
    return Decision(calls=[(tool, arguments)])


def say(text: str) -> Decision:
    """End the run without a tool call (the agent goes idle, still receiving)."""
    return Decision(text=text)


Policy = Callable[[ContextView], Decision]


class ScriptedModel:
    def __init__(self, policy: Policy, name: str = "scripted"):
        self.policy = policy
        self.name = name
        self.requests = 0

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, max_output_tokens: int,
                       max_requests: int) -> ModelReply:
        self.requests += 1
        view = ContextView.parse(messages, tools)
        decision = self.policy(view)
        unknown = [name for name, _ in decision.calls if name not in view.tools]
        if unknown:
            raise ModelError(f"policy {self.name} called tools it was not given: {unknown}")
        calls = [ToolCall(id=f"call_{view.assistant_turns}_{i}", name=name, arguments=arguments)
                 for i, (name, arguments) in enumerate(decision.calls)]
        return ModelReply(text=decision.text, tool_calls=calls)

    async def close(self) -> None:
        return None


# -- policies every host offers (inboxmesh run --model scripted:<name>) -----------------
def finish_with_task(view: ContextView) -> Decision:
    """Finish at once, answering with the task text."""
    return call("finish", result=f"done: {view.task}")


def echo(view: ContextView) -> Decision:
    """Reply to every new message with its own text; idle otherwise."""
    if view.new:
        return Decision(calls=[("reply", {"message_id": m.message_id, "text": m.text}) for m in view.new
                               if m.kind != "control"])
    return say("waiting for messages")


POLICIES: dict[str, Policy] = {"finish": finish_with_task, "echo": echo}
