"""AutoGen's gRPC runtime on the bench workload (see bench/common.py).

Three processes: a GrpcWorkerAgentRuntimeHost, a receiver worker whose
RoutedAgent handles `Msg`, and a sender worker calling runtime.send_message(
Msg, AgentId("receiver", "default")) N times with at most C calls in flight;
each goes sender -> host -> receiver and the handler's `Ack` comes back the
same way. Latency: sender's now_ns() just before send_message to the receiver's
handler having the message ("consumed"; AutoGen keeps nothing on disk). CPU:
seconds each process spent in the measured phase. WARMUP messages go first.

    .venv-autogen/bin/python bench/autogen_bench.py --messages 3000 --concurrency 64
(.venv-autogen: pip install -r bench/autogen-requirements.txt)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
from dataclasses import dataclass

import grpc
from autogen_core import (
    AgentId,
    MessageContext,
    RoutedAgent,
    message_handler,
    try_get_known_serializers_for_type,
)
from autogen_ext.runtimes.grpc import GrpcWorkerAgentRuntime, GrpcWorkerAgentRuntimeHost

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import cpu_seconds, emit, now_ns, payload, python_env, summarize  # noqa: E402
from bench.procs import Child, read_command  # noqa: E402

WARMUP = 200
RECEIVER = "receiver"


@dataclass
class Msg:
    n: int  # message number; negative for warm-up messages
    body: str


@dataclass
class Ack:
    n: int


# --- children ---
async def serve_commands(extra=dict) -> None:
    """mark: start the CPU reading; report: print it (and extra()); stop/EOF: return."""
    cpu0 = cpu_seconds()
    while (command := await read_command()) not in ("", "stop"):
        if command == "mark":
            cpu0 = cpu_seconds()
            print("marked", flush=True)
        elif command == "report":
            print("report", json.dumps({"cpu": cpu_seconds() - cpu0, **extra()}), flush=True)


class Receiver(RoutedAgent):
    """Records when its handler has each measured message; the returned Ack is the response."""

    def __init__(self, consumed: dict[int, int]) -> None:
        super().__init__("bench receiver")
        self.consumed = consumed

    @message_handler
    async def on_msg(self, message: Msg, ctx: MessageContext) -> Ack:
        if message.n >= 0:
            self.consumed[message.n] = now_ns()
        return Ack(n=message.n)


async def connect(address: str) -> GrpcWorkerAgentRuntime:
    runtime = GrpcWorkerAgentRuntime(host_address=address)
    for cls in (Msg, Ack):  # JSON serializers for the request and the response type
        runtime.add_message_serializer(try_get_known_serializers_for_type(cls))
    await runtime.start()
    return runtime


async def run_host(address: str) -> None:
    host = GrpcWorkerAgentRuntimeHost(address)
    host.start()
    async with grpc.aio.insecure_channel(address) as channel:  # ready = accepts connections
        await asyncio.wait_for(channel.channel_ready(), timeout=30)
    print("ready", flush=True)
    await serve_commands()
    await host.stop(grace=0)


async def run_receiver(address: str) -> None:
    consumed: dict[int, int] = {}
    runtime = await connect(address)
    await Receiver.register(runtime, RECEIVER, lambda: Receiver(consumed))
    print("ready", flush=True)
    await serve_commands(lambda: {"consumed": consumed})
    await runtime.stop()


async def send_all(runtime: GrpcWorkerAgentRuntime, numbers: list[int], concurrency: int, sent: dict) -> None:
    """send_message for every number, from `concurrency` tasks (= at most that many in flight)."""
    target = AgentId(RECEIVER, "default")
    todo = iter(numbers)

    async def worker() -> None:
        for n in todo:
            sent[n] = now_ns()
            ack = await runtime.send_message(Msg(n=n, body=payload(abs(n))), target)
            if not isinstance(ack, Ack) or ack.n != n:
                raise RuntimeError(f"bad response to message {n}: {ack!r}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def run_sender(address: str, messages: int, concurrency: int) -> None:
    runtime = await connect(address)
    await send_all(runtime, list(range(-WARMUP, 0)), concurrency, {})
    print("ready", flush=True)
    if await read_command() != "go":
        return
    sent: dict[int, int] = {}
    cpu0 = cpu_seconds()
    await send_all(runtime, list(range(messages)), concurrency, sent)
    print("report", json.dumps({"cpu": cpu_seconds() - cpu0, "sent": sent}), flush=True)
    await runtime.stop()


# --- parent ---
def run_parent(messages: int, concurrency: int) -> dict:
    with socket.socket() as probe:  # a free port for the host (it cannot tell which one it bound)
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    children: list[Child] = []

    def start(role: str, *extra: str) -> Child:
        children.append(Child(role, [sys.executable, os.path.abspath(__file__), "--role", role,
                                     "--address", address, *extra], python_env()))
        children[-1].expect("ready", others=children)
        return children[-1]

    try:
        host = start("host")
        receiver = start("receiver")
        sender = start("sender", "--messages", str(messages), "--concurrency", str(concurrency))  # + warm-up
        for child in (host, receiver):
            child.send("mark")
            child.expect("marked")
        sender.send("go")
        sent = json.loads(sender.expect("report", timeout=600, others=children))
        reports = {}
        for child in (receiver, host):
            child.send("report")
            reports[child.name] = json.loads(child.expect("report"))
            child.send("stop")
    finally:
        for child in reversed(children):
            child.close()
    sent_ns = {int(k): v for k, v in sent["sent"].items()}
    consumed_ns = {int(k): v for k, v in reports["receiver"]["consumed"].items()}
    cpu = {"host": reports["host"]["cpu"], "sender": sent["cpu"], "receiver": reports["receiver"]["cpu"]}
    return summarize("autogen", concurrency, sent_ns, consumed_ns, cpu)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=3000, help="measured messages (default 3000)")
    parser.add_argument("--concurrency", type=int, default=1, help="max messages in flight (default 1)")
    parser.add_argument("--role", choices=["host", "receiver", "sender"], help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.messages < 1 or args.concurrency < 1:
        parser.error("--messages and --concurrency must be at least 1")
    if args.role == "host":
        asyncio.run(run_host(args.address))
    elif args.role == "receiver":
        asyncio.run(run_receiver(args.address))
    elif args.role == "sender":
        asyncio.run(run_sender(args.address, args.messages, args.concurrency))
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally stops the children
        emit(run_parent(args.messages, args.concurrency))


if __name__ == "__main__":
    main()
