"""The arguments of `inboxmesh run` and `inboxmesh host`, apart from the commands themselves: building the
command line's parser imports only these light modules, so every other command (`up`, `send`, `events`, ...)
starts without loading the agent host and the OpenAI client (about 0.7 s of CPU a process here)."""

from __future__ import annotations

import argparse

from agent_host.config import KEEP_ALIVE_POLICIES, Budget
from agent_host.local_model import LOCAL_MODEL
from agent_host.local_model.server import MODELS
from agent_host.models.scripted import POLICIES


def run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("task", help="the top-level agent's task")
    parser.add_argument("--name", default="main", help="the top-level agent's name")
    parser.add_argument("--model", default="openai",
                        help="openai (an OpenAI-compatible endpoint, see --base-url), local (the project's own"
                             " local model, prepared by the set-up: `.venv/bin/python -m harness.prepare`), or"
                             f" scripted:<policy> ({', '.join(POLICIES)}) for every agent")
    parser.add_argument("--agent", metavar="ID",
                        help="run the task as this configured agent of the mesh's routing config (its models,"
                             " tools and skills; its children with its subagents.model)")
    parser.add_argument("--skills", metavar="DIR", action="append",
                        help="a folder of skills (<DIR>/<name>/SKILL.md) for configured agents; repeatable"
                             " (default: ./skills when it exists)")
    parser.add_argument("--local-model", default=LOCAL_MODEL, choices=sorted(MODELS),
                        help=f"which local model `local` runs (default {LOCAL_MODEL})")
    parser.add_argument("--policies", metavar="MODULE:DICT",
                        help="scripted policies by agent name, e.g. harness.policies:SIBLING_POLICIES")
    parser.add_argument("--base-url", help="OpenAI-compatible endpoint (default: OPENAI_BASE_URL)")
    parser.add_argument("--model-name", help="model name (default: INBOXMESH_MODEL or OPENAI_MODEL)")
    parser.add_argument("--api-key", help="API key (default: OPENAI_API_KEY)")
    parser.add_argument("--model-timeout", type=float,
                        help="seconds per model request (default: INBOXMESH_MODEL_TIMEOUT, else 60; local: 240)")
    parser.add_argument("--tool-choice", choices=("auto", "required"),
                        help="auto or required (default: INBOXMESH_TOOL_CHOICE, else auto; local: required)")
    parser.add_argument("--tools", help="comma-separated tools every agent gets (default: all; --model local:"
                                        " spawn_agent, send_message, reply, finish, wait; configured agents:"
                                        " their config's)")
    parser.add_argument("--max-requests", type=int, default=Budget.max_model_requests, help="model requests in all")
    parser.add_argument("--max-seconds", type=float, default=Budget.max_wall_time_s, help="wall-time budget")
    parser.add_argument("--max-output-tokens", type=int, default=Budget.max_output_tokens, help="per request")
    parser.add_argument("--keep-alive", default="until_closed", choices=KEEP_ALIVE_POLICIES,
                        help="what children do after their task")
    parser.add_argument("--host-dir", help="where the host keeps its agents (default <data-dir>/host)")
    parser.add_argument("--via-ioa", action="store_true",
                        help="send every message between agents through the mesh's IOA relay")
    parser.add_argument("--quiet", action="store_true", help="no live lines, only the summary")


def host_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ingress-token", help="an ingress token of the routing config, to claim sessions"
                                                " (default: INBOXMESH_INGRESS_TOKEN)")
    parser.add_argument("--skills", metavar="DIR", action="append",
                        help="a folder of skills (<DIR>/<name>/SKILL.md); repeatable (default: ./skills)")
    parser.add_argument("--local-model", default=LOCAL_MODEL, choices=sorted(MODELS),
                        help=f"which local model `local/...` references run on (default {LOCAL_MODEL})")
    parser.add_argument("--host-dir", help="where the host keeps its agents (default <data-dir>/sessions-host)")
    parser.add_argument("--max-requests", type=int, default=Budget.max_model_requests,
                        help="model requests per message a session takes")
    parser.add_argument("--max-seconds", type=float, default=Budget.max_wall_time_s,
                        help="wall time per message a session takes")
    parser.add_argument("--max-output-tokens", type=int, default=Budget.max_output_tokens, help="per request")
    parser.add_argument("--quiet", action="store_true", help="no live lines")
