"""Multi-agent routing: which agent handles a channel message, and in which
session. config.py reads and validates the routing file; resolve.py matches
a message against its bindings."""

from services.routing.config import (
    AgentConfig,
    Binding,
    BindingMatch,
    Identity,
    LoopGuard,
    ModelConfig,
    PeerMatch,
    RoutingConfig,
    SessionConfig,
    SubagentPolicy,
    ToolsPolicy,
    load_routing_config,
    normalize_agent_id,
    parse_routing_config,
)
from services.routing.resolve import ResolvedRoute, binding_tier, main_session_key, resolve_route, session_key

__all__ = [
    "AgentConfig",
    "Binding",
    "BindingMatch",
    "Identity",
    "LoopGuard",
    "ModelConfig",
    "PeerMatch",
    "ResolvedRoute",
    "RoutingConfig",
    "SessionConfig",
    "SubagentPolicy",
    "ToolsPolicy",
    "binding_tier",
    "load_routing_config",
    "main_session_key",
    "normalize_agent_id",
    "parse_routing_config",
    "resolve_route",
    "session_key",
]
