"""Models an agent's loop can call: one interface, a scripted model for
deterministic runs, and an OpenAI-compatible chat-completions client."""

from agent_host.models.base import Model, ModelError, ModelReply, ToolCall, Usage

__all__ = ["Model", "ModelError", "ModelReply", "ToolCall", "Usage"]
