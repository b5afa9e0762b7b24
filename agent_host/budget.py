"""The budget of one top-level task, shared by every agent working on it
(docs/lifecycle.md "Budgets"), and the model call made within it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agent_host.config import Budget
from agent_host.hoststore import HostedAgent
from agent_host.models.base import Model, ModelError, ModelReply


class BudgetExceeded(Exception):
    """A task's budget ran out; the message says where it stopped."""


class TaskBudget:
    """What one task has used of its limits (`Budget`), shared by every agent working on it."""

    def __init__(self, limits: Budget):
        self.limits = limits
        self.started = time.monotonic()
        self.requests = 0
        self.max_output_tokens_seen = 0

    def remaining_s(self) -> float:
        return self.limits.max_wall_time_s - (time.monotonic() - self.started)

    def check(self, agent: HostedAgent) -> None:
        """BudgetExceeded, naming where `agent` stopped, when no model request is left or the time is up."""
        where = f"{agent.name} ({agent.agent_id}) at turn {agent.turn}"
        if self.requests >= self.limits.max_model_requests:
            raise BudgetExceeded(f"stopped at {where}: all {self.limits.max_model_requests} model requests used")
        if self.remaining_s() <= 0:
            raise BudgetExceeded(f"stopped at {where}: the wall-time budget of {self.limits.max_wall_time_s:.0f}s"
                                 " ran out")

    async def complete(self, model: Model, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                       agent: HostedAgent) -> ModelReply:
        """One reply of `model` for `agent`, within what is left: its requests (a failed reply's
        included) are counted, and a request still running when the wall time is up is
        BudgetExceeded."""
        self.check(agent)
        max_requests = min(self.limits.max_requests_per_reply, self.limits.max_model_requests - self.requests)
        try:
            reply = await asyncio.wait_for(
                model.complete(messages, tools, max_output_tokens=self.limits.max_output_tokens,
                               max_requests=max_requests),
                max(0.001, self.remaining_s()))
        except ModelError as exc:
            self.requests += exc.attempts
            raise
        except TimeoutError:
            raise BudgetExceeded(f"stopped at {agent.name} ({agent.agent_id}) turn {agent.turn}: the wall-time"
                                 f" budget of {self.limits.max_wall_time_s:.0f}s ran out during a model request"
                                 ) from None
        self.requests += reply.attempts
        self.max_output_tokens_seen = max(self.max_output_tokens_seen, reply.usage.completion_tokens)
        return reply

    def report(self) -> dict[str, Any]:
        return {"model_requests": self.requests, "max_model_requests": self.limits.max_model_requests,
                "elapsed_s": round(time.monotonic() - self.started, 3),
                "max_wall_time_s": self.limits.max_wall_time_s,
                "max_output_tokens_per_request": self.limits.max_output_tokens,
                "most_output_tokens_in_a_request": self.max_output_tokens_seen}
