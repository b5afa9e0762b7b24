"""At start, whether the NATS servers fsync every JetStream write before acknowledging it.

"Accepted" means stored durably (docs/delivery-contract.md). JetStream acknowledges a publish once the
write is in the server's file store, and by default fsyncs those files every two minutes: a power loss
or kernel crash of the machine then loses messages the mesh had answered ACCEPTED (Jepsen, NATS 2.12.1,
December 2025). With `jetstream { sync_interval: always }` every write is fsynced first. A client cannot
see that setting over its NATS connection; the server's monitoring endpoint (`nats-server -m PORT`,
`/varz`) shows it as `jetstream.config.sync_always`, so the mesh reads it there, from every server it is
given, and refuses to start on one that does not fsync every write unless told to accept that
(StoreConfig.nats_accept_lazy_fsync, `--nats-accept-lazy-fsync`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
import urllib.request
from typing import Any

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from services.config import StoreConfig

log = logging.getLogger(__name__)

DEFAULT_MONITOR_PORT = 8222
"""nats-server's usual monitoring port: the endpoint checked when none is given (`-m 8222`)."""
_MAX_VARZ_BYTES = 1 << 20
_TIMEOUT_S = 5.0
_SHOWN = 200
"""Characters of a failure's own text a refusal quotes at most."""


def monitor_urls(config: StoreConfig) -> tuple[str, ...]:
    """The monitoring endpoints to check: those given, else port 8222 on each NATS server's host."""
    if config.nats_monitor_urls:
        return config.nats_monitor_urls
    hosts = dict.fromkeys(urllib.parse.urlsplit(url if "://" in url else f"nats://{url}").hostname or "127.0.0.1"
                          for url in config.nats_urls)
    return tuple(f"http://{host}:{DEFAULT_MONITOR_PORT}" for host in hosts)


def _read_varz(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url.rstrip('/')}/varz", timeout=_TIMEOUT_S) as response:
        body = response.read(_MAX_VARZ_BYTES + 1)
    if len(body) > _MAX_VARZ_BYTES:
        raise ValueError(f"its /varz is larger than {_MAX_VARZ_BYTES} bytes")
    found = json.loads(body)
    if not isinstance(found, dict):
        raise ValueError("its /varz is not a JSON object")
    return found


def _refusal(message: str) -> errors.FailedPrecondition:
    return errors.FailedPrecondition(message, reason=Reason.NATS_NOT_DURABLE,
                                     metadata={"setting": "--nats-accept-lazy-fsync"})


async def check_durability(config: StoreConfig) -> None:
    """Raise FailedPrecondition (NATS_NOT_DURABLE) naming the server when a NATS server's monitoring
    endpoint cannot be read, shows no JetStream, or shows that it does not fsync every write."""
    if config.nats_accept_lazy_fsync:
        log.warning("NATS durability not checked (--nats-accept-lazy-fsync): unless every server runs with"
                    " `jetstream { sync_interval: always }`, a power loss can lose accepted messages")
        return
    for url in monitor_urls(config):
        try:
            varz = await asyncio.to_thread(_read_varz, url)
        except Exception as exc:
            raise _refusal(
                f"cannot read whether NATS fsyncs every write: its monitoring endpoint {url}/varz did not answer"
                f" ({str(exc)[:_SHOWN]}); give each server's monitoring address with --nats-monitor"
                " (nats-server -m PORT), or start with --nats-accept-lazy-fsync to run unchecked") from None
        name = str(varz.get("server_name", ""))[:_SHOWN] or url
        jetstream = varz.get("jetstream")
        settings = jetstream.get("config") if isinstance(jetstream, dict) else None
        if not isinstance(settings, dict):
            raise _refusal(f"NATS server {name} ({url}) runs without JetStream: start it with -js")
        if settings.get("sync_always") is not True:
            every = settings.get("sync_interval")
            interval = f"every {every / 1e9:g} s" if isinstance(every, (int, float)) and every else "on its own timer"
            raise _refusal(
                f"NATS server {name} ({url}) fsyncs JetStream writes {interval}, not before acknowledging each:"
                " a message the mesh answered ACCEPTED could be lost if that machine fails. Start it with"
                " `jetstream { sync_interval: always }` (harness/nats-server.conf), or accept the risk with"
                " --nats-accept-lazy-fsync")
        log.info("NATS server %s fsyncs every write (checked at %s)", name, url)
