"""Reading an agent host's settings from the environment: the one place
that does. The usual OpenAI variables point the host at any
OpenAI-compatible endpoint."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSettings:
    base_url: str
    """OPENAI_BASE_URL, e.g. https://api.openai.com/v1 or http://127.0.0.1:8080/v1."""
    api_key: str
    """OPENAI_API_KEY (local servers usually accept anything)."""
    model: str
    """INBOXMESH_MODEL (or OPENAI_MODEL): the model name the endpoint serves."""
    timeout_s: float = 60.0
    """INBOXMESH_MODEL_TIMEOUT: seconds per request."""
    tool_choice: str = "auto"
    """INBOXMESH_TOOL_CHOICE: auto or required."""


def model_settings(base_url: str | None = None, api_key: str | None = None, model: str | None = None,
                   timeout_s: float | None = None, tool_choice: str | None = None) -> ModelSettings:
    """Explicit values win over the environment; a missing base URL or model
    is an error that says which variable to set."""
    env = os.environ
    base_url = base_url or env.get("OPENAI_BASE_URL", "")
    model = model or env.get("INBOXMESH_MODEL") or env.get("OPENAI_MODEL", "")
    if not base_url:
        raise ValueError("no model endpoint: set OPENAI_BASE_URL (e.g. http://127.0.0.1:8080/v1) or pass --base-url")
    if not model:
        raise ValueError("no model name: set INBOXMESH_MODEL (or OPENAI_MODEL) or pass --model-name")
    return ModelSettings(
        base_url=base_url,
        api_key=api_key or env.get("OPENAI_API_KEY", ""),
        model=model,
        timeout_s=timeout_s or float(env.get("INBOXMESH_MODEL_TIMEOUT", "60")),
        tool_choice=tool_choice or env.get("INBOXMESH_TOOL_CHOICE", "auto"),
    )


def openai_model(settings: ModelSettings):
    from agent_host.models.openai_chat import OpenAIChatModel

    return OpenAIChatModel(base_url=settings.base_url, api_key=settings.api_key, model=settings.model,
                           timeout_s=settings.timeout_s, tool_choice=settings.tool_choice)
