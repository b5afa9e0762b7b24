"""Storage behind the services: one interface per concern (base.AgentStore,
InboxStore, RunStore, EventStore), joined with a lifecycle in base.Store; one
subpackage per backend (sqlite/, jetstream/), cut the same way."""

from __future__ import annotations

from inboxmesh.client.errors import Reason
from services.config import StoreConfig
from services.store.base import Store


def open_store(config: StoreConfig) -> Store:
    """The store the configuration names (not yet started)."""
    if config.backend == "sqlite":
        from services.store.sqlite import SqliteStore

        return SqliteStore(config)
    if config.backend == "jetstream":
        from services.store.jetstream import JetStreamStore

        return JetStreamStore(config)
    from inboxmesh.client.errors import InvalidArgument

    raise InvalidArgument(f"unknown store backend {config.backend!r}; known: 'sqlite', 'jetstream'",
                          reason=Reason.BAD_CONFIG)
