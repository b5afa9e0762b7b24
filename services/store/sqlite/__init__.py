"""The embedded default store: SQLite (services.store.sqlite.store)."""

from services.store.sqlite.store import SqliteStore

__all__ = ["SqliteStore"]
