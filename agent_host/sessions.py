"""A host that serves the session agents routing ingress creates (docs/routing.md "Hosts that serve
sessions"): it follows the mesh's event record for ROUTED events (with the operator token), claims each
session agent it does not run yet (ClaimSession, with an ingress token) and runs it on its Host as the
session's configured agent (agent_host/configured.py). The session's messages wake it like any agent's;
its answers go back on the channel by replying to the channel address (the channel's gateway).

Sessions it already runs (after a restart: the ones the Host resumed from host.db) are not claimed again.
Claims are made one at a time, in the order of the record; a claim that fails is logged and retried at the
session's next ROUTED event. The id of the last ROUTED event handled is kept in host.db (mark
`sessions.routed`): a restarted host follows the record from there, not from its start, and so does this
host when the watch ends (a mesh restarted, the connection lost), after a pause (WATCH_RETRY_S doubling
up to WATCH_RETRY_MAX_S).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from agent_host.configured import ConfiguredAgents
from agent_host.host import Host
from inboxmesh.client import errors
from inboxmesh.client.mesh import MeshClient
from inboxmesh.events.v1 import events_pb2 as ev

log = logging.getLogger(__name__)


MARK = "sessions.routed"
"""host.db's mark: the last ROUTED event this host handled."""
WATCH_RETRY_S = 0.2
"""The first pause before the record is followed again after the watch ended or failed (doubling)."""
WATCH_RETRY_MAX_S = 5.0
"""The longest pause between tries, and the pause after a failure that is not a passing one."""


class SessionHost:
    def __init__(self, host: Host, client: MeshClient, ingress_token: str):
        self.host = host
        self.client = client
        """A client with the operator token (it follows the whole record)."""
        self.token = ingress_token
        self.claimed: dict[str, str] = {}
        """session agent id -> its session key, for every session this host took over."""
        self._task: asyncio.Task[None] | None = None
        self._versions: set[str] = set()
        """Config versions seen on ROUTED events (a new one makes the host read the configured agents again)."""
        self.failures: list[str] = []
        self.handled = 0
        """ROUTED events this SessionHost handled (a restarted one starts after host.db's mark)."""

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._follow(), name="sessions")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def __aenter__(self) -> SessionHost:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _follow(self) -> None:
        """Follow the record from host.db's mark, and follow it again from there whenever the watch ends (a
        mesh restarted, the network dropped, the mesh stopping): the mark moves only past an event handled,
        so an event met by a failure is handled by the next watch."""
        pause, said = WATCH_RETRY_S, ""
        while True:
            try:
                async for event in self.client.admin_watch_events(kinds=[ev.EVENT_KIND_ROUTED],
                                                                  after=self.host.store.mark(MARK)):
                    await self._handle(event)
                    self.host.store.set_mark(MARK, event.event_id)
                    self.handled += 1
                    pause, said = WATCH_RETRY_S, ""
                failure = "the mesh ended the watch"
            except errors.MeshError as exc:
                failure = f"{type(exc).__name__}: {exc}"
                if not isinstance(exc, (errors.Unavailable, errors.DeadlineExceeded, errors.ResourceExhausted)):
                    pause = WATCH_RETRY_MAX_S  # not passing (a token refused, say): an operator must act
            if failure != said:  # once per change, not once per attempt
                said = failure
                log.warning("following the mesh's sessions: %s; again in %.1fs, from event %d", failure, pause,
                            self.host.store.mark(MARK))
            await asyncio.sleep(pause)
            pause = min(pause * 2, WATCH_RETRY_MAX_S)

    async def _handle(self, event: ev.Event) -> None:
        version = event.detail.rpartition(" config=")[2]
        profiles = self.host.profiles
        if isinstance(profiles, ConfiguredAgents) and version and version not in self._versions:
            self._versions.add(version)
            if version != profiles.version:  # the mesh reloaded its routing file
                profiles.use(await self.client.configured_agents())
                self._versions.add(profiles.version)
                log.info("configured agents: config version %s", profiles.version)
        if event.agent_id in self.host.runners or event.agent_id in self.claimed:
            return
        try:
            await self._claim(event)
        except errors.MeshError as exc:
            self.failures.append(f"{event.agent_id}: {exc}")
            log.error("could not take over session agent %s: %s", event.agent_id, exc)

    async def _claim(self, event: ev.Event) -> None:
        info = await self.client.admin_agent(event.agent_id)
        key = info.name  # a session agent is named by its session key
        config_id = info.metadata.get("inboxmesh-agent", "")
        handle = await self.client.claim_session(self.token, key)
        self.claimed[handle.agent_id] = key
        await self.host.adopt(handle, config_id=config_id)
        log.info("serving session %s (%s) as configured agent %s", key, handle.agent_id, config_id)
