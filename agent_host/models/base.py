"""The model interface. Conversations are OpenAI chat messages (dicts with
role system/user/assistant/tool); tools are OpenAI function-tool schemas.
Whatever model is behind it, the agent loop sees a ModelReply: text and/or
tool calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]
    """Parsed JSON arguments. A model that sent unparseable JSON gets
    {"_unparsed": raw} and a tool result saying so."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class ModelReply:
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage = Usage()
    attempts: int = 1
    """Requests it took (failed ones retried within the budget included)."""

    def as_message(self) -> dict[str, Any]:
        """The assistant message to append to the conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.tool_calls:
            import json

            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for c in self.tool_calls
            ]
        return message


class ModelError(Exception):
    """The model could not produce a reply (after retries within budget)."""

    def __init__(self, message: str, *, attempts: int = 1, retryable: bool = False):
        super().__init__(message)
        self.attempts = attempts
        self.retryable = retryable


class Model(Protocol):
    name: str

    async def complete(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        *,
        max_output_tokens: int,
        max_requests: int,
    ) -> ModelReply:
        """One reply. May use up to `max_requests` requests (retries of
        failed ones); raises ModelError when none succeeded."""
        ...

    async def close(self) -> None: ...
