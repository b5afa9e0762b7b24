"""The mesh under the bench/common.py workload: a mesh process (`inboxmesh
up`, embedded SQLite with synchronous=FULL: every accepted message and every
consumption is fsynced before it is acknowledged), a sender process and a
receiver process.

- sender: SendStream; whenever window slots are free it sends that many
  messages in one request (one message per request at concurrency 1). It
  learns that a message was consumed from the mesh's own event stream
  (WatchEvents, the receiver's MESSAGE_CONSUMED events) and only then
  frees the slot. `ack_to_watch_p50_ms` in the result: from the mesh taking
  the receiver's ack (the time of its MESSAGE_CONSUMED event) to the sender's
  watch giving that consumption (p50): the ack's writes and the event's way
  to a watcher, the last leg of each slot's cycle.
- receiver: one Consume stream (deliveries in, acks out on the same
  stream, through inboxmesh.client.stream.InboxStream, which hands over
  everything delivered meanwhile as one batch); acks each batch with one
  ack; a message counts as consumed when its ack returns CONSUMED.

    python bench/mesh_bench.py --messages 5000 --concurrency 64

--traces otlp: every process exports its spans over OTLP/gRPC to a receiver
in a process of its own (tests/test_otlp_export.py's; its CPU is reported
apart, as a backend's would be); otlp+grpc adds the call spans of
opentelemetry-instrumentation-grpc, which the project does not install
(`pip install opentelemetry-instrumentation-grpc==0.66b2` first).

--metrics: a scraper (a thread of this driving process, whose CPU is not
counted, as a Prometheus server's would not be) reads every mesh's /metrics
once a second with the operator token, so each mesh folds the event record
into its metrics (docs/metrics.md); without it the web view is served but
nobody signs in, and nothing is folded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, now_ns, payload, python_env, summarize  # noqa: E402
from bench.procs import Child, read_command  # noqa: E402

WARMUP = 300
SENT_TIMEOUT_S = float(os.environ.get("INBOXMESH_BENCH_SENT_TIMEOUT_S", "600"))
"""How long the sender gets for the measured phase before the run fails (with the meshes' task stacks)."""


def _tls(ca: str) -> Any:
    """TLS credentials trusting the CA file `ca` (--tls), or None for plaintext."""
    from inboxmesh.client.mesh import tls_credentials

    return tls_credentials(ca) if ca else None


async def run_sender(address: str, agent_id: str, credential: str, recipient: str, n: int, c: int,
                     events_address: str = "", ca: str = "", watch_credential: str = "") -> None:
    import grpc

    from inboxmesh.client.mesh import MeshClient, envelope
    from inboxmesh.events.v1 import events_pb2 as ev
    from inboxmesh.inbox.v1 import inbox_pb2 as pb

    async with MeshClient(address, tls=_tls(ca)) as client, \
            MeshClient(events_address or address, tls=_tls(ca)) as events_client:
        me = client.agent(agent_id, credential)
        receiver_id = recipient.rpartition("/")[2]
        # the receiver's replica records its acks; on another mesh (two meshes across IOA) the sender is
        # unknown there, and the watch reads the receiver's own events with its credential
        watcher_view = (events_client.agent(receiver_id, watch_credential) if watch_credential else
                        events_client.agent(agent_id, credential))
        window = asyncio.Semaphore(c)
        consumed = 0
        all_consumed = asyncio.Event()
        target = 0

        watched: dict[str, int] = {}
        """Message id -> event id of each consumption the watch gave."""
        watch_lag_ms: dict[str, float] = {}
        """Message id -> ms from its MESSAGE_CONSUMED event's time to the watch giving it."""

        async def watch():
            nonlocal consumed
            # the receiver's consumptions (its inbox only ever holds this sender's messages)
            async for event in watcher_view.watch_events(agent_id=receiver_id, kinds=[ev.EVENT_KIND_MESSAGE_CONSUMED],
                                                         from_now=True):
                watched[event.message_id] = event.event_id
                watch_lag_ms[event.message_id] = (time.time_ns() // 1000 - event.at_us) / 1000
                consumed += 1
                window.release()
                if consumed >= target:
                    all_consumed.set()

        watcher = asyncio.create_task(watch())
        call = me.send_stream()
        writing = asyncio.Lock()  # a write, or the stream opened again with what was not answered
        unanswered: dict[str, Any] = {}
        """Messages written and not yet answered by a receipt, in the order written."""

        async def check_receipts():
            # As a client would: when the mesh could not store a request (UNAVAILABLE: NATS electing a
            # leader, say), the stream ends; a new one sends every unanswered message again with its id,
            # in order (what was stored comes back DUPLICATE). Any other end fails the run at once.
            nonlocal call
            while True:
                try:
                    async for response in call:
                        for receipt in response.receipts:
                            if receipt.status not in (pb.RECEIPT_STATUS_ACCEPTED, pb.RECEIPT_STATUS_DUPLICATE):
                                raise SystemExit(f"unexpected receipt {receipt}")
                            unanswered.pop(receipt.message_id, None)
                    return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        raise SystemExit(f"the send stream ended: {exc.code().name}: {exc.details()}") from None
                    print(f"send stream: {exc.details()}; {len(unanswered)} unanswered messages sent again",
                          file=sys.stderr, flush=True)
                    await asyncio.sleep(0.1)
                    async with writing:
                        call = me.send_stream()
                        if unanswered:
                            await call.write(pb.SendRequest(messages=list(unanswered.values())))

        def checked(task: asyncio.Task) -> None:  # a sender whose receipts stopped must not wait forever
            if not task.cancelled() and task.exception() is not None:
                print(f"receipts: {task.exception()!r}", file=sys.stderr, flush=True)
                os._exit(1)

        checker = asyncio.create_task(check_receipts())
        checker.add_done_callback(checked)
        await asyncio.sleep(0.2)  # let the event watch attach before the first consumption can happen

        async def progress() -> None:  # on stderr: what a run that hangs had reached (shown when it fails)
            last = -1
            while True:
                await asyncio.sleep(10)
                print(f"progress: {consumed} consumptions seen, waiting for {target}", file=sys.stderr, flush=True)
                if consumed == last and consumed < target:
                    await stalled()
                last = consumed

        async def stalled() -> None:
            """The consumptions the event record holds and the watch did not give, with their neighbours."""
            stored, after = [], 0
            while True:
                page = await watcher_view.events(agent_id=receiver_id, kinds=[ev.EVENT_KIND_MESSAGE_CONSUMED],
                                                 after=after, limit=1000)
                stored += page
                if len(page) < 1000:
                    break
                after = page[-1].event_id
            missed = [e for e in stored if e.message_id not in watched]
            print(f"stalled: the record holds {len(stored)} consumptions of the receiver, the watch gave"
                  f" {len(watched)}; missed: {[(e.message_id, e.event_id, e.at_us) for e in missed[:5]]}; the"
                  f" watch's last event ids: {sorted(watched.values())[-5:]}", file=sys.stderr, flush=True)

        reporter = asyncio.create_task(progress())

        async def phase(prefix: str, count: int, sent_ns: dict) -> None:
            nonlocal target
            target = consumed + count
            all_consumed.clear()
            i = 0
            while i < count:
                await window.acquire()
                batch = [i]
                while len(batch) < count - i and not window.locked():
                    await window.acquire()
                    batch.append(i + len(batch))
                envelopes = []
                for k in batch:
                    e = envelope(recipient, payload(k), message_id=f"{prefix}{k}")
                    sent_ns[e.message_id] = now_ns()
                    envelopes.append(e)
                async with writing:
                    unanswered.update((e.message_id, e) for e in envelopes)
                    try:
                        await call.write(pb.SendRequest(messages=envelopes))
                    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                        pass  # the stream ended: the receipt checker opens a new one and sends these again
                i += len(batch)
            await all_consumed.wait()

        await phase("w", WARMUP, {})
        print("warmed", flush=True)
        await read_command()
        sent_ns: dict[str, int] = {}
        await phase("m", n, sent_ns)
        async with writing:
            await call.done_writing()
        await checker
        watcher.cancel()
        reporter.cancel()
        print("sent " + json.dumps(sent_ns), flush=True)
        print("watched " + json.dumps([watch_lag_ms[k] for k in sent_ns if k in watch_lag_ms]), flush=True)


async def run_receiver(address: str, agent_id: str, credential: str, ca: str = "") -> None:
    from inboxmesh.client.mesh import MeshClient
    from inboxmesh.client.stream import InboxStream

    async with MeshClient(address, tls=_tls(ca)) as client:
        me = client.agent(agent_id, credential)
        stream = InboxStream([me], max_in_flight=2048)
        consumed_ns: dict[str, int] = {}

        async def report():
            command = await read_command()  # "report <n>": the sender saw n consumptions in the event record
            expected = int(command.split()[1]) if len(command.split()) > 1 else 0
            for _ in range(500):  # the ack's answer may reach this process just after its event reached the sender
                if sum(1 for k in consumed_ns if k.startswith("m")) >= expected:
                    break
                await asyncio.sleep(0.01)
            print("consumed " + json.dumps({k: v for k, v in consumed_ns.items() if k.startswith("m")}), flush=True)
            stream.stop()

        reporter = asyncio.create_task(report())
        async for item in stream:  # everything delivered meanwhile comes as one item: one ack
            if item.agent_event is not None:
                print("ready", flush=True)
                continue
            won = await stream.consume(agent_id, item.messages)
            at = now_ns()
            if len(won) != len(item.messages):
                raise SystemExit(f"only {len(won)} of {len(item.messages)} messages consumed")
            for m in won:
                # through IOA the id is "<node>:<sender>:<id>"; the sender knows it by <id>
                consumed_ns[m.message_id.rpartition(":")[2]] = at
        await reporter


async def setup_agents(address: str, ca: str = "", receiver_address: str = "") -> tuple:
    """The sender and the receiver, children of one lead; with `receiver_address` (another mesh) the
    receiver is a child of a lead of its own there."""
    from inboxmesh.client.mesh import MeshClient

    async with MeshClient(address, tls=_tls(ca)) as client:
        lead = await client.register("bench")
        sender = await lead.spawn("sender")
        if not receiver_address:
            return sender, await lead.spawn("receiver", inbox_capacity=100_000)
    async with MeshClient(receiver_address, tls=_tls(ca)) as far:
        return sender, await (await far.register("bench")).spawn("receiver", inbox_capacity=100_000)


async def run_otlp_receiver() -> None:
    from tests.test_otlp_export import OtlpReceiver

    receiver = OtlpReceiver(keep=False)
    print(f"otlp receiver listening on {await receiver.start()}", flush=True)
    await read_command()  # "report": every other process has exited, its spans exported
    print(f"spans {receiver.count}", flush=True)
    await receiver.stop()


def instrument_grpc() -> None:
    """Call spans for every grpc.aio server and channel made from now on (--traces otlp+grpc). Not on the
    server side of Consume: the instrumentation's aio server interceptor takes every streaming handler for an
    async generator and fails a handler that writes with context.write, as Consume does
    (open-telemetry/opentelemetry-python-contrib#3066)."""
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer, filters

    GrpcAioInstrumentorServer(filter_=filters.negate(filters.method_name("Consume"))).instrument()
    GrpcAioInstrumentorClient().instrument()


def grpc_instrumented_cli() -> None:
    """`inboxmesh` (its arguments in sys.argv) with gRPC call spans."""
    from inboxmesh.cli.main import main

    instrument_grpc()
    sys.exit(main(sys.argv[1:]))


class Scraper(threading.Thread):
    """--metrics: GET each mesh's /metrics every `every_s` with its operator token (from its mesh.json)."""

    def __init__(self, data_dirs: list[str], every_s: float = 1.0):
        super().__init__(name="metrics-scraper", daemon=True)
        states = [json.loads((Path(d) / "mesh.json").read_text()) for d in data_dirs]
        self.targets = [(s["web"] + "metrics", s["admin_token"]) for s in states]
        self.every_s = every_s
        self.stopping = threading.Event()
        self.scrapes = 0
        self.last = ""

    def scrape(self) -> None:
        for url, token in self.targets:
            request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=30) as response:
                self.last = response.read().decode()
            self.scrapes += 1

    def run(self) -> None:
        while not self.stopping.wait(self.every_s):
            self.scrape()

    def consumed(self) -> float:
        """inboxmesh_messages_consumed_total of the last scrape."""
        line = next((x for x in self.last.splitlines() if x.startswith("inboxmesh_messages_consumed_total ")), "")
        return float(line.split()[1]) if line else 0.0


def run(n: int, c: int, synchronous: str = "full", via_ioa: bool = False, store: str = "sqlite",
        replicas: int = 1, nats_nodes: int = 1, tls: bool = False, traces: str = "none",
        metrics: bool = False) -> dict:
    """One measurement. With the jetstream store a nats-server (file
    storage) runs beside the mesh, or a cluster of `nats_nodes` with every
    stream on all of them; with two replicas the sender talks to the first
    mesh process and the receiver to the second. Via IOA on SQLite, two
    "replicas" are two meshes (nodes near and far), as IOA is used: each
    does one relay's work."""
    env = python_env()
    me = [sys.executable, str(Path(__file__).resolve())]
    cli = [sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "warning"]
    if traces == "otlp+grpc":
        cli[1:3] = ["-c", "from bench.mesh_bench import grpc_instrumented_cli; grpc_instrumented_cli()"]
        me.append("--grpc-spans")
    with tempfile.TemporaryDirectory(prefix="meshbench") as data:
        children = []
        otlp: Child | None = None
        if traces != "none":
            otlp = Child("otlp-receiver", [*me, "--role", "otlp-receiver"], env)
            env = {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.expect("otlp receiver listening on ")}
        nats_node: Any = None
        extra = []
        ca = ""
        if tls:  # the mesh serves TLS with a certificate made here; the clients trust its CA
            from services.tls import make_certificates

            make_certificates(Path(data) / "certs", ["mesh"])
            ca = str(Path(data) / "certs" / "ca.pem")
            extra += ["--tls-cert", f"{data}/certs/mesh.pem", "--tls-key", f"{data}/certs/mesh.key"]
        if via_ioa:
            network = Child("ioa-server", [*cli, "ioa-server", "--port", "0"], env)
            children.append(network)
            extra = ["--ioa-network", network.expect("ioa network listening on ")]
        two_meshes = via_ioa and store == "sqlite" and replicas > 1
        if two_meshes and replicas != 2:
            raise SystemExit("via IOA on SQLite: --replicas 2 (two meshes, near and far) or 1")
        if store == "jetstream":
            from harness.nats import NatsCluster, NatsNode, wait_for_jetstream

            if nats_nodes > 1:
                nats_node = NatsCluster(Path(data) / "nats", size=nats_nodes).start()
                asyncio.run(wait_for_jetstream(nats_node.urls, replicas=nats_nodes))
            else:
                nats_node = NatsNode(Path(data) / "nats").start()
            extra += nats_node.mesh_args()
        meshes = []
        addresses = []
        scraper: Scraper | None = None
        try:
            for i in range(replicas):  # one after the other: the first creates the streams and buckets
                node = (["--node-id", ("near", "far")[i] if two_meshes else "bench"] if via_ioa else [])
                mesh = Child(f"mesh{i}", [*cli, "up", "--port", "0", "--no-demo", "--data-dir", f"{data}/m{i}",
                                          "--synchronous", synchronous, *extra, *node], env)
                meshes.append(mesh)
                children.append(mesh)
                addresses.append(mesh.expect("inboxmesh listening on ").split()[0])
            sender, receiver = asyncio.run(setup_agents(addresses[0], ca, addresses[-1] if two_meshes else ""))
            target = f"ioa:{'far' if two_meshes else 'bench'}/{receiver.agent_id}" if via_ioa else receiver.agent_id
            recv = Child("receiver", [*me, "--role", "receiver", "--address", addresses[-1], "--agent",
                                      receiver.agent_id, "--credential", receiver.credential, "--tls-ca", ca], env)
            children.append(recv)
            recv.expect("ready", others=children)
            send = Child("sender", [*me, "--role", "sender", "--address", addresses[0], "--agent", sender.agent_id,
                                    "--credential", sender.credential, "--recipient", target,
                                    "--events-address", addresses[-1],
                                    "--messages", str(n), "--concurrency", str(c), "--tls-ca", ca,
                                    "--watch-credential", receiver.credential if two_meshes else ""], env)
            children.append(send)
            send.expect("warmed", others=children)
            if metrics:
                scraper = Scraper([f"{data}/m{i}" for i in range(replicas)])
                scraper.scrape()  # before the measured phase: the folds have read the record of the warm-up
                scraper.start()
            processes = {**{m.name: m for m in meshes}, "sender": send, "receiver": recv,
                         **({"ioa-network": children[0]} if via_ioa else {})}
            before = {k: p.cpu() for k, p in processes.items()}
            nats_before = _cpu_of(nats_node)
            otlp_before = otlp.cpu() if otlp is not None else 0.0
            send.send("go")
            try:
                sent_ns = json.loads(send.expect("sent ", timeout=SENT_TIMEOUT_S, others=children))
            except SystemExit as failed:
                raise SystemExit(f"{failed}\n{_stalled(meshes, recv)}") from None
            lags = sorted(json.loads(send.expect("watched ", others=children)))
            after = {k: p.cpu() for k, p in processes.items()}
            cpu = {k: after[k] - before[k] for k in before}
            if nats_node is not None:
                cpu["nats"] = _cpu_of(nats_node) - nats_before
            otlp_cpu = otlp.cpu() - otlp_before if otlp is not None else 0.0
            recv.send(f"report {len(sent_ns)}")
            consumed_ns = json.loads(recv.expect("consumed ", others=children))
            watch_lag = {"ack_to_watch_p50_ms": round(lags[len(lags) // 2], 3)} if lags else {}
            name = ("inboxmesh-ioa" + ("-2meshes" if two_meshes else "") if via_ioa else "inboxmesh") + \
                ("-tls" if tls else "")
            if store == "jetstream":
                name += f"-jetstream-{replicas}r" + (f"-{nats_nodes}n" if nats_nodes > 1 else "")
            if scraper is not None:
                scraper.stopping.set()
                scraper.join()
                scraper.scrape()  # the end: the metrics count every message
                return {**summarize(name + "-metrics", c, sent_ns, consumed_ns, cpu), **watch_lag,
                        "scrapes": scraper.scrapes, "scraped_consumed": scraper.consumed()}
            if otlp is None:
                return {**summarize(name, c, sent_ns, consumed_ns, cpu), **watch_lag}
            result = {**summarize(f"{name}-{traces.replace('+', '-')}", c, sent_ns, consumed_ns, cpu), **watch_lag}
            for child in reversed(children):  # they export what they still hold as they stop
                child.close()
            otlp.send("report")
            return {**result, "otlp_receiver_cpu_s": round(otlp_cpu, 3), "spans_exported": int(otlp.expect("spans "))}
        finally:
            if scraper is not None:
                scraper.stopping.set()
            for child in reversed(children):
                child.close()
            if otlp is not None:
                otlp.close()
            if nats_node is not None:
                nats_node.kill()


def _stalled(meshes: list[Child], receiver: Child) -> str:
    """What the mesh processes' asyncio tasks wait for (`inboxmesh up` writes them on SIGUSR1) and the
    receiver's output: for a run that did not finish."""
    for mesh in meshes:
        if mesh.proc.poll() is None:
            os.kill(mesh.pid, signal.SIGUSR1)
    time.sleep(2)
    return "\n".join(f"--- {child.name} stderr:\n{child.stderr_tail(20_000)}" for child in [*meshes, receiver])


def _cpu_of(node) -> float:
    """CPU seconds used so far by a nats-server process (all of a cluster's)."""
    if node is None:
        return 0.0
    total = 0.0
    for one in getattr(node, "nodes", [node]):
        fields = Path(f"/proc/{one.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--synchronous", default="full", choices=["full", "normal"],
                        help="the mesh's durability setting (the comparison uses full)")
    parser.add_argument("--via-ioa", action="store_true",
                        help="send through the mesh's IOA relay and a reference IOA network (sender and receiver"
                             " on the same node, so every message crosses the network)")
    parser.add_argument("--store", default="sqlite", choices=["sqlite", "jetstream"],
                        help="the mesh's store (jetstream: a nats-server with file storage beside it)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="mesh processes on the jetstream store (the sender uses the first, the receiver the"
                             " last); with --via-ioa on sqlite, 2 means two meshes (nodes near and far)")
    parser.add_argument("--nats-nodes", type=int, default=1,
                        help="jetstream: a cluster of this many nats-servers, every stream on all of them")
    parser.add_argument("--tls", action="store_true",
                        help="the mesh serves TLS (a certificate made for the run), the clients trust its CA")
    parser.add_argument("--traces", default="none", choices=["none", "otlp", "otlp+grpc"],
                        help="export every process's spans over OTLP to a receiver (+grpc: with gRPC call spans)")
    parser.add_argument("--metrics", action="store_true",
                        help="scrape every mesh's /metrics once a second during the run (docs/metrics.md)")
    parser.add_argument("--grpc-spans", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tls-ca", default="", help=argparse.SUPPRESS)
    parser.add_argument("--events-address", default="", help=argparse.SUPPRESS)
    parser.add_argument("--watch-credential", default="", help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=["sender", "receiver", "otlp-receiver"], help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--agent", help=argparse.SUPPRESS)
    parser.add_argument("--credential", help=argparse.SUPPRESS)
    parser.add_argument("--recipient", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "otlp-receiver":
        asyncio.run(run_otlp_receiver())
    elif args.role:  # sender or receiver: tracing as the CLI's processes do it (on with OTEL_EXPORTER_OTLP_ENDPOINT)
        from inboxmesh.client.tracing import configure_tracing

        tracing = configure_tracing(None, f"bench-{args.role}")
        if args.grpc_spans:
            instrument_grpc()
        try:
            if args.role == "sender":
                asyncio.run(run_sender(args.address, args.agent, args.credential, args.recipient, args.messages,
                                       args.concurrency, args.events_address, args.tls_ca, args.watch_credential))
            else:
                asyncio.run(run_receiver(args.address, args.agent, args.credential, args.tls_ca))
        finally:
            if tracing is not None:
                tracing.shutdown()
    else:
        emit(run(args.messages, args.concurrency, args.synchronous, args.via_ioa, args.store, args.replicas,
                 args.nats_nodes, args.tls, args.traces, args.metrics))


if __name__ == "__main__":
    main()
