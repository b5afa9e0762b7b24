"""Models by reference: `<provider>/<model>` (docs/routing.md "Models") to a Model a runner can call, and
an agent's primary and fallbacks to its ModelChain.

Providers come from the routing config (`models.providers`, served by ListConfiguredAgents) and the
built-in ones: `openai` (OPENAI_BASE_URL, else OpenAI's endpoint; key OPENAI_API_KEY), `local` (the
project's local model server: its base URL is given to the catalog by whoever started it) and `scripted`
(`scripted/<policy>`, the deterministic policies of agent_host.models.scripted). A bare reference is on
`openai`. Keys are read from the environment variable the provider names, never from the config.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from agent_host.models.base import Model, ModelChain
from agent_host.models.scripted import POLICIES, Policy, ScriptedModel
from inboxmesh.routing.v1 import routing_pb2 as route_pb

OPENAI_DEFAULT_URL = "https://api.openai.com/v1"
DEFAULT_TIMEOUT_S = 60.0
LOCAL_TIMEOUT_S = 240.0
"""A 1.5B model on 2 CPU cores answers a long prompt in 10-20 s and a 512-token answer in up to ~120 s."""


class ModelConfigError(ValueError):
    """A model reference the catalog cannot serve; the message names the reference and why."""


@dataclass(frozen=True)
class Endpoint:
    """Where a provider's models are served, and how to ask them."""

    base_url: str
    api_key: str
    timeout_s: float
    tool_choice: str


class ModelCatalog:
    """Builds (once per reference) the models that configured agents name."""

    def __init__(self, providers: Iterable[route_pb.ModelProvider] = (), *,
                 env: Mapping[str, str] | None = None, local_url: str = "",
                 policies: Mapping[str, Policy] | None = None,
                 factory: Callable[[str, Endpoint], Model] | None = None):
        self.providers = {p.id: p for p in providers}
        self.env = os.environ if env is None else env
        self.local_url = local_url
        """The base URL of the running local model server (empty: none is running)."""
        self.policies = dict(POLICIES) | dict(policies or {})
        self._factory = factory or _openai_model
        self._models: dict[str, Model] = {}

    def endpoint(self, provider_id: str, ref: str) -> Endpoint:
        declared = self.providers.get(provider_id)
        if declared is None and provider_id not in ("openai", "local"):
            raise ModelConfigError(f"model {ref!r}: provider {provider_id!r} is neither declared in"
                                   " models.providers nor built in (openai, local, scripted)")
        base_url = declared.base_url if declared is not None and declared.base_url else ""
        if not base_url and provider_id == "openai":
            base_url = self.env.get("OPENAI_BASE_URL", "") or OPENAI_DEFAULT_URL
        if not base_url and provider_id == "local":
            if not self.local_url:
                raise ModelConfigError(f"model {ref!r}: the local model server is not running (start the host with"
                                       " --local-model, or `inboxmesh run --model local`)")
            base_url = self.local_url
        key_env = declared.api_key_env if declared is not None and declared.api_key_env else (
            "OPENAI_API_KEY" if provider_id == "openai" else "")
        timeout = declared.timeout_s if declared is not None and declared.timeout_s else (
            LOCAL_TIMEOUT_S if provider_id == "local" else DEFAULT_TIMEOUT_S)
        choice = declared.tool_choice if declared is not None and declared.tool_choice else (
            "required" if provider_id == "local" else "auto")
        return Endpoint(base_url=base_url, api_key=self.env.get(key_env, "") if key_env else "", timeout_s=timeout,
                        tool_choice=choice)

    def model(self, ref: str) -> Model:
        """The model a reference names (the same object for the same reference)."""
        found = self._models.get(ref)
        if found is not None:
            return found
        provider, slash, name = ref.partition("/")
        if not slash:
            provider, name = "openai", ref
        if not name.strip():
            raise ModelConfigError(f"model {ref!r} names no model after the provider")
        if provider == "scripted":
            policy = self.policies.get(name)
            if policy is None:
                raise ModelConfigError(f"model {ref!r}: no scripted policy {name!r} (known: {sorted(self.policies)})")
            model: Model = ScriptedModel(policy, ref)  # stateless: agents naming it may share it
        else:
            model = self._factory(name, self.endpoint(provider, ref))
            model.name = ref
        self._models[ref] = model
        return model

    def chain(self, primary: str, fallbacks: list[str] | tuple[str, ...] = ()) -> ModelChain:
        """An agent's models in the order to try them."""
        return ModelChain([(ref, self.model(ref)) for ref in (primary, *fallbacks)])

    async def close(self) -> None:
        for model in self._models.values():
            await model.close()


def _openai_model(name: str, endpoint: Endpoint) -> Model:
    from agent_host.models.openai_chat import OpenAIChatModel

    return OpenAIChatModel(base_url=endpoint.base_url, api_key=endpoint.api_key, model=name,
                           timeout_s=endpoint.timeout_s, tool_choice=endpoint.tool_choice)
