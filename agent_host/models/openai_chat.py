"""An OpenAI-compatible chat-completions model with native tool calling
(works with OpenAI, llama.cpp's llama-server, vLLM, Ollama's /v1 and the
like). Settings come from agent_host.settings (OPENAI_BASE_URL,
OPENAI_API_KEY, INBOXMESH_MODEL)."""

from __future__ import annotations

import json
import logging
from typing import Any, cast

import openai
from openai.types.chat import (
    ChatCompletionMessageParam,
    ChatCompletionToolChoiceOptionParam,
    ChatCompletionToolUnionParam,
)

from agent_host.models.base import ModelError, ModelReply, ToolCall, Usage

log = logging.getLogger(__name__)


class OpenAIChatModel:
    def __init__(self, *, base_url: str, api_key: str, model: str, timeout_s: float = 60.0,
                 temperature: float = 0.0, tool_choice: str = "auto"):
        self.name = f"openai:{model}@{base_url}"
        self.model = model
        self.base_url = base_url
        self.temperature = temperature
        self.tool_choice = tool_choice
        # Retries are ours (within the run's request budget), not the SDK's.
        self._client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "none", timeout=timeout_s,
                                          max_retries=0)

    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, max_output_tokens: int,
        max_requests: int,
    ) -> ModelReply:
        failures: list[str] = []
        # the conversation and the tool schemas are plain dicts in exactly the SDK's shapes (TypedDicts)
        sdk_messages = cast(list[ChatCompletionMessageParam], messages)
        sdk_tools = cast(list[ChatCompletionToolUnionParam], tools)
        tool_choice = cast(ChatCompletionToolChoiceOptionParam, self.tool_choice)  # "auto" or "required"
        for attempt in range(1, max(1, max_requests) + 1):
            try:
                response = await self._client.chat.completions.create(
                    model=self.model, messages=sdk_messages, tools=sdk_tools or openai.omit,
                    tool_choice=tool_choice if tools else openai.omit,
                    max_tokens=max_output_tokens, temperature=self._temperature(attempt),
                )
            except (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError,
                    openai.RateLimitError) as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                log.warning("model request %d of %d failed: %s", attempt, max_requests, exc)
                continue
            except openai.APIStatusError as exc:  # 4xx: retrying will not help
                raise ModelError(f"model endpoint refused the request ({exc.status_code}): {exc.message}",
                                 attempts=attempt) from exc
            reply = _reply_of(response, attempt)
            if reply is None:
                failures.append("the reply had neither text nor tool calls")
            elif tools and self.tool_choice == "required" and not reply.tool_calls:
                failures.append("a tool call was required and the reply had none")  # retried like a failure
            else:
                return reply
        raise ModelError(f"no usable reply in {max_requests} requests: {'; '.join(failures[-3:])}",
                         attempts=max_requests, retryable=True)

    def _temperature(self, attempt: int) -> float:
        """A retry of the same prompt at temperature 0 would produce the same
        failing output: later attempts vary a little."""
        return self.temperature if attempt == 1 else max(self.temperature, 0.3 * (attempt - 1))

    async def close(self) -> None:
        await self._client.close()


def _reply_of(response: Any, attempt: int) -> ModelReply | None:
    if not response.choices:
        return None
    message = response.choices[0].message
    calls = []
    for index, call in enumerate(message.tool_calls or []):
        raw = call.function.arguments or "{}"
        try:
            arguments = json.loads(raw)
            if not isinstance(arguments, dict):
                arguments = {"_unparsed": raw}
        except json.JSONDecodeError:
            arguments = {"_unparsed": raw}
        calls.append(ToolCall(id=call.id or f"call_{attempt}_{index}", name=call.function.name, arguments=arguments))
    text = message.content or ""
    if not text and not calls:
        return None
    usage = response.usage
    return ModelReply(
        text=text, tool_calls=calls, attempts=attempt,
        usage=Usage(prompt_tokens=getattr(usage, "prompt_tokens", 0) or 0,
                    completion_tokens=getattr(usage, "completion_tokens", 0) or 0),
    )
