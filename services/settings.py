"""Reading configuration from the environment and from a running mesh's
state directory. The only place that touches env vars or config files."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import replace
from pathlib import Path

from services.config import InboxLimits, MeshConfig, StoreConfig

DEFAULT_PORT = 7400
DEFAULT_DATA_DIR = Path(".inboxmesh")
ENV_ADDRESS = "INBOXMESH_ADDRESS"
ENV_DATA_DIR = "INBOXMESH_DATA_DIR"
ENV_ADMIN_TOKEN = "INBOXMESH_ADMIN_TOKEN"


def data_dir(value: str | None = None) -> Path:
    return Path(value or os.environ.get(ENV_DATA_DIR) or DEFAULT_DATA_DIR)


def mesh_config(
    *,
    host: str,
    port: int,
    data: Path,
    services: tuple[str, ...],
    admin_token: str | None,
    capacity: int | None = None,
    allow_cross_scope: bool = False,
    synchronous: str = "FULL",
    heartbeat_interval_s: float = 10.0,
) -> MeshConfig:
    limits = InboxLimits(allow_cross_scope=allow_cross_scope)
    if capacity:
        limits = replace(limits, default_capacity=capacity)
    return MeshConfig(
        host=host,
        port=port,
        store=StoreConfig(path=data / "mesh.db", synchronous=synchronous),
        limits=limits,
        services=services,
        admin_token=admin_token or os.environ.get(ENV_ADMIN_TOKEN) or secrets.token_urlsafe(24),
        heartbeat_interval_s=heartbeat_interval_s,
    )


def write_state(data: Path, address: str, admin_token: str | None) -> Path:
    """Tell other CLI commands where the mesh listens (and its admin token);
    readable by the owner only."""
    data.mkdir(parents=True, exist_ok=True)
    path = data / "mesh.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"address": address, "admin_token": admin_token, "pid": os.getpid()}, handle)
    return path


def read_state(data: Path) -> dict:
    try:
        return json.loads((data / "mesh.json").read_text())
    except FileNotFoundError:
        return {}


def address(explicit: str | None, data: Path) -> str:
    return explicit or os.environ.get(ENV_ADDRESS) or read_state(data).get("address") or f"127.0.0.1:{DEFAULT_PORT}"


def admin_token(explicit: str | None, data: Path) -> str | None:
    return explicit or os.environ.get(ENV_ADMIN_TOKEN) or read_state(data).get("admin_token")
