"""Operations: health checking, reflection, graceful shutdown, the CLI, and
services run as separate processes."""

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from inboxmesh.client.mesh import MeshClient
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.server import Mesh
from tests.fixtures import ADMIN_TOKEN, eventually, make_config
from tests.processes import MeshProcess
from tests.streams import Collector

ROOT = Path(__file__).resolve().parent.parent


async def test_health_and_reflection(mesh):
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inboxmesh.inbox.v1.InboxService", "inboxmesh.registry.v1.RegistryService",
                        "inboxmesh.events.v1.EventService"):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

    def reflect():
        with grpc.insecure_channel(mesh.address) as channel:
            return set(ProtoReflectionDescriptorDatabase(channel).get_services())

    services = await asyncio.to_thread(reflect)
    assert {"inboxmesh.inbox.v1.InboxService", "inboxmesh.registry.v1.RegistryService",
            "inboxmesh.events.v1.EventService", "grpc.health.v1.Health"} <= services

    # reflection v1 (grpc.reflection.v1, what newer tools ask first): the same messages as v1alpha on the wire
    async with grpc.aio.insecure_channel(mesh.address) as channel:
        call = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        await call.write(reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="inboxmesh.inbox.v1.InboxService"))
        await call.done_writing()
        listed, described = [answer async for answer in call]
        assert "inboxmesh.inbox.v1.InboxService" in {s.name for s in listed.list_services_response.service}
        assert described.file_descriptor_response.file_descriptor_proto, "the service's file, serialized"


async def test_graceful_shutdown_tells_subscribers_to_come_back(tmp_path):
    mesh = Mesh(make_config(tmp_path))
    await mesh.start()
    try:
        async with MeshClient(mesh.address, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            b = await lead.spawn("b")
            sub = Collector(b)
            await sub.wait_event(pb.SUBSCRIPTION_EVENT_KIND_ATTACHED)
            receipt = await lead.send(b.agent_id, "before shutdown")
            await sub.wait_for(1)
            await mesh.stop(grace=2)
            await asyncio.wait_for(sub.ended.wait(), 5)
            assert sub.error is not None and sub.error.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in sub.error.details()
    finally:
        await mesh.stop()
        await mesh.stop()  # twice is fine
    async with Mesh(make_config(tmp_path)) as again:
        async with MeshClient(again.address, admin_token=ADMIN_TOKEN) as client:
            lead = client.agent(lead.info, lead.credential)
            assert (await lead.status(receipt.message_id)).state == pb.MESSAGE_STATE_DELIVERED


async def test_a_port_in_use_is_refused_not_shared(mesh, tmp_path):
    from dataclasses import replace

    from inboxmesh.client import errors

    second = Mesh(replace(make_config(tmp_path / "other"), port=mesh.port))
    with pytest.raises(errors.Unavailable, match="could not listen"):
        await second.start()
    await second.stop()


def _cli(*args, data_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "warning", *args,
                           "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_cli_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "inboxmesh.cli.main", "--help"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    for command in ("up", "register", "send", "tail", "status", "events", "close"):
        assert command in out


def test_commands_load_only_what_they_use():
    """Every `inboxmesh` process builds the whole parser, `run` and `host` included: their arguments come from
    inboxmesh/cli/host_args.py, so `up`, `send`, `events` and the rest start without the agent host and the
    OpenAI client (which cost each process about 0.7 s of CPU here)."""
    def loaded(probe: str) -> str:
        """What a fresh interpreter running `probe` prints (its list of unwanted modules loaded)."""
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()

    found = loaded("import sys; from inboxmesh.cli.main import build_parser; build_parser();"
                   " print(sorted(m for m in sys.modules if m == 'openai' or m.startswith(('openai.',"
                   " 'agent_host.host', 'agent_host.runner', 'inboxmesh.cli.run', 'inboxmesh.cli.host'))"
                   " and m != 'inboxmesh.cli.host_args'))")
    assert found == "[]", found
    # and an agent host (inboxmesh run, inboxmesh host) loads the OpenAI client only for a model that speaks
    # it, and the metrics server (aiohttp, the Prometheus exporter) only with --metrics-port
    found = loaded("import sys, inboxmesh.cli.run, inboxmesh.cli.host;"
                   " print(sorted(m for m in ('openai', 'aiohttp', 'prometheus_client', 'agent_host.metrics')"
                   " if m in sys.modules))")
    assert found == "[]", found


def test_up_runs_the_demo_exchange(tmp_path):
    result = subprocess.run([sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "warning", "up", "--port", "0",
                             "--data-dir", str(tmp_path), "--exit-after-demo"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "inboxmesh listening on 127.0.0.1:" in out
    assert "bob consumed" in out and "alice consumed" in out
    assert "sent +" in out and "stored +" in out and "delivered +" in out and "consumed +" in out


def test_cli_register_send_status_events_against_a_running_mesh(tmp_path):
    with MeshProcess(tmp_path):
        lead = json.loads(_cli("register", "lead", data_dir=tmp_path).stdout)
        child = json.loads(_cli("register", "child", "--parent", lead["credential"], data_dir=tmp_path).stdout)
        assert child["parent_id"] == lead["agent_id"] and child["scope_id"] == lead["agent_id"]
        sent = _cli("send", "--as", lead["credential"], "--to", child["agent_id"], "--message-id", "cli-1",
                    "hello from the shell", data_dir=tmp_path)
        assert sent.returncode == 0, sent.stderr
        assert json.loads(sent.stdout)["status"] == "RECEIPT_STATUS_ACCEPTED"
        status = _cli("status", "--as", lead["credential"], "cli-1", data_dir=tmp_path)
        assert '"state": "MESSAGE_STATE_QUEUED"' in status.stdout and "message_stored" in status.stdout
        events = _cli("events", "--agent", child["agent_id"], data_dir=tmp_path)  # admin token from mesh.json
        assert "message_sent" in events.stdout and "msg=cli-1" in events.stdout
        full = _cli("send", "--as", lead["credential"], "--to", "agt_nobody", "x", data_dir=tmp_path)
        assert full.returncode == 3 and "UNKNOWN_TARGET" in full.stdout
        bad = _cli("send", "--as", "nonsense", "--to", child["agent_id"], "x", data_dir=tmp_path)
        assert bad.returncode == 2 and "MALFORMED_CREDENTIAL" in bad.stderr


def test_cli_events_pages_through_the_whole_record_and_filters_by_kind_and_time(tmp_path):
    """More events than one ListEvents page (1,000): `inboxmesh events` prints them all; --kind and
    --since/--until filter; --last N prints the newest N and says how many it left out; a bad kind or time is
    refused naming it."""
    from inboxmesh.client.mesh import envelope

    with MeshProcess(tmp_path) as proc:
        async def fill() -> str:
            async with MeshClient(proc.address, admin_token=ADMIN_TOKEN) as client:
                lead = await client.register("lead")
                kid = await lead.spawn("kid", inbox_capacity=10_000)
                for start in range(0, 1_300, 100):
                    receipts = await lead.send_batch([envelope(kid.agent_id, f"n{i}", message_id=f"m-{i}")
                                                      for i in range(start, start + 100)])
                    assert {r.status for r in receipts} == {pb.RECEIPT_STATUS_ACCEPTED}
                return kid.agent_id

        kid = asyncio.run(fill())
        every = _cli("events", "--agent", kid, data_dir=tmp_path).stdout.splitlines()
        assert sum("message_stored" in line for line in every) == 1_300, "every page, not the first 1,000"
        listed = _cli("events", "--agent", kid, "--kind", "message_stored", data_dir=tmp_path)
        stored = listed.stdout.splitlines()
        assert listed.returncode == 0, listed.stderr
        assert len(stored) == 1_300 and all("message_stored" in line for line in stored)
        assert "msg=m-0 " in stored[0] and "msg=m-1299 " in stored[-1]
        last = _cli("events", "--agent", kid, "--kind", "MESSAGE_STORED", "--last", "3", data_dir=tmp_path)
        assert [line.split("msg=")[1].split()[0] for line in last.stdout.splitlines()] == ["m-1297", "m-1298", "m-1299"]
        assert "1297 earlier matching events not shown (--last 3)" in last.stderr
        assert len(_cli("events", "--agent", kid, "--kind", "message_stored", "--since", "1h",
                        data_dir=tmp_path).stdout.splitlines()) == 1_300
        assert _cli("events", "--agent", kid, "--until", "2020-01-01", data_dir=tmp_path).stdout == ""
        bad = _cli("events", "--kind", "consumed_twice", data_dir=tmp_path)
        assert bad.returncode == 2 and "no event kind 'consumed_twice'" in bad.stderr and "message_stored" in bad.stderr
        when = _cli("events", "--since", "yesterday", data_dir=tmp_path)
        assert when.returncode == 2 and "--since: 'yesterday' is neither a time" in when.stderr


async def test_sigusr1_writes_where_each_task_waits_and_the_mesh_keeps_serving(tmp_path):
    with MeshProcess(tmp_path) as proc:
        async with MeshClient(proc.address, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            child = await lead.spawn("child")
            sub = Collector(child)  # a stream open while the tasks are written
            try:
                await eventually(lambda: _subscribed(lead, child.agent_id), 20)
                assert proc.proc is not None
                proc.proc.send_signal(signal.SIGUSR1)
                await eventually(lambda: "tasks" in proc.output() and "task " in proc.output(), 10,
                                 message="the task dump")
                assert (await lead.send(child.agent_id, "after the dump")).status == pb.RECEIPT_STATUS_ACCEPTED
                (got,) = await sub.wait_for(1)
                assert got.content.text == "after the dump"
            finally:
                await sub.stop()
        assert proc.proc is not None and proc.proc.poll() is None, "SIGUSR1 does not stop the mesh"
        assert "/services/" in proc.output(), "the stacks name the mesh's own code"


async def test_cli_tail_shows_messages_live(tmp_path):
    with MeshProcess(tmp_path) as proc:
        async with MeshClient(proc.address, admin_token=ADMIN_TOKEN) as client:
            lead = await client.register("lead")
            child = await lead.spawn("child")
            tail = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "warning", "tail", "--as", child.credential,
                "--consume", "--data-dir", str(tmp_path), cwd=ROOT, stdout=asyncio.subprocess.PIPE)
            try:
                assert tail.stdout is not None, "stdout is a pipe"
                await eventually(lambda: _subscribed(lead, child.agent_id), 20)
                await lead.send(child.agent_id, "live one")
                first = await asyncio.wait_for(tail.stdout.readline(), 20)
                assert first.startswith(b"-- attached " + child.agent_id.encode())
                line = await asyncio.wait_for(tail.stdout.readline(), 20)
                assert b"live one" in line and b"(consumed)" in line
                status = await lead.inbox_status(1, recipient=child.agent_id)
                assert status.state == pb.MESSAGE_STATE_CONSUMED
            finally:
                tail.kill()
                await tail.wait()


async def _subscribed(agent, agent_id):
    from inboxmesh.events.v1 import events_pb2 as ev

    return await agent.events(agent_id=agent_id, kinds=[ev.EVENT_KIND_SUBSCRIBED])


async def test_registry_and_inbox_as_separate_processes_on_one_store(tmp_path):
    """Registry in one process, Inbox and Events in another, sharing the
    SQLite file: an agent registered in one sends and receives in the other,
    and a close made in the registry process ends the inbox stream."""
    with MeshProcess(tmp_path, "--services", "registry") as registry, \
            MeshProcess(tmp_path, "--services", "inbox,events", "--heartbeat-interval", "0.5") as inbox:
        async with MeshClient(registry.address, admin_token=ADMIN_TOKEN) as reg_client, \
                MeshClient(inbox.address, admin_token=ADMIN_TOKEN) as inbox_client:
            lead = await reg_client.register("lead")
            b = await lead.spawn("b")
            lead_i, b_i = inbox_client.agent(lead.info, lead.credential), inbox_client.agent(b.info, b.credential)
            sub = Collector(b_i, auto_ack=True)
            try:
                assert (await lead_i.send(b.agent_id, "across processes")).status == pb.RECEIPT_STATUS_ACCEPTED
                await eventually(lambda: len(sub.consumed) == 1)
                await lead.close(b.agent_id, reason="closed elsewhere")
                event = await sub.wait_event(pb.SUBSCRIPTION_EVENT_KIND_CLOSED, timeout=15)
                assert b.agent_id == event.agent_id
                assert (await lead_i.send(b.agent_id, "late")).status == pb.RECEIPT_STATUS_TARGET_CLOSED
            finally:
                await sub.stop()
        with pytest.raises(grpc.aio.AioRpcError):
            async with grpc.aio.insecure_channel(registry.address) as channel:
                await pb_stub(channel).Send(pb.SendRequest(), timeout=2)


def pb_stub(channel):
    from inboxmesh.inbox.v1 import inbox_pb2_grpc

    return inbox_pb2_grpc.InboxServiceStub(channel)


def test_cli_run_shows_the_exchange_live_and_summarises_it(tmp_path):
    with MeshProcess(tmp_path):
        result = _cli("run", "--policies", "harness.policies:SIBLING_POLICIES", "--name", "parent",
                      "Coordinate A and B. The secret code for A is SEC-777777.", data_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "B            agent_woken" in out and "consumed" in out
    assert "A -> B [text] 'Hello B, the code is SEC-777777.': consumed" in out
    assert "-> parent [completion" in out
    result = out.split("\nresult: ", 1)[1]  # the parent joined both reports, each with its stats line
    assert "A: B confirmed SEC-777777" in result, "both reports, in whichever order they came"
    assert result.count("Stats: ran ") == 2


def test_cli_run_without_a_model_endpoint_says_what_to_set(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with MeshProcess(tmp_path):
        result = _cli("run", "do something", data_dir=tmp_path)
    assert result.returncode == 2 and "OPENAI_BASE_URL" in result.stderr


def test_ioa_network_and_two_meshes_as_separate_processes(tmp_path):
    """`inboxmesh ioa-server` in its own process, two `inboxmesh up --ioa-network` meshes: an agent of one
    reaches an agent of the other with the CLI."""
    network = subprocess.Popen([sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "warning", "ioa-server",
                                "--port", "0"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert network.stdout is not None, "stdout is a pipe"
        address = network.stdout.readline().split()[-1]
        with MeshProcess(tmp_path / "a", "--ioa-network", address, "--node-id", "north"), \
                MeshProcess(tmp_path / "b", "--ioa-network", address, "--node-id", "south"):
            sender = json.loads(_cli("register", "sender", data_dir=tmp_path / "a").stdout)
            receiver = json.loads(_cli("register", "receiver", data_dir=tmp_path / "b").stdout)
            sent = _cli("send", "--as", sender["credential"], "--to", f"ioa:south/{receiver['agent_id']}",
                        "--message-id", "over-the-network", "hello south", data_dir=tmp_path / "a")
            assert sent.returncode == 0, sent.stdout + sent.stderr
            receipt = json.loads(sent.stdout)
            assert receipt["status"] == "RECEIPT_STATUS_ACCEPTED" and receipt["sequence"] == "1"
            events = _cli("events", "--agent", receiver["agent_id"], data_dir=tmp_path / "b").stdout
            assert f"from=ioa:north/{sender['agent_id']}" in events and "ioa_received" in events
    finally:
        network.terminate()
        network.wait(10)
        if network.stdout is not None:
            network.stdout.close()


def test_inboxmesh_host_serves_routed_sessions_and_they_answer_on_their_channel(tmp_path):
    """`inboxmesh host` in its own process beside `inboxmesh up --routing`: a channel message through
    Ingress is claimed and answered by its configured agent (scripted echo), and the answer reaches the
    channel's gateway; SIGTERM stops the host cleanly."""
    from inboxmesh.client.mesh import MeshClient
    from inboxmesh.routing.v1 import routing_pb2 as route
    from tests.streams import Collector

    routing = tmp_path / "routing.yaml"
    routing.write_text("agents:\n  list:\n    - id: helper\n      model: scripted/echo\n"
                       "      tools: {allow: [reply, wait]}\ningress: {tokens: [tok]}\n")
    with MeshProcess(tmp_path, "--routing", str(routing)) as mesh:
        host = subprocess.Popen([sys.executable, "-m", "inboxmesh.cli.main", "--log-level", "warning", "host",
                                 "--ingress-token", "tok", "--data-dir", str(tmp_path)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            async def exchange():
                async with MeshClient(mesh.address, admin_token="test-admin-token") as client:
                    sent = await client.ingress("tok", route.RouteInput(channel="telegram", peer=route.Peer(
                        kind=route.PEER_KIND_DM, id="ann")), "tg-1", "hello there")
                    gateway = await client.claim_session("tok", "channel:telegram/default")
                    inbox = Collector(gateway, auto_ack=True)
                    try:
                        [answer] = await inbox.wait_for(1, timeout=30)
                    finally:
                        await inbox.stop()
                    return sent, answer

            sent, answer = asyncio.run(exchange())
            assert answer.content.text == "hello there" and answer.in_reply_to == "tg-1"
            assert answer.sender == sent.session_agent_id
        finally:
            host.send_signal(signal.SIGTERM)
            out, _ = host.communicate(timeout=30)
        assert host.returncode == 0, out
        assert "serving the sessions of 1 configured agent(s) (helper" in out


def test_run_offers_the_local_model_a_smaller_tool_set_unless_told():
    """Every tool schema is part of each request's prompt: `inboxmesh run --model local` leaves out
    list_agents and close_agent (about a fifth of the schemas) unless --tools names them."""
    import json

    from agent_host.tools import ALL_TOOLS, schemas
    from inboxmesh.cli.run import tools_offered

    local = tools_offered(None, "local")
    assert set(local) == set(ALL_TOOLS) - {"list_agents", "close_agent"}
    assert tools_offered(None, "openai") == ALL_TOOLS
    assert tools_offered("finish, list_agents", "local") == ("finish", "list_agents")
    assert len(json.dumps(schemas(local))) < 0.8 * len(json.dumps(schemas(ALL_TOOLS)))


def test_live_lines_show_a_configured_agents_identity_and_stay_aligned(capsys):
    """`inboxmesh run`'s live lines: an agent that runs as a configured agent with an identity shows its emoji
    and name beside its own (`🏠 Claw (main)`); one without shows its plain name; the kind column lines up."""
    from types import SimpleNamespace

    from agent_host.host import HostEvent
    from inboxmesh.cli.run import AgentLabels, cells, printer
    from inboxmesh.routing.v1 import routing_pb2 as route

    configured = SimpleNamespace(agents={
        "home": route.ConfiguredAgent(id="home", identity=route.Identity(name="Claw", emoji="\U0001F3E0")),
        "code": route.ConfiguredAgent(id="code")})
    runners = {agent_id: SimpleNamespace(record=SimpleNamespace(config_id=config_id))
               for agent_id, config_id in (("a1", "home"), ("a2", "code"), ("a3", ""))}
    host = SimpleNamespace(runners=runners)
    show = printer(100.0, AgentLabels(host, configured))  # type: ignore[arg-type]  # what AgentLabels reads
    for agent_id, name in (("a1", "main"), ("a2", "coder"), ("a3", "plain")):
        show(HostEvent(101.0, name, agent_id, "turn_started", "turn 1"))
    runners.pop("a1")  # closed: the host drops its runner before the last line
    show(HostEvent(102.0, "main", "a1", "closed", "task completed"))
    columns = [line[len("+  1.000s  "):] for line in capsys.readouterr().out.splitlines()]  # from the agent on
    assert columns[0].startswith("\U0001F3E0 Claw (main) ") and columns[3].startswith("\U0001F3E0 Claw (main) ")
    assert columns[1].startswith("coder ") and columns[2].startswith("plain ") and "Claw" not in columns[1] + columns[2]
    # the kind column starts at the same terminal cell: 12 for a name, 7 for "🏠 Claw" and 3 for " ()"; the
    # emoji takes two cells, so its line is one character shorter
    assert [c.index(" turn_started") for c in columns[:3]] == [21, 22, 22] and columns[3].index(" closed") == 21
    assert {cells(c[:22 if "Claw" not in c else 21]) for c in columns} == {22}, columns

    plain = printer(100.0)  # a run of no configured agent: the column as it always was
    plain(HostEvent(101.0, "B", "b", "agent_woken", ""))
    assert "B            agent_woken" in capsys.readouterr().out


def test_cli_run_as_a_configured_agent_shows_its_identity_live(tmp_path):
    routing = tmp_path / "routing.yaml"
    routing.write_text("agents:\n  list:\n    - id: home\n      model: scripted/finish\n"
                       "      identity: {name: Claw, emoji: \"\\U0001F3E0\"}\n")
    with MeshProcess(tmp_path, "--routing", str(routing)):
        result = _cli("run", "--agent", "home", "--name", "main", "Say hello.", data_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    live = [line for line in result.stdout.splitlines() if line.startswith("+")]
    assert live and all("\U0001F3E0 Claw (main) " in line for line in live), result.stdout
    assert any(" turn_started " in line for line in live)
