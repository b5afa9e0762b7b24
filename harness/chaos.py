"""A chaos soak in the manner of Jepsen (issue 14, docs/jetstream.md "Chaos soak"): agents exchanging
messages through two mesh processes on a three-node NATS cluster (every stream on three nodes, every
write fsynced) while mesh processes, agent hosts and NATS nodes are killed with SIGKILL and started
again every few seconds; then checked from the stored record.

Half the agents send, each its messages one after the other (message ids `m-<n>`, to one of the other
half, a function of the seed, the sender and n, so a host started again picks up exactly where it was),
retrying each with the same id until a receipt says what became of it; before every RUN_EVERY-th it
spawns a child with a run that the child ends at once (its result announced to the sender's inbox).
(Senders only receive announces: an agent that consumed what it is sent would continue that causal
chain in what it sends next, and the loop guard refuses a chain past 32 hops.) Hosts consume everything delivered
to their agents. The agent hosts (their own processes, `--role host`) write what they sent and what
their acks won to a log; the mesh's event record says what was stored and consumed.

Across an IOA network as well: mesh process 0 is node `near` of an IOA network (`inboxmesh ioa-server`, its
own process), and a third mesh (`far`, on its own SQLite store) has agents of its own that send to the
same receivers at `ioa:near/<agent>` the same way, from their own host process. The network process is
killed and started again among the faults ("ioa"), and so is mesh process 0, so both relays reconnect
(the network gives a reconnecting node its recent messages again) while messages cross.

The check, after the faults stop and every accepted message had time to be consumed:
- lost: messages (local or from the far mesh) whose receipt said ACCEPTED (or DUPLICATE) with no
  CONSUMED or DEAD_LETTERED event (dead letters are counted on their own: a message delivered too many
  times, each time a stream broke, goes to the dead letters with a notice to its sender);
- consumed twice: messages with more than one CONSUMED event;
- reordered: per sender and recipient, CONSUMED events (in the record's order) out of send order;
- announces: per run created, exactly one announce consumed by its requester.
(A far agent waits for each receipt before its next send, so per-pair order holds across the network
too; issue 15 is about order when an IOA sender pipelines.)

    .venv/bin/python -m harness.chaos --seed 1 --agents 100 --messages 100000 --duration 1800 --drain 1800
    .venv/bin/python -m harness.chaos --seed 7 --agents 20 --messages 2000      # the short version

The report (JSON) is printed and written to <work dir>/report.json; the exit status is 1 when any check
fails.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import functools
import hashlib
import json
import logging
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ADMIN = "chaos-admin-token"
RUN_EVERY = 25
"""An agent spawns a child with a run before every RUN_EVERY-th message."""
RUN_TASK = "chaos job"
FAULTS = ("mesh", "host", "nats", "ioa")
NEAR, FAR = "near", "far"
"""The IOA node ids of mesh process 0 and of the far mesh."""


@dataclass
class Plan:
    seed: int = 1
    agents: int = 100
    messages: int = 100_000
    hosts: int = 4
    far_agents: int = 10
    """Agents of the far mesh, all senders (0: no IOA network, no far mesh)."""
    far_messages: int = 0
    """Messages each far agent sends (0: as many as each local sender, out of `messages`)."""
    duration_s: float = 1800.0
    """The faults stop after this long even when the senders are not done."""
    fault_every_s: float = 5.0
    min_faults: int = 0
    """The faults go on after the senders are done until this many were injected (within duration_s): a
    machine slow to start processes again fits fewer faults among the sends (a fault waits for its victim
    to be back), and a soak with too few proves little."""
    faults: tuple[str, ...] = FAULTS
    """What may be killed."""
    drain_s: float = 180.0
    """How long the consumers get, after the faults, to consume what was accepted."""
    pace_s: float = 0.0
    """The senders spread their messages over at least this long (0: as fast as they go), so the faults
    fall among the sends however fast the machine is (an idle machine sent the suite's 1,000 local messages in 10 s,
    between one fault and the next)."""
    work_dir: Path | None = None


@dataclass
class Report:
    seed: int
    agents: int
    messages_planned: int
    accepted: int = 0
    accepted_over_ioa: int = 0
    """Of them, sent by the far mesh's agents across the IOA network."""
    refused: int = 0
    consumed: int = 0
    dead_lettered: int = 0
    """Accepted, then dead-lettered (too many delivery attempts: each redelivery after a stream broke counts
    one), each with its DEAD_LETTERED event and a notice to its sender: accounted for, not consumed."""
    lost: int = 0
    """Accepted, and neither consumed nor dead-lettered."""
    consumed_twice: int = 0
    reordered: int = 0
    runs: int = 0
    announces_missing: int = 0
    announces_twice: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.consumed_twice or self.reordered or self.announces_missing
                    or self.announces_twice) and self.accepted > 0


# -- processes ---------------------------------------------------------------------------
class Proc:
    """A child process started again with the same arguments after a kill, its output in a log file."""

    def __init__(self, name: str, argv: list[str], log: Path, ready: str = ""):
        self.name, self.argv, self.log_path, self.ready = name, argv, log, ready
        self.proc: subprocess.Popen[bytes] | None = None
        self.refused = 0
        """Starts that failed since the last look (restart)."""

    def start(self, timeout: float = 60.0) -> None:
        log = self.log_path.open("ab")
        start = self.log_path.stat().st_size
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        log.close()
        if not self.ready:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.log_path.open("rb") as seen:
                seen.seek(start)
                if self.ready.encode() in seen.read():
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start: {self.log_path.read_text()[-2000:]}")

    def restart(self, attempts: int = 30) -> None:
        """Start again as a supervisor would: a mesh process refuses to start while NATS has no leader for
        its streams (a node was just killed), and exits; it is started again a second later."""
        for attempt in range(attempts):
            try:
                self.start()
                return
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                self.refused += 1
                self.kill()
                time.sleep(1.0)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def _free_port() -> int:
    from harness.nats import free_port

    return free_port()


# -- the orchestrator ------------------------------------------------------------------------
def soak(plan: Plan) -> Report:
    from harness.nats import NatsCluster, wait_for_jetstream

    started = time.monotonic()
    work = plan.work_dir or Path(tempfile.mkdtemp(prefix="inboxmesh-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(plan.seed)
    faults: collections.Counter[str] = collections.Counter()
    cluster = NatsCluster(work / "nats").start()
    meshes: list[Proc] = []
    hosts: list[Proc] = []
    network: Proc | None = None
    try:
        asyncio.run(wait_for_jetstream(cluster.urls, timeout=60, replicas=3))
        ioa: list[str] = []
        if plan.far_agents:
            ioa_port = _free_port()
            network = Proc("ioa", [sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "warning",
                                   "ioa-server", "--port", str(ioa_port)],
                           work / "ioa.log", ready="ioa network listening on")
            network.start()
            ioa = ["--ioa-network", f"127.0.0.1:{ioa_port}"]
        ports = [_free_port(), _free_port()]
        for i, port in enumerate(ports):
            mesh = Proc(f"mesh{i}", _mesh_argv(port, work / f"mesh{i}", plan, *cluster.mesh_args(),
                                               *(ioa + ["--node-id", NEAR] if ioa and i == 0 else [])),
                        work / f"mesh{i}.log", ready="inboxmesh listening on")
            mesh.start()
            meshes.append(mesh)
        addresses = [f"127.0.0.1:{p}" for p in ports]
        far_address = ""
        if ioa:
            far_port = _free_port()
            far = Proc("far", _mesh_argv(far_port, work / "far", plan, *ioa, "--node-id", FAR),
                       work / "far.log", ready="inboxmesh listening on")
            far.start()
            meshes.append(far)  # stopped with the others; not among the faults (the network and mesh 0 are)
            far_address = f"127.0.0.1:{far_port}"
        state = asyncio.run(_register(addresses[0], far_address, plan))
        state_path = work / "state.json"
        state_path.write_text(json.dumps(state))
        for i in range(_host_count(plan)):
            far_host = i == plan.hosts
            first = (i // 2) % 2  # (host 2k sends, 2k+1 receives) half the senders and receivers on each first
            order = addresses[first:] + addresses[:first]
            host = Proc(f"host{i}", [sys.executable, "-m", "harness.chaos", "--role", "host", "--state",
                                     str(state_path), "--index", str(i), "--hosts", str(plan.hosts),
                                     "--target", far_address if far_host else "ipv4:" + ",".join(order),
                                     "--work-dir", str(work)],
                        work / f"host{i}.out")
            host.start()
            hosts.append(host)
        deadline = started + plan.duration_s
        next_fault = time.monotonic() + rng.uniform(0.5, 1.5) * plan.fault_every_s
        while time.monotonic() < deadline and (not _all_done(work, plan) or _injected(faults) < plan.min_faults):
            time.sleep(0.2)
            _supervise(hosts, work, faults)
            if time.monotonic() < next_fault:
                continue
            next_fault = time.monotonic() + rng.uniform(0.5, 1.5) * plan.fault_every_s
            kind = rng.choice([f for f in plan.faults if f != "ioa" or network is not None])
            faults[kind] += 1
            at = time.monotonic() - started
            if kind == "mesh":
                victim = rng.choice(meshes[:2])
                _timeline(work, at, victim.name)
                victim.kill()
                time.sleep(rng.uniform(0.2, 2.0))
                victim.restart()
                faults["mesh starts refused"] += victim.refused
                victim.refused = 0
            elif kind == "host":
                victim = rng.choice(hosts)
                _timeline(work, at, victim.name)
                victim.kill()
                time.sleep(rng.uniform(0.2, 2.0))
                victim.start()
            elif kind == "ioa":
                assert network is not None  # (drawn only when there is one)
                _timeline(work, at, network.name)
                network.kill()  # both relays lose their connection, and reconnect once it is back
                time.sleep(rng.uniform(0.2, 2.0))
                network.start()
            else:
                node = rng.choice(cluster.nodes)  # one at a time: the other two keep the quorum
                _timeline(work, at, f"nats node {cluster.nodes.index(node)}")
                node.kill()
                time.sleep(rng.uniform(0.5, 3.0))
                node.start()
        # no more faults: the senders finish, then the consumers take what is left
        finish = time.monotonic() + plan.drain_s
        while time.monotonic() < finish and not _all_done(work, plan):
            time.sleep(0.5)
            _supervise(hosts, work, faults)
        asyncio.run(_drain(addresses[0], work, plan, finish))
        report = asyncio.run(_check(addresses[0], work, plan))
        report.faults = dict(faults)
        report.seconds = round(time.monotonic() - started, 1)
        (work / "report.json").write_text(json.dumps(asdict(report), indent=2))
        return report
    finally:
        for host in hosts:
            host.terminate()
        for mesh in meshes:
            mesh.terminate()
        if network is not None:
            network.terminate()
        cluster.kill()


def _mesh_argv(port: int, data_dir: Path, plan: Plan, *extra: str) -> list[str]:
    return [sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "warning", "up", "--port", str(port),
            "--no-demo", "--data-dir", str(data_dir), "--admin-token", ADMIN,
            "--max-active-children", str(plan.agents + 64), *extra]


def _timeline(work: Path, at: float, victim: str) -> None:
    """When each fault came and what it killed (faults.log), to read beside the logs."""
    with (work / "faults.log").open("a") as timeline:
        timeline.write(f"{at:.1f} {victim}\n")


def _injected(faults: collections.Counter[str]) -> int:
    """The faults injected so far (not the refused starts and host exits counted beside them)."""
    return sum(n for kind, n in faults.items() if kind in FAULTS)


def _host_count(plan: Plan) -> int:
    """The hosts of the near agents, and one more for the far mesh's agents when there are any."""
    return plan.hosts + (1 if plan.far_agents else 0)


def _all_done(work: Path, plan: Plan) -> bool:
    return all((work / f"host{i}.done").exists() for i in range(_host_count(plan)))


def _supervise(hosts: list[Proc], work: Path, faults: collections.Counter[str]) -> None:
    """A host that ended by itself (a bug, an error it did not expect) is started again, as by a supervisor,
    and counted."""
    for i, host in enumerate(hosts):
        if host.proc is not None and host.proc.poll() is not None and not (work / f"host{i}.done").exists():
            faults["host exits"] += 1
            host.start()


async def _register(address: str, far_address: str, plan: Plan) -> dict[str, Any]:
    from inboxmesh.client.mesh import MeshClient

    async def agents_of(at: str, lead_name: str, prefix: str, count: int) -> list[dict[str, str]]:
        async with MeshClient(at, admin_token=ADMIN, timeout=30) as client:
            lead = await client.register(lead_name)
            agents = []
            for i in range(count):
                agent = await lead.spawn(f"{prefix}{i}", inbox_capacity=100_000)
                agents.append({"id": agent.agent_id, "credential": agent.credential,
                               "info": base64.b64encode(agent.info.SerializeToString()).decode()})
            return agents

    near = await agents_of(address, "chaos-lead", "agent", plan.agents)
    far = await agents_of(far_address, "chaos-far", "far", plan.far_agents) if far_address else []
    per_agent = max(1, plan.messages // (len(near[0::2]) + (0 if plan.far_messages else len(far))))
    return {"seed": plan.seed, "agents": near, "far_agents": far, "per_agent": per_agent,
            "far_per_agent": plan.far_messages or per_agent, "salt": secrets.token_hex(16),
            "paced_from": time.time(), "pace_s": plan.pace_s}


def _as_seen(state: dict[str, Any], sender: str, n: str) -> tuple[str, str]:
    """(sender, message id) of message n of `sender` as the near mesh's record shows it: a far agent's is
    `ioa:far/<agent>` with the IOA message id `far:<agent>:m-<n>` (docs/ioa.md, "Addresses")."""
    if sender in state["far_ids"]:
        return f"ioa:{FAR}/{sender}", f"{FAR}:{sender}:m-{n}"
    return sender, f"m-{n}"


def _number(message_id: str) -> int | None:
    """n of a soak message's id (`m-<n>`, or `far:<agent>:m-<n>` from across the network), else None."""
    local = message_id.rpartition(":")[2] if message_id.startswith(FAR + ":") else message_id
    return int(local[2:]) if local.startswith("m-") and local[2:].isdigit() else None


def _load_state(work: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((work / "state.json").read_text())
    state["far_ids"] = {a["id"] for a in state.get("far_agents", [])}
    return state


def _log_lines(work: Path, plan: Plan) -> list[list[str]]:
    lines = []
    for i in range(_host_count(plan)):
        path = work / f"host{i}.log"
        if path.exists():
            lines += [line.split() for line in path.read_text().splitlines() if line.endswith(" .")]
    return lines


async def _drain(address: str, work: Path, plan: Plan, until: float) -> None:
    """Until the record shows every accepted message consumed (or dead-lettered) and the announce of every
    run spawned consumed (or time is up), sweeping the runs meanwhile so that announces waiting for a retry
    go now. (The record, not the hosts' logs: a host killed after its ack was stored and before it wrote
    its line never logs that message, which is not delivered again.)"""
    from inboxmesh.client.mesh import MeshClient
    from inboxmesh.events.v1 import events_pb2 as ev
    from services.store.base import ANNOUNCE_ID_PREFIX

    state = _load_state(work)
    done: set[tuple[str, str]] = set()
    after = 0
    async with MeshClient(address, admin_token=ADMIN, timeout=30) as client:
        while time.monotonic() < until:
            while len(page := await client.admin_events(after=after, limit=1000)) > 0:
                after = page[-1].event_id
                done |= {("" if e.message_id.startswith(ANNOUNCE_ID_PREFIX) else e.sender, e.message_id)
                         for e in page if e.kind in (ev.EVENT_KIND_MESSAGE_CONSUMED,
                                                     ev.EVENT_KIND_MESSAGE_DEAD_LETTERED)}
            lines = _log_lines(work, plan)
            wanted = {_as_seen(state, line[1], line[2]) for line in lines if line[0] == "r"}
            wanted |= {("", ANNOUNCE_ID_PREFIX + line[3]) for line in lines if line[0] == "s"}
            if wanted <= done:
                return
            await client.sweep_runs()
            await asyncio.sleep(1.0)


async def _check(address: str, work: Path, plan: Plan) -> Report:
    from harness.evidence import Record
    from inboxmesh.client.mesh import MeshClient
    from inboxmesh.events.v1 import events_pb2 as ev
    from inboxmesh.registry.v1 import registry_pb2 as reg
    from services.store.base import ANNOUNCE_ID_PREFIX

    state = _load_state(work)
    async with MeshClient(address, admin_token=ADMIN, timeout=60) as client:
        record = await Record.read(client)
        lines = _log_lines(work, plan)
        accepted = {_as_seen(state, line[1], line[2]): line[3] for line in lines if line[0] == "r"}
        refused = {_as_seen(state, line[1], line[2]): " ".join(line[4:-1]) for line in lines if line[0] == "x"}
        consumed: collections.Counter[tuple[str, str]] = collections.Counter()
        order: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
        announces: collections.Counter[str] = collections.Counter()
        runs: set[str] = set()
        dead: set[tuple[str, str]] = set()
        for event in record.events:
            if event.kind == ev.EVENT_KIND_MESSAGE_CONSUMED:
                if event.message_id.startswith(ANNOUNCE_ID_PREFIX):
                    announces[event.message_id[len(ANNOUNCE_ID_PREFIX):]] += 1
                elif (n := _number(event.message_id)) is not None:
                    consumed[(event.sender, event.message_id)] += 1
                    order[(event.sender, event.recipient)].append(n)
            elif event.kind == ev.EVENT_KIND_MESSAGE_DEAD_LETTERED:
                dead.add((event.sender, event.message_id))
            elif event.kind == ev.EVENT_KIND_RUN_CREATED and event.detail == RUN_TASK:
                runs.add(event.message_id)  # (the agents themselves are children of the lead, with runs never ended)
        unaccounted = accepted.keys() - consumed.keys() - dead
        handles = {a["id"]: client.agent(reg.Agent.FromString(base64.b64decode(a["info"])), a["credential"])
                   for a in state["agents"]}
        states = []
        for sender, message_id in sorted(m for m in unaccounted if m[0] in handles)[:5]:  # the first lost ones
            status = await handles[sender].status(message_id)
            states.append(f"{sender} {message_id}: state {status.state}, {status.delivery_attempts} attempts")
    dead_accepted = (accepted.keys() & dead) - consumed.keys()
    lost = sorted(f"{s} {m}" for s, m in unaccounted)
    twice = sorted(f"{s} {m}" for (s, m), n in consumed.items() if n > 1)
    reordered = sorted(f"{pair[0]}->{pair[1]}" for pair, ns in order.items()
                       if any(b <= a for a, b in zip(ns, ns[1:])))
    missing = sorted(r for r in runs if announces[r] == 0)
    announced_twice = sorted(r for r, n in announces.items() if n > 1)
    return Report(seed=plan.seed, agents=plan.agents, messages_planned=plan.messages, accepted=len(accepted),
                  accepted_over_ioa=sum(1 for sender, _ in accepted if sender.startswith("ioa:")),
                  refused=len(refused), consumed=sum(consumed.values()), dead_lettered=len(dead_accepted),
                  lost=len(lost), consumed_twice=len(twice),
                  reordered=len(reordered), runs=len(runs), announces_missing=len(missing),
                  announces_twice=len(announced_twice),
                  examples={"refused": sorted(f"{s} {m}: {status}" for (s, m), status in refused.items())[:5],
                            "lost": lost[:5], "lost_states": states, "consumed_twice": twice[:5],
                            "reordered": reordered[:5],
                            "announces_missing": missing[:5], "announces_twice": announced_twice[:5]})


# -- an agent host ------------------------------------------------------------------------------
class HostLog:
    """What a host did, one line each, fsynced (a host is killed at any moment; a line is whole or
    absent): `r agent n recipient seq .` a receipt ACCEPTED or DUPLICATE, `x agent n recipient status .`
    one that refused it, `c agent seq sender message_id .` a message the host's ack consumed,
    `s agent k run_id .` a run spawned."""

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("a")

    def write(self, *fields: object) -> None:
        self._file.write(" ".join(str(f) for f in fields) + " .\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def done_upto(self) -> dict[str, int]:
        """Per agent, the next message number to send (after the last one with an outcome)."""
        upto: dict[str, int] = {}
        for line in self.path.read_text().splitlines():
            parts = line.split()
            if line.endswith(" .") and parts[0] in ("r", "x"):
                upto[parts[1]] = max(upto.get(parts[1], 0), int(parts[2]) + 1)
        return upto


def _request_id(salt: str, agent_id: str, n: int) -> str:
    """The spawn's request_id (the secret its child's credential comes from), the same when a host started
    again spawns the child of message n again."""
    return hashlib.sha256(f"{salt}:{agent_id}:{n}".encode()).hexdigest()


def _recipient(seed: int, sender: str, n: int, receivers: list[str]) -> str:
    return random.Random(f"{seed}:{sender}:{n}").choice(receivers)


async def host(state: dict[str, Any], index: int, hosts: int, target: str, work: Path) -> None:
    from inboxmesh.client import errors
    from inboxmesh.client.mesh import MeshClient
    from inboxmesh.client.stream import InboxStream
    from inboxmesh.inbox.v1 import inbox_pb2
    from inboxmesh.registry.v1 import registry_pb2 as reg

    receivers = [a["id"] for a in state["agents"][1::2]]
    far = index == hosts  # the far mesh's host: all its agents send, across the network, and spawn no runs
    mine = state["far_agents"] if far else state["agents"][index::hosts]
    senders = {a["id"] for a in mine} if far else {a["id"] for a in state["agents"][0::2]}
    log = HostLog(work / f"host{index}.log")
    upto = log.done_upto()
    seed, per_agent = state["seed"], state["far_per_agent" if far else "per_agent"]

    async def retried(call: Any, what: str = "") -> Any:
        last = ""
        while True:
            try:
                return await call()
            except (errors.Unavailable, errors.DeadlineExceeded, errors.ResourceExhausted) as exc:
                # to host<i>.out, once per change of error: what a stalled host waited for, to read beside
                # the meshes' logs and faults.log when a soak falls short
                said = f"{type(exc).__name__} {exc.reason}"
                if said != last:
                    last = said
                    print(f"{time.time():.1f} {what} retried after {said}: {errors.clip(str(exc), 200)}",
                          file=sys.stderr, flush=True)
                await asyncio.sleep(0.2)

    async with MeshClient(target, timeout=10) as client:
        handles = {}
        for agent in mine:
            handles[agent["id"]] = client.agent(reg.Agent.FromString(base64.b64decode(agent["info"])),
                                                agent["credential"])
        stream = InboxStream(list(handles.values()), max_in_flight=256)

        taken: dict[str, set[tuple[str, str]]] = collections.defaultdict(set)
        """Per agent, the (sender, message id) its acks won (logged): a message consumed by an ack of this
        host whose answer was lost is told from one consumed elsewhere (InboxStream.consume_many)."""

        delivered: asyncio.Queue[list[Any]] = asyncio.Queue()

        async def read() -> None:
            # only reading the stream opens it again after it broke: acks are written by ack() meanwhile
            async for item in stream:
                if item.messages:
                    delivered.put_nowait(item.messages)

        async def ack() -> None:
            # Everything delivered so far in one ack, each agent's messages in sequence order; an ack whose
            # outcome is not known (the stream lost, no answer in time) is written again, with what came
            # since, until answered: an ack the mesh stored before its answer was lost reads ALREADY_CONSUMED
            # then, and counts as this host's (`taken` tells it from one consumed elsewhere). Copies delivered
            # again after a reconnect join the same ack.
            by_agent: dict[str, dict[int, Any]] = collections.defaultdict(dict)
            while True:
                batches = [await delivered.get()] if not by_agent else []
                while not delivered.empty():
                    batches.append(delivered.get_nowait())
                for batch in batches:
                    for message in batch:
                        by_agent[message.recipient][message.sequence] = message
                try:
                    # every agent of the ack named in `taken` (an empty set for one that won nothing yet): an
                    # agent it does not name is acked as if alone, and its lost ack's ALREADY_CONSUMED would not
                    # count as its own (consume_many)
                    done = await stream.consume_many({a: [m[s] for s in sorted(m)] for a, m in by_agent.items()},
                                                     taken={a: taken[a] for a in by_agent})
                except (errors.Unavailable, errors.DeadlineExceeded):
                    await asyncio.sleep(0.2)
                    continue
                except errors.MeshError:
                    by_agent.clear()  # refused outright: delivered again if it still stands
                    continue
                for agent_id, won in done.messages.items():
                    for message in won:
                        taken[agent_id].add((message.sender, message.message_id))
                        log.write("c", agent_id, message.sequence, message.sender, message.message_id)
                by_agent.clear()  # (an agent refused, closed say: nothing to write again)

        async def consume() -> None:
            # the acker ending (an error it does not expect) ends the host too, to be seen and started again,
            # not a host that reads on and never acks
            acker, reader = asyncio.create_task(ack()), asyncio.create_task(read())
            try:
                done, _ = await asyncio.wait({acker, reader}, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
                if acker in done:
                    raise RuntimeError("the acker ended")
            finally:
                acker.cancel()
                reader.cancel()

        async def send(agent_id: str) -> None:
            handle = handles[agent_id]
            for n in range(upto.get(agent_id, 0), per_agent):
                # on schedule (a host started again keeps it): message n of per_agent not before its time
                due = state.get("paced_from", 0.0) + state.get("pace_s", 0.0) * n / per_agent
                if due > time.time():
                    await asyncio.sleep(due - time.time())
                if n % RUN_EVERY == RUN_EVERY - 1 and not far:
                    run = reg.RunSpec(task=RUN_TASK, task_message_id=f"task-{n}", run_timeout_s=20,
                                      cleanup=reg.RUN_CLEANUP_DELETE)
                    try:
                        child = await retried(functools.partial(handle.spawn, f"job{n}", run=run,
                                                                request_id=_request_id(state["salt"], agent_id, n)))
                    except errors.FailedPrecondition:  # spawned before this host was killed, ended, closed
                        child = None
                    if child is not None:
                        log.write("s", agent_id, n, child.run_id)
                        worker = client.agent(child.info, child.credential)
                        try:
                            await retried(functools.partial(worker.end_run, "done"))
                        except errors.MeshError:
                            pass  # ended or closed already (a retry after a kill): its announce comes anyway
                recipient = _recipient(seed, agent_id, n, receivers)
                sending = functools.partial(handle.send, f"ioa:{NEAR}/{recipient}" if far else recipient,
                                            f"chaos {n}", message_id=f"m-{n}")
                while True:
                    receipt = await retried(sending, f"{agent_id} m-{n}")
                    if receipt.status in (inbox_pb2.RECEIPT_STATUS_ACCEPTED, inbox_pb2.RECEIPT_STATUS_DUPLICATE):
                        log.write("r", agent_id, n, recipient, receipt.sequence)
                        break
                    if receipt.status == inbox_pb2.RECEIPT_STATUS_INBOX_FULL:
                        await asyncio.sleep(0.5)
                        continue
                    log.write("x", agent_id, n, recipient, inbox_pb2.ReceiptStatus.Name(receipt.status),
                              "_".join(receipt.detail[:160].split()) or "-")  # why, for the report's examples
                    break

        consumer = asyncio.create_task(consume())
        await asyncio.gather(*(send(agent_id) for agent_id in handles if agent_id in senders))
        (work / f"host{index}.done").write_text("done\n")
        await consumer  # until the orchestrator stops this host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--far-messages", type=int, default=0,
                        help="messages each far agent sends (default: as many as each local sender)")
    parser.add_argument("--far-agents", type=int, default=10,
                        help="agents of a far mesh that send across an IOA network (0: none)")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of faults at most")
    parser.add_argument("--fault-every", type=float, default=5.0, help="seconds between faults, on average")
    parser.add_argument("--min-faults", type=int, default=0,
                        help="go on with faults after the senders are done until this many (within --duration)")
    parser.add_argument("--drain", type=float, default=180.0)
    parser.add_argument("--pace", type=float, default=0.0,
                        help="spread the sends over at least this many seconds (0: as fast as they go)")
    parser.add_argument("--faults", default=",".join(FAULTS), help="what may be killed: mesh, host, nats, ioa")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--role", choices=["host"], help=argparse.SUPPRESS)
    parser.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "host":
        # the stream's reconnects, timed, in host<i>.out beside faults.log
        logging.basicConfig(format="%(asctime)s %(name)s %(message)s", level=logging.WARNING)
        logging.getLogger("inboxmesh.client.stream").setLevel(logging.INFO)
        asyncio.run(host(json.loads(args.state.read_text()), args.index, args.hosts, args.target, args.work_dir))
        return
    report = soak(Plan(seed=args.seed, agents=args.agents, messages=args.messages, hosts=args.hosts,
                       far_agents=args.far_agents, far_messages=args.far_messages,
                       duration_s=args.duration, fault_every_s=args.fault_every, min_faults=args.min_faults,
                       drain_s=args.drain, pace_s=args.pace,
                       faults=tuple(args.faults.split(",")),
                       work_dir=args.work_dir))
    print(json.dumps(asdict(report), indent=2))
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
