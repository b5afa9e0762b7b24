"""The host process of the many-agent benchmark (bench/many_bench.py starts
it): it registers the agents, attaches them, sends between them and consumes
what they receive, and times all of it. Commands come on stdin, one answer
line on stdout each (bench/procs.py):

    register <agents> <window>      -> registered {"seconds": ...}
    attach <one|per-agent> <window> -> attached {"seconds": ...}
    load <messages> <in flight> <id prefix> -> loaded {"msgs_per_s": ..., "p50_ms": ..., ...}
    wake <messages> <seconds>       -> woken {"from_receipt_p50_ms": ..., ...}

Two kinds of host (--host):
- `client`: the host side of the client, bench/many_client.py (InboxStream,
  one for all agents or one per agent). A message is *woken* when the
  host-side stream yields its delivery to the consumer, and *consumed* when
  its ack came back CONSUMED. Each agent has at most one ack out at a time
  and its next ack takes everything that arrived meanwhile, as an agent's
  turn does (agent_host/runner.py); agents with nothing to do cost no task.
- `agent_host`: a real agent_host.Host with a scripted model (every agent
  answers a turn with text and goes idle). A message is *woken* when the
  host starts the recipient's turn (the host's TURN_STARTED observation:
  after the runner recorded AGENT_WOKEN and TURN_STARTED in the mesh), and
  *consumed* when the runner's ack of it came back (its "consumed"
  observation). Agents are registered and subscribed by Host.start_child, so
  `attach` has nothing left to do.

Sends are made by the host's agents: for each message a random sender among
the first half of the N and a random recipient among the second half (a
fixed seed; why two halves: `pick`), on one SendStream for all of them
(--sends stream) or through the unary Send with the sender's credential
(--sends unary); bench/many_client.py says which calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import many_client  # noqa: E402
from bench.common import now_ns, payload, percentile  # noqa: E402
from bench.procs import read_command  # noqa: E402
from inboxmesh.client.mesh import AgentHandle, MeshClient  # noqa: E402
from inboxmesh.common.v1 import envelope_pb2 as env_pb  # noqa: E402
from inboxmesh.inbox.v1 import inbox_pb2  # noqa: E402

WAIT_S = 120.0
"""The longest a message may take to be woken or consumed before the run fails."""
ANSWERS = {"register": "registered", "attach": "attached", "load": "loaded", "wake": "woken"}
MAX_IN_FLIGHT = 64
"""Delivered-but-unacked messages per agent (agent_host's default)."""


class Side(Protocol):
    """What the load and wake phases need from either kind of host."""

    agents: list[AgentHandle]

    async def register(self, count: int, window: int) -> None: ...

    async def attach(self, streams: many_client.StreamMode, window: int) -> None: ...

    def expect(self, message_id: str, recipient: str) -> tuple[asyncio.Future[int], asyncio.Future[int]]:
        """Futures of the times (now_ns) the message is woken and consumed; made before it is sent."""
        ...

    def stages(self, recipient: str) -> dict[str, int]:
        """When the steps before the recipient's last wake happened (now_ns), by name."""
        ...

    async def send(self, sender: AgentHandle, recipient: AgentHandle, message_id: str) -> inbox_pb2.Receipt:
        """One message of the load from `sender` (an agent of the host) to `recipient`; its receipt."""
        ...

    async def close(self) -> None: ...


class _Expected:
    """The woken and consumed futures of the messages a phase waits for."""

    def __init__(self) -> None:
        self.woken: dict[str, asyncio.Future[int]] = {}
        self.consumed: dict[str, asyncio.Future[int]] = {}

    def _futures(self, message_id: str) -> tuple[asyncio.Future[int], asyncio.Future[int]]:
        loop = asyncio.get_running_loop()
        woken = self.woken[message_id] = loop.create_future()
        consumed = self.consumed[message_id] = loop.create_future()
        return woken, consumed

    def mark(self, futures: dict[str, asyncio.Future[int]], message_id: str, at: int) -> None:
        future = futures.pop(message_id, None)
        if future is not None and not future.done():
            future.set_result(at)


class ClientSide(_Expected):
    """The client-level host: bench/many_client.py's HostInbox and HostSender, and a consumer."""

    def __init__(self, client: MeshClient, sends: many_client.SendMode) -> None:
        super().__init__()
        self.client = client
        self.sends = sends
        self.agents: list[AgentHandle] = []
        self.sender: many_client.HostSender | None = None
        self.inbox: many_client.HostInbox | None = None
        self._pending: dict[str, list[env_pb.Envelope]] = {}
        self._acking: set[str] = set()
        self._flush: asyncio.Handle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def register(self, count: int, window: int) -> None:
        parent, self.agents = await many_client.register(self.client, count)
        self.sender = many_client.HostSender(self.client, parent, self.sends)

    async def attach(self, streams: many_client.StreamMode, window: int) -> None:
        self.inbox = many_client.HostInbox(self.agents, streams, max_in_flight=MAX_IN_FLIGHT,
                                           on_messages=self._on_messages)
        await self.inbox.attach(window)

    def expect(self, message_id: str, recipient: str) -> tuple[asyncio.Future[int], asyncio.Future[int]]:
        if self.inbox is not None and self.inbox.failed.done():
            self.inbox.failed.result()  # raises the stream's failure
        return self._futures(message_id)

    def stages(self, recipient: str) -> dict[str, int]:
        return {}

    def _on_messages(self, messages: list[env_pb.Envelope]) -> None:
        assert self.inbox is not None, "deliveries come only after attach"
        at = now_ns()
        for message in messages:
            self.mark(self.woken, message.message_id, at)
            self._pending.setdefault(message.recipient, []).append(message)
        if self.inbox.acks_many:
            if self._flush is None:  # everything the stream yields before the loop comes round: one ack
                self._flush = asyncio.get_running_loop().call_soon(self._ack_pending)
            return
        for agent_id in {m.recipient for m in messages} - self._acking:
            self._acking.add(agent_id)
            self._start(self._ack(agent_id))

    def _start(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _ack_pending(self) -> None:
        """One ack request for every agent with messages pending and no ack out."""
        self._flush = None
        batch = {a: self._pending.pop(a) for a in list(self._pending) if a not in self._acking}
        if batch:
            self._acking.update(batch)
            self._start(self._ack_many(batch))

    async def _ack_many(self, batch: dict[str, list[env_pb.Envelope]]) -> None:
        assert self.inbox is not None, "deliveries come only after attach"
        try:
            try:
                won = await self.inbox.consume_many(batch)
            except Exception as exc:
                self._fail([m for messages in batch.values() for m in messages], exc)
                raise
            at = now_ns()
            for messages in won.values():
                for message in messages:
                    self.mark(self.consumed, message.message_id, at)
        finally:
            self._acking.difference_update(batch)
            if self._pending and self._flush is None:
                self._flush = asyncio.get_running_loop().call_soon(self._ack_pending)

    async def _ack(self, agent_id: str) -> None:
        """One ack at a time for the agent (on its own stream), each taking all that is pending."""
        assert self.inbox is not None, "deliveries come only after attach"
        try:
            while batch := self._pending.pop(agent_id, None):
                try:
                    won = await self.inbox.consume(agent_id, batch)
                except Exception as exc:
                    self._fail(batch, exc)
                    raise
                at = now_ns()
                for message in won:
                    self.mark(self.consumed, message.message_id, at)
        finally:
            self._acking.discard(agent_id)

    def _fail(self, messages: list[env_pb.Envelope], exc: Exception) -> None:
        for message in messages:
            future = self.consumed.pop(message.message_id, None)
            if future is not None and not future.done():
                future.set_exception(exc)

    async def send(self, sender: AgentHandle, recipient: AgentHandle, message_id: str) -> inbox_pb2.Receipt:
        assert self.sender is not None, "sends come only after register"
        return await self.sender.send(sender, recipient.agent_id, payload(0), message_id)

    async def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.sender is not None:
            await self.sender.close()
        if self.inbox is not None:
            await self.inbox.close()


class AgentHostSide(_Expected):
    """A real agent_host.Host with a scripted model that idles after every turn."""

    def __init__(self, client: MeshClient, data_dir: Path, sends: many_client.SendMode) -> None:
        from agent_host.config import Budget, HostConfig
        from agent_host.host import AgentProfile, Host, HostEvent
        from agent_host.models.scripted import ScriptedModel, say

        super().__init__()
        self.client = client
        self.agents: list[AgentHandle] = []
        self.sends = sends
        self.sender: many_client.HostSender | None = None
        self._turn_of: dict[str, asyncio.Future[int]] = {}
        self._woken_recorded: dict[str, int] = {}
        unlimited = Budget(max_model_requests=10**9, max_wall_time_s=10.0**7, max_turns_per_agent=10**9)
        config = HostConfig(mesh_address=client.target, data_dir=data_dir, max_in_flight=MAX_IN_FLIGHT,
                            budget=unlimited)
        model = ScriptedModel(lambda view: say("ok"), name="idle")
        self.host = Host(config, lambda record: AgentProfile(model=model), client=client)

        def observe(event: HostEvent) -> None:
            at = now_ns()
            if event.kind == "turn_started":
                turn = self._turn_of.pop(event.agent_id, None)
                if turn is not None and not turn.done():
                    turn.set_result(at)
            elif event.kind == "agent_woken":
                self._woken_recorded[event.agent_id] = at
            elif event.kind == "consumed":
                self.mark(self.consumed, event.detail.split(" ", 1)[0], at)

        self.host.observers.append(observe)

    async def register(self, count: int, window: int) -> None:
        await self.host.start()
        parent = await self.host.start_task("many", "stay idle")
        self.sender = many_client.HostSender(self.client, parent.handle, self.sends)
        children: list[AgentHandle | None] = [None] * count

        async def spawn(index: int) -> None:
            record = await self.host.start_child(parent.record, name=f"a{index}", task="stay idle", mode="async",
                                                 history=[], budget=parent.budget)
            children[index] = self.host.runners[record.agent_id].handle

        await many_client.windowed(count, window, spawn)
        self.agents = [c for c in children if c is not None]

    async def attach(self, streams: many_client.StreamMode, window: int) -> None:
        return None  # Host.start_child subscribed each agent (on the host's own inbox stream or streams)

    def expect(self, message_id: str, recipient: str) -> tuple[asyncio.Future[int], asyncio.Future[int]]:
        _, consumed = self._futures(message_id)
        self.woken.pop(message_id)
        turn = self._turn_of[recipient] = asyncio.get_running_loop().create_future()
        self._woken_recorded.pop(recipient, None)
        return turn, consumed

    def stages(self, recipient: str) -> dict[str, int]:
        """The runner recorded AGENT_WOKEN in the mesh (and then TURN_STARTED, which is the wake)."""
        at = self._woken_recorded.get(recipient)
        return {"agent_woken_recorded": at} if at is not None else {}

    async def send(self, sender: AgentHandle, recipient: AgentHandle, message_id: str) -> inbox_pb2.Receipt:
        """From the agent's handle, beside the host (the runners' own sends are their model's)."""
        assert self.sender is not None, "sends come only after register"
        return await self.sender.send(sender, recipient.agent_id, payload(0), message_id)

    async def close(self) -> None:
        if self.sender is not None:
            await self.sender.close()
        await self.host.stop()


def pick(rng: random.Random, agents: list[AgentHandle]) -> tuple[AgentHandle, AgentHandle]:
    """A random sender from the first half of the agents and a random recipient from the second.

    Why two halves: an agent's message continues the causal chain of what it consumed last (the
    loop guard, services/inbox/service.py), so if the agents that send also consumed, random
    traffic among them would be one endless chain, refused once it is 32 hops long or passes an
    agent 5 times (at N = 10 after a few hundred messages)."""
    half = len(agents) // 2
    return agents[rng.randrange(half)], agents[half + rng.randrange(len(agents) - half)]


async def checked_send(side: Side, sender: AgentHandle, recipient: AgentHandle, message_id: str) -> None:
    receipt = await side.send(sender, recipient, message_id)
    if receipt.status != inbox_pb2.RECEIPT_STATUS_ACCEPTED:
        raise SystemExit(f"message {message_id} to {recipient.agent_id} not accepted: {receipt}")


async def load(side: Side, rng: random.Random, count: int, in_flight: int, prefix: str) -> dict[str, Any]:
    """`count` messages between random pairs, at most `in_flight` sent and not yet consumed."""
    window = asyncio.Semaphore(in_flight)
    sent: dict[str, int] = {}
    received: dict[str, int] = {}
    woken: dict[str, int] = {}
    consumed: dict[str, int] = {}

    async def one(index: int) -> None:
        try:
            sender, recipient = pick(rng, side.agents)
            message_id = f"{prefix}{index}"
            wake, done = side.expect(message_id, recipient.agent_id)
            sent[message_id] = now_ns()
            await checked_send(side, sender, recipient, message_id)
            received[message_id] = now_ns()
            consumed[message_id] = await asyncio.wait_for(done, WAIT_S)
            woken[message_id] = wake.result() if wake.done() else consumed[message_id]
        finally:
            window.release()

    async with asyncio.TaskGroup() as group:
        for index in range(count):
            await window.acquire()
            group.create_task(one(index))
    latencies = [(consumed[k] - sent[k]) / 1e6 for k in sent]
    elapsed = (max(consumed.values()) - min(sent.values())) / 1e9
    return {"messages": count, "in_flight": in_flight, "elapsed_s": round(elapsed, 3),
            "msgs_per_s": round(count / elapsed, 1), "p50_ms": round(percentile(latencies, 50), 2),
            "p99_ms": round(percentile(latencies, 99), 2),
            "stages_p50_ms": {  # where the time of a message goes (each stage's median on its own)
                "send_to_receipt": round(percentile([(received[k] - sent[k]) / 1e6 for k in sent], 50), 2),
                "send_to_woken": round(percentile([(woken[k] - sent[k]) / 1e6 for k in sent], 50), 2),
                "woken_to_consumed": round(percentile([(consumed[k] - woken[k]) / 1e6 for k in sent], 50), 2)}}


async def wake(side: Side, rng: random.Random, count: int, seconds: float) -> dict[str, Any]:
    """Single messages to idle agents, one at a time, spread over `seconds` (so
    that heartbeats fall inside): from the accepted receipt (and from the send's
    start) to the recipient's wake. A wake before the receipt reached the
    sender counts as 0 from the receipt."""
    from_receipt: list[float] = []
    from_send: list[float] = []
    stages: dict[str, list[float]] = {}
    before_receipt = 0
    gap = seconds / count
    for index in range(count):
        started = time.monotonic()
        sender, recipient = pick(rng, side.agents)
        woken, done = side.expect(f"k{index}", recipient.agent_id)
        sent_at = now_ns()
        await checked_send(side, sender, recipient, f"k{index}")
        accepted_at = now_ns()
        woken_at = await asyncio.wait_for(woken, WAIT_S)
        await asyncio.wait_for(done, WAIT_S)  # idle again before the next
        before_receipt += woken_at < accepted_at
        from_receipt.append(max(0, woken_at - accepted_at) / 1e6)
        from_send.append((woken_at - sent_at) / 1e6)
        for stage, at in side.stages(recipient.agent_id).items():
            stages.setdefault(stage, []).append(max(0, at - accepted_at) / 1e6)
        await asyncio.sleep(max(0.0, started + gap - time.monotonic()))
    return {"wakes": count, "seconds": seconds, "woken_before_receipt": before_receipt,
            "from_receipt_p50_ms": round(percentile(from_receipt, 50), 2),
            "from_receipt_p99_ms": round(percentile(from_receipt, 99), 2),
            "from_send_p50_ms": round(percentile(from_send, 50), 2),
            "from_send_p99_ms": round(percentile(from_send, 99), 2),
            "stages_from_receipt": {k: {"p50_ms": round(percentile(v, 50), 2), "p99_ms": round(percentile(v, 99), 2)}
                                    for k, v in stages.items()}}


async def serve(address: str, kind: str, sends: many_client.SendMode, seed: int) -> None:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="manyhost") as data:
        async with MeshClient(address, timeout=60.0) as client:
            side: Side = (ClientSide(client, sends) if kind == "client"
                          else AgentHostSide(client, Path(data), sends))
            print("ready", flush=True)
            try:
                while command := await read_command():
                    name, *args = command.split()
                    started = time.monotonic()
                    if name == "register":
                        await side.register(int(args[0]), int(args[1]))
                        answer: dict[str, Any] = {"seconds": round(time.monotonic() - started, 3)}
                    elif name == "attach":
                        await side.attach(many_client.stream_mode(args[0]), int(args[1]))
                        answer = {"seconds": round(time.monotonic() - started, 3)}
                    elif name == "load":
                        answer = await load(side, rng, int(args[0]), int(args[1]), args[2])
                    elif name == "wake":
                        answer = await wake(side, rng, int(args[0]), float(args[1]))
                    else:
                        raise SystemExit(f"unknown command {command!r}")
                    print(ANSWERS[name], json.dumps(answer), flush=True)
            finally:
                await side.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True)
    parser.add_argument("--host", choices=["client", "agent_host"], default="client")
    parser.add_argument("--sends", choices=many_client.SEND_MODES, default="stream",
                        help="one SendStream for all senders, or the unary Send per message")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(serve(args.address, args.host, many_client.send_mode(args.sends), args.seed))


if __name__ == "__main__":
    main()
