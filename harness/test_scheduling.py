"""The scheduler's rules, shown with scripted models on a real mesh: input
arriving during a run waits for the next turn boundary and is taken in one
turn; idle agents are woken; two agents sending to each other at once; a
cancelled run keeps the inbox; never two model loops for one agent."""

import asyncio

from agent_host.models.scripted import Decision, call, say
from harness.evidence import K, Record
from harness.hosts import GatedModel, by_name, scripted_host
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from tests.fixtures import eventually


def replier(view):
    """Reply to each new message; look around once at the start; else idle."""
    if view.new:
        return Decision(calls=[("reply", {"message_id": m.message_id, "text": f"got {m.text}"}) for m in view.new])
    if not view.results:
        return call("list_agents")
    return say("nothing to do")


async def _poker(host, name):
    """A second agent in the worker's tree (registered, not hosted) to send from."""
    worker = by_name(host, name)
    return await worker.handle.spawn("poker")


async def test_messages_arriving_during_a_run_wait_for_the_next_turn_boundary(mesh, client, tmp_path):
    gate = asyncio.Event()
    model = GatedModel(replier, {1: gate})
    async with scripted_host(mesh.address, tmp_path, {"worker": model}) as host:
        worker = await host.start_task("worker", "Answer whoever writes to you.")
        await asyncio.wait_for(model.waiting.wait(), 10)  # turn 1 is in its model call
        poker = await _poker(host, "worker")
        sent = [await poker.send(worker.agent_id, f"m{i}") for i in range(2)]
        for receipt in sent:
            await eventually(lambda r=receipt: _state_is(poker, r.message_id, pb.MESSAGE_STATE_DELIVERED))
        # the mesh records DELIVERED as it writes to the stream: the host holds them a moment later
        await eventually(lambda: len(worker.pending) == 2, message="both delivered to the host, held for the"
                                                                   " turn boundary")
        assert model.waiting.is_set(), "turn 1 is still in its model call"
        gate.set()
        await eventually(lambda: _state_is(poker, sent[1].message_id, pb.MESSAGE_STATE_CONSUMED))
        await eventually(lambda: worker.state == "idle")
    record = await Record.read(client)
    ended_1 = record.one(K.EVENT_KIND_TURN_ENDED, agent_id=worker.agent_id, turn=1)
    consumed = [record.one(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=r.message_id) for r in sent]
    assert {e.turn for e in consumed} == {2}, "both taken together, in the next turn"
    assert all(e.event_id > ended_1.event_id for e in consumed), "not before turn 1 had ended"
    injected = [m for m in worker.conversation.messages if m["role"] == "user" and "Message from" in m["content"]]
    assert len(injected) == 1 and all(r.message_id in injected[0]["content"] for r in sent), "one user turn"
    position = worker.conversation.messages.index(injected[0])
    assert worker.conversation.messages[position - 1]["role"] == "tool", "right after turn 1's tool result"
    replies = record.of(K.EVENT_KIND_MESSAGE_STORED, sender=worker.agent_id)
    assert {e.in_reply_to for e in replies} == {r.message_id for r in sent}
    assert record.turns_alternate(worker.agent_id) and worker.max_runs_active == 1


async def _state_is(agent, message_id, state):
    return (await agent.status(message_id)).state == state


async def test_an_idle_agent_is_woken_by_a_message(mesh, client, tmp_path):
    async with scripted_host(mesh.address, tmp_path, {"sleeper": replier}) as host:
        sleeper = await host.start_task("sleeper", "Answer whoever writes to you.")
        await eventually(lambda: sleeper.state == "idle" and sleeper.record.turn == 2)
        poker = await _poker(host, "sleeper")
        receipt = await poker.send(sleeper.agent_id, "wake up")
        await eventually(lambda: _state_is(poker, receipt.message_id, pb.MESSAGE_STATE_CONSUMED))
        await eventually(lambda: sleeper.state == "idle" and sleeper.record.turn >= 4)
    record = await Record.read(client)
    idle = record.of(K.EVENT_KIND_AGENT_IDLE, agent_id=sleeper.agent_id)[0]
    stored = record.one(K.EVENT_KIND_MESSAGE_STORED, message_id=receipt.message_id)
    woken = record.one(K.EVENT_KIND_AGENT_WOKEN, agent_id=sleeper.agent_id)
    started = record.one(K.EVENT_KIND_TURN_STARTED, agent_id=sleeper.agent_id, turn=3)
    consumed = record.one(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=receipt.message_id)
    assert idle.event_id < stored.event_id < woken.event_id < started.event_id < consumed.event_id
    assert consumed.turn == 3 and "poker" in woken.detail


def mutual(other):
    def policy(view):
        if not view.called("send_message"):
            return call("send_message", to=other, text=f"hello {other}")
        mine = view.called("send_message")[0].result["message_id"]
        theirs = [m for m in view.inbox if m.kind == "text" and m.sender_name == other]
        answered = {r.arguments["message_id"] for r in view.called("reply")}
        todo = [m for m in theirs if m.message_id not in answered]
        if todo:
            return call("reply", message_id=todo[0].message_id, text=f"hi back from me to {other}")
        got_answer = any(m.kind == "reply" and m.in_reply_to == mine for m in view.inbox)
        if theirs and got_answer and not view.called("finish"):
            return call("finish", result=f"exchanged greetings with {other}")
        return say("waiting")
    return policy


def spawn_pair(view):
    if not view.called("spawn_agent"):
        return Decision(calls=[
            ("spawn_agent", {"agent_name": "A", "task": "Greet B, answer B's greeting, then finish."}),
            ("spawn_agent", {"agent_name": "B", "task": "Greet A, answer A's greeting, then finish."})])
    if len([m for m in view.inbox if m.kind == "completion"]) == 2:
        return call("finish", result="both done")
    return say("waiting")


async def test_two_agents_sending_to_each_other_at_the_same_moment(mesh, client, tmp_path):
    policies = {"lead": spawn_pair, "A": mutual("B"), "B": mutual("A")}
    async with scripted_host(mesh.address, tmp_path, policies) as host:
        outcome = await host.run_task("lead", "Let A and B greet each other.", timeout=30)
        assert outcome.ok, outcome.error
        a, b = by_name(host, "A"), by_name(host, "B")
        assert a.max_runs_active == 1 and b.max_runs_active == 1
    record = await Record.read(client)
    a_to_b = record.one(K.EVENT_KIND_MESSAGE_STORED, sender=a.agent_id, recipient=b.agent_id, in_reply_to="")
    b_to_a = record.one(K.EVENT_KIND_MESSAGE_STORED, sender=b.agent_id, recipient=a.agent_id, in_reply_to="")
    for message, consumer in ((a_to_b, b), (b_to_a, a)):
        assert len(record.of(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=message.message_id)) == 1
        record.one(K.EVENT_KIND_MESSAGE_STORED, sender=consumer.agent_id, in_reply_to=message.message_id)
    assert record.turns_alternate(a.agent_id) and record.turns_alternate(b.agent_id)


async def test_cancel_stops_the_run_and_keeps_the_inbox(mesh, client, tmp_path):
    gate = asyncio.Event()
    model = GatedModel(replier, {1: gate})
    async with scripted_host(mesh.address, tmp_path, {"worker": model}) as host:
        worker = await host.start_task("worker", "Answer whoever writes to you.")
        await asyncio.wait_for(model.waiting.wait(), 10)
        assert await host.cancel(worker.agent_id)
        await eventually(lambda: worker.state == "idle")
        poker = await _poker(host, "worker")
        receipt = await poker.send(worker.agent_id, "still there?")
        assert receipt.status == pb.RECEIPT_STATUS_ACCEPTED, "the inbox stays open"
        await eventually(lambda: _state_is(poker, receipt.message_id, pb.MESSAGE_STATE_CONSUMED))
    record = await Record.read(client)
    cancelled = record.one(K.EVENT_KIND_RUN_CANCELLED, agent_id=worker.agent_id)
    assert cancelled.turn == 1
    cut = record.one(K.EVENT_KIND_TURN_ENDED, agent_id=worker.agent_id, turn=1)
    assert cut.detail == "cancelled; ran: none", "turn 1 ended, saying it was cut short before any call ran"
    assert cut.event_id < cancelled.event_id
    assert record.one(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=receipt.message_id).turn == 2
    assert not record.of(K.EVENT_KIND_AGENT_CLOSED, agent_id=worker.agent_id)
