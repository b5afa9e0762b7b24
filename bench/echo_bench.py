"""The floor: a bare grpc.aio bidi-streaming echo on the bench workload.

Two processes: an echo server (one stream-stream method on raw bytes, every
request written straight back) and a client that opens one bidi stream and
writes N payloads of common.payload(i) (prefixed by the 8-byte message
number) keeping at most C sent but not yet echoed. Measured per message:
now_ns() just before the client writes it to the client reading its echo
("consumed"). No agent runtime, no serialization, no disk: the least any
gRPC design can cost for the workload. CPU is the seconds both processes spent
during the measured phase. A warm-up of WARMUP messages on the same stream
runs first and is not measured.

    .venv/bin/python bench/echo_bench.py --messages 20000 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import struct
import sys

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import cpu_seconds, emit, now_ns, payload, python_env, summarize  # noqa: E402
from bench.procs import Child, read_command  # noqa: E402

WARMUP = 200
SERVICE, METHOD = "bench.Echo", "Echo"
HEAD = struct.Struct(">q")  # message number, negative for warm-up


# --- children ---
async def echo(request_iterator, context):
    async for request in request_iterator:
        yield request


async def run_server() -> None:
    # No serializers given = requests and responses stay raw bytes (identity).
    methods = {METHOD: grpc.stream_stream_rpc_method_handler(echo)}
    handler = grpc.method_handlers_generic_handler(SERVICE, methods)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print("ready", str(port), flush=True)
    cpu0 = cpu_seconds()
    while (command := await read_command()) not in ("", "stop"):
        if command == "mark":
            cpu0 = cpu_seconds()
            print("marked", flush=True)
        elif command == "report":
            print("report", json.dumps({"cpu": cpu_seconds() - cpu0}), flush=True)
    await server.stop(grace=0)


async def exchange(call, numbers: list[int], concurrency: int, sent: dict, consumed: dict) -> None:
    """Write every number on the stream with at most `concurrency` unechoed; time both ends."""
    window = asyncio.Semaphore(concurrency)

    async def writer() -> None:
        for n in numbers:
            await window.acquire()
            sent[n] = now_ns()
            await call.write(HEAD.pack(n) + payload(abs(n)).encode())

    async def reader() -> None:
        for _ in numbers:
            message = await call.read()
            received = now_ns()
            if message is grpc.aio.EOF:
                raise RuntimeError(f"stream ended early: {await call.code()} {await call.details()}")
            consumed[HEAD.unpack_from(message)[0]] = received
            window.release()

    await asyncio.gather(writer(), reader())


async def run_client(port: int, messages: int, concurrency: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(f"/{SERVICE}/{METHOD}")()  # raw bytes both ways
        await exchange(call, list(range(-WARMUP, 0)), concurrency, {}, {})
        print("ready", flush=True)
        if await read_command() != "go":
            return
        sent: dict[int, int] = {}
        consumed: dict[int, int] = {}
        cpu0 = cpu_seconds()
        await exchange(call, list(range(messages)), concurrency, sent, consumed)
        cpu = cpu_seconds() - cpu0
        await call.done_writing()
        print("report", json.dumps({"cpu": cpu, "sent": sent, "consumed": consumed}), flush=True)


# --- parent ---
def run_parent(messages: int, concurrency: int) -> dict:
    children: list[Child] = []
    try:
        me = [sys.executable, os.path.abspath(__file__)]
        server = Child("server", [*me, "--role", "server"], python_env())
        children.append(server)
        port = server.expect("ready")
        client = Child("client", [*me, "--role", "client", "--port", port,
                                  "--messages", str(messages), "--concurrency", str(concurrency)], python_env())
        children.append(client)
        client.expect("ready")  # stream open and warmed up
        server.send("mark")
        server.expect("marked")
        client.send("go")
        report = json.loads(client.expect("report", timeout=600, others=children))
        server.send("report")
        server_cpu = json.loads(server.expect("report"))["cpu"]
        server.send("stop")
    finally:
        for child in reversed(children):
            child.close()
    sent_ns = {int(k): v for k, v in report["sent"].items()}
    consumed_ns = {int(k): v for k, v in report["consumed"].items()}
    cpu = {"server": server_cpu, "client": report["cpu"]}
    return summarize("grpc-echo", concurrency, sent_ns, consumed_ns, cpu)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20000, help="measured messages (default 20000)")
    parser.add_argument("--concurrency", type=int, default=1, help="max messages in flight (default 1)")
    parser.add_argument("--role", choices=["server", "client"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.messages < 1 or args.concurrency < 1:
        parser.error("--messages and --concurrency must be at least 1")
    if args.role == "server":
        asyncio.run(run_server())
    elif args.role == "client":
        asyncio.run(run_client(args.port, args.messages, args.concurrency))
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally stops the children
        emit(run_parent(args.messages, args.concurrency))


if __name__ == "__main__":
    main()
