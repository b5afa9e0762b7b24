"""The distributed store: NATS JetStream (services.store.jetstream.store, docs/jetstream.md)."""

from services.store.jetstream.store import JetStreamStore

__all__ = ["JetStreamStore"]
