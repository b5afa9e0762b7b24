"""The agent runner on its own: an in-memory host (AgentHost), an in-memory agent in the mesh (its
AgentCalls and its Inbox, agent_host/ports.py), and a scripted model. No mesh, no gRPC: each fake keeps
what the runner asked of it, and the tests read that back.

- a turn consumes a delivered message (acked with its turn) and the model's reply goes out as a reply;
- a message arriving while a turn runs does not start a second loop: it waits for the turn boundary,
  and the messages waiting then are taken together in one turn;
- a task over its budget fails through the host, and a child that finishes with close_on_complete
  ends its run, asks to be closed, and is released when the mesh closes it;
- a turn that waits leaves its remaining tool calls undone.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

import pytest

from agent_host.budget import BudgetExceeded, TaskBudget
from agent_host.config import CLOSE_ON_COMPLETE, Budget, HostConfig
from agent_host.conversation import Conversation
from agent_host.host import AgentProfile
from agent_host.hoststore import HostedAgent
from agent_host.models.base import Model, ModelReply
from agent_host.models.scripted import ContextView, Decision, ScriptedModel, call, echo, say
from agent_host.ports import Team
from agent_host.runner import AgentRunner
from agent_host.tools import ALL_TOOLS
from inboxmesh.client import errors
from inboxmesh.client.stream import StreamItem
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.ioa.v1 import relay_pb2
from inboxmesh.registry.v1 import registry_pb2 as reg
from inboxmesh.runs.v1 import runs_pb2
from tests.fixtures import eventually

K = ev.EventKind
CONFIG = HostConfig(mesh_address="unused: the runner only talks to its fakes", call_timeout_s=5)


class FakeHost:
    """An AgentHost that keeps every request of its one runner."""

    def __init__(self, names: dict[str, str]):
        self.names = names
        self.observed: list[tuple[str, str]] = []
        self.saves = 0
        self.ended: list[tuple[str, Exception | None]] = []
        self.close_requests: list[tuple[str, str]] = []
        self.released: list[tuple[list[str], str]] = []
        self.team_of: dict[str, Team] = {}

    def observe(self, agent: HostedAgent, kind: str, detail: str) -> None:
        self.observed.append((kind, detail))

    def save(self, agent: HostedAgent, conversation: Conversation) -> None:
        self.saves += 1

    async def name_of(self, agent_id: str) -> str:
        return self.names.get(agent_id, agent_id)

    async def address_for(self, sender: Any, to: str) -> str:
        return to  # local delivery (no route_via_ioa)

    def runners_on(self, budget: TaskBudget) -> list[Any]:
        return []  # one agent on each budget here

    def team(self, agent: HostedAgent) -> Team:
        return self.team_of.get(agent.agent_id, Team())

    async def start_child(self, parent: HostedAgent, *, name: str, task: str, mode: str,
                          history: list[dict[str, Any]], budget: TaskBudget, config_id: str = "") -> HostedAgent:
        raise errors.FailedPrecondition("this host starts no children", reason="NO_CHILDREN_HERE")

    def task_ended(self, agent: HostedAgent, budget: TaskBudget, error: Exception | None = None) -> None:
        self.ended.append((agent.agent_id, error))

    def close_soon(self, agent_id: str, reason: str) -> None:
        self.close_requests.append((agent_id, reason))

    async def release(self, agent_ids: list[str], reason: str) -> None:
        self.released.append((agent_ids, reason))


class FakeAgent:
    """One agent as an in-memory mesh would serve it: its inbox stream (deliveries, acks with the
    first ack of a message winning) and the calls it makes as itself."""

    def __init__(self, agent_id: str, parent_id: str = ""):
        self._agent_id = agent_id
        self.parent_id = parent_id
        self.acks: list[tuple[int, list[str]]] = []
        """(turn, message ids) of every ack."""
        self.sent: list[env_pb.Envelope] = []
        self.events: list[ev.Event] = []
        self.ended_runs: list[str] = []
        self._consumed: set[int] = set()
        self._sequences = itertools.count(1)
        self._items: asyncio.Queue[StreamItem | None] = asyncio.Queue()
        self._items.put_nowait(StreamItem(agent_event=inbox_pb2.SubscriptionEvent(
            agent_id=agent_id, kind=inbox_pb2.SUBSCRIPTION_EVENT_KIND_ATTACHED)))

    # -- what the test does as the mesh ----------------------------------------------
    def deliver(self, sender: str, text: str, message_id: str,
                kind: env_pb.MessageKind = env_pb.MESSAGE_KIND_TEXT) -> None:
        message = env_pb.Envelope(message_id=message_id, sender=sender, recipient=self._agent_id, kind=kind,
                                  content=env_pb.Content(text=text), sequence=next(self._sequences))
        self._items.put_nowait(StreamItem(messages=[message]))

    def close_inbox(self, detail: str) -> None:
        self._items.put_nowait(StreamItem(agent_event=inbox_pb2.SubscriptionEvent(
            agent_id=self._agent_id, kind=inbox_pb2.SUBSCRIPTION_EVENT_KIND_CLOSED, detail=detail)))

    def kinds(self) -> list[tuple[str, int]]:
        """(kind, turn) of the runtime events recorded."""
        return [(K.Name(e.kind).removeprefix("EVENT_KIND_"), e.turn) for e in self.events]

    # -- Inbox --------------------------------------------------------------------------
    async def __aiter__(self) -> AsyncGenerator[StreamItem, None]:
        while (item := await self._items.get()) is not None:
            yield item

    async def consume(self, agent_id: str, messages: list[env_pb.Envelope], turn: int = 0,
                      taken: set[tuple[str, str]] | None = None) -> list[env_pb.Envelope]:
        mine = [m for m in messages if m.recipient == agent_id]
        self.acks.append((turn, [m.message_id for m in mine]))
        won = [m for m in mine if m.sequence not in self._consumed]
        self._consumed |= {m.sequence for m in won}
        return won

    def stop(self) -> None:
        self._items.put_nowait(None)

    # -- AgentCalls -----------------------------------------------------------------------
    @property
    def agent_id(self) -> str:
        return self._agent_id

    async def send(self, recipient: str, text: str = "", **fields: Any) -> inbox_pb2.Receipt:
        message_id = fields.pop("message_id", f"sent-{len(self.sent) + 1}")
        message = env_pb.Envelope(recipient=recipient, sender=self._agent_id, message_id=message_id,
                                  content=env_pb.Content(text=text), **fields)
        self.sent.append(message)
        return inbox_pb2.Receipt(message_id=message.message_id, recipient=recipient, sequence=len(self.sent),
                                 status=inbox_pb2.RECEIPT_STATUS_ACCEPTED)

    async def end_run(self, result: str) -> runs_pb2.EndRunResponse:
        self.ended_runs.append(result)
        return runs_pb2.EndRunResponse(run=runs_pb2.SubagentRun(
            announce_state=runs_pb2.ANNOUNCE_STATE_ANNOUNCED, announce_message_id=f"inboxmesh:announce:run-{result}"))

    async def record_events(self, events: list[ev.Event], timeout: float | None = None) -> None:
        self.events += events

    async def get(self, agent_id: str | None = None) -> reg.Agent:
        return reg.Agent(agent_id=agent_id or self._agent_id, parent_id=self.parent_id,
                         state=reg.AGENT_STATE_OPEN)

    async def resolve(self, name: str) -> reg.Agent:
        raise errors.NotFound(f"no agent named {name}", reason=errors.Reason.NAME_NOT_FOUND)

    async def list_agents(self, *, parent_id: str = "", include_closed: bool = False) -> list[reg.Agent]:
        return []  # an agent without children or siblings

    async def close(self, agent_id: str | None = None, reason: str = "") -> reg.CloseAgentResponse:
        return reg.CloseAgentResponse(closed_agent_ids=[agent_id or self._agent_id])

    async def map_address(self, agent_id: str) -> str:
        raise errors.MeshError("no IOA relay here", reason="UNIMPLEMENTED")

    async def space_send(self, space: str, text: str) -> relay_pb2.SpaceSendResponse:
        raise errors.MeshError("no IOA relay here", reason="UNIMPLEMENTED")

    async def space_read(self, space: str, after: int = 0) -> relay_pb2.SpaceReadResponse:
        raise errors.MeshError("no IOA relay here", reason="UNIMPLEMENTED")


class HeldModel(ScriptedModel):
    """A scripted model whose request `hold` waits until the test lets it go, and which counts how
    many of its requests ever ran at once."""

    def __init__(self, policy: Any, hold: int):
        super().__init__(policy, "held")
        self.hold = hold
        self.holding = asyncio.Event()
        self.go = asyncio.Event()
        self.running = self.most_running = 0

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *,
                       max_output_tokens: int, max_requests: int) -> ModelReply:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            if self.requests + 1 == self.hold:
                self.holding.set()
                await self.go.wait()
            return await super().complete(messages, tools, max_output_tokens=max_output_tokens,
                                          max_requests=max_requests)
        finally:
            self.running -= 1


def runner_for(agent: FakeAgent, host: FakeHost, model: Model, *, task: str = "", budget: Budget | None = None,
               **record: Any) -> AgentRunner[FakeAgent]:
    hosted = HostedAgent(agent_id=agent.agent_id, name=host.names[agent.agent_id], credential="unused",
                         mode="async" if agent.parent_id else "main", parent_id=agent.parent_id, tools=ALL_TOOLS,
                         **record)
    conversation = Conversation(messages=[{"role": "system", "content": "You are a test agent."}])
    if task:
        conversation.add_user(task)
    return AgentRunner(host, hosted, agent, agent, model, conversation, TaskBudget(budget or Budget()), CONFIG)


@pytest.fixture
async def running():
    """Start runners, and stop them at the end of the test."""
    started: list[AgentRunner[FakeAgent]] = []

    async def start(runner: AgentRunner[FakeAgent], run: bool = False) -> AgentRunner[FakeAgent]:
        started.append(runner)
        await runner.start(run=run)
        return runner

    yield start
    for runner in started:
        await runner.stop()


async def test_a_turn_consumes_the_delivered_message_and_the_model_replies_to_it(running):
    agent, host = FakeAgent("agt_bob"), FakeHost({"agt_bob": "bob", "agt_alice": "alice"})
    runner = await running(runner_for(agent, host, ScriptedModel(echo)))
    assert runner.state == "idle" and not agent.acks, "subscribed, nothing to do yet"
    agent.deliver("agt_alice", "hello bob", "m1")
    await eventually(lambda: runner.state == "idle" and agent.sent, message="a reply, then idle again")
    assert agent.acks == [(1, ["m1"])], "consumed once, acked with its turn"
    [answer] = agent.sent
    assert (answer.recipient, answer.kind, answer.in_reply_to, answer.content.text) == (
        "agt_alice", env_pb.MESSAGE_KIND_REPLY, "m1", "hello bob")
    injected = [m["content"] for m in runner.conversation.messages if m["role"] == "user"]
    assert injected == ["Message from alice (agt_alice), message_id=m1, kind=text:\nhello bob"]
    assert "m1" in runner.received
    # the reply's turn, then one more turn in which the model has nothing left to answer
    assert agent.kinds() == [("AGENT_WOKEN", 0), ("TURN_STARTED", 1), ("MODEL_CALLED", 1), ("TURN_ENDED", 1),
                             ("TURN_STARTED", 2), ("MODEL_CALLED", 2), ("TURN_ENDED", 2), ("AGENT_IDLE", 2)]
    assert ("consumed", "m1 from alice (turn 1)") in host.observed and host.saves >= 2
    assert not host.ended, "an agent that only answers does not end its task"


def busy_then_echo(view: ContextView) -> Decision:
    return call("list_agents") if not view.results else echo(view)


async def test_a_message_arriving_during_a_turn_waits_for_the_boundary_in_the_one_loop(running):
    agent, host = FakeAgent("agt_bob"), FakeHost({"agt_bob": "bob", "agt_alice": "alice"})
    model = HeldModel(busy_then_echo, hold=1)
    runner = await running(runner_for(agent, host, model, task="answer whoever writes"), run=True)
    await asyncio.wait_for(model.holding.wait(), 10)  # turn 1 is in its model call
    agent.deliver("agt_alice", "first", "m1")
    agent.deliver("agt_alice", "second", "m2")
    await eventually(lambda: len(runner.pending) + sum(len(ids) for _, ids in agent.acks) == 2,
                     message="both delivered to the runner")
    assert runner.runs_active == 1 and model.running == 1, "no second loop started"
    assert len(runner.pending) == 2 and not agent.acks, "they wait, delivered but not consumed"
    model.go.set()
    await eventually(lambda: runner.state == "idle" and len(agent.sent) == 2, message="both answered")
    assert model.most_running == 1 and runner.max_runs_active == 1, "one model loop, ever"
    assert agent.acks == [(2, ["m1", "m2"])], "taken together, at the next turn boundary"
    assert [m.in_reply_to for m in agent.sent] == ["m1", "m2"]
    turns = [k for k in agent.kinds() if k[0] in ("TURN_STARTED", "TURN_ENDED")]
    assert turns == [("TURN_STARTED", 1), ("TURN_ENDED", 1), ("TURN_STARTED", 2), ("TURN_ENDED", 2),
                     ("TURN_STARTED", 3), ("TURN_ENDED", 3)]
    assert ("AGENT_WOKEN", 0) not in agent.kinds(), "it was running, not idle: no wake"


async def test_a_task_over_its_budget_fails_through_the_host(running):
    agent, host = FakeAgent("agt_looper"), FakeHost({"agt_looper": "looper"})
    model = ScriptedModel(lambda view: call("list_agents"))  # never done
    runner = await running(runner_for(agent, host, model, task="loop", budget=Budget(max_model_requests=2)),
                           run=True)
    await eventually(lambda: host.ended and runner.state == "failed", message="the task ended")
    [(agent_id, error)] = host.ended
    assert agent_id == "agt_looper" and isinstance(error, BudgetExceeded)
    assert str(error) == "stopped at looper (agt_looper) before turn 3: all 2 model requests used"
    assert model.requests == 2 and runner.budget.requests == 2 and runner.model_requests == 2
    assert not runner.record.running and not runner.record.completed
    # the record: two whole turns, no third one started, and why the task failed
    assert [k for k in agent.kinds() if k[0] != "MODEL_CALLED"][-2:] == [("TURN_ENDED", 2), ("TASK_FAILED", 2)]
    assert agent.events[-1].detail == str(error)
    assert runner.budget.failed == f"looper (agt_looper): {error}"
    # a message arriving after the failure is not consumed: no turn takes it (it stays in the inbox)
    agent.deliver("agt_other", "too late", "late-1")
    await asyncio.sleep(0.1)
    assert agent.acks == [] and runner.record.turn == 2 and runner.state == "failed"


def finisher(view: ContextView) -> Decision:
    return say("done") if view.called("finish") else call("finish", result=f"did: {view.task}")


async def test_a_finished_child_with_close_on_complete_asks_to_be_closed_and_is_released(running):
    agent, host = FakeAgent("agt_kid", parent_id="agt_mom"), FakeHost({"agt_kid": "kid", "agt_mom": "mom"})
    runner = await running(runner_for(agent, host, ScriptedModel(finisher), keep_alive=CLOSE_ON_COMPLETE))
    agent.deliver("agt_mom", "count the sheep", "task-1", kind=env_pb.MESSAGE_KIND_TASK)
    await eventually(lambda: host.ended and runner.state == "idle", message="the task ended")
    assert agent.ended_runs == ["did: count the sheep"], "the run ended in the mesh, with the result"
    assert host.ended == [("agt_kid", None)] and runner.record.completed
    assert host.close_requests == [("agt_kid", "task completed (close_on_complete)")]
    assert ("TASK_COMPLETED", 1) in agent.kinds()
    agent.close_inbox("closed by mom")
    await eventually(lambda: host.released, message="released")
    assert host.released == [(["agt_kid"], "closed by mom")]


async def test_a_turn_that_waits_leaves_its_other_calls_undone(running):
    agent, host = FakeAgent("agt_bob"), FakeHost({"agt_bob": "bob"})
    # a reply with nothing received yet makes the turn wait: the call after it is not carried out
    model = ScriptedModel(lambda view: Decision(calls=[("reply", {"text": "hi"}), ("list_agents", {})])
                          if not view.results else say("idle"))
    runner = await running(runner_for(agent, host, model, task="answer first"), run=True)
    await eventually(lambda: runner.state == "idle" and model.requests == 1, message="the run ended")
    [assistant] = [m for m in runner.conversation.messages if m["role"] == "assistant"]
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["reply"]
    assert ("tool", "list_agents -> skipped: the turn ended with a wait") in host.observed
    [ended] = [e for e in agent.events if e.kind == K.EVENT_KIND_TURN_ENDED]
    assert ended.detail == "ran: reply; skipped: list_agents"


async def test_a_wait_that_is_not_the_answers_last_call_is_skipped(running):
    agent, host = FakeAgent("agt_bob", parent_id="agt_mom"), FakeHost({"agt_bob": "bob"})
    model = ScriptedModel(lambda view: Decision(calls=[("wait", {}), ("list_agents", {}), ("wait", {})])
                          if not view.results else say("idle"))
    runner = await running(runner_for(agent, host, model, task="look around"), run=True)
    await eventually(lambda: runner.state == "idle" and model.requests == 1, message="the run ended")
    [assistant] = [m for m in runner.conversation.messages if m["role"] == "assistant"]
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["list_agents", "wait"]
    [ended] = [e for e in agent.events if e.kind == K.EVENT_KIND_TURN_ENDED]
    assert ended.detail == "ran: list_agents, wait; skipped: wait"


async def test_a_reply_to_a_wrong_message_id_is_told_the_ids_it_can_answer(running):
    """A small model dropped the node prefix of an IOA message id and sent the same wrong id eleven times:
    the error lists the messages it can answer (newest first), so the next call can copy the right one."""
    agent, host = FakeAgent("agt_bob"), FakeHost({"agt_bob": "bob", "agt_alice": "alice"})

    def copies_from_the_error(view: ContextView) -> Decision:
        tried = view.called("reply")
        if not tried:
            return Decision(calls=[("reply", {"message_id": "north:agt_alice", "text": "got it"})]) if view.new \
                else say("waiting")
        if "error" in tried[-1].result and len(tried) == 1:
            [listed] = re.findall(r"message_id '([^']+)'", tried[-1].result["error"].split("newest first")[1])
            return Decision(calls=[("reply", {"message_id": listed, "text": "got it"})])
        return say("done")

    runner = await running(runner_for(agent, host, ScriptedModel(copies_from_the_error)))
    agent.deliver("agt_alice", "the code is K-1 and more words here", "ioa:north:agt_alice:m1")
    await eventually(lambda: runner.state == "idle" and agent.sent, message="answered at the second try")
    error = ContextView.parse(runner.conversation.messages, []).called("reply")[0].result["error"]
    assert "'north:agt_alice'" in error and "message_id 'ioa:north:agt_alice:m1' ('the code is K-1 and more words"\
        " here')" in error, error
    [answer] = agent.sent
    assert answer.in_reply_to == "ioa:north:agt_alice:m1"


class ToolsSeen(ScriptedModel):
    """A scripted model that keeps the tool schemas of every request."""

    def __init__(self, policy: Any):
        super().__init__(policy, "tools-seen")
        self.tools: list[list[dict[str, Any]]] = []

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *,
                       max_output_tokens: int, max_requests: int) -> ModelReply:
        self.tools.append(tools)
        return await super().complete(messages, tools, max_output_tokens=max_output_tokens,
                                      max_requests=max_requests)


@pytest.mark.parametrize(("host_rule", "profile_rule", "choice"), [
    (False, True, True), (True, False, False), (True, None, True), (False, None, False)])
async def test_send_message_targets_come_from_the_agents_profile_before_the_hosts_rule(
        running, host_rule, profile_rule, choice):
    """A configured agent's tools.sendTo (its profile's team_targets) decides whether send_message offers a
    choice of its team's names; without one, the host's rule does."""
    agent, host = FakeAgent("agt_bob"), FakeHost({"agt_bob": "bob"})
    kid = HostedAgent(agent_id="agt_kid", name="kid", credential="unused", mode="async", parent_id="agt_bob")
    host.team_of["agt_bob"] = Team(children=(kid,))
    model = ToolsSeen(lambda view: say("idle"))
    runner = runner_for(agent, host, model, task="look around")
    runner.config = replace(runner.config, team_targets=host_rule)
    runner.profile = AgentProfile(model=model, team_targets=profile_rule)
    await running(runner, run=True)
    await eventually(lambda: model.tools, message="a model request")
    [send] = [t for t in model.tools[0] if t["function"]["name"] == "send_message"]
    offered = send["function"]["parameters"]["properties"]["to"]
    assert ("enum" in offered) is choice, offered
    if choice:
        assert offered["enum"] == ["kid"]


async def test_a_message_is_answered_once_and_the_task_with_finish(running):
    """The real model (the sibling run that hit the turn limit, 2026-12-04) answered its task with reply, then
    answered A's message again every turn; A, woken by each answer, wrote again, until B's twelfth turn. The
    task is refused as a reply target, and so is a message already answered, each error saying what to do
    next: the one reply stands, and the agent is steered to finish."""
    agent = FakeAgent("agt_bob", parent_id="agt_boss")
    host = FakeHost({"agt_bob": "bob", "agt_alice": "alice", "agt_boss": "boss"})

    def answers_everything_twice(view: ContextView) -> Decision:
        tried = view.called("reply")
        if not tried:
            return Decision(calls=[("reply", {"message_id": "task-1", "text": "on it"})])
        if len(tried) < 3:
            return Decision(calls=[("reply", {"message_id": "m1", "text": "the code is K-1"})])
        if not view.called("finish"):
            return Decision(calls=[("finish", {"result": "answered alice"})])
        return say("done")

    runner = await running(runner_for(agent, host, ScriptedModel(answers_everything_twice)))
    agent.deliver("agt_boss", "answer alice", "task-1", kind=env_pb.MESSAGE_KIND_TASK)
    agent.deliver("agt_alice", "the code is K-1", "m1")
    await eventually(lambda: agent.ended_runs, message="finished")
    errors_seen = [c.result.get("error", "") for c in
                   ContextView.parse(runner.conversation.messages, []).called("reply")]
    assert errors_seen[0] == ("message_id 'task-1' is your task: you answer it with finish, not reply; the newest"
                              " message you may answer is message_id 'm1' ('the code is K-1')"), errors_seen
    assert errors_seen[1] == "", errors_seen  # the one reply
    assert "you answered message_id 'm1' already (your reply 'sent-1')" in errors_seen[2], errors_seen
    assert "if your task is done, call finish with your report" in errors_seen[2], errors_seen
    assert [(m.recipient, m.in_reply_to) for m in agent.sent if m.kind == env_pb.MESSAGE_KIND_REPLY] == \
        [("agt_alice", "m1")]


async def test_a_reply_may_name_an_ioa_message_by_its_id_without_the_node_prefix(running):
    """The real model dropped the node prefix of an IOA message id and then finished instead of trying again
    (1 of 3 runs over IOA): the end of an id after a `:` names the message when it names exactly one."""
    agent, host = FakeAgent("agt_bob"), FakeHost({"agt_bob": "bob", "agt_alice": "alice"})

    def drops_the_prefix(view: ContextView) -> Decision:
        if not view.called("reply") and view.new:
            return Decision(calls=[("reply", {"message_id": "agt_alice:m1", "text": "got it"})])
        return say("done")

    runner = await running(runner_for(agent, host, ScriptedModel(drops_the_prefix)))
    agent.deliver("agt_alice", "the code is K-1", "north:agt_alice:m1")
    agent.deliver("agt_carol", "the code is K-2", "north:agt_carol:m1")
    await eventually(lambda: runner.state == "idle" and agent.sent, message="answered")
    [answer] = agent.sent
    assert answer.in_reply_to == "north:agt_alice:m1"
    assert runner.actions.message("m1") is None, "an end that names two messages names none"


async def test_a_reply_may_name_the_message_by_its_senders_id_when_one_message_is_from_that_sender(running):
    """The real model gave the sender's agent id as the message_id, was told the right id, and finished
    instead of answering (1 run over IOA in CI on 2026-12-04): an id that is the sender of exactly one message
    the agent can answer names that message; of two, none."""
    agent, host = FakeAgent("agt_bob"), FakeHost({"agt_bob": "bob", "agt_alice": "alice"})

    def names_the_sender(view: ContextView) -> Decision:
        if not view.called("reply") and view.new:
            return Decision(calls=[("reply", {"message_id": "agt_alice", "text": "got it"})])
        return say("done")

    runner = await running(runner_for(agent, host, ScriptedModel(names_the_sender)))
    agent.deliver("agt_alice", "the code is K-1", "north:agt_alice:m1")
    await eventually(lambda: runner.state == "idle" and agent.sent, message="answered")
    [answer] = agent.sent
    assert answer.in_reply_to == "north:agt_alice:m1"
    agent.deliver("agt_carol", "one", "north:agt_carol:m2")
    agent.deliver("agt_carol", "two", "north:agt_carol:m3")
    await eventually(lambda: runner.state == "idle" and len(runner.actions.received) == 3, message="delivered")
    assert runner.actions.message("agt_carol") is None, "a sender of two messages names neither"


class FailingSaves(FakeHost):
    """host.db failing its writes (a full disk) for the next `failures` saves made between runs (the save
    after a run; one within a run fails the run, as any error of a run does)."""

    def __init__(self, names: dict[str, str], failures: int):
        super().__init__(names)
        self.failures = failures

    def save(self, agent: HostedAgent, conversation: Conversation) -> None:
        if self.failures and not agent.running:
            self.failures -= 1
            raise OSError(28, "No space left on device")
        super().save(agent, conversation)


async def test_a_save_that_fails_after_a_run_does_not_end_the_agents_loop(running, caplog):
    """The save after a run is outside the run's own failure handling: one that raised ended the loop, and
    the agent answered nothing more. It is logged, and the next message is answered."""
    agent, host = FakeAgent("agt_bob"), FailingSaves({"agt_bob": "bob", "agt_alice": "alice"}, failures=1)
    await running(runner_for(agent, host, ScriptedModel(echo)))
    agent.deliver("agt_alice", "first", "m1")
    await eventually(lambda: host.failures == 0 and agent.sent, message="the first run over, its save failed")
    agent.deliver("agt_alice", "second", "m2")
    await eventually(lambda: len(agent.sent) >= 2, message="the second message answered")
    assert [m.content.text for m in agent.sent][-1] == "second"
    assert "could not save the agent in the host's store" in caplog.text
