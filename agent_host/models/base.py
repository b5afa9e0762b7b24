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
class ModelAttempt:
    """One model of an agent's chain in one reply (after its retries): which, how it went, what it took."""

    model: str
    """The model's reference as configured (e.g. `local/qwen2.5-coder-1.5b`, `openai/gpt-4o-mini`)."""
    ok: bool
    requests: int
    error: str = ""
    usage: Usage = Usage()

    def detail(self) -> str:
        """The MODEL_CALLED event's detail (docs/lifecycle.md)."""
        if self.ok:
            return (f"model={self.model} outcome=ok requests={self.requests} "
                    f"tokens={self.usage.prompt_tokens}/{self.usage.completion_tokens}")
        return f"model={self.model} outcome=failed requests={self.requests} error={self.error[:300]}"


@dataclass(frozen=True)
class ModelReply:
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage = Usage()
    attempts: int = 1
    """Requests it took (failed ones retried within the budget included)."""
    tried: tuple[ModelAttempt, ...] = ()
    """The models of the agent's chain that were asked for this reply, in order (the last one answered);
    set by TaskBudget.complete."""

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

    def __init__(self, message: str, *, attempts: int = 1, retryable: bool = False,
                 tried: tuple[ModelAttempt, ...] = ()):
        super().__init__(message)
        self.attempts = attempts
        self.retryable = retryable
        self.tried = tried
        """The models asked before it failed (TaskBudget.complete: every model of the chain)."""


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


class ModelChain:
    """An agent's models in the order to try them: its primary, then its fallbacks (docs/routing.md
    "Models"). TaskBudget.complete asks the next one when one fails (connection error, 5xx, timeout,
    a refused request), within the task's budget."""

    def __init__(self, models: list[tuple[str, Model]]):
        if not models:
            raise ValueError("a model chain needs at least one model")
        self.models = list(models)
        self.name = " > ".join(ref for ref, _ in self.models)

    @staticmethod
    def of(model: Model | ModelChain) -> ModelChain:
        """A chain as is; a single model as a chain of one (named by its own name)."""
        return model if isinstance(model, ModelChain) else ModelChain([(model.name, model)])

    async def close(self) -> None:
        for _, model in self.models:
            await model.close()
