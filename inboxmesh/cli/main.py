"""`inboxmesh`: run the mesh and talk to it from a shell.

    inboxmesh up                      serve the whole mesh (embedded SQLite) and run the demo
    inboxmesh register NAME           register an agent; prints its id and credential
    inboxmesh send --as CRED --to ID TEXT
    inboxmesh tail --as CRED          follow an inbox live (add --consume to ack)
    inboxmesh status --as CRED MESSAGE_ID
    inboxmesh events [--agent ID] [--message ID] [--kind K] [--since T] [--until T] [--last N] [--follow]
    inboxmesh close --as CRED [AGENT_ID]
    inboxmesh run "TASK" [--model openai|local|scripted:echo] [--agent ID] [--policies MODULE:DICT]
    inboxmesh host --ingress-token T  serve the sessions of the routing config's agents
    inboxmesh ioa-server [--port N]   the reference IOA network (then: up --ioa-network HOST:PORT)
    inboxmesh mcp --transport stdio|http  an MCP server giving its client an agent (docs/interop.md)
    inboxmesh a2a --agent ID    the A2A gateway: the agent as an A2A agent, a2a: addresses (docs/interop.md)

Commands find a local mesh through .inboxmesh/mesh.json (written by `up`),
or --mesh / INBOXMESH_ADDRESS.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

from google.protobuf import json_format

from inboxmesh.client import errors
from inboxmesh.client.mesh import AgentHandle, MeshClient, envelope
from inboxmesh.client.tracing import configure_tracing
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev_pb
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.registry.v1 import registry_pb2 as reg_pb
from services import settings, tls

log = logging.getLogger("inboxmesh")


def _time(us: int) -> str:
    return datetime.fromtimestamp(us / 1e6, tz=UTC).strftime("%H:%M:%S.%f")[:-3] if us else "-"


def _print_json(message) -> None:
    print(json_format.MessageToJson(message, preserving_proto_field_name=True, indent=2))


def _event_line(e: ev_pb.Event) -> str:
    kind = ev_pb.EventKind.Name(e.kind).removeprefix("EVENT_KIND_").lower()
    parts = [f"#{e.event_id}", _time(e.at_us), f"{kind:<22}"]
    if e.message_id:
        parts.append(f"msg={e.message_id}")
    if e.sender:
        parts.append(f"from={e.sender}")
    if e.recipient:
        parts.append(f"to={e.recipient}")
    if e.sequence:
        parts.append(f"seq={e.sequence}")
    if e.agent_id and not e.recipient:
        parts.append(f"agent={e.agent_id}")
    if e.detail:
        parts.append(f"({e.detail})")
    return " ".join(parts)


# -- up ---------------------------------------------------------------------
def _dump_tasks() -> None:
    """SIGUSR1: where each of the mesh's asyncio tasks waits, on stderr (a stalled call, in a running mesh)."""
    tasks = asyncio.all_tasks()
    lines = [f"inboxmesh: {len(tasks)} tasks"]
    for task in tasks:
        lines.append(f"task {task.get_name()}: {task.get_coro()!r}")
        lines += [f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
                  for frame in task.get_stack(limit=12)]
    print("\n".join(lines), file=sys.stderr, flush=True)


async def _up(args) -> int:
    from inboxmesh.cli.demo import run_demo
    from services.server import Mesh

    flags = vars(args)
    try:
        config = settings.mesh_config(flags, os.environ)
        mesh = Mesh(config)
    except errors.MeshError as exc:
        print(f"inboxmesh: {exc.message}", file=sys.stderr)
        return 2
    try:
        await mesh.start()
    except errors.MeshError as exc:  # the port taken, the store unreachable or unfit (SCHEMA_MISMATCH, ...)
        hint = ". Use --port 0 for any free port." if exc.reason == errors.Reason.BIND_FAILED else ""
        print(f"inboxmesh: {exc.message}{hint}", file=sys.stderr)
        return 1
    web = mesh.web.url if mesh.web is not None else None
    state = settings.write_state(settings.data_dir(flags, os.environ), mesh.address, config.admin_token, web)
    where = (f"sqlite {config.store.path}" if config.store.backend == "sqlite"
             else f"jetstream {','.join(config.store.nats_urls)} namespace {config.store.nats_namespace}")
    print(f"inboxmesh listening on {mesh.address} ({tls.mode(config.tls)}; services: {', '.join(config.services)};"
          f" store: {where})", flush=True)
    if mesh.relay is not None and config.ioa is not None:
        print(f"inboxmesh: IOA relay node {mesh.relay.node_id!r} on network {config.ioa.network}", flush=True)
    if web is not None:
        print(f"inboxmesh: web view at {web} (open it once as {web}?token=<admin token>)", flush=True)
    print(f"inboxmesh: address{', web view' if web else ''} and admin token written to {state}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)
    if mesh.routing_reloader is not None:  # SIGHUP: read the routing file again now
        loop.add_signal_handler(signal.SIGHUP, mesh.routing_reloader.reload)
    try:
        if args.demo and "inbox" in config.services:
            demo_tls = settings.client_tls(flags, os.environ)
            if config.tls.cert is not None and demo_tls.ca is None:
                print("inboxmesh: demo skipped: the mesh serves TLS and no CA to trust was given (--tls-ca or"
                      " INBOXMESH_TLS_CA)", flush=True)
            else:
                await run_demo(mesh.address, say=lambda line: print(line, flush=True),
                               tls=tls.channel_credentials(demo_tls, "the demo"))
        if args.exit_after_demo:
            return 0
        print("inboxmesh: serving; Ctrl-C to stop", flush=True)
        stopped = asyncio.ensure_future(mesh.wait_stopped())  # by itself: its store lost for good
        await asyncio.wait([asyncio.ensure_future(stop.wait()), stopped], return_when=asyncio.FIRST_COMPLETED)
        if mesh.lost:
            print(f"inboxmesh: {mesh.lost}; stopped, exit status 1: start it again", file=sys.stderr, flush=True)
            return 1
        print("inboxmesh: stopping", flush=True)
        return 0
    finally:
        await mesh.stop()


async def _ioa_server(args) -> int:
    from services.ioa_network.server import NetworkConfig, NetworkServer

    try:
        config = NetworkConfig(host=args.host, port=args.port, history=args.history,
                               tls=settings.server_tls(vars(args), os.environ), insecure=bool(args.insecure),
                               faults=bool(args.faults), reconnect_grace_s=args.reconnect_grace_s)
        server = NetworkServer(config)
        await server.start()
    except errors.MeshError as exc:
        print(f"inboxmesh ioa-server: {exc.message}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"inboxmesh ioa-server: {exc}. Use --port 0 for any free port.", file=sys.stderr)
        return 1
    print(f"ioa network listening on {server.address}", flush=True)
    print(f"ioa network: {tls.mode(config.tls)}{', fault injection on' if config.faults else ''}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
    return 0


async def _certs(args) -> int:
    """`inboxmesh certs DIR NAME...`: a CA and certificates it signed, for a trial or a private deployment."""
    names = [n for n in args.names if n]
    bad = [n for n in names if not all(c.isalnum() or c in "-._" for c in n) or len(n) > 64]
    if bad:
        print(f"inboxmesh certs: names are host names or node ids (letters, digits, '-', '.', '_'): {bad[0]!r}",
              file=sys.stderr)
        return 2
    for path in tls.make_certificates(Path(args.directory), names):
        print(path, flush=True)
    return 0


# -- agent commands -----------------------------------------------------------
def _client(args) -> MeshClient:
    found = settings.client_settings(vars(args), os.environ)
    return MeshClient(found.address, timeout=found.timeout_s, admin_token=found.admin_token,
                      tls=tls.channel_credentials(found.tls, "inboxmesh"))


def _as(client: MeshClient, credential: str | None) -> AgentHandle:
    if not credential:
        raise errors.InvalidArgument("this command acts as an agent: pass --as <credential>")
    from services.auth import agent_id_of

    return client.agent(agent_id_of(credential), credential)


async def _register(args) -> int:
    async with _client(args) as client:
        metadata = dict(kv.split("=", 1) for kv in args.meta)
        if args.parent:
            parent = _as(client, args.parent)
            agent = await parent.spawn(args.name, reg_pb.AgentMode.Value(f"AGENT_MODE_{args.mode.upper()}"),
                                       metadata=metadata, inbox_capacity=args.capacity)
        else:
            agent = await client.register(args.name, metadata=metadata, inbox_capacity=args.capacity)
        print(json.dumps({"agent_id": agent.agent_id, "name": agent.info.name, "scope_id": agent.info.scope_id,
                          "parent_id": agent.info.parent_id, "credential": agent.credential}, indent=2))
    return 0


async def _send(args) -> int:
    async with _client(args) as client:
        me = _as(client, args.credential)
        kind = env_pb.MessageKind.Value(f"MESSAGE_KIND_{args.kind.upper()}")
        if args.reply_to:
            kind = env_pb.MESSAGE_KIND_REPLY
        receipts = await me.send_batch([envelope(args.to, args.text, message_id=args.message_id, kind=kind,
                                                 in_reply_to=args.reply_to or "")])
        _print_json(receipts[0])
        return 0 if receipts[0].status in (inbox_pb2.RECEIPT_STATUS_ACCEPTED, inbox_pb2.RECEIPT_STATUS_DUPLICATE) else 3


async def _tail(args) -> int:
    from inboxmesh.client.stream import InboxStream

    async with _client(args) as client:
        me = _as(client, args.credential)
        if args.consume:
            stream = InboxStream([me])
            async for item in stream:
                if item.agent_event is not None:
                    kind = inbox_pb2.SubscriptionEventKind.Name(item.agent_event.kind)
                    print(f"-- {kind.removeprefix('SUBSCRIPTION_EVENT_KIND_').lower()} {item.agent_event.agent_id} "
                          f"{item.agent_event.detail}".rstrip(), flush=True)
                for m in await stream.consume(me.agent_id, item.messages):
                    print(f"{_time(m.stored_at_us)} seq={m.sequence} from={m.sender} id={m.message_id} "
                          f"(consumed) {m.content.text!r}", flush=True)
            return 0
        async for event in me.watch_events(agent_id=me.agent_id, from_now=not args.from_start):
            if event.kind == ev_pb.EVENT_KIND_MESSAGE_STORED and event.recipient == me.agent_id:
                status = await me.inbox_status(event.sequence)
                m = status.envelope
                print(f"{_time(m.stored_at_us)} seq={m.sequence} from={m.sender} id={m.message_id} "
                      f"{m.content.text!r}", flush=True)
            elif event.recipient == me.agent_id and event.kind != ev_pb.EVENT_KIND_MESSAGE_SENT:
                print(f"    {_event_line(event)}", flush=True)
    return 0


async def _status(args) -> int:
    async with _client(args) as client:
        me = _as(client, args.credential)
        status = await me.status(args.message_id, sender=args.sender or "")
        _print_json(status)
        sender = status.envelope.sender
        for e in await me.events(message_id=args.message_id, sender=sender):
            print(_event_line(e))
    return 0


async def _events(args) -> int:
    async with _client(args) as client:
        fetch: Callable[..., Awaitable[list[ev_pb.Event]]]  # an agent's events or the operator's: same filters
        if args.credential:
            me = _as(client, args.credential)
            fetch = me.events
        elif client.admin_token:
            fetch = client.admin_events
        else:
            raise errors.Unauthenticated("pass --as <credential>, or run next to `inboxmesh up` for its admin token")
        kinds = [_event_kind(k) for k in args.kind or ()]
        since, until = _when(args.since, "--since"), _when(args.until, "--until")

        def wanted(e: ev_pb.Event) -> bool:
            return (since is None or e.at_us >= since) and (until is None or e.at_us <= until)

        async def page(after: int) -> list[ev_pb.Event]:
            return await fetch(agent_id=args.agent or "", message_id=args.message or "", kinds=kinds, after=after,
                               limit=EVENTS_PAGE)

        after, newest, left_out = 0, collections.deque[ev_pb.Event](maxlen=args.last or None), 0
        while True:  # every page of the record, not only the first
            found = await page(after)
            for e in filter(wanted, found):
                if args.last and len(newest) == args.last:
                    left_out += 1
                newest.append(e)
                if not args.last:
                    print(_event_line(e), flush=True)
            if not found:  # the end (a page may be shorter than EVENTS_PAGE: ListEvents cuts pages at 2 MiB)
                break
            after = found[-1].event_id
        if args.last:
            if left_out:
                print(f"inboxmesh events: {left_out} earlier matching events not shown (--last {args.last});"
                      " --last 0 shows all", file=sys.stderr, flush=True)
            for e in newest:
                print(_event_line(e), flush=True)
        while args.follow:
            found = await page(after)
            for e in filter(wanted, found):
                print(_event_line(e), flush=True)
            after = found[-1].event_id if found else after
            if not found:
                await asyncio.sleep(0.5)
        return 0


EVENTS_PAGE = 1000
"""Events one ListEvents call returns at most (the mesh's limit)."""


def _event_kind(name: str) -> ev_pb.EventKind:
    """An event kind by its name, as in the proto or as `inboxmesh events` prints it (message_consumed)."""
    key = name.strip().upper()
    key = key if key.startswith("EVENT_KIND_") else "EVENT_KIND_" + key
    if key not in ev_pb.EventKind.keys() or key == "EVENT_KIND_UNSPECIFIED":
        known = ", ".join(k.removeprefix("EVENT_KIND_").lower() for k in ev_pb.EventKind.keys()[1:])
        raise errors.InvalidArgument(f"--kind: no event kind {name[:60]!r}; the kinds are {known}",
                                     reason=errors.Reason.BAD_VALUE)
    return cast(ev_pb.EventKind, ev_pb.EventKind.Value(key))


_AGO = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _when(text: str | None, flag: str) -> int | None:
    """A time as microseconds since the epoch: ISO 8601 (UTC unless it names a zone) or a span ago
    (90s, 10m, 2h, 1d)."""
    if not text:
        return None
    text = text.strip()
    if text[:-1].isdigit() and text[-1:] in _AGO:
        return int((time.time() - int(text[:-1]) * _AGO[text[-1]]) * 1_000_000)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise errors.InvalidArgument(f"{flag}: {text[:60]!r} is neither a time (2026-12-03T21:00:00, UTC unless a"
                                     " zone is given) nor a span ago (90s, 10m, 2h, 1d)",
                                     reason=errors.Reason.BAD_VALUE) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1_000_000)


async def _run(args) -> int:
    from inboxmesh.cli import run as cli_run

    found = settings.client_settings(vars(args), os.environ)
    me = asyncio.current_task()
    assert me is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, me.cancel)  # unwinds: the model server stops
    try:
        async with _host_metrics(args, "run"):
            return await cli_run.run(args, found.address, found.data_dir,
                                     tls=tls.channel_credentials(found.tls, "inboxmesh run"))
    except ValueError as exc:
        print(f"inboxmesh run: {exc}", file=sys.stderr)
        return 2
    except asyncio.CancelledError:
        print("inboxmesh run: stopped (SIGTERM); its agents stay open in the mesh", file=sys.stderr)
        return 143


async def _host(args) -> int:
    from inboxmesh.cli import host as cli_host

    found = settings.client_settings(vars(args), os.environ)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with _host_metrics(args, "host"):
            return await cli_host.serve(args, found.address, found.data_dir, found.admin_token,
                                        args.ingress_token or os.environ.get("INBOXMESH_INGRESS_TOKEN", ""),
                                        tls.channel_credentials(found.tls, "inboxmesh host"), stop)
    except ValueError as exc:
        print(f"inboxmesh host: {exc}", file=sys.stderr)
        return 2


@contextlib.asynccontextmanager
async def _host_metrics(args, command: str) -> AsyncIterator[None]:
    """--metrics-port: the host's metrics for Prometheus (agent_host/metrics.py) on loopback while it runs."""
    if args.metrics_port is None:
        yield
        return
    from agent_host.metrics import MetricsServer

    server = MetricsServer(args.metrics_port)
    try:
        await server.start()
    except OSError as exc:
        raise ValueError(f"--metrics-port {args.metrics_port}: cannot listen on 127.0.0.1 ({exc})") from None
    try:
        print(f"inboxmesh {command}: metrics at {server.url}", flush=True)
        yield
    finally:
        await server.stop()


def _metrics_port_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-port", type=int, metavar="N",
                        help="serve the host's metrics for Prometheus at http://127.0.0.1:N/metrics (0: any free"
                             " port; default: none; docs/metrics.md)")


async def _close(args) -> int:
    async with _client(args) as client:
        me = _as(client, args.credential)
        _print_json(await me.close(args.agent_id or None, reason=args.reason))
    return 0


async def _mcp(args) -> int:
    """`inboxmesh mcp`: an MCP server (inboxmesh/mcp, docs/interop.md). Credentials come from environment
    variables named by the flags, never from the command line (it shows in `ps`)."""
    from inboxmesh.mcp import Identity, McpConfig, McpHttpServer, serve_stdio

    def secret(variable: str | None, flag: str) -> str | None:
        if not variable:
            return None
        value = os.environ.get(variable, "").strip()
        if not value:
            raise errors.InvalidArgument(f"{flag}: the environment variable {variable} is not set",
                                         reason=errors.Reason.MISSING_CREDENTIAL)
        return value

    if args.credential_env and args.parent_credential_env:
        raise errors.InvalidArgument("--credential-env binds to an existing agent, --parent-credential-env registers"
                                     " a new one: give one of them", reason=errors.Reason.CONFLICTING_FIELDS)
    found = settings.client_settings(vars(args), os.environ)
    identity = Identity(name=args.name or "mcp", credential=secret(args.credential_env, "--credential-env"),
                        parent_credential=secret(args.parent_credential_env, "--parent-credential-env"))
    config = McpConfig(mesh=found.address, identity=identity, timeout_s=found.timeout_s, port=args.port,
                       tls=tls.channel_credentials(found.tls, "inboxmesh mcp"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)  # the sessions' agents are released before the process ends
    if args.transport == "stdio":  # stdout is the MCP stream: nothing else may be printed there
        await serve_stdio(config, stop)
        return 0
    server = McpHttpServer(config)
    await server.start()
    try:
        print(f"inboxmesh mcp listening on {server.url} (one agent per MCP session; mesh {found.address})",
              flush=True)
        await stop.wait()
    finally:
        await server.stop()
    return 0


def _tokens(text: str, variable: str) -> dict[str, str]:
    """`principal=token,principal=token` (INBOXMESH_A2A_TOKENS) -> {token: principal}."""
    tokens: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        principal, eq, token = entry.partition("=")
        if not eq or not principal.strip() or not token.strip():
            raise errors.InvalidArgument(f"{variable}: each entry is principal=token (comma-separated); one entry"
                                         " is not", reason=errors.Reason.BAD_VALUE, metadata={"variable": variable})
        tokens[token.strip()] = principal.strip()
    return tokens


async def _a2a(args) -> int:
    """`inboxmesh a2a`: the A2A gateway (inboxmesh/a2a, docs/interop.md). Tokens come from environment
    variables, never from the command line (it shows in `ps`)."""
    from inboxmesh.a2a import A2aConfig, A2aServer

    found = settings.client_settings(vars(args), os.environ)
    if not found.admin_token:
        raise errors.InvalidArgument("inboxmesh a2a claims the mesh's A2A gateway with the admin token: give it"
                                     " (INBOXMESH_ADMIN_TOKEN, or the data directory of a local mesh)",
                                     reason=errors.Reason.MISSING_CREDENTIAL)
    tokens = _tokens(os.environ.get(args.tokens_env, ""), args.tokens_env)
    if not tokens and not args.anonymous:
        raise errors.InvalidArgument(f"no bearer tokens: set {args.tokens_env} (principal=token,...), or accept"
                                     " callers without one with --anonymous", reason=errors.Reason.MISSING_CREDENTIAL)
    skills = []
    for skill in args.skill or ():
        skill_id, eq, text = skill.partition("=")
        if not eq or not skill_id.strip():
            raise errors.InvalidArgument(f"--skill {skill[:80]!r}: give id=description", reason=errors.Reason.BAD_VALUE)
        skills.append((skill_id.strip(), text.strip()))
    state = Path(args.state) if args.state else found.data_dir / "a2a" / f"{args.agent}.sqlite"
    config = A2aConfig(
        mesh=found.address, admin_token=found.admin_token, agent_id=args.agent, state=state, host=args.host,
        http_port=args.http_port, grpc_port=args.grpc_port, tokens=tokens, anonymous=args.anonymous,
        public_url=args.public_url or "", description=args.description or "", skills=tuple(skills),
        send_wait_s=args.send_wait, remote_token=os.environ.get(args.remote_token_env) or None,
        remote_timeout_s=args.remote_timeout, keep_days=args.keep_days, max_streams=args.max_streams,
        timeout_s=found.timeout_s,
        tls=tls.channel_credentials(found.tls, "inboxmesh a2a"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = A2aServer(config)
    await server.start()
    try:
        print(f"inboxmesh a2a: agent {args.agent} at {server.http_url}.well-known/agent-card.json (JSON-RPC"
              f" {server.http_url}, gRPC {server.grpc_target}); mesh {found.address}", flush=True)
        await stop.wait()
    finally:
        await server.stop()
    return 0


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text[:40]!r}") from None
    if not value >= 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text[:40]}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inboxmesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--traces", default=None,
                        help="export spans: otlp, console (comma-separated) or none (default: INBOXMESH_TRACES, then"
                             " OTEL_TRACES_EXPORTER; otlp when OTEL_EXPORTER_OTLP_ENDPOINT is set)")
    sub = parser.add_subparsers(dest="command", required=True)

    def client_args(p):
        p.add_argument("--mesh", help="mesh address host:port (default: INBOXMESH_ADDRESS, then the data"
                                      f" directory's mesh.json, then 127.0.0.1:{settings.DEFAULT_PORT})")
        p.add_argument("--data-dir", help="state directory of a local mesh (default: INBOXMESH_DATA_DIR, then"
                                          " .inboxmesh)")
        p.add_argument("--timeout", type=float, help="deadline of each call, seconds (default 10)")
        tls_client_args(p)

    def tls_client_args(p):
        p.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA (INBOXMESH_TLS_CA)")
        p.add_argument("--tls-client-cert", metavar="PEM",
                       help="this client's certificate, for a mesh that requires one (INBOXMESH_TLS_CLIENT_CERT)")
        p.add_argument("--tls-client-key", metavar="PEM", help="its key (INBOXMESH_TLS_CLIENT_KEY)")

    def tls_server_args(p):
        p.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain (INBOXMESH_TLS_CERT)")
        p.add_argument("--tls-key", metavar="PEM", help="its private key (INBOXMESH_TLS_KEY)")
        p.add_argument("--tls-client-ca", metavar="PEM",
                       help="require client certificates this CA signed: mutual TLS (INBOXMESH_TLS_CLIENT_CA)")
        p.add_argument("--insecure", action="store_true", default=None,
                       help="allow plaintext on an address that is not a loopback one")

    # `up`'s flags default to None (not given): services.settings.mesh_config holds the defaults and
    # merges flag > environment > file > default
    up = sub.add_parser("up", help="serve the mesh in one process on the embedded store")
    up.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    up.add_argument("--port", type=int, help=f"0 = any free port (default {settings.DEFAULT_PORT})")
    up.add_argument("--data-dir", help="where the SQLite file and mesh.json live (default: INBOXMESH_DATA_DIR,"
                    " then .inboxmesh)")
    up.add_argument("--services", help="comma-separated services to serve (default registry,inbox,events)")
    up.add_argument("--admin-token", help="operator token (default: INBOXMESH_ADMIN_TOKEN, else random; written"
                    " to mesh.json)")
    up.add_argument("--capacity", type=int, help="default inbox capacity")
    up.add_argument("--heartbeat-interval", type=float,
                    help="seconds between stream heartbeats (and re-checks of closes made by other processes)")
    up.add_argument("--synchronous", choices=["full", "normal"],
                    help="full: every commit is fsynced before it is acknowledged (default); normal: survives a"
                         " crash of the mesh process but not of the machine")
    up.add_argument("--allow-cross-scope", action="store_true", default=None,
                    help="let agents send outside their own tree")
    tls_server_args(up)
    up.add_argument("--bind-credentials", action="store_true", default=None,
                    help="with mutual TLS: an agent's credential works only from the client certificate it was"
                         " registered from")
    tls_client_args(up)  # for the demo's client
    up.add_argument("--ioa-network", metavar="HOST:PORT", help="connect this mesh to an IOA network (relay)")
    up.add_argument("--ioa-tls-ca", metavar="PEM", help="connect to the IOA network with TLS, trusting this CA"
                                                        " (INBOXMESH_IOA_TLS_CA)")
    up.add_argument("--ioa-tls-cert", metavar="PEM",
                    help="the relay's certificate, for a network that requires one (INBOXMESH_IOA_TLS_CERT)")
    up.add_argument("--ioa-tls-key", metavar="PEM", help="its key (INBOXMESH_IOA_TLS_KEY)")
    up.add_argument("--node-id", help="this mesh's node id on the IOA network (default: mesh-<port>)")
    up.add_argument("--ioa-expose", metavar="RULE",
                    help="which agents the IOA network can reach: all (default; an agent registered with metadata"
                         " inboxmesh.ioa_exposed=false is not), none, or agent:<id>,scope:<id> items (plus agents"
                         " registered with inboxmesh.ioa_exposed=true)")
    up.add_argument("--ioa-outbox", action="store_true", default=None,
                    help="a send to an IOA node that cannot be reached goes into the outbox (receipt OUTBOXED) and"
                         " is sent when the node is back, unless its request chooses otherwise (docs/ioa.md)")
    up.add_argument("--store", choices=["sqlite", "jetstream"],
                    help="sqlite: embedded file in --data-dir (default); jetstream: NATS JetStream (docs/jetstream.md)")
    up.add_argument("--nats", metavar="URL[,URL]", help="NATS servers of the jetstream store")
    up.add_argument("--nats-replicas", type=int, help="JetStream replicas (default 1; 3 on a three-node cluster)")
    up.add_argument("--nats-monitor", metavar="URL[,URL]",
                    help="monitoring endpoints of the NATS servers (nats-server -m PORT), read at start to check"
                         " that each fsyncs every write (default: port 8222 of each --nats host)")
    up.add_argument("--nats-accept-lazy-fsync", action="store_true", default=None,
                    help="start without that check: on a server that does not fsync every write, a power loss"
                         " can lose accepted messages")
    up.add_argument("--nats-tls-ca", metavar="PEM", help="TLS to NATS (tls:// URLs), trusting this CA"
                                                         " (INBOXMESH_NATS_TLS_CA)")
    up.add_argument("--nats-tls-cert", metavar="PEM",
                    help="the mesh's client certificate for NATS servers that require one (INBOXMESH_NATS_TLS_CERT)")
    up.add_argument("--nats-tls-key", metavar="PEM", help="its key (INBOXMESH_NATS_TLS_KEY)")
    up.add_argument("--nats-namespace", help="prefix of the mesh's streams and buckets (default im)")
    up.add_argument("--routing", metavar="FILE", help="routing config (YAML or TOML: agents.list, bindings,"
                    " ingress.tokens; docs/routing.md); serves the routing ingress")
    up.add_argument("--max-spawn-depth", type=int, help="deepest subagent allowed (default 3)")
    up.add_argument("--max-active-children", type=int, help="running children per agent (default 8)")
    up.add_argument("--conversation-budget", type=int,
                    help="loop guard: agent messages one conversation may hold (default: the routing config's"
                         " agents.defaults.loopGuard, else 500)")
    up.add_argument("--max-trail-visits", type=int,
                    help="loop guard: times one agent may appear in a message's chain (default: the routing"
                         " config's agents.defaults.loopGuard, else 5)")
    up.add_argument("--run-archive-after", type=float, metavar="MINUTES",
                    help="archive ended subagent runs after this long (default: the routing config's"
                         " archiveAfterMinutes, else 60)")
    up.add_argument("--web-port", metavar="PORT|off",
                    help=f"the web view's port on --host (INBOXMESH_WEB_PORT; default {settings.DEFAULT_WEB_PORT}, or"
                         " any free port when that one is taken; 0 = any free port; off = none; docs/webview.md)")
    up.add_argument("--no-web", action="store_true", default=None, help="serve no web view")
    up.add_argument("--demo", action=argparse.BooleanOptionalAction, default=True,
                    help="run the two-agent demo after starting (default on)")
    up.add_argument("--exit-after-demo", action="store_true", help="stop once the demo finished")
    up.set_defaults(run=_up)

    ioa = sub.add_parser("ioa-server", help="run the reference IOA network server (its own process)")
    ioa.add_argument("--host", default="127.0.0.1")
    ioa.add_argument("--port", type=int, default=7500, help="0 = any free port")
    ioa.add_argument("--history", type=int, default=50, help="recent messages a reconnecting node gets again")
    tls_server_args(ioa)
    ioa.add_argument("--reconnect-grace-s", type=_non_negative_float, default=30.0,
                     help="for this long after it starts, a message to a node the network does not know is"
                          " refused as 'not connected' (its sender retries), not 'no such node' (final): nodes"
                          " reconnect to a restarted network one by one (0: no grace)")
    ioa.add_argument("--faults", action="store_true",
                     help="allow InjectFault (dropped connections, duplicates, delays, reordering: for tests)")
    ioa.set_defaults(run=_ioa_server)

    certs = sub.add_parser("certs", help="make a CA and certificates it signed (for a trial or a private network;"
                                         " docs/security.md)")
    certs.add_argument("directory", help="where ca.pem/ca.key and NAME.pem/NAME.key go (an existing CA is reused)")
    certs.add_argument("names", nargs="*", help="host names or node ids, one certificate each")
    certs.set_defaults(run=_certs)

    reg = sub.add_parser("register", help="register an agent; prints its id and credential")
    client_args(reg)
    reg.add_argument("name")
    reg.add_argument("--parent", metavar="CRED", help="register as a child of the agent with this credential")
    reg.add_argument("--mode", default="async", choices=["sync", "async", "fork"], help="child mode")
    reg.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE")
    reg.add_argument("--capacity", type=int, default=0, help="inbox capacity (0 = mesh default)")
    reg.set_defaults(run=_register)

    send = sub.add_parser("send", help="send a message as an agent; prints the receipt")
    client_args(send)
    send.add_argument("--as", dest="credential", required=True, metavar="CRED")
    send.add_argument("--to", required=True, metavar="AGENT_ID")
    send.add_argument("--kind", default="text", choices=["text", "task", "completion", "reply", "control"])
    send.add_argument("--reply-to", metavar="MESSAGE_ID")
    send.add_argument("--message-id", help="idempotency key (default: random)")
    send.add_argument("text")
    send.set_defaults(run=_send)

    tail = sub.add_parser("tail", help="follow an agent's inbox live")
    client_args(tail)
    tail.add_argument("--as", dest="credential", required=True, metavar="CRED")
    tail.add_argument("--consume", action="store_true",
                      help="subscribe and ack (consume) messages; takes delivery over from any other subscriber")
    tail.add_argument("--from-start", action="store_true", help="show earlier messages too")
    tail.set_defaults(run=_tail)

    status = sub.add_parser("status", help="show a message's state and its events")
    client_args(status)
    status.add_argument("--as", dest="credential", required=True, metavar="CRED")
    status.add_argument("--sender", help="the sender (default: the --as agent)")
    status.add_argument("message_id")
    status.set_defaults(run=_status)

    events = sub.add_parser("events", help="show the event record")
    client_args(events)
    events.add_argument("--as", dest="credential", metavar="CRED", help="default: the local mesh's admin token")
    events.add_argument("--agent")
    events.add_argument("--message")
    events.add_argument("--follow", action="store_true", help="then print new events as they are recorded")
    events.add_argument("--kind", action="append", metavar="KIND",
                        help="only events of this kind (message_consumed, agent_closed, ...; repeatable)")
    events.add_argument("--since", metavar="TIME", help="only events at or after TIME (ISO 8601, UTC unless"
                                                        " zoned; or a span ago: 90s, 10m, 2h, 1d)")
    events.add_argument("--until", metavar="TIME", help="only events at or before TIME (as --since)")
    events.add_argument("--last", type=int, default=0, metavar="N",
                        help="only the newest N matching events, saying how many earlier ones it left out"
                             " (default 0: all, every page of the record)")
    events.set_defaults(run=_events)

    run = sub.add_parser("run", help="run a top-level agent with a task on an agent host (live view, summary)")
    client_args(run)
    from inboxmesh.cli.host_args import host_arguments, run_arguments

    run_arguments(run)
    _metrics_port_arg(run)
    run.set_defaults(run=_run)

    host = sub.add_parser("host", help="an agent host serving the sessions of the mesh's configured agents")
    client_args(host)
    host_arguments(host)
    _metrics_port_arg(host)
    host.set_defaults(run=_host)

    close = sub.add_parser("close", help="close an agent and its descendants")
    client_args(close)
    close.add_argument("--as", dest="credential", required=True, metavar="CRED")
    close.add_argument("--reason", default="closed from the CLI")
    close.add_argument("agent_id", nargs="?")
    close.set_defaults(run=_close)

    mcp = sub.add_parser("mcp", help="an MCP server: each MCP session is an agent of the mesh (docs/interop.md)")
    client_args(mcp)
    mcp.add_argument("--transport", required=True, choices=["stdio", "http"],
                     help="stdio: the MCP client starts this command, one agent for the process; http: streamable"
                          " HTTP on 127.0.0.1, one agent per MCP session")
    mcp.add_argument("--port", type=int, default=0, help="http: the port on 127.0.0.1 (default 0: any free port)")
    who = mcp.add_mutually_exclusive_group()
    who.add_argument("--name", help="register a new agent with this name for each session (default mcp; over http"
                                    " a session's URL may name its own: /mcp?name=B)")
    who.add_argument("--credential-env", metavar="VAR",
                     help="be the existing agent whose credential is in the environment variable VAR")
    mcp.add_argument("--parent-credential-env", metavar="VAR",
                     help="register each session's agent as a child of the agent whose credential is in VAR")
    mcp.set_defaults(run=_mcp)

    gateway = sub.add_parser("a2a", help="the A2A gateway: a mesh agent as an A2A agent, and a2a: addresses"
                                         " (docs/interop.md)")
    client_args(gateway)
    gateway.add_argument("--agent", required=True, metavar="AGENT_ID", help="the mesh agent to expose")
    gateway.add_argument("--state", metavar="PATH", help="the gateway's task book, SQLite (default: the data"
                                                         " directory's a2a/<agent>.sqlite)")
    gateway.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    gateway.add_argument("--http-port", type=int, default=0, help="JSON-RPC and the Agent Card (default 0: any)")
    gateway.add_argument("--grpc-port", type=int, default=0, help="the gRPC binding (default 0: any)")
    gateway.add_argument("--public-url", help="the base URL the card advertises (default http://host:http-port)")
    gateway.add_argument("--tokens-env", default="INBOXMESH_A2A_TOKENS", metavar="VAR",
                         help="environment variable holding principal=token,... (default INBOXMESH_A2A_TOKENS)")
    gateway.add_argument("--anonymous", action="store_true", help="also accept callers without a token")
    gateway.add_argument("--skill", action="append", metavar="ID=DESCRIPTION", help="a skill the card lists")
    gateway.add_argument("--description", help="the card's description")
    gateway.add_argument("--send-wait", type=float, default=30.0, metavar="S",
                         help="a non-streaming SendMessage waits this long for the answer (default 30)")
    gateway.add_argument("--remote-token-env", default="INBOXMESH_A2A_REMOTE_TOKEN", metavar="VAR",
                         help="bearer token sent to remote A2A agents (default INBOXMESH_A2A_REMOTE_TOKEN)")
    gateway.add_argument("--remote-timeout", type=float, default=120.0, metavar="S",
                         help="a remote A2A agent must answer within this (default 120)")
    gateway.add_argument("--keep-days", type=float, default=7.0, metavar="D",
                         help="forget ended tasks D days after they ended (default 7)")
    gateway.add_argument("--max-streams", type=int, default=256, metavar="N",
                         help="streams served at once; one more is TOO_MANY_STREAMS (default 256)")
    gateway.set_defaults(run=_a2a)
    return parser


SERVICE_NAMES = {"up": "inboxmesh-mesh", "host": "inboxmesh-host", "run": "inboxmesh-host",
                 "ioa-server": "inboxmesh-ioa-network", "mcp": "inboxmesh-mcp",
                 "a2a": "inboxmesh-a2a"}
"""A process's service.name in its spans when OTEL_SERVICE_NAME does not give one (other commands:
inboxmesh-cli)."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        tracing = configure_tracing(args.traces, SERVICE_NAMES.get(args.command, "inboxmesh-cli"))
    except errors.MeshError as exc:
        print(f"inboxmesh: {exc.message}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(args.run(args))
    except errors.MeshError as exc:
        print(f"inboxmesh: {exc.reason}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if tracing is not None:  # the long-running commands return here on SIGTERM too: export what is queued
            tracing.shutdown()


if __name__ == "__main__":
    sys.exit(main())
