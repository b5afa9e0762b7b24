"""The budget of one top-level task, shared by every agent working on it
(docs/lifecycle.md "Budgets"), and the model call made within it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from agent_host.config import Budget
from agent_host.hoststore import HostedAgent
from agent_host.models.base import Model, ModelAttempt, ModelChain, ModelError, ModelReply


class BudgetExceeded(Exception):
    """A task's budget ran out; the message says where it stopped. `tried`: the models asked in the
    reply it stopped in, if any."""

    def __init__(self, message: str, tried: tuple[ModelAttempt, ...] = ()):
        super().__init__(message)
        self.tried = tried


class TaskBudget:
    """What one task has used of its limits (`Budget`), shared by every agent working on it."""

    def __init__(self, limits: Budget, *, per_wake: bool = False):
        self.limits = limits
        self.per_wake = per_wake
        """A session's budget: renewed (renew()) when its agent wakes from idle with nothing of it running,
        so each inbound message gets the whole budget (a task's budget is never renewed)."""
        self.started = time.monotonic()
        self.requests = 0
        self.max_output_tokens_seen = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.failed: str | None = None
        """Why the task failed for good (fail()): no run of it starts or consumes anything after that."""

    def renew(self) -> None:
        """A fresh budget for the next piece of a session's work (per_wake only): time, requests, failure."""
        self.started = time.monotonic()
        self.requests = 0
        self.failed = None

    def fail(self, why: str) -> None:
        """The task failed for good (the first reason stays): no run of it starts or consumes anything more."""
        if self.failed is None:
            self.failed = why

    def remaining_s(self) -> float:
        return self.limits.max_wall_time_s - (time.monotonic() - self.started)

    def check(self, agent: HostedAgent, *, before_turn: bool = False) -> None:
        """BudgetExceeded, naming where `agent` stopped (in its turn, or before its next one), when no model
        request is left or the time is up."""
        where = (f"{agent.name} ({agent.agent_id}) " +
                 (f"before turn {agent.turn + 1}" if before_turn else f"at turn {agent.turn}"))
        if self.requests >= self.limits.max_model_requests:
            raise BudgetExceeded(f"stopped at {where}: all {self.limits.max_model_requests} model requests used")
        if self.remaining_s() <= 0:
            raise BudgetExceeded(f"stopped at {where}: the wall-time budget of {self.limits.max_wall_time_s:.0f}s"
                                 " ran out")

    async def complete(self, models: Model | ModelChain, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]], agent: HostedAgent) -> ModelReply:
        """One reply for `agent` from its chain of models, within what is left: the primary first, on a
        failure the next fallback, each with up to `max_requests_per_reply` requests, all counted. A
        request still running when the wall time is up is BudgetExceeded. The reply (or the ModelError
        when every model failed, or the BudgetExceeded) carries every model asked (`tried`)."""
        chain = ModelChain.of(models)
        tried: list[ModelAttempt] = []
        failures = []
        for ref, model in chain.models:
            try:
                self.check(agent)
            except BudgetExceeded as exc:
                raise BudgetExceeded(str(exc), tuple(tried)) from None
            max_requests = min(self.limits.max_requests_per_reply, self.limits.max_model_requests - self.requests)
            try:
                reply = await asyncio.wait_for(
                    model.complete(messages, tools, max_output_tokens=self.limits.max_output_tokens,
                                   max_requests=max_requests),
                    max(0.001, self.remaining_s()))
            except ModelError as exc:
                self.requests += exc.attempts
                tried.append(ModelAttempt(ref, ok=False, requests=exc.attempts, error=str(exc)))
                failures.append(f"{ref}: {exc}")
                continue
            except TimeoutError:
                tried.append(ModelAttempt(ref, ok=False, requests=1, error="the task's wall time ran out"))
                self.requests += 1
                raise BudgetExceeded(f"stopped at {agent.name} ({agent.agent_id}) turn {agent.turn}: the wall-time"
                                     f" budget of {self.limits.max_wall_time_s:.0f}s ran out during a model"
                                     " request", tuple(tried)) from None
            self.requests += reply.attempts
            self.prompt_tokens += reply.usage.prompt_tokens
            self.output_tokens += reply.usage.completion_tokens
            self.max_output_tokens_seen = max(self.max_output_tokens_seen, reply.usage.completion_tokens)
            tried.append(ModelAttempt(ref, ok=True, requests=reply.attempts, usage=reply.usage))
            return replace(reply, attempts=sum(t.requests for t in tried), tried=tuple(tried))
        raise ModelError("every model failed: " + "; ".join(failures), attempts=sum(t.requests for t in tried),
                         retryable=True, tried=tuple(tried))

    def report(self) -> dict[str, Any]:
        return {"model_requests": self.requests, "max_model_requests": self.limits.max_model_requests,
                "elapsed_s": round(time.monotonic() - self.started, 3),
                "max_wall_time_s": self.limits.max_wall_time_s,
                "max_output_tokens_per_request": self.limits.max_output_tokens,
                "most_output_tokens_in_a_request": self.max_output_tokens_seen,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens}
