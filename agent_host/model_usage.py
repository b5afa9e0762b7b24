"""What the model requests of one host process came to (agent_host/metrics.py serves it for Prometheus when
asked): counted by the runner where it records its MODEL_CALLED events."""

from __future__ import annotations

import collections
import heapq

from agent_host.models.base import ModelAttempt

TRACKED_AGENTS = 10_000
"""Agents whose counts are kept (the least recently active one is dropped for a new one beyond that)."""
MODELS = 100
"""Distinct model references with series of their own; any further one is counted as OTHER."""
OTHER = "other"


class ModelUsage:
    """Model requests and tokens of one host process: per model (reference and outcome) and per agent."""

    def __init__(self, tracked_agents: int = TRACKED_AGENTS, models: int = MODELS):
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        """(model, "ok" | "failed") -> requests."""
        self.tokens: collections.Counter[tuple[str, str]] = collections.Counter()
        """(model, "prompt" | "output") -> tokens."""
        self.agents: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        """agent id -> [requests, prompt tokens, output tokens], least recently active first."""
        self._tracked_agents = tracked_agents
        self._models = models
        self._known: set[str] = set()

    def count(self, agent_id: str, attempt: ModelAttempt) -> None:
        """One model asked in one of `agent_id`'s turns (what its MODEL_CALLED event says)."""
        model = attempt.model
        if model not in self._known:
            if len(self._known) < self._models:
                self._known.add(model)
            else:
                model = OTHER
        self.requests[(model, "ok" if attempt.ok else "failed")] += attempt.requests
        self.tokens[(model, "prompt")] += attempt.usage.prompt_tokens
        self.tokens[(model, "output")] += attempt.usage.completion_tokens
        counts = self.agents.get(agent_id)
        if counts is None:
            if len(self.agents) >= self._tracked_agents:
                self.agents.popitem(last=False)
            counts = self.agents[agent_id] = [0, 0, 0]
        else:
            self.agents.move_to_end(agent_id)
        counts[0] += attempt.requests
        counts[1] += attempt.usage.prompt_tokens
        counts[2] += attempt.usage.completion_tokens

    def top(self, n: int) -> list[tuple[str, list[int]]]:
        """The n agents with the most model requests (ties by agent id)."""
        return heapq.nsmallest(n, self.agents.items(), key=lambda item: (-item[1][0], item[0]))


MODEL_USAGE = ModelUsage()
"""This process's model usage (the runner counts into it; a MetricsServer reads it)."""
