"""Crash points for fault tests: `INBOXMESH_CRASH_AT=<name>[:N]` makes the mesh
process die (like kill -9: nothing flushed, no goodbye) when it reaches the
named point. Used to prove that every phase between two commits resumes
after a restart. Unset in normal operation, where a point costs one dict
lookup."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
ENV = "INBOXMESH_CRASH_AT"


_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Exit at this point when INBOXMESH_CRASH_AT is `name`, or `name:N` for
    the N-th time the point is reached."""
    wanted = os.environ.get(ENV)
    if not wanted or wanted.partition(":")[0] != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(wanted.partition(":")[2] or 1):
        log.error("crash point %r reached (%s): exiting now", name, ENV)
        os._exit(137)
