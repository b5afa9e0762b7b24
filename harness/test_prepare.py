"""The suite's set-up (harness.prepare) runs before pytest and tests never
build or download: a test that needs the local model fails at once, naming
the command that prepares it, when the set-up has not been done; prepare
finds what is cached without making it again; an external endpoint needs
nothing local. Each case uses its own empty INBOXMESH_CACHE, so none of
them touches the real cache or the network."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.prepare import PREPARE_COMMAND, scenario_local_model

pytestmark = pytest.mark.store_independent

ROOT = Path(__file__).resolve().parent.parent


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INBOXMESH_SCENARIO_")}
    return {**env, "INBOXMESH_CACHE": str(cache), **extra}


def _run(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def test_the_real_model_test_fails_at_once_naming_the_set_up_when_nothing_is_prepared(tmp_path):
    cache = tmp_path / "cache"
    run = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", "harness/test_real_llm.py::"
               "test_the_sibling_exchange_with_a_real_model[local]", env=_env(cache), timeout=100)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output  # failed (an error at set-up), not skipped and not passed
    assert "1 error" in output and "skipped" not in output, output
    assert PREPARE_COMMAND in output and "llama-server" in output, output
    assert _files(cache) == [], "the test started building or downloading"


def test_prepare_finds_what_is_cached_and_makes_nothing(tmp_path):
    cache = tmp_path / "cache"
    local = scenario_local_model(cache / "inboxmesh" / "llm")
    local.binary.parent.mkdir(parents=True)
    # files reach these names only by an atomic rename once built or verified, so being there means ready
    local.binary.write_bytes(b"built earlier")
    local.weights.write_bytes(b"assembled earlier")
    before = _files(cache)
    run = _run("-m", "harness.prepare", env=_env(cache), timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "llama-server: cached" in run.stdout and f"model {local.name}: cached" in run.stdout, run.stdout
    assert run.stdout.splitlines()[-1].endswith(" s") and "done in" in run.stdout.splitlines()[-1], run.stdout
    assert _files(cache) == before and local.weights.read_bytes() == b"assembled earlier"


def test_prepare_makes_nothing_local_for_an_external_endpoint(tmp_path):
    cache = tmp_path / "cache"
    run = _run("-m", "harness.prepare", env=_env(cache, INBOXMESH_SCENARIO_LLM="http://127.0.0.1:9/v1"),
               timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    last = run.stdout.splitlines()[-1]
    assert "INBOXMESH_SCENARIO_LLM is set" in run.stdout and "done in" in last, run.stdout
    assert not cache.exists()
