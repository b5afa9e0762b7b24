"""compose.yaml without Docker: every service's command and environment, as
written there, started as local processes (service host names become
127.0.0.1, ports become free ones, /data a temporary directory), and the
mesh they form works: NATS, a registry, two inbox replicas serving the same
agents, the IOA network and relay, and an agent host that runs the sibling
exchange to the end."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness.nats import free_port, nats_server_binary
from inboxmesh.client.mesh import MeshClient, tls_credentials
from inboxmesh.events.v1 import events_pb2 as ev

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["certs", "nats", "registry", "inbox-1", "inbox-2", "ioa-network", "relay"]
pytestmark = [pytest.mark.store_independent, pytest.mark.timeout(240)]


def load() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]


def test_every_service_is_built_from_the_repository_dockerfile():
    services = load()
    assert set(services) == {*ORDER, "agent-host"}
    assert (ROOT / "Dockerfile").exists()
    assert all(s.get("build") == "." for s in services.values())
    for name in ("registry", "inbox-1", "inbox-2", "relay"):
        assert "--store jetstream" in services[name]["command"], f"{name} runs on JetStream"


class Local:
    """The compose services as processes on this machine."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.ports: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen] = {}

    def port(self, service: str, port: str) -> int:
        return self.ports.setdefault(f"{service}:{port}", free_port())

    def argv(self, name: str, command: str) -> list[str]:
        services = load()
        text = command.replace("/data", str(self.tmp / name)).replace("/app/", f"{ROOT}/")  # the image's copy
        text = text.replace("/certs", str(self.tmp / "certs"))  # the volume all services share
        # the service's own ports (its clients', nats-server's monitoring), as the others address them
        text = re.sub(r"(--port|-p|-m) (\d+)", lambda m: f"{m.group(1)} {self.port(name, m.group(2))}", text)
        for other in services:
            def local_address(m: re.Match[str], other: str = other) -> str:
                return f"127.0.0.1:{self.port(other, m.group(1))}"

            text = re.sub(rf"\b{re.escape(other)}:(\d+)", local_address, text)
        text = text.replace("0.0.0.0", "127.0.0.1")
        argv = shlex.split(text)
        executable = {"inboxmesh": str(Path(sys.executable).parent / "inboxmesh"),
                      "nats-server": nats_server_binary()}[argv[0]]
        return [executable, *argv[1:]]

    def start(self, name: str) -> None:
        service = load()[name]
        env = {**os.environ, **{k: str(v) for k, v in (service.get("environment") or {}).items()}}
        (self.tmp / name).mkdir(parents=True, exist_ok=True)
        log = open(self.tmp / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(self.argv(name, service["command"]), cwd=ROOT, env=env, stdout=log,
                                            stderr=subprocess.STDOUT)
        if service.get("restart") == "no":  # a one-shot service (certs): it must finish, and well
            assert self.procs[name].wait(60) == 0, (self.tmp / f"{name}.log").read_text()[-2000:]
            return
        own = re.search(r"(?:--port|-p) (\d+)", service["command"])
        if own is None:
            raise AssertionError(f"{name}'s command in compose.yaml names no port: {service['command']}")
        self.wait_listening(name, self.port(name, own.group(1)))

    def wait_listening(self, name: str, port: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} exited: {(self.tmp / f'{name}.log').read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"{name} did not listen on {port}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)


async def test_the_compose_services_form_a_working_mesh(tmp_path):
    local = Local(tmp_path)
    try:
        for name in ORDER:
            local.start(name)
        inbox_1 = f"127.0.0.1:{local.port('inbox-1', '7401')}"
        inbox_2 = f"127.0.0.1:{local.port('inbox-2', '7402')}"
        relay = f"127.0.0.1:{local.port('relay', '7403')}"
        token = load()["registry"]["environment"]["INBOXMESH_ADMIN_TOKEN"]
        host = load()["agent-host"]
        # the host loads its scripted policies from harness/, which the distribution does not install: the
        # image puts its copy on PYTHONPATH (Dockerfile), this run the repository's
        agent_host = await asyncio.create_subprocess_exec(*local.argv("agent-host", host["command"]), cwd=ROOT,
                                                          env={**os.environ, "PYTHONPATH": str(ROOT)},
                                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(agent_host.communicate(), timeout=120)
        finally:
            if agent_host.returncode is None:
                agent_host.kill()
                await agent_host.wait()
        stdout, stderr = out.decode(), err.decode()
        assert agent_host.returncode == 0, stdout[-3000:] + stderr[-3000:]
        tls = tls_credentials(tmp_path / "certs" / "ca.pem")  # every service serves TLS
        async with MeshClient(inbox_2, admin_token=token, tls=tls) as second, \
                MeshClient(relay, admin_token=token, tls=tls) as third:
            events = await second.admin_events(limit=1000)  # what the host did through inbox-1, seen from inbox-2
            consumed = [e for e in events if e.kind == ev.EVENT_KIND_MESSAGE_CONSUMED]
            completed = [e for e in events if e.kind == ev.EVENT_KIND_TASK_COMPLETED]
            assert len(consumed) >= 6 and len(completed) == 3, "the sibling exchange ran to the end"
            lead = await second.register("seen-everywhere")
            assert (await third.agent(lead.info, lead.credential).get()).name == "seen-everywhere"
        assert "ABC-12345" in stdout
        assert inbox_1 in " ".join(local.argv("agent-host", host["command"]))
        for name in ("registry", "inbox-1", "inbox-2", "relay"):
            assert "(TLS;" in (tmp_path / f"{name}.log").read_text(), f"{name} serves TLS"
        assert "ioa network: mutual TLS" in (tmp_path / "ioa-network.log").read_text()
    finally:
        local.stop()
