"""The seed's sibling scenario driven by a real language model.

A parent creates A and B through the subagent tool; A holds a random secret
that B's task does not contain; A sends it to B; B receives it from its own
inbox (woken, no polling tool) and replies quoting it; A consumes the reply
and reports; B reports; the parent consumes both reports and completes.
Every decision is the model's, through native tool calls (tool_choice
"required", with a `wait` tool for "nothing to do now"): the runtime gives
each agent only the tools its part needs, lays the prompt out with the
newest work in the latest user turn (no agent ids to copy wrongly), shows
real receipts in tool results, ends a run after a send (the agent waits for
the answer) and retries failed model requests within the budget.

What counts is the record, never the model's words: registry identities,
message ids and reply correlation, consume and wake events, spans.

    python -m harness.real_llm --runs 20            # reliability, local model server
    python -m harness.real_llm --runs 20 --via-ioa  # the same over an IOA network
    INBOXMESH_SCENARIO_LLM=https://api.example.com/v1 python -m harness.real_llm  # any OpenAI-compatible endpoint

Reports go to results/real-llm/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent_host.config import Budget, HostConfig
from agent_host.host import AgentProfile, Host, HostEvent
from agent_host.hoststore import HostedAgent
from agent_host.models.base import Model
from agent_host.models.openai_chat import OpenAIChatModel
from harness.prepare import SCENARIO_MODEL, log_progress, prepare, prepared, scenario_endpoint
from inboxmesh.cli.run import exchange_summary
from inboxmesh.client.mesh import MeshClient
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results" / "real-llm"
BUDGET = Budget(max_model_requests=40, max_wall_time_s=600, max_output_tokens=192, max_requests_per_reply=3,
                max_turns_per_agent=12)
"""600 s of wall time: on this project's shared 2-core machines the 1.5B model generates 3-9 tokens/s
(measured 2026-12-01): a run takes 2-6 minutes. 192 output tokens a request: the parent's first answer (and the
configured lead's) is its three calls, about 150 tokens, and then repeats of them until the limit, which the host
skips (the turn ended with its wait); every other answer of the two scenarios took 12-97 tokens (2026-12-08)."""
TOOLS = {"parent": ("spawn_agent", "finish", "wait"), "A": ("send_message", "finish", "wait"),
         "B": ("reply", "finish", "wait")}
ROLES = {
    "parent": "You coordinate subagents.",
    "A": "You deliver a code to B.",
    "B": "You answer A.",
}
K = ev.EventKind
LOCAL_MODEL = SCENARIO_MODEL
"""The local model the scenario runs on (INBOXMESH_SCENARIO_LOCAL_MODEL picks another of
agent_host.local_model's)."""
NODE = "scenario"
"""The IOA node id of the scenario's mesh."""


B_TASK = ("Wait for a message from A. Answer it with the reply tool, repeating the code in it. Then call finish with"
          " the code.")


def a_task(secret: str) -> str:
    # The exact message to send, so that only the code travels: a model that sends its whole task makes B echo
    # instructions back to A. And "code", not "secret code": the model declines to pass on a "secret".
    # (single quotes: the parent copies this task into a double-quoted tool argument)
    return (f"Send B this message with send_message: 'The code is {secret}.' When B answers, call finish with"
            " B's answer.")


def parent_task(secret: str) -> str:
    return (f'Step 1: call spawn_agent with agent_name B and task "{B_TASK}"\n'
            f'Step 2: call spawn_agent with agent_name A and task "{a_task(secret)}"\n'
            "Step 3: wait for both reports, then call finish with them.")


@dataclass
class ScenarioResult:
    ok: bool
    mode: str
    secret: str
    elapsed_s: float
    model_requests: dict[str, int]
    problems: list[str] = field(default_factory=list)
    outcome: str = ""
    report: Path | None = None


class Evidence:
    """Checks on what the mesh recorded; each failed check becomes a problem."""

    def __init__(self):
        self.problems: list[str] = []

    def check(self, condition, problem: str) -> bool:
        if not condition:
            self.problems.append(problem)
        return bool(condition)


async def _events(client: MeshClient) -> list[ev.Event]:
    events, after = [], 0
    while True:
        page = await client.admin_events(after=after, limit=1000)
        events += page
        if not page:  # (a page is also cut at 2 MiB: only an empty one is the end)
            return events
        after = page[-1].event_id


async def verify(client: MeshClient, host: Host, secret: str, spans=None, *, reply_quotes: bool = True) -> list[str]:
    """The scenario's assertions, on the record only. `reply_quotes`: B's reply must contain the secret, where
    B's task asks for that (this scenario's "repeating the code in it"); otherwise any reply B correlates to
    A's message counts, its consumption by B's turn being the evidence that B received the code."""
    e = Evidence()
    runners = {r.record.name: r for r in host.runners.values()}
    if not e.check({"parent", "A", "B"} <= set(runners), f"agents created: {sorted(runners)}"):
        return e.problems
    parent, a, b = runners["parent"], runners["A"], runners["B"]
    view = client.agent(parent.agent_id, parent.record.credential)
    for child in (a, b):
        info = await view.get(child.agent_id)
        e.check(info.parent_id == parent.agent_id and info.scope_id == parent.agent_id,
                f"{child.record.name} is the parent's child in its scope")
    e.check(secret not in b.record.task_text, "B's task does not contain the secret")
    events = await _events(client)

    def of(kind, **match):
        return [x for x in events if x.kind == kind and all(getattr(x, k) == v for k, v in match.items())]

    def sent_by(runner):  # A's or B's messages as stored in the receiver's inbox (locally or via IOA)
        return {runner.agent_id, f"ioa:{NODE}/{runner.agent_id}"}

    a_to_b = [x for x in of(K.EVENT_KIND_MESSAGE_STORED, recipient=b.agent_id) if x.sender in sent_by(a)
              and not x.in_reply_to]
    if not e.check(a_to_b, "A sent a message to B"):
        return e.problems
    b_view = client.agent(b.agent_id, b.record.credential)
    b_consumed = {x.message_id: x for x in of(K.EVENT_KIND_MESSAGE_CONSUMED, agent_id=b.agent_id)}
    carrying = [x for x in a_to_b if x.message_id in b_consumed
                and secret in (await b_view.inbox_status(x.sequence)).envelope.content.text]
    if not e.check(carrying, "B consumed a message from A carrying the secret"):
        return e.problems
    message = carrying[0]
    woken = [w for w in of(K.EVENT_KIND_AGENT_WOKEN, agent_id=b.agent_id) if w.event_id < b_consumed[
        message.message_id].event_id]
    e.check(woken, "B was woken by the arrival (it has no polling tool)")
    e.check(b_consumed[message.message_id].turn > 0, "B's consumption names its turn")
    replies = [x for x in of(K.EVENT_KIND_MESSAGE_STORED, recipient=a.agent_id) if x.sender in sent_by(b)
               and x.in_reply_to == _local(message.message_id)]
    if not e.check(replies, "B replied to A's message (reply correlation)"):
        return e.problems
    a_view = client.agent(a.agent_id, a.record.credential)
    a_consumed = {x.message_id: x for x in of(K.EVENT_KIND_MESSAGE_CONSUMED, agent_id=a.agent_id)}
    quoted = [x for x in replies if x.message_id in a_consumed
              and (not reply_quotes or secret in (await a_view.inbox_status(x.sequence)).envelope.content.text)]
    e.check(quoted, "A consumed B's reply quoting the secret" if reply_quotes else "A consumed B's reply")
    reports = {x.sender: x for x in of(K.EVENT_KIND_MESSAGE_STORED, recipient=parent.agent_id)}
    parent_consumed = {x.message_id: x for x in of(K.EVENT_KIND_MESSAGE_CONSUMED, agent_id=parent.agent_id)}
    for child in (a, b):
        report = next((reports[s] for s in sent_by(child) if s in reports), None)
        if not e.check(report is not None and report.message_id in parent_consumed,
                       f"the parent consumed {child.record.name}'s report") or report is None:
            continue
        status = await view.status(report.message_id, sender=report.sender)
        e.check(status.envelope.kind == env_pb.MESSAGE_KIND_COMPLETION,
                f"{child.record.name}'s report is a completion")
        announces = [x for x in of(K.EVENT_KIND_RUN_ANNOUNCED) if x.agent_id == child.agent_id]
        e.check(len(announces) == 1 and report.message_id == f"inboxmesh:announce:{announces[0].message_id}",
                f"{child.record.name}'s result was announced exactly once, by its run")
    if quoted:
        a_done = of(K.EVENT_KIND_TASK_COMPLETED, agent_id=a.agent_id)
        e.check(a_done and a_done[0].event_id > a_consumed[quoted[0].message_id].event_id,
                "A reported after consuming B's reply")
    done = of(K.EVENT_KIND_TASK_COMPLETED, agent_id=parent.agent_id)
    if e.check(done, "the parent completed"):
        e.check(all(x.event_id < done[0].event_id for x in parent_consumed.values()),
                "the parent completed after consuming the reports")
    for runner in (parent, a, b):
        e.check(runner.max_runs_active == 1, f"{runner.record.name} never ran two loops at once")
    if spans is not None:
        trace_names = {s.name for s in spans.get_finished_spans()
                       if format(s.context.trace_id, "032x") == message.trace_id}
        e.check({"send", "enqueue", "deliver", "consume", "reply"} <= trace_names,
                f"one trace from A's send to B's reply: {sorted(trace_names)}")
    return e.problems


def _local(message_id: str) -> str:
    """A's message id as A knows it (through IOA the inbox holds '<node>:<sender>:<id>')."""
    return message_id.rpartition(":")[2] if message_id.count(":") >= 2 else message_id


def profiles(model: Model):
    def profile(record: HostedAgent) -> AgentProfile:
        return AgentProfile(model=model, tools=TOOLS.get(record.name, ("finish",)), role=ROLES.get(record.name, ""),
                            max_spawns=2 if record.name == "parent" else 0)
    return profile


async def run_once(mesh_address: str, model: Model, data_dir: Path, *, via_ioa: bool, client: MeshClient,
                   budget: Budget = BUDGET, spans=None, label: str = "") -> ScenarioResult:
    secret = f"SEC-{secrets.randbelow(10**6):06d}"
    config = HostConfig(mesh_address=mesh_address, data_dir=data_dir, budget=budget, yield_after_send=True,
                        show_ids=False, team_targets=True, route_via_ioa=via_ioa)
    log: list[HostEvent] = []
    started = time.time()
    async with Host(config, profiles(model)) as host:
        host.observers.append(log.append)
        runner = await host.start_task("parent", parent_task(secret))
        outcome = await host.outcome(runner.agent_id, timeout=budget.max_wall_time_s + 10)
        await asyncio.sleep(0)
        problems = [] if outcome.ok else [f"task failed: {outcome.error}"]
        problems += await verify(client, host, secret, spans)
        requests = {r.record.name: r.model_requests for r in host.runners.values()}
        lines = await exchange_summary(client.agent(runner.agent_id, runner.record.credential), started)
        await host.close(runner.agent_id, reason="scenario finished")
    result = ScenarioResult(ok=not problems, mode="ioa" if via_ioa else "local", secret=secret,
                            elapsed_s=round(time.time() - started, 2), model_requests=requests, problems=problems,
                            outcome=outcome.result or outcome.error)
    result.report = write_report(result, lines, log, started, model, outcome.budget, label)
    return result


def write_report(result: ScenarioResult, lines: list[str], log: list[HostEvent], started: float, model: Model,
                 budget: dict, label: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(started))
    path = RESULTS / f"{stamp}-{result.mode}{'-' + label if label else ''}.md"
    body = [f"# Real-model sibling scenario ({result.mode}): {'PASS' if result.ok else 'FAIL'}", "",
            f"model: {model.name}", f"secret: {result.secret}", f"elapsed: {result.elapsed_s}s",
            f"model requests: {json.dumps(result.model_requests)} (budget: {json.dumps(budget)})",
            f"outcome: {result.outcome}", ""]
    if result.problems:
        body += ["problems:"] + [f"- {p}" for p in result.problems] + [""]
    body += ["## Exchange (from the event record)", *lines, "", "## Live log"]
    body += [f"+{e.at - started:7.3f}s {e.agent_name:<8} {e.kind:<15} {e.detail}" for e in log]
    path.write_text("\n".join(body) + "\n")
    return path


@contextlib.asynccontextmanager
async def scenario_mesh(tmp: Path, via_ioa: bool, routing: Path | None = None):
    """A mesh (with an IOA network and relay when via_ioa; with a routing config when given) in this
    process."""
    from services.config import IoaConfig, MeshConfig, StoreConfig
    from services.ioa_network.server import NetworkConfig, NetworkServer
    from services.server import Mesh

    token = secrets.token_urlsafe(16)
    async with contextlib.AsyncExitStack() as stack:
        config = MeshConfig(port=0, store=StoreConfig(path=tmp / "mesh.db"), admin_token=token, routing=routing)
        if via_ioa:
            network = await stack.enter_async_context(NetworkServer(NetworkConfig()))
            config = replace(config, ioa=IoaConfig(node_id=NODE, network=network.address))
        mesh = await stack.enter_async_context(Mesh(config))
        if mesh.relay is not None:
            await mesh.relay.wait_connected(10)
        client = await stack.enter_async_context(MeshClient(mesh.address, admin_token=token))
        yield mesh, client


@contextlib.asynccontextmanager
async def scenario_model() -> AsyncIterator[OpenAIChatModel]:
    """The model the scenario uses: INBOXMESH_SCENARIO_LLM (any OpenAI-compatible
    endpoint; INBOXMESH_SCENARIO_MODEL names the model, OPENAI_API_KEY the key),
    else the local model server (agent_host.local_model) with LOCAL_MODEL, which must be
    prepared already (harness.prepare; NotPrepared names the command): nothing
    is built or downloaded here."""
    endpoint = scenario_endpoint()
    if endpoint:
        model = OpenAIChatModel(base_url=endpoint, api_key=os.environ.get("OPENAI_API_KEY", ""),
                                model=os.environ.get("INBOXMESH_SCENARIO_MODEL", "default"), timeout_s=60,
                                tool_choice="required")
        try:
            yield model
        finally:
            await model.close()
        return
    from agent_host.local_model.server import LlamaServer

    local = prepared()
    async with LlamaServer(local.binary, local.weights) as server:
        model = OpenAIChatModel(base_url=server.base_url, api_key="local", model=local.name, timeout_s=240,
                                tool_choice="required")
        try:
            yield model
        finally:
            await model.close()


async def reliability(runs: int, via_ioa: bool) -> int:
    async def once(model: OpenAIChatModel, tmp: Path, label: str) -> ScenarioResult:
        async with scenario_mesh(tmp, via_ioa) as (mesh, client):
            return await run_once(mesh.address, model, tmp / "host", via_ioa=via_ioa, client=client, label=label)

    return await repeat(runs, once, pass_rate=0.95)


async def repeat(runs: int, once: Callable[[OpenAIChatModel, Path, str], Awaitable[ScenarioResult]],
                 pass_rate: float) -> int:
    """Run a scenario `runs` times on the scenario's model, each in a fresh directory, printing a line per
    run and the tally; exit status 0 when at least `pass_rate` of them passed."""
    results = []
    async with scenario_model() as model:
        for index in range(runs):
            with tempfile.TemporaryDirectory(prefix="real-llm-") as tmp:
                result = await once(model, Path(tmp), f"run{index + 1:02d}")
            results.append(result)
            print(f"run {index + 1:2d}/{runs} {result.mode}: {'PASS' if result.ok else 'FAIL'} in"
                  f" {result.elapsed_s:6.1f}s,"
                  f" requests {sum(result.model_requests.values()):2d} {result.model_requests}"
                  + ("" if result.ok else f"  {result.problems[0]}"), flush=True)
    passed = sum(r.ok for r in results)
    print(f"\n{passed}/{runs} passed ({100 * passed / runs:.0f}%); reports in {RESULTS}")
    return 0 if passed / runs >= pass_rate else 1


async def until_terminated(work: Awaitable[int]) -> int:
    """Run `work`; SIGTERM cancels it, so the model server it started is stopped on the way out (exit 143)."""
    me = asyncio.current_task()
    assert me is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, me.cancel)
    try:
        return await work
    except asyncio.CancelledError:
        print("stopped (SIGTERM)", flush=True)
        return 143


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--via-ioa", action="store_true")
    args = parser.parse_args()
    log_progress("prepare")
    prepare()  # run by hand, so it makes what is missing (first run: minutes), unlike the test
    raise SystemExit(asyncio.run(until_terminated(reliability(args.runs, args.via_ioa))))


if __name__ == "__main__":
    main()
