"""Retry and resume, side by side: an A2A agent built with a2a-sdk alone (harness/a2a_agent.py: its
DefaultRequestHandler and InMemoryTaskStore) against a mesh agent behind `inboxmesh a2a`, both driven by
a2a-sdk's own client over JSON-RPC. Prints a Markdown table (docs/interop.md keeps the last one).

    .venv/bin/python -m harness.a2a_compare

The cases:
1. the client sends, then sends again with the same messageId (its first answer was lost): how many times
   the agent ran it, and whether the two answers name one task;
2. the server restarts while a task is in progress; the client then asks for the task (GetTask) and
   subscribes again, saying the last event it saw: what it gets;
3. the client's stream breaks after its first event; it subscribes again without a restart: which events
   it gets, and whether any repeats one it had.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.types import a2a_pb2 as a2a

from harness.a2a_agent import pong_agent
from inboxmesh.a2a import A2aConfig, A2aServer
from inboxmesh.client.mesh import AgentHandle, MeshClient
from inboxmesh.client.stream import InboxStream
from services.config import MeshConfig, StoreConfig
from services.server import Mesh

TOKEN = "compare-" + uuid.uuid4().hex
ADMIN = "admin-" + uuid.uuid4().hex
EVENT_ID = "inboxmesh.event_id"


def _request(text: str, message_id: str) -> a2a.SendMessageRequest:
    return a2a.SendMessageRequest(message=a2a.Message(message_id=message_id, role=a2a.ROLE_USER,
                                                      parts=[a2a.Part(text=text)]))


def _context(last: int | None = None) -> ClientCallContext:
    params = {"authorization": f"Bearer {TOKEN}"}
    if last is not None:
        params["last-event-id"] = str(last)
    return ClientCallContext(service_parameters=params)


def _label(response: a2a.StreamResponse) -> str:
    if response.HasField("task"):
        return f"Task({a2a.TaskState.Name(response.task.status.state).removeprefix('TASK_STATE_')})"
    if response.HasField("status_update"):
        return a2a.TaskState.Name(response.status_update.status.state).removeprefix("TASK_STATE_")
    if response.HasField("artifact_update"):
        return "artifact"
    return "message"


async def _client(url: str, http: httpx.AsyncClient, streaming: bool = True):
    return await ClientFactory(ClientConfig(streaming=streaming, httpx_client=http)).create_from_url(url)


async def _first_task(stream) -> a2a.Task:
    async for response in stream:
        if response.HasField("task"):
            return response.task
        if response.HasField("status_update"):
            return a2a.Task(id=response.status_update.task_id)
    raise RuntimeError("no task")


class _Holder:
    """The exposed mesh agent: answers `pong: <text>` (after `slow_s` for texts starting with `slow`)."""

    def __init__(self, agent: AgentHandle, slow_s: float):
        self.agent, self.slow_s = agent, slow_s
        self.runs: dict[str, int] = {}
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        stream = InboxStream([self.agent])
        async for item in stream:
            for message in await stream.consume(self.agent.agent_id, item.messages) if item.messages else []:
                key = message.headers.get("inboxmesh-a2a-message-id", message.message_id)
                self.runs[key] = self.runs.get(key, 0) + 1
                if message.content.text.startswith("slow"):
                    await asyncio.sleep(self.slow_s)
                await self.agent.reply(message, f"pong: {message.content.text}")


@contextlib.asynccontextmanager
async def _mesh_side(tmp: Path, slow_s: float) -> AsyncIterator[tuple[Mesh, AgentHandle, _Holder]]:
    mesh = Mesh(MeshConfig(port=0, store=StoreConfig(path=tmp / "mesh.db"), admin_token=ADMIN))
    await mesh.start()
    client = MeshClient(mesh.address, admin_token=ADMIN)
    agent = await client.register("pong")
    holder = _Holder(agent, slow_s)
    try:
        yield mesh, agent, holder
    finally:
        holder.task.cancel()
        await client.close()
        await mesh.stop(grace=0.5)


def _gateway_config(mesh: Mesh, agent: AgentHandle, tmp: Path, port: int = 0) -> A2aConfig:
    return A2aConfig(mesh=mesh.address, admin_token=ADMIN, agent_id=agent.agent_id, state=tmp / "a2a.sqlite",
                     http_port=port, tokens={TOKEN: "compare"}, send_wait_s=20)


async def sdk_alone(slow_s: float) -> dict[str, str]:
    found: dict[str, str] = {}
    async with httpx.AsyncClient(timeout=30, headers={"authorization": f"Bearer {TOKEN}"}) as http:
        async with pong_agent(slow_s=slow_s) as (url, executor):
            client = await _client(url, http, streaming=False)
            message_id = uuid.uuid4().hex
            first = [r async for r in client.send_message(_request("hello", message_id))][0].task
            second = [r async for r in client.send_message(_request("hello", message_id))][0].task
            runs = executor.executions[message_id]
            found["retry"] = (f"ran {runs} time{'s' if runs != 1 else ''}; "
                              f"{'one task' if first.id == second.id else 'two tasks'}")
            client = await _client(url, http)
            stream = client.send_message(_request("slow resume", uuid.uuid4().hex))
            task = await _first_task(stream)
            await stream.aclose()
            resumed = [_label(r) async for r in client.subscribe(a2a.SubscribeToTaskRequest(id=task.id))]
            found["break"] = ", ".join(resumed) + " (a snapshot, then what came after it; no cursor)"
            stream = client.send_message(_request("slow restart", uuid.uuid4().hex))
            task = await _first_task(stream)
            await stream.aclose()
        async with pong_agent(slow_s=slow_s) as (url2, _):  # the restart: a new process on a new port
            client = await _client(url2, http)
            try:
                await client.get_task(a2a.GetTaskRequest(id=task.id))
                found["restart"] = "GetTask found it"
            except Exception as exc:  # noqa: BLE001 (what the SDK raises is the finding)
                found["restart"] = f"GetTask: {type(exc).__name__}: {str(exc)[:80]}; the task and its answer are gone"
    return found


async def gateway(slow_s: float) -> dict[str, str]:
    found: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        async with _mesh_side(tmp, slow_s) as (mesh, agent, holder), httpx.AsyncClient(timeout=30) as http:
            server = A2aServer(_gateway_config(mesh, agent, tmp))
            await server.start()
            url = server.http_url
            client = await _client(url, http, streaming=False)
            message_id = uuid.uuid4().hex
            first = [r async for r in client.send_message(_request("hello", message_id), context=_context())][0].task
            second = [r async for r in client.send_message(_request("hello", message_id), context=_context())][0].task
            runs = holder.runs.get(message_id, 0)
            found["retry"] = (f"ran {runs} time{'s' if runs != 1 else ''}; "
                              f"{'one task' if first.id == second.id else 'two tasks'}")
            client = await _client(url, http)
            stream = client.send_message(_request("slow resume", uuid.uuid4().hex), context=_context())
            task = await _first_task(stream)
            await stream.aclose()
            last = int(str(task.metadata[EVENT_ID]))
            resumed = [_label(r) async for r in client.subscribe(a2a.SubscribeToTaskRequest(id=task.id),
                                                                 context=_context(last))]
            found["break"] = ", ".join(resumed) + " (each event once, after the one the client named)"
            stream = client.send_message(_request("slow restart", uuid.uuid4().hex), context=_context())
            task = await _first_task(stream)
            await stream.aclose()
            last = int(str(task.metadata[EVENT_ID]))
            port = int(url.rstrip("/").rsplit(":", 1)[1])
            await server.stop()
            server = A2aServer(_gateway_config(mesh, agent, tmp, port))
            await server.start()
            client = await _client(server.http_url, http)
            got = await client.get_task(a2a.GetTaskRequest(id=task.id), context=_context())
            replay = [_label(r) async for r in client.subscribe(a2a.SubscribeToTaskRequest(id=task.id),
                                                                context=_context(last))]
            found["restart"] = (f"GetTask: {a2a.TaskState.Name(got.status.state).removeprefix('TASK_STATE_')};"
                                f" resubscribed after event {last}: {', '.join(replay)}")
            await server.stop()
    return found


async def main() -> None:
    slow_s = 2.0
    alone, ours = await sdk_alone(slow_s), await gateway(slow_s)
    rows = [("retry with the same messageId", "retry"), ("stream broken, subscribe again", "break"),
            ("server restarted mid-task, then GetTask and subscribe", "restart")]
    print("| case | a2a-sdk alone (InMemoryTaskStore) | mesh agent behind `inboxmesh a2a` |")
    print("| --- | --- | --- |")
    for title, key in rows:
        print(f"| {title} | {alone[key]} | {ours[key]} |")


if __name__ == "__main__":
    asyncio.run(main())
