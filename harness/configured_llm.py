"""The second real-model scenario (issue 17): the seed's exchange given as one plain-language task to a
top-level configured agent, whose children run as another configured agent; every tool set comes from
the routing config, not from code.

The runtime: a mesh with this routing config (lead: spawn_agent, finish, wait, and may spawn `helper`;
helper: send_message, reply, finish, wait), a Host running configured agents (agent_host/configured.py)
with the small-model rules `inboxmesh run --model local` uses (names instead of ids, send_message's
targets as a choice of the team's names, a run ends after a send), the model behind the `scenario`
provider. The task: TASK below, written once and never tuned per run; only its code is random. What
counts is the record (harness.real_llm.verify): A and B are the lead's children; A's message to B carries
the code and B consumed it; B's reply to it is correlated and consumed by A, which reports after it; both
reports are announced once and consumed by the lead, which completes after them. The reply's words are not
checked: the task asks B to reply "confirming the code", not to repeat it (the first scenario's B task asks
for the code in the reply, and there it is checked); that B's turn consumed A's message carrying the code is
the evidence that B received it.

    python -m harness.configured_llm --runs 10    # reliability, local model; docs/real-llm.md
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time
from pathlib import Path

from agent_host.catalog import ModelCatalog
from agent_host.config import Budget, HostConfig
from agent_host.configured import ConfiguredAgents
from agent_host.host import Host, HostEvent
from agent_host.models.openai_chat import OpenAIChatModel
from harness.prepare import log_progress, prepare
from harness.real_llm import BUDGET, ScenarioResult, repeat, scenario_mesh, until_terminated, verify, write_report
from inboxmesh.cli.run import exchange_summary, small_model_rules
from inboxmesh.client.mesh import MeshClient

TASK = ("Create two helper agents named A and B. Tell A the code {code} and ask A to send it to B. B must reply to"
        " A confirming the code. Then both report back to you, and you finish with a summary.")
"""The issue's wording, with a random code."""
CONFIG = """
models:
  providers:
    scenario: {{baseUrl: "{base_url}", timeoutSeconds: 240, toolChoice: required}}
agents:
  list:
    - id: lead
      default: true
      name: Lead
      model: scenario/{model}
      tools: {{allow: [spawn_agent, finish, wait]}}
      subagents: {{allowAgents: [helper], maxChildrenPerAgent: 2}}
    - id: helper
      name: Helper
      model: scenario/{model}
      tools: {{allow: [send_message, reply, finish, wait]}}
"""


def code() -> str:
    return f"K-{secrets.randbelow(9000) + 1000}"


async def run_once(model: OpenAIChatModel, tmp: Path, *, budget: Budget = BUDGET, spans=None,
                   label: str = "") -> ScenarioResult:
    secret = code()
    routing = tmp / "routing.yaml"
    routing.write_text(CONFIG.format(base_url=model.base_url, model=model.model))
    async with scenario_mesh(tmp, via_ioa=False, routing=routing) as (mesh, client):
        return await _run(mesh.address, client, model, tmp / "host", secret, budget, spans, label)


async def _run(address: str, client: MeshClient, model: OpenAIChatModel, data_dir: Path, secret: str,
               budget: Budget, spans, label: str) -> ScenarioResult:
    listing = await client.configured_agents()
    catalog = ModelCatalog(listing.providers)
    config = small_model_rules(HostConfig(mesh_address=address, data_dir=data_dir, budget=budget))
    log: list[HostEvent] = []
    started = time.time()
    try:
        async with Host(config, ConfiguredAgents(listing, catalog)) as host:
            host.observers.append(log.append)
            runner = await host.start_task("parent", TASK.format(code=secret), config_id="lead")
            outcome = await host.outcome(runner.agent_id, timeout=budget.max_wall_time_s + 10)
            await asyncio.sleep(0)
            problems = [] if outcome.ok else [f"task failed: {outcome.error}"]
            problems += await verify(client, host, secret, spans, reply_quotes=False)
            configured = {r.record.name: r.record.config_id for r in host.runners.values()}
            problems += [f"{name} ran as {got!r}, not as a helper" for name, got in configured.items()
                         if name in ("A", "B") and got != "helper"]
            requests = {r.record.name: r.model_requests for r in host.runners.values()}
            lines = await exchange_summary(client.agent(runner.agent_id, runner.record.credential), started)
            await host.close(runner.agent_id, reason="scenario finished")
    finally:
        await catalog.close()
    result = ScenarioResult(ok=not problems, mode="configured", secret=secret,
                            elapsed_s=round(time.time() - started, 2), model_requests=requests, problems=problems,
                            outcome=outcome.result or outcome.error)
    result.report = write_report(result, lines, log, started, model, outcome.budget, label)
    return result


async def reliability(runs: int) -> int:
    async def once(model: OpenAIChatModel, tmp: Path, label: str) -> ScenarioResult:
        return await run_once(model, tmp, label=label)

    return await repeat(runs, once, pass_rate=0.8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    log_progress("prepare")
    prepare()
    raise SystemExit(asyncio.run(until_terminated(reliability(args.runs))))


if __name__ == "__main__":
    main()

