"""Task completed vs idle vs closed, keep-alive after a task, close and
cancel with messages in flight, cascading close, sync and fork spawns, and
hosts that stop or die and come back."""

import asyncio

from agent_host.config import CLOSE_ON_COMPLETE, IDLE_TIMEOUT
from agent_host.models.scripted import Decision, call, say
from harness.evidence import K, Record
from harness.hosts import GatedModel, by_name, scripted_host
from harness.test_addressing import tool_results
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from inboxmesh.registry.v1 import registry_pb2 as reg
from tests.fixtures import eventually


def finisher(view):
    """Finish the task at once; afterwards answer anything that arrives."""
    if not view.called("finish"):
        return call("finish", result=f"finished: {view.task}")
    if view.new:
        return Decision(calls=[("reply", {"message_id": m.message_id, "text": "still here"}) for m in view.new
                               if m.kind != "control"])
    return say("idle")


def spawner(mode):
    def policy(view):
        if not view.called("spawn_agent"):
            return call("spawn_agent", agent_name="child", task="do it", mode=mode)
        return say("waiting")
    return policy


async def test_a_completed_child_keeps_receiving_until_closed(mesh, client, tmp_path):
    async with scripted_host(mesh.address, tmp_path, {"lead": spawner("async"), "child": finisher}) as host:
        lead = await host.start_task("lead", "spawn")
        await eventually(lambda: any(r.record.name == "child" and r.record.completed for r in host.runners.values()))
        child = by_name(host, "child")
        await eventually(lambda: child.state == "idle")
        assert (await lead.handle.get(child.agent_id)).state == reg.AGENT_STATE_OPEN, "completed is not closed"
        receipt = await lead.send(child.agent_id, "after your task")
        await eventually(lambda: receipt.message_id in child.received)
        await eventually(lambda: any(m["role"] == "tool" and "still here" in m["content"] or False
                                     for m in child.conversation.messages) or len(tool_results(child, "reply")) == 1)
    record = await Record.read(client)
    completion = record.one(K.EVENT_KIND_TASK_COMPLETED, agent_id=child.agent_id)
    stored = record.one(K.EVENT_KIND_MESSAGE_STORED, message_id=completion.message_id)
    assert stored.recipient == lead.agent_id, "the result went to the parent's inbox, the ordinary path"
    assert record.of(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=completion.message_id, agent_id=lead.agent_id)
    assert record.one(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=receipt.message_id).turn > completion.turn


async def test_close_on_complete_and_idle_timeout(mesh, client, tmp_path):
    for policy_name, extra in ((CLOSE_ON_COMPLETE, {}), (IDLE_TIMEOUT, {"idle_timeout_s": 0.3})):
        async with scripted_host(mesh.address, tmp_path / policy_name, {"lead": spawner("async"),
                                                                        "child": finisher},
                                 keep_alive=policy_name, **extra) as host:
            lead = await host.start_task("lead", "spawn")
            await eventually(lambda: any(r.record.name == "child" for r in host.runners.values()))
            child_id = by_name(host, "child").agent_id
            await eventually(lambda child_id=child_id: child_id not in host.runners,
                             message=f"{policy_name} closes the child")
            info = await lead.handle.get(child_id)
            assert info.state == reg.AGENT_STATE_CLOSED
            assert ("task completed" if policy_name == CLOSE_ON_COMPLETE else "idle for") in info.close_reason


def sync_parent(view):
    if not view.called("spawn_agent"):
        return call("spawn_agent", agent_name="helper", task="compute 6*7", mode="sync")
    if not view.called("finish"):
        return call("finish", result=f"helper said: {view.called('spawn_agent')[0].result.get('result')}")
    return say("done")


async def test_a_sync_spawn_returns_when_the_child_completes(mesh, client, tmp_path):
    policies = {"lead": sync_parent, "helper": lambda v: call("finish", result="42") if not v.called("finish")
                else say("done")}
    async with scripted_host(mesh.address, tmp_path, policies) as host:
        outcome = await host.run_task("lead", "ask the helper", timeout=20)
    # the helper's announce: its findings, then its stats line (run time, model requests, tokens)
    assert outcome.ok and outcome.result.startswith("helper said: 42\n\nStats: ran "), outcome.result
    assert "1 model request(s)" in outcome.result
    record = await Record.read(client)
    completion = record.one(K.EVENT_KIND_TASK_COMPLETED, agent_id=by_name_id(record, "helper"))
    consumed = record.one(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=completion.message_id)
    lead_turn_1 = [e for e in record.of(K.EVENT_KIND_TURN_ENDED, turn=1) if e.agent_id == consumed.agent_id][0]
    assert consumed.turn == 1 and consumed.event_id < lead_turn_1.event_id, "taken in as the spawn tool's result"


def by_name_id(record, name):
    return next(e.agent_id for e in record.of(K.EVENT_KIND_AGENT_REGISTERED) if f"name={name} " in e.detail)


def forking(view):
    if not view.called("spawn_agent"):
        return call("spawn_agent", agent_name="fork", task="continue from here", mode="fork")
    return say("waiting")


async def test_a_fork_starts_from_a_copy_of_the_parents_conversation(mesh, client, tmp_path):
    def fork_policy(view):
        return call("finish", result="forked") if not view.called("finish") else say("done")

    async with scripted_host(mesh.address, tmp_path, {"lead": forking, "fork": fork_policy}) as host:
        lead = await host.start_task("lead", "the parent's own task text")
        await eventually(lambda: any(r.record.name == "fork" and r.record.completed for r in host.runners.values()))
        fork = by_name(host, "fork")
        users = [m["content"] for m in fork.conversation.messages if m["role"] == "user"]
        assert users[0] == "the parent's own task text", "the parent's conversation came along"
        assert "kind=task" in users[-1] and "continue from here" in users[-1]
        assert f"You are fork (agent id {fork.agent_id})" in fork.conversation.messages[0]["content"]
        assert lead.agent_id not in fork.conversation.messages[0]["content"]


def busy_then_reply(view):
    if answerable := [m for m in view.new if m.kind != "task"]:  # a task is answered by finish, not reply
        return Decision(calls=[("reply", {"message_id": m.message_id, "text": "ok"}) for m in answerable])
    return call("list_agents") if not view.results else say("idle")


async def test_close_with_messages_in_flight_dead_letters_them_and_tells_the_senders(mesh, client, tmp_path):
    gate = asyncio.Event()
    victim_model = GatedModel(busy_then_reply, {2: gate})

    def talker(view):
        if not view.called("send_message"):
            return call("send_message", to="victim", text="are you there?")
        return say("waiting")

    def lead_policy(view):
        if not view.called("spawn_agent"):
            return Decision(calls=[("spawn_agent", {"agent_name": "victim", "task": "work"}),
                                   ("spawn_agent", {"agent_name": "talker", "task": "talk to victim"})])
        return say("waiting")

    async with scripted_host(mesh.address, tmp_path, {"lead": lead_policy, "victim": victim_model,
                                                      "talker": talker}) as host:
        lead = await host.start_task("lead", "set up")
        await asyncio.wait_for(victim_model.waiting.wait(), 10)  # victim's run is in progress (turn 2)
        # the lead spawns talker after victim: victim's second request may start before talker exists
        talker_runner = await eventually(lambda: next((r for r in host.runners.values() if r.record.name == "talker"),
                                                      None), message="talker started")
        await eventually(lambda: len(tool_results(talker_runner, "send_message")) == 1)
        (_, sent), = tool_results(talker_runner, "send_message")
        victim = by_name(host, "victim")
        await eventually(lambda: len(victim.pending) == 1, message="the message is delivered, not consumed")
        closed = await host.close(victim.agent_id, reason="no longer needed", by=lead)
        assert closed == [victim.agent_id] and victim.agent_id not in host.runners
        status = await talker_runner.handle.status(sent["message_id"])
        assert status.state == pb.MESSAGE_STATE_DEAD_LETTERED and status.dead_letter_reason == "recipient closed"
        await eventually(lambda: any("kind=control" in (m.get("content") or "")
                                     for m in talker_runner.conversation.messages),
                         message="the sender's agent learns of it in its own inbox")
        notice = [m["content"] for m in talker_runner.conversation.messages if "kind=control" in (m["content"] or "")]
        assert sent["message_id"] in notice[0] and "recipient closed" in notice[0]
        late = await talker_runner.handle.send(victim.agent_id, "too late")
        assert late.status == pb.RECEIPT_STATUS_TARGET_CLOSED
        gate.set()


async def test_closing_a_parent_closes_its_descendants_and_stops_them(mesh, client, tmp_path):
    def tree(view):
        if not view.called("spawn_agent"):
            return Decision(calls=[("spawn_agent", {"agent_name": "mid", "task": "spawn a leaf"})])
        return say("waiting")

    def mid(view):
        if not view.called("spawn_agent"):
            return call("spawn_agent", agent_name="leaf", task="wait")
        return say("waiting")

    async with scripted_host(mesh.address, tmp_path, {"root": tree, "mid": mid, "leaf": lambda v: say("idle")}) as host:
        root = await host.start_task("root", "build a tree")
        await eventually(lambda: len(host.runners) == 3)
        ids = {r.record.name: r.agent_id for r in host.runners.values()}
        closed = await host.close(root.agent_id, reason="all done")
        assert closed == [ids["root"], ids["mid"], ids["leaf"]]
        assert not host.runners
        outcome = await host.outcome(root.agent_id, timeout=5)
        assert not outcome.ok and "closed before finishing" in outcome.error
    async def streams_ended():
        record = await Record.read(client)
        return all(record.of(K.EVENT_KIND_UNSUBSCRIBED, agent_id=a) for a in ids.values()) and record

    record = await eventually(streams_ended, message="every stream ended")
    for agent_id in ids.values():
        assert "all done" in record.one(K.EVENT_KIND_AGENT_CLOSED, agent_id=agent_id).detail


async def test_a_host_that_stops_before_acking_gets_the_message_again_and_consumes_it_once(mesh, client, tmp_path):
    gate = asyncio.Event()  # never opened: the first host is stopped while its run waits here
    first_model = GatedModel(busy_then_reply, {2: gate})
    async with scripted_host(mesh.address, tmp_path, {"worker": first_model}) as host:
        worker = await host.start_task("worker", "answer")
        await asyncio.wait_for(first_model.waiting.wait(), 10)
        poker = await worker.handle.spawn("poker")
        receipt = await poker.send(worker.agent_id, "please answer")
        await eventually(lambda: len(worker.pending) == 1)
    # the first host is gone without having acked; a new host on the same state picks the agent up
    poker = client.agent(poker.info, poker.credential)
    await eventually(lambda: _state(poker, receipt.message_id, pb.MESSAGE_STATE_DELIVERED),
                     message="delivered (the marker is written with the next commit), never consumed")
    async with scripted_host(mesh.address, tmp_path, {"worker": busy_then_reply}) as host:
        await eventually(lambda: _consumed(poker, receipt.message_id))
        resumed = by_name(host, "worker")
        await eventually(lambda: len(tool_results(resumed, "reply")) == 1)
    record = await Record.read(client)
    assert len(record.of(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=receipt.message_id)) == 1
    delivered = record.of(K.EVENT_KIND_MESSAGE_DELIVERED, message_id=receipt.message_id)
    assert [e.detail for e in delivered] == ["attempt=1", "attempt=2"]
    assert sum("please answer" in (m["content"] or "") for m in resumed.conversation.messages) == 1


async def _state(agent, message_id, state):
    return (await agent.status(message_id)).state == state


async def _consumed(agent, message_id):
    return await _state(agent, message_id, pb.MESSAGE_STATE_CONSUMED)


async def test_a_restarted_host_recovers_messages_consumed_but_not_yet_in_the_conversation(mesh, client, tmp_path):
    async with scripted_host(mesh.address, tmp_path, {"worker": busy_then_reply}) as host:
        worker = await host.start_task("worker", "answer")
        await eventually(lambda: worker.state == "idle" and worker.record.turn == 2)
        poker = await worker.handle.spawn("poker")
        credential = worker.record.credential
    # while no host runs it, the message is consumed (as if a host acked and died before saving)
    poker = client.agent(poker.info, poker.credential)
    receipt = await poker.send(worker.agent_id, "consumed while you were away")
    handle = client.agent(worker.agent_id, credential)
    assert [r.status for r in await handle.ack([receipt.sequence])] == [pb.ACK_STATUS_CONSUMED]
    async with scripted_host(mesh.address, tmp_path, {"worker": busy_then_reply}) as host:
        resumed = by_name(host, "worker")
        assert any("consumed while you were away" in (m["content"] or "") for m in resumed.conversation.messages)
        assert any(e.kind == "recovered" for e in host.log)
        await eventually(lambda: len(tool_results(resumed, "reply")) == 1, message="and it answers it")


async def test_a_host_stopped_right_after_a_finish_keeps_the_last_turn_in_the_record(mesh, client, tmp_path):
    """The host stops the moment the task is done: the runtime events already
    on their way (the last TURN_ENDED) still reach the record."""
    async with scripted_host(mesh.address, tmp_path, {"lead": finisher}) as host:
        lead = await host.start_task("lead", "finish at once")
        await host.outcome(lead.agent_id, timeout=30)
    record = await Record.read(client)
    started = record.of(K.EVENT_KIND_TURN_STARTED, agent_id=lead.agent_id)
    ended = record.of(K.EVENT_KIND_TURN_ENDED, agent_id=lead.agent_id)
    assert started and [e.turn for e in ended] == [e.turn for e in started], "every started turn ended in the record"
