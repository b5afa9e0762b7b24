"""Multi-agent routing: which agent handles a channel message, and in which
session. config.py reads and validates the routing file; resolve.py matches
a message against its bindings."""

from services.routing.config import (
    BUILT_IN_PROVIDERS,
    TOOL_NAMES,
    AgentConfig,
    Binding,
    BindingMatch,
    Identity,
    LoopGuard,
    ModelConfig,
    PeerMatch,
    ProviderConfig,
    RoutingConfig,
    SessionConfig,
    SubagentPolicy,
    ToolsPolicy,
    config_version,
    load_routing_config,
    normalize_agent_id,
    parse_routing_config,
)
from services.routing.resolve import ResolvedRoute, binding_tier, main_session_key, resolve_route, session_key

__all__ = [
    "BUILT_IN_PROVIDERS",
    "TOOL_NAMES",
    "AgentConfig",
    "Binding",
    "BindingMatch",
    "Identity",
    "LoopGuard",
    "ModelConfig",
    "PeerMatch",
    "ProviderConfig",
    "ResolvedRoute",
    "RoutingConfig",
    "SessionConfig",
    "SubagentPolicy",
    "ToolsPolicy",
    "binding_tier",
    "config_version",
    "load_routing_config",
    "main_session_key",
    "normalize_agent_id",
    "parse_routing_config",
    "resolve_route",
    "session_key",
]
