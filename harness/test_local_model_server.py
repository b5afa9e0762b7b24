"""The local model server (agent_host.local_model.server.LlamaServer) as the harness starts it: its OpenMP
threads wait asleep, not spinning, unless the environment says otherwise (why: LlamaServer.environment)."""

from pathlib import Path

import pytest

from agent_host.local_model.server import LlamaServer
from harness.prepare import prepared, scenario_endpoint

pytestmark = pytest.mark.store_independent


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").partition("=")[::2] for entry in entries if entry)


@pytest.mark.skipif(scenario_endpoint() is not None,
                    reason="INBOXMESH_SCENARIO_LLM names an external endpoint: no local model is prepared")
async def test_the_started_server_waits_asleep_unless_the_environment_says_otherwise(monkeypatch):
    local = prepared()  # made by the set-up; NotPrepared names the command when it was not run
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    async with LlamaServer(local.binary, local.weights) as server:
        assert server.process is not None
        assert _environ(server.process.pid).get("OMP_WAIT_POLICY") == "passive"
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # a machine the server has to itself
    assert LlamaServer.environment()["OMP_WAIT_POLICY"] == "active"
