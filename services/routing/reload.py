"""Reloading the routing config while the mesh runs (docs/routing.md "Reload").

The mesh looks at the routing file once a second (its modification time and size) and on SIGHUP. A
changed file is read and validated in full first: a valid one is served from the next call on (routing,
ingress tokens, ListConfiguredAgents, the run registry's spawn policies), and its version is what routed
events and routes carry from then on; a file that cannot be read or is invalid is refused, logged with
its key path, kept as `reload_error` in ListConfiguredAgents, and the config in force stays. Messages
already stored are untouched either way: a reload moves where the next message goes, nothing else.

The mesh-wide values of the file (agents.defaults.loopGuard, subagents.archiveAfterMinutes) were merged
into the mesh's settings at start; a reload that changes them says so in the log, and they take effect
at the next start.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from inboxmesh.client import errors
from services.routing.config import RoutingConfig, load_routing_config
from services.routing.service import RoutingService

log = logging.getLogger(__name__)
INTERVAL_S = 1.0


class RoutingReloader:
    def __init__(self, path: Path, service: RoutingService, interval_s: float = INTERVAL_S):
        self.path = Path(path)
        self.service = service
        self.interval_s = interval_s
        self._stamp = self._stat()
        self._task: asyncio.Task[None] | None = None

    def _stat(self) -> tuple[int, int] | None:
        try:
            found = os.stat(self.path)
        except OSError:
            return None
        return found.st_mtime_ns, found.st_size

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="routing-reload")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            stamp = self._stat()
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self.reload()
                except Exception:  # a bug in reading a file must not end the watching: the config in force stays
                    log.exception("routing config reload failed; the config in force (version %s) stays",
                                  self.service.config.version)

    def reload(self) -> bool:
        """Read and validate the file now; serve it when valid (True), else keep the config in force."""
        self._stamp = self._stat()
        try:
            new = load_routing_config(self.path)
        except errors.MeshError as exc:
            self.service.reload_error = exc.message
            log.error("routing config reload refused, the config in force (version %s) stays: %s",
                      self.service.config.version, exc.message)
            return False
        self.service.reload_error = ""
        old = self.service.config
        if new.version == old.version:
            return True
        _warn_start_only(old, new, self.path)
        self.service.use(new)
        log.info("routing config %s reloaded: version %s -> %s", self.path, old.version, new.version)
        return True


def _warn_start_only(old: RoutingConfig, new: RoutingConfig, path: Path) -> None:
    if (old.loop_guard, old.archive_after_minutes) != (new.loop_guard, new.archive_after_minutes):
        log.warning("%s: agents.defaults.loopGuard and subagents.archiveAfterMinutes are mesh-wide settings read at"
                    " start; their new values take effect at the next start", path)
