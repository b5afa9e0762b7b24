"""Crash points for fault tests: `INBOXMESH_CRASH_AT=<name>` makes the mesh
process die (like kill -9: nothing flushed, no goodbye) when it reaches the
named point. Used to prove that every phase between two commits resumes
after a restart. Unset in normal operation, where a point costs one dict
lookup."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
ENV = "INBOXMESH_CRASH_AT"


def crash_point(name: str) -> None:
    if os.environ.get(ENV) == name:
        log.error("crash point %r reached (%s): exiting now", name, ENV)
        os._exit(137)
