"""`inboxmesh mcp` driven by the official MCP SDK's client, as an MCP client (a coding assistant) would:
real server processes (`python -m inboxmesh.cli.main mcp`, over stdio and over streamable HTTP) against a
real mesh, everything proven from the mesh's own record (events, registry, message states), not from what
the tools say about themselves.

- two MCP sessions play the seed's sibling exchange (A passes a random code to B, B answers, both report
  to their parent);
- a take interrupted before its result returns consumes nothing: a server killed at that point, and a
  call the client cancelled;
- a send retried with the same message_id is DUPLICATE and stores nothing;
- `notifications/resources/updated` for the inbox when a message lands (2025-11-25 `resources/subscribe`
  over HTTP; 2026-07-28 `subscriptions/listen` over stdio);
- refusals are tool errors naming the mesh's reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp_types
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.shared.exceptions import MCPError
from mcp.shared.subscriptions import ResourceUpdated
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS

from harness.evidence import K, Record
from inboxmesh.client.mesh import AgentHandle, MeshClient
from inboxmesh.client.stream import InboxStream
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.registry.v1 import registry_pb2 as reg_pb
from tests.fixtures import eventually

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
PARENT_VAR = "INBOXMESH_TEST_PARENT_CREDENTIAL"
AGENT_VAR = "INBOXMESH_TEST_AGENT_CREDENTIAL"
CALL_TIMEOUT_S = 90.0
"""Each MCP request's read timeout: generous, the machine is shared (a take waits at most 30 s itself)."""
CREDENTIAL = re.compile(r"agt_[0-9a-f]{20}\.")
"""What a credential looks like (`<agent_id>.<secret>`): never in a tool result."""


def mcp_args(address: str, *args: str) -> list[str]:
    return ["-m", "inboxmesh.cli.main", "--log-level", "info", "mcp", "--mesh", address, *args]


@contextlib.asynccontextmanager
async def stdio_session(address: str, log: Path, *args: str, env: dict[str, str],
                        **client_options: Any) -> AsyncIterator[Client]:
    """An MCP client session with `inboxmesh mcp --transport stdio ARGS`, which the SDK's stdio client
    starts (and stops: stdin closed, then its process group terminated); the server's stderr goes to
    `log`."""
    params = StdioServerParameters(command=sys.executable, args=mcp_args(address, "--transport", "stdio", *args),
                                   env=env, cwd=str(ROOT))
    with log.open("a") as errlog:
        async with Client(stdio_client(params, errlog=errlog), read_timeout_seconds=CALL_TIMEOUT_S,
                          **client_options) as session:
            yield session


@contextlib.asynccontextmanager
async def http_server(address: str, log: Path, *args: str, env: dict[str, str]) -> AsyncIterator[str]:
    """`inboxmesh mcp --transport http --port 0 ARGS` as a process; yields its URL; stopped by its PID."""
    with log.open("ab") as errlog:
        process = await asyncio.create_subprocess_exec(
            sys.executable, *mcp_args(address, "--transport", "http", "--port", "0", *args), cwd=ROOT,
            env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errlog)
        try:
            assert process.stdout is not None
            line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
            found = re.search(r"listening on (\S+)", line)
            assert found, f"the HTTP server did not start: {line!r} (its log: {log})"
            yield found.group(1)
        finally:
            if process.returncode is None:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), 30)
                except TimeoutError:
                    process.kill()
                    await process.wait()


async def tool(session: Client, name: str, **arguments: Any) -> dict[str, Any]:
    """A tool's result (its JSON), which must not be an error."""
    result = await session.call_tool(name, arguments)
    text = result.content[0].text if result.content and isinstance(result.content[0], mcp_types.TextContent) else ""
    assert not result.is_error, f"{name}({arguments}) failed: {text}"
    assert not CREDENTIAL.search(text), f"a credential in the result of {name}"
    return json.loads(text)


async def refused(session: Client, name: str, **arguments: Any) -> dict[str, Any]:
    """A tool's error result (its JSON): a refusal, never a traceback."""
    result = await session.call_tool(name, arguments)
    assert result.is_error, f"{name}({arguments}) was not refused: {result.content}"
    assert isinstance(result.content[0], mcp_types.TextContent)
    text = result.content[0].text
    assert "Traceback" not in text and not CREDENTIAL.search(text)
    return json.loads(text)


async def consume(agent: AgentHandle, count: int) -> list[env_pb.Envelope]:
    """Consume `count` messages of the agent's inbox on a Consume stream, one turn per delivery."""
    stream = InboxStream([agent])
    taken: list[env_pb.Envelope] = []

    async def follow() -> None:
        turn = 0
        async for item in stream:
            if item.messages:
                turn += 1
                taken.extend(await stream.consume(agent.agent_id, item.messages, turn=turn))
                if len(taken) >= count:
                    return

    try:
        await asyncio.wait_for(follow(), 60)
    finally:
        stream.stop()
    return taken


def once(record: Record, message_id: str, sender: str, recipient: str, *, attempts: int = 1) -> ev.Event:
    """The message stored, delivered (`attempts` times) and consumed exactly once, in that order, by its
    recipient; its CONSUMED event."""
    match = {"message_id": message_id, "sender": sender, "recipient": recipient}
    stored = record.one(K.EVENT_KIND_MESSAGE_STORED, **match)
    delivered = record.of(K.EVENT_KIND_MESSAGE_DELIVERED, agent_id=recipient, **match)
    consumed = record.one(K.EVENT_KIND_MESSAGE_CONSUMED, agent_id=recipient, **match)
    assert [d.detail for d in delivered] == [f"attempt={n}" for n in range(1, attempts + 1)]
    assert stored.event_id < delivered[0].event_id and delivered[-1].event_id < consumed.event_id
    return consumed


async def closed(client: MeshClient, *agent_ids: str) -> Record:
    """The record once it shows each agent closed (a session's end releases its agent)."""
    async def read() -> Record | None:
        record = await Record.read(client)
        return record if all(record.of(K.EVENT_KIND_AGENT_CLOSED, agent_id=a) for a in agent_ids) else None

    return await eventually(read, timeout=60, interval=0.1, message=f"AGENT_CLOSED of {agent_ids}")


async def test_two_mcp_sessions_play_the_sibling_exchange(mesh, client, tmp_path):
    """A (stdio, 2026-07-28) and B (streamable HTTP, the handshake era) are children of a parent the test
    registered; A passes a random code to B, B answers it, both report to the parent."""
    parent = await client.register("parent")
    env = {PARENT_VAR: parent.credential}
    code = f"SEC-{secrets.randbelow(10**6):06d}"
    family = ("--parent-credential-env", PARENT_VAR)
    async with http_server(mesh.address, tmp_path / "b.log", "--name", "B", *family, env=env) as url, \
            stdio_session(mesh.address, tmp_path / "a.log", "--name", "A", *family, env=env) as a, \
            Client(url, read_timeout_seconds=CALL_TIMEOUT_S) as b:
        assert a.protocol_version in MODERN_PROTOCOL_VERSIONS
        assert b.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS, "the HTTP transport speaks the handshake era"
        a_id, b_id = (await tool(a, "whoami"))["agent_id"], (await tool(b, "whoami"))["agent_id"]
        team = {agent["name"]: agent["agent_id"] for agent in (await tool(a, "list_agents"))["agents"]}
        assert team == {"parent": parent.agent_id, "A": a_id, "B": b_id}

        assert (await tool(a, "take_messages"))["messages"] == []  # A's first take (turn 1): nothing yet
        to_b = await tool(a, "send_message", to="B", text=f"The code is {code}. Tell me you have it.")
        assert (to_b["status"], to_b["to"]) == ("ACCEPTED", b_id)

        took = await tool(b, "take_messages", wait_s=30)
        (message,) = took["messages"]
        assert (took["turn"], message["message_id"], message["from"], message["from_name"]) == (
            1, to_b["message_id"], a_id, "A")
        assert code in message["text"]
        answer = await tool(b, "reply", message_id=message["message_id"], text=f"I have it: {code}")
        assert (answer["status"], answer["to"]) == ("ACCEPTED", a_id)

        took = await tool(a, "take_messages", wait_s=30)
        (reply,) = took["messages"]
        assert (took["turn"], reply["message_id"], reply["from"], reply["kind"], reply["in_reply_to"]) == (
            2, answer["message_id"], b_id, "reply", to_b["message_id"])
        assert code in reply["text"]

        report_a = await tool(a, "send_message", to=parent.agent_id, text=f"A: B confirmed {code}")
        report_b = await tool(b, "send_message", to="parent", text=f"B: got {code} from A")
        assert {report_a["status"], report_b["status"]} == {"ACCEPTED"}
        reports = await consume(parent, 2)
        assert {m.message_id for m in reports} == {report_a["message_id"], report_b["message_id"]}

    record = await closed(client, a_id, b_id)
    # identities: A and B are the parent's async children, registered for their sessions, closed at their end
    for name, agent_id in (("A", a_id), ("B", b_id)):
        agent = await client.admin_agent(agent_id)
        assert (agent.name, agent.parent_id, agent.scope_id, agent.mode) == (
            name, parent.agent_id, parent.agent_id, reg_pb.AGENT_MODE_ASYNC)
        assert agent.close_reason == "its MCP session ended"
        record.one(K.EVENT_KIND_AGENT_REGISTERED, agent_id=agent_id)

    # A -> B, consumed by B's first take; B's reply to it, consumed by A's second take
    b_took = once(record, to_b["message_id"], a_id, b_id)
    a_took = once(record, answer["message_id"], b_id, a_id)
    assert (b_took.turn, a_took.turn) == (1, 2), "each take is one turn, acked by the take that returned it"
    stored_reply = record.one(K.EVENT_KIND_MESSAGE_STORED, message_id=answer["message_id"])
    assert stored_reply.in_reply_to == to_b["message_id"] and stored_reply.event_id > b_took.event_id
    reply_status = await client.agent(parent.agent_id, parent.credential).status(answer["message_id"], sender=b_id)
    assert (reply_status.envelope.sender, reply_status.envelope.kind) == (b_id, env_pb.MESSAGE_KIND_REPLY)
    assert code in reply_status.envelope.content.text

    # both reports, consumed by the parent, sent after what each reports on
    parent_took = [once(record, report_a["message_id"], a_id, parent.agent_id),
                   once(record, report_b["message_id"], b_id, parent.agent_id)]
    assert all(t.turn >= 1 for t in parent_took)
    assert record.one(K.EVENT_KIND_MESSAGE_STORED, message_id=report_a["message_id"]).event_id > a_took.event_id

    # the four messages are the whole exchange (besides the mesh's own: the runs' announces at the end)
    exchanged = {e.message_id for e in record.of(K.EVENT_KIND_MESSAGE_STORED)
                 if not e.message_id.startswith("inboxmesh:")}
    assert exchanged == {to_b["message_id"], answer["message_id"], report_a["message_id"], report_b["message_id"]}


async def test_a_take_killed_before_its_result_leaves_the_message_for_the_next_server(mesh, client, tmp_path):
    """The server bound to B by credential dies (a crash point: exit like kill -9) after its take has the
    message and before the ack: nothing is consumed; a server started again with the same credential
    takes it (delivered a second time), and numbers its takes on from the record's last turn."""
    parent = await client.register("parent")
    b = await parent.spawn("B")
    first = await parent.send(b.agent_id, "the code is SEC-1")
    bound = ("--credential-env", AGENT_VAR)
    log = tmp_path / "b.log"
    crashing = {AGENT_VAR: b.credential, "INBOXMESH_CRASH_AT": "mcp-take-before-ack"}
    async with stdio_session(mesh.address, log, *bound, env=crashing) as session:
        with pytest.raises(MCPError):
            await session.call_tool("take_messages", {"wait_s": 30})
    assert "crash point 'mcp-take-before-ack' reached" in log.read_text()
    record = await Record.read(client)
    assert not record.of(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=first.message_id)

    async with stdio_session(mesh.address, log, *bound, env={AGENT_VAR: b.credential}) as session:
        took = await tool(session, "take_messages", wait_s=30)
        assert [m["message_id"] for m in took["messages"]] == [first.message_id] and took["turn"] == 1
    second = await parent.send(b.agent_id, "and SEC-2")
    async with stdio_session(mesh.address, log, *bound, env={AGENT_VAR: b.credential}) as session:
        took = await tool(session, "take_messages", wait_s=30)
        assert [m["message_id"] for m in took["messages"]] == [second.message_id]
        assert took["turn"] == 2, "a bound agent's takes go on from the last turn in the record"

    record = await Record.read(client)
    assert once(record, first.message_id, parent.agent_id, b.agent_id, attempts=2).turn == 1
    assert once(record, second.message_id, parent.agent_id, b.agent_id).turn == 2
    assert not record.of(K.EVENT_KIND_AGENT_CLOSED, agent_id=b.agent_id), "an agent bound by credential stays open"


async def test_a_cancelled_take_consumes_nothing(mesh, client, tmp_path):
    """The client gives up on a waiting take (the SDK then sends notifications/cancelled): the server's
    take stops with it, so a message arriving afterwards is left for the next take, not swallowed by a
    take whose result nobody reads."""
    parent = await client.register("parent")
    b = await parent.spawn("B")
    async with stdio_session(mesh.address, tmp_path / "b.log", "--credential-env", AGENT_VAR,
                             env={AGENT_VAR: b.credential}) as session:
        with anyio.move_on_after(1) as waited:
            await session.call_tool("take_messages", {"wait_s": 30})
        assert waited.cancelled_caught, "the take was still waiting (the inbox was empty)"
        await tool(session, "whoami")  # read after the cancel on the same connection: the take is stopped by now
        sent = await parent.send(b.agent_id, "after the cancel")
        await eventually(lambda: delivered(client, sent.message_id), timeout=30, message="the delivery to B's server")
        took = await tool(session, "take_messages", wait_s=30)
        assert [m["message_id"] for m in took["messages"]] == [sent.message_id]
        assert took["turn"] == 2, "the cancelled take was turn 1"
    record = await Record.read(client)
    assert once(record, sent.message_id, parent.agent_id, b.agent_id).turn == 2


RAW_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
               "MCP-Protocol-Version": "2025-11-25"}


async def raw_call(http: httpx2.AsyncClient, url: str, session_id: str, request_id: int, method: str,
                   params: dict[str, Any]) -> dict[str, Any]:
    """One JSON-RPC request of a 2025-11-25 session, by hand; its answer read from the SSE response."""
    body = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
    headers = {**RAW_HEADERS, "Mcp-Session-Id": session_id}
    async with http.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line[5:].strip():
                message = json.loads(line[5:])
                if message.get("id") == request_id:
                    return message
    raise AssertionError(f"no answer to {method}")


async def test_a_take_whose_http_connection_dropped_consumes_nothing(mesh, client, tmp_path):
    """A client's connection drops while its take waits (no notifications/cancelled: a client that died).
    The SDK's HTTP transport runs the call on the session all the same; the take sees the connection gone
    before acking, so the message that arrives is left for the session's next take."""
    parent = await client.register("parent")
    b = await parent.spawn("B")
    async with http_server(mesh.address, tmp_path / "b.log", "--credential-env", AGENT_VAR,
                           env={AGENT_VAR: b.credential}) as url, httpx2.AsyncClient(timeout=60) as http:
        hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}
        response = await http.post(url, json=hello, headers=RAW_HEADERS)
        assert response.status_code == 200, response.text
        session_id = response.headers["Mcp-Session-Id"]
        done = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        response = await http.post(url, json=done, headers={**RAW_HEADERS, "Mcp-Session-Id": session_id})
        assert response.status_code == 202
        take = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": "take_messages", "arguments": {"wait_s": 30}}}
        async with httpx2.AsyncClient(timeout=60) as dying, \
                dying.stream("POST", url, json=take, headers={**RAW_HEADERS, "Mcp-Session-Id": session_id}) as taking:
            assert taking.status_code == 200  # the take's event stream is open: the session runs it
        # the response was left unread and its client closed: the connection is gone, without a word
        sent = await parent.send(b.agent_id, "while nobody listens")
        answer = await raw_call(http, url, session_id, 3, "tools/call",
                                {"name": "take_messages", "arguments": {"wait_s": 30}})
        took = json.loads(answer["result"]["content"][0]["text"])
        assert [m["message_id"] for m in took["messages"]] == [sent.message_id]
    record = await Record.read(client)
    assert once(record, sent.message_id, parent.agent_id, b.agent_id).turn == took["turn"]


async def delivered(client: MeshClient, message_id: str) -> bool:
    events = await client.admin_events(message_id=message_id, kinds=[K.EVENT_KIND_MESSAGE_DELIVERED])
    return bool(events)


async def test_a_send_retried_with_its_message_id_is_a_duplicate(mesh, client, tmp_path):
    parent = await client.register("parent")
    b = await parent.spawn("B")
    async with stdio_session(mesh.address, tmp_path / "a.log", "--name", "A", "--parent-credential-env",
                             PARENT_VAR, env={PARENT_VAR: parent.credential}) as a:
        a_id = (await tool(a, "whoami"))["agent_id"]
        sent = await tool(a, "send_message", to=b.agent_id, text="once", message_id="retry-1")
        again = await tool(a, "send_message", to=b.agent_id, text="once", message_id="retry-1")
    assert (sent["status"], again["status"]) == ("ACCEPTED", "DUPLICATE")
    assert again["sequence"] == sent["sequence"] and again["message_id"] == sent["message_id"] == "retry-1"
    record = await Record.read(client)
    assert len(record.of(K.EVENT_KIND_MESSAGE_SENT, message_id="retry-1", sender=a_id)) == 2
    record.one(K.EVENT_KIND_MESSAGE_STORED, message_id="retry-1", sender=a_id)
    assert len(record.of(K.EVENT_KIND_MESSAGE_STORED, recipient=b.agent_id)) == 1, "nothing stored twice"


async def test_the_inbox_resource_announces_arrivals_to_a_subscribed_http_session(mesh, client, tmp_path):
    """2025-11-25: `resources/subscribe`, then `notifications/resources/updated` on the session's own
    stream when a message lands. A client pinned to the sessionless 2026-07-28 protocol is refused."""
    parent = await client.register("parent")
    arrived = asyncio.Event()
    updates: list[str] = []

    async def on_message(message: Any) -> None:
        if isinstance(message, mcp_types.ResourceUpdatedNotification):
            updates.append(message.params.uri)
            arrived.set()

    async with http_server(mesh.address, tmp_path / "b.log", "--parent-credential-env", PARENT_VAR,
                           env={PARENT_VAR: parent.credential}) as url:
        async with Client(f"{url}?name=B", mode="legacy", message_handler=on_message,
                          read_timeout_seconds=CALL_TIMEOUT_S) as b:
            me = await tool(b, "whoami")
            assert me["name"] == "B", "the session's URL named its agent"
            inbox = me["inbox"]
            assert [r.uri for r in (await b.list_resources()).resources] == [inbox]
            with warnings.catch_warnings():  # the SDK deprecates resources/subscribe for 2026-07-28 servers
                warnings.simplefilter("ignore")
                await b.subscribe_resource(inbox)
            assert json.loads(await read_text(b, inbox))["waiting"] == 0
            sent = await parent.send(me["agent_id"], "news")
            await asyncio.wait_for(arrived.wait(), 30)
            assert updates == [inbox]
            waiting = json.loads(await read_text(b, inbox))
            assert (waiting["waiting"], waiting["message_ids"]) == (1, [sent.message_id])
            took = await tool(b, "take_messages")
            assert [m["message_id"] for m in took["messages"]] == [sent.message_id]
            assert json.loads(await read_text(b, inbox))["waiting"] == 0

        async with Client(url, mode="2026-07-28", read_timeout_seconds=CALL_TIMEOUT_S) as modern:
            with pytest.raises(MCPError, match="no sessions"):
                await modern.call_tool("whoami", {})


async def read_text(session: Client, uri: str) -> str:
    contents = (await session.read_resource(uri)).contents
    assert isinstance(contents[0], mcp_types.TextResourceContents)
    return contents[0].text


async def test_the_inbox_resource_announces_arrivals_on_a_listen_stream(mesh, client, tmp_path):
    """2026-07-28: `subscriptions/listen` naming the inbox gets `notifications/resources/updated`."""
    parent = await client.register("parent")
    async with stdio_session(mesh.address, tmp_path / "a.log", "--name", "A", "--parent-credential-env",
                             PARENT_VAR, env={PARENT_VAR: parent.credential}) as a:
        me = await tool(a, "whoami")
        async with a.listen(resource_subscriptions=[me["inbox"]]) as updates:
            sent = await parent.send(me["agent_id"], "news")
            with anyio.fail_after(30):
                event = await anext(updates)
        assert isinstance(event, ResourceUpdated) and event.uri == me["inbox"]
        assert json.loads(await read_text(a, me["inbox"]))["message_ids"] == [sent.message_id]


async def test_sigterm_releases_the_agent_of_a_stdio_server_whose_client_keeps_stdin_open(mesh, client, tmp_path):
    """A host that stops its MCP servers with SIGTERM (stdin still open): the server ends at once, and the
    agent it registered is closed, not left open with nobody holding its credential."""
    parent = await client.register("parent")
    with (tmp_path / "s.log").open("wb") as errlog:
        server = await asyncio.create_subprocess_exec(
            sys.executable, *mcp_args(mesh.address, "--transport", "stdio", "--name", "S", "--parent-credential-env",
                                      PARENT_VAR), cwd=ROOT, env={**os.environ, PARENT_VAR: parent.credential},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errlog)
        try:
            async def registered() -> list[reg_pb.Agent]:
                return [a for a in await parent.list_agents() if a.name == "S"]

            (agent,) = await eventually(registered, timeout=60, interval=0.1, message="S registered")
            await eventually(lambda: subscribed(client, agent.agent_id), timeout=60, message="S subscribed")
            server.terminate()
            assert await asyncio.wait_for(server.wait(), 60) == 0
        finally:
            if server.returncode is None:
                server.kill()
                await server.wait()
    record = await closed(client, agent.agent_id)
    assert record.one(K.EVENT_KIND_AGENT_CLOSED, agent_id=agent.agent_id).detail == "its MCP session ended"


async def subscribed(client: MeshClient, agent_id: str) -> bool:
    return bool(await client.admin_events(agent_id=agent_id, kinds=[K.EVENT_KIND_SUBSCRIBED]))


async def test_refusals_are_tool_errors_naming_the_reason(mesh, client, tmp_path):
    parent = await client.register("parent")
    async with stdio_session(mesh.address, tmp_path / "a.log", "--name", "A", "--parent-credential-env",
                             PARENT_VAR, env={PARENT_VAR: parent.credential}) as a:
        a_id = (await tool(a, "whoami"))["agent_id"]
        unknown = await refused(a, "send_message", to="agt_00000000000000000000", text="hello?")
        assert unknown["error"] == "UNKNOWN_TARGET" and unknown["receipt"]["status"] == "UNKNOWN_TARGET"
        assert (await refused(a, "send_message", to="nobody", text="hello?"))["error"] == "NAME_NOT_FOUND"
        assert (await refused(a, "send_message", to="parent"))["error"] == "MISSING_FIELD"
        assert (await refused(a, "send_message", to="parent", text=7))["error"] == "WRONG_TYPE"
        assert (await refused(a, "send_message", to="parent", text="x", cc="B"))["error"] == "UNKNOWN_KEY"
        assert (await refused(a, "take_messages", max=0))["error"] == "BAD_VALUE"
        assert (await refused(a, "take_messages", wait_s=31))["error"] == "BAD_VALUE"
        assert (await refused(a, "reply", message_id="never-seen", text="x"))["error"] == "MESSAGE_NOT_FOUND"
        with pytest.raises(MCPError, match="Unknown tool"):
            await a.call_tool("close", {})
    record = await Record.read(client)
    stored = [e.message_id for e in record.of(K.EVENT_KIND_MESSAGE_STORED, sender=a_id)]
    assert all(m.startswith("inboxmesh:announce:") for m in stored), "nothing refused was stored (the mesh announced" \
        " A's run to the parent when A's session ended)"
