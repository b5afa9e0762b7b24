"""`inboxmesh a2a`, the A2A gateway, with a2a-sdk's own client and server on the other side (no mocks): a
real mesh, the gateway as a process, an exposed agent consuming its inbox and answering, everything checked
against the mesh's record.

Inbound: SendMessage over JSON-RPC and gRPC; a retry with the same messageId is the same task and one
stored message; the task's states follow the record; a stream resumed after a gateway SIGKILL with the
last event id the client saw loses nothing and repeats nothing; every refusal is its A2A error.
Outbound: a mesh agent's message to `a2a:<card URL>` reaches an a2a-sdk agent (bearer token), and its
answer comes back into the agent's inbox as a REPLY; a failing or unknown remote gets a dead-letter
notice."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.client.errors import A2AClientError
from a2a.types import a2a_pb2 as a2a
from a2a.utils.errors import A2AError, TaskNotFoundError, UnsupportedOperationError

from agent_host.models.scripted import call
from harness.a2a_agent import pong_agent
from harness.hosts import scripted_host
from inboxmesh.a2a.book import TaskBook, TaskRow
from inboxmesh.a2a.errors import register as register_errors
from inboxmesh.a2a.gateway import task_id_for
from inboxmesh.client.mesh import AgentHandle, MeshClient
from inboxmesh.client.stream import InboxStream
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from tests.fixtures import ADMIN_TOKEN, eventually

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent
TOKENS = {"alice": "tok-alice-" + uuid.uuid4().hex, "bob": "tok-bob-" + uuid.uuid4().hex}
EVENT_ID = "inboxmesh.event_id"


class Gateway:
    """`inboxmesh a2a` as a process, restartable on the same state file and ports."""

    def __init__(self, mesh: str, agent_id: str, tmp: Path, *extra: str):
        self.mesh, self.agent_id, self.tmp, self.extra = mesh, agent_id, tmp, extra
        self.process: asyncio.subprocess.Process | None = None
        self.http_port = self.grpc_port = 0
        self.url = self.grpc = ""

    async def start(self) -> None:
        args = ["-m", "inboxmesh.cli.main", "a2a", "--mesh", self.mesh, "--agent", self.agent_id,
                "--state", str(self.tmp / "a2a.sqlite"), "--http-port", str(self.http_port),
                "--grpc-port", str(self.grpc_port), "--send-wait", "20", "--remote-timeout", "6", *self.extra]
        env = {**os.environ, "INBOXMESH_ADMIN_TOKEN": ADMIN_TOKEN,
               "INBOXMESH_A2A_TOKENS": ",".join(f"{p}={t}" for p, t in TOKENS.items()),
               "INBOXMESH_A2A_REMOTE_TOKEN": "remote-secret"}
        with (self.tmp / "a2a.log").open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, *args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=log)
        assert self.process.stdout is not None
        line = (await asyncio.wait_for(self.process.stdout.readline(), 60)).decode()
        found = re.search(r"JSON-RPC (http://127\.0\.0\.1:(\d+)/), gRPC (127\.0\.0\.1:(\d+))", line)
        assert found, f"the gateway did not start: {line!r} (log: {(self.tmp / 'a2a.log').read_text()[-2000:]})"
        self.url, self.grpc = found.group(1), found.group(3)
        self.http_port, self.grpc_port = int(found.group(2)), int(found.group(4))

    async def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        await self.process.wait()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 20)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


class Answerer:
    """The exposed agent: consumes its inbox (one turn per delivery) and answers each message
    `echo: <text>` with a REPLY to its sender, while `running` is set."""

    def __init__(self, agent: AgentHandle):
        self.agent = agent
        self.running = asyncio.Event()
        self.running.set()
        self.consumed: list[env_pb.Envelope] = []
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        stream = InboxStream([self.agent])
        turn = 0
        async for item in stream:
            if not item.messages:
                continue
            await self.running.wait()
            turn += 1
            for message in await stream.consume(self.agent.agent_id, item.messages, turn=turn):
                self.consumed.append(message)
                await self.agent.reply(message, f"echo: {message.content.text}")

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


@pytest.fixture
async def setup(mesh, tmp_path) -> AsyncIterator[tuple[MeshClient, AgentHandle, Answerer, Gateway]]:
    register_errors()
    async with MeshClient(mesh.address, timeout=10.0, admin_token=ADMIN_TOKEN) as client:
        exposed = await client.register("helper", inbox_capacity=3)
        answerer = Answerer(exposed)
        gateway = Gateway(mesh.address, exposed.agent_id, tmp_path, "--max-streams", "2")
        await gateway.start()
        try:
            yield client, exposed, answerer, gateway
        finally:
            await answerer.close()
            await gateway.stop()


def auth(principal: str = "alice", last_event_id: int | None = None) -> ClientCallContext:
    params = {"authorization": f"Bearer {TOKENS[principal]}"} if principal else {}
    if last_event_id is not None:
        params["last-event-id"] = str(last_event_id)
    return ClientCallContext(service_parameters=params)


async def a2a_client(gateway: Gateway, binding: str, http: httpx.AsyncClient, streaming: bool = True):
    factory = ClientFactory(ClientConfig(streaming=streaming, httpx_client=http, supported_protocol_bindings=[binding],
                                         grpc_channel_factory=grpc.aio.insecure_channel))
    return await factory.create_from_url(gateway.url)


def request(text: str, message_id: str | None = None, **configuration) -> a2a.SendMessageRequest:
    return a2a.SendMessageRequest(
        message=a2a.Message(message_id=message_id or uuid.uuid4().hex, role=a2a.ROLE_USER,
                            parts=[a2a.Part(text=text)]),
        configuration=a2a.SendMessageConfiguration(**configuration))


async def stored(client: MeshClient, message_id: str) -> list[ev.Event]:
    return [e for e in await client.admin_events(message_id=message_id)
            if e.kind == ev.EVENT_KIND_MESSAGE_STORED]


def answer_of(task: a2a.Task) -> str:
    return "\n".join(p.text for artifact in task.artifacts for p in artifact.parts)


@pytest.mark.parametrize("binding", ["JSONRPC", "GRPC"])
async def test_a_message_is_a_task_whose_states_follow_the_record(setup, binding):
    client, exposed, answerer, gateway = setup
    async with httpx.AsyncClient(timeout=30) as http:
        sdk = await a2a_client(gateway, binding, http, streaming=False)
        message_id = uuid.uuid4().hex
        [response] = [r async for r in sdk.send_message(request("hello", message_id), context=auth())]
        task = response.task
        assert task.status.state == a2a.TASK_STATE_COMPLETED, task
        assert answer_of(task) == "echo: hello"
        # the record: one message from the client's a2a address, stored, consumed by the agent's turn
        events = await client.admin_events(message_id=task.id)
        kinds = [e.kind for e in events if e.recipient == exposed.agent_id]
        assert ev.EVENT_KIND_MESSAGE_STORED in kinds and ev.EVENT_KIND_MESSAGE_CONSUMED in kinds
        assert {e.sender for e in events if e.kind == ev.EVENT_KIND_MESSAGE_STORED} == {"a2a:client/alice"}
        consumed = [m for m in answerer.consumed if m.message_id == task.id]
        assert len(consumed) == 1 and consumed[0].headers["inboxmesh-a2a-message-id"] == message_id
        # the answer: the agent's reply, stored in the gateway agent's inbox and consumed there (the gateway
        # completes the task and then acks the reply, so a crash between loses no answer: the consumption
        # may be recorded a moment after the client saw the task completed)
        async def replies() -> list[ev.Event]:
            return [e for e in await client.admin_events(kinds=[ev.EVENT_KIND_MESSAGE_CONSUMED])
                    if e.in_reply_to == task.id]

        [reply] = await eventually(replies, timeout=10, message="the reply consumed by the gateway")
        assert reply.sender == exposed.agent_id
        await asyncio.sleep(0.2)
        assert len(await replies()) == 1, "consumed once"
        # a retry with the same messageId: the same task, nothing stored twice
        [again] = [r async for r in sdk.send_message(request("hello", message_id), context=auth())]
        assert again.task.id == task.id and again.task.status.state == a2a.TASK_STATE_COMPLETED
        assert len(await stored(client, task.id)) == 1
        assert len([m for m in answerer.consumed if m.message_id == task.id]) == 1
        # GetTask reads the same; another caller does not see it
        got = await sdk.get_task(a2a.GetTaskRequest(id=task.id), context=auth())
        assert got.status.state == a2a.TASK_STATE_COMPLETED and answer_of(got) == "echo: hello"
        with pytest.raises((TaskNotFoundError, A2AClientError), match="no task"):
            await sdk.get_task(a2a.GetTaskRequest(id=task.id), context=auth("bob"))
        await sdk.close()


async def test_a_stream_resumes_after_a_gateway_kill_without_loss_or_repetition(setup):
    client, exposed, answerer, gateway = setup
    answerer.running.clear()  # the agent holds the message: the task stays SUBMITTED
    async with httpx.AsyncClient(timeout=30) as http:
        sdk = await a2a_client(gateway, "JSONRPC", http)
        seen: list[a2a.StreamResponse] = []
        stream = sdk.send_message(request("resume me"), context=auth())
        seen.append(await anext(stream))
        await stream.aclose()
        task = seen[0].task
        assert task.status.state == a2a.TASK_STATE_SUBMITTED
        last = int(str(task.metadata[EVENT_ID]))
        await sdk.close()
    await gateway.kill()  # SIGKILL: the task book is all that is left
    answerer.running.set()  # the agent consumes and answers while no gateway runs
    await eventually(lambda: any(m.message_id == task.id for m in answerer.consumed), timeout=30,
                     message="the agent consumed the message")
    await gateway.start()
    async with httpx.AsyncClient(timeout=30) as http:
        sdk = await a2a_client(gateway, "GRPC", http)
        resumed = [r async for r in sdk.subscribe(a2a.SubscribeToTaskRequest(id=task.id),
                                                  context=auth(last_event_id=last))]
        await sdk.close()
    states = [r.status_update.status.state for r in resumed if r.HasField("status_update")]
    answers = [r.artifact_update.artifact for r in resumed if r.HasField("artifact_update")]
    assert states == [a2a.TASK_STATE_WORKING, a2a.TASK_STATE_COMPLETED], resumed
    assert [p.text for a in answers for p in a.parts] == ["echo: resume me"]
    ids = [int(str((r.status_update if r.HasField("status_update") else r.artifact_update).metadata[EVENT_ID]))
           for r in resumed]
    assert ids == sorted(set(ids)) and ids[0] > last
    # without a cursor an ended task is not subscribed to (GetTask reads it)
    async with httpx.AsyncClient(timeout=30) as http:
        sdk = await a2a_client(gateway, "JSONRPC", http)
        with pytest.raises((UnsupportedOperationError, A2AClientError), match="has ended"):
            [r async for r in sdk.subscribe(a2a.SubscribeToTaskRequest(id=task.id), context=auth())]
        await sdk.close()


async def test_the_record_watch_goes_on_after_the_task_book_failed_a_write(setup, tmp_path):
    """The task book's file failing a write (here: locked by another process past sqlite's busy timeout)
    stops the gateway's record watch for a moment, not for good: it resumes from the book's cursor and
    records what it could not, so the task still follows the record."""
    client, exposed, answerer, gateway = setup
    await answerer.close()  # this test consumes the message itself, and sends no answer
    async with httpx.AsyncClient(timeout=30) as http:
        sdk = await a2a_client(gateway, "JSONRPC", http)
        stream = sdk.send_message(request("held"), context=auth())
        task = (await anext(stream)).task
        await stream.aclose()
        assert task.status.state == a2a.TASK_STATE_SUBMITTED
        book = sqlite3.connect(tmp_path / "a2a.sqlite", isolation_level=None)
        book.execute("BEGIN EXCLUSIVE")  # every write of the gateway's book waits 5 s, then fails
        try:
            inbox = InboxStream([exposed])
            async for item in inbox:
                if item.messages:
                    assert [m.message_id for m in item.messages] == [task.id]
                    await inbox.consume(exposed.agent_id, item.messages)
                    break
            inbox.stop()
            await eventually(lambda: "the task book failed" in (tmp_path / "a2a.log").read_text(), timeout=30,
                             message="the record watch's write failed on the locked book")
        finally:
            book.execute("COMMIT")
            book.close()
        # the CONSUMED event, read again from the cursor: the task is WORKING (it stayed SUBMITTED when the
        # book's error ended the watch)
        async def state() -> int:
            return (await sdk.get_task(a2a.GetTaskRequest(id=task.id), context=auth())).status.state

        for _ in range(100):
            if await state() == a2a.TASK_STATE_WORKING:
                break
            await asyncio.sleep(0.2)
        assert await state() == a2a.TASK_STATE_WORKING
        await sdk.close()


async def test_every_refusal_is_an_a2a_error_and_stores_nothing(setup):
    client, exposed, answerer, gateway = setup
    async with httpx.AsyncClient(timeout=30) as http:
        for binding in ("JSONRPC", "GRPC"):
            sdk = await a2a_client(gateway, binding, http, streaming=False)
            with pytest.raises((A2AError, A2AClientError), match="bearer token"):
                [r async for r in sdk.send_message(request("who am I"), context=auth(principal=""))]
            with pytest.raises((A2AError, A2AClientError), match="no task"):
                await sdk.get_task(a2a.GetTaskRequest(id="a2a-nope"), context=auth())
            await sdk.close()
        # the agent stops taking messages: its inbox (capacity 3) fills with two streams' messages and one more
        answerer.running.clear()
        # streams past --max-streams (2): the third is refused while two are open
        streaming = await a2a_client(gateway, "JSONRPC", http)
        open_streams = [streaming.send_message(request(f"stream {n}"), context=auth()) for n in range(2)]
        for stream in open_streams:
            assert (await anext(stream)).task.status.state == a2a.TASK_STATE_SUBMITTED
        with pytest.raises((A2AError, A2AClientError), match="streams at once"):
            [r async for r in streaming.send_message(request("stream 3"), context=auth())]
        for stream in open_streams:
            await stream.aclose()
        await streaming.close()
        sdk = await a2a_client(gateway, "JSONRPC", http, streaming=False)
        [r] = [r async for r in sdk.send_message(request("fill", return_immediately=True), context=auth())]
        assert r.task.status.state == a2a.TASK_STATE_SUBMITTED
        refused_id = uuid.uuid4().hex
        with pytest.raises((A2AError, A2AClientError), match="inbox is full"):
            [r async for r in sdk.send_message(request("one too many", refused_id), context=auth())]
        grpc_sdk = await a2a_client(gateway, "GRPC", http, streaming=False)
        with pytest.raises((A2AError, A2AClientError), match="RESOURCE_EXHAUSTED|inbox is full"):
            [r async for r in grpc_sdk.send_message(request("one too many", refused_id), context=auth())]
        await grpc_sdk.close()
        assert await stored(client, task_id_for("alice", refused_id)) == []
        answerer.running.set()
        # a closed agent
        await eventually(lambda: len(answerer.consumed) >= 3, timeout=30, message="the agent caught up")
        await exposed.close(reason="test over")
        with pytest.raises((A2AError, A2AClientError), match="closed"):
            [r async for r in sdk.send_message(request("anyone there?"), context=auth())]
        await sdk.close()


async def test_an_agent_reaches_an_a2a_agent_and_its_answer_comes_back_as_a_reply(setup):
    client, exposed, answerer, gateway = setup
    caller = await client.register("caller")
    async with pong_agent(token="remote-secret", slow_s=15) as (url, executor):
        stream = InboxStream([caller])
        inbox: list[env_pb.Envelope] = []

        async def read() -> None:
            async for item in stream:
                inbox.extend(await stream.consume(caller.agent_id, item.messages) if item.messages else [])

        reader = asyncio.create_task(read())
        try:
            receipt = await caller.send(f"a2a:{url}", "ping", message_id="out-1")
            assert receipt.status == 1, receipt  # ACCEPTED: stored in the gateway's outbox inbox
            await eventually(lambda: any(m.in_reply_to == "out-1" for m in inbox), timeout=60,
                             message="the remote answer in the caller's inbox")
            [answer] = [m for m in inbox if m.in_reply_to == "out-1"]
            assert answer.kind == env_pb.MESSAGE_KIND_REPLY and answer.content.text == "pong: ping"
            assert answer.sender == f"a2a:{url}" and answer.origin.kind == env_pb.ORIGIN_KIND_A2A
            assert executor.executions["out-1"] == 1
            assert executor.seen_metadata[-1]["inboxmesh.sender"] == caller.agent_id
            # a failing remote and an unknown one: a dead-letter notice, as for a local message
            await caller.send(f"a2a:{url}", "fail please", message_id="out-2")
            await caller.send("a2a:http://127.0.0.1:9/", "anyone?", message_id="out-3")
            await caller.send(f"a2a:{url}", "slow, longer than --remote-timeout", message_id="out-5")
            await eventually(lambda: {m.in_reply_to for m in inbox} >= {"out-2", "out-3", "out-5"}, timeout=60,
                             message="three notices")
            notices = {m.in_reply_to: m for m in inbox if m.kind == env_pb.MESSAGE_KIND_CONTROL}
            assert notices["out-2"].headers["inboxmesh-reason"] == "A2A_FAILED"
            assert notices["out-3"].headers["inboxmesh-reason"] == "UNKNOWN_TARGET"
            assert notices["out-5"].headers["inboxmesh-reason"] == "A2A_TIMEOUT"
            assert len([m for m in inbox if m.in_reply_to == "out-5"]) == 1
            assert all(n.headers["inboxmesh-notice"] == "dead-lettered" for n in notices.values())
        finally:
            stream.stop()
            reader.cancel()
    # an a2a: address that is not one, on the receipt
    bad = await caller.send("a2a:ftp://x", "no", message_id="out-4")
    assert bad.status == 3 and "not an A2A address" in bad.detail  # UNKNOWN_TARGET


async def test_a_hosted_agent_asks_an_a2a_agent_with_send_message_and_reads_the_answer_at_a_turn(setup, tmp_path):
    """The agent host's own send_message tool: the answer is an ordinary inbox message, consumed by the next
    turn (the record's MESSAGE_CONSUMED with that turn), and the model sees it with in_reply_to."""
    client, exposed, answerer, gateway = setup
    async with pong_agent(token="remote-secret") as (url, executor):
        def asker(view):
            step = len(view.results)
            if step == 0:
                return call("send_message", to=f"a2a:{url}", text="are you there?")
            answers = [m for m in view.inbox if m.text.endswith("pong: are you there?")]
            if not answers:
                return call("wait")
            return call("finish", result=f"remote said {answers[0].text!r} in reply to {answers[0].in_reply_to}")

        async with scripted_host(client.target, tmp_path / "host", {"asker": asker}) as host:
            runner = await host.start_task("asker", "ask the remote agent")
            await eventually(lambda: runner.record.completed,
                             timeout=60, message="the asker finished")
            [(arguments, sent)] = [(r.arguments, r.result) for r in _results(runner) if r.name == "send_message"]
            assert sent["status"] == "accepted", sent
            answers = [e for e in await client.admin_events(agent_id=runner.agent_id,
                                                            kinds=[ev.EVENT_KIND_MESSAGE_CONSUMED])
                       if e.sender == f"a2a:{url}"]
            assert len(answers) == 1 and answers[0].turn >= 2 and answers[0].in_reply_to, answers
            assert executor.executions and all(n == 1 for n in executor.executions.values())


def _results(runner):
    from agent_host.models.scripted import ContextView
    return ContextView.parse(runner.conversation.messages, []).results


def test_the_task_book_forgets_ended_tasks_after_their_time_and_keeps_open_ones(tmp_path):
    book = TaskBook(tmp_path / "book.sqlite")
    for task_id in ("ended", "open"):
        book.add_task(TaskRow(task_id, "alice", "ctx", f"m-{task_id}", "agt_x", a2a.Message(message_id="m"), 1))
    assert book.add_event("ended", "done", a2a.TASK_STATE_COMPLETED) is not None
    assert book.add_event("ended", "late", a2a.TASK_STATE_WORKING) is None  # nothing after the end
    assert book.add_event("open", "consumed", a2a.TASK_STATE_WORKING) is not None
    assert book.add_event("open", "consumed", a2a.TASK_STATE_WORKING) is None  # one fact, stored once
    assert book.prune(ended_before_us=0) == 0
    assert book.prune(ended_before_us=2**62) == 1
    assert book.task("ended") is None and book.events("ended") == []
    assert book.task("open") is not None and [e.state for e in book.events("open")] == [
        a2a.TASK_STATE_SUBMITTED, a2a.TASK_STATE_WORKING]
    assert oct((tmp_path / "book.sqlite").stat().st_mode & 0o777) == "0o600"
