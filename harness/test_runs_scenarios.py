"""Run registry and loop guard with real hosts (scripted models, real mesh):
a busy parent gets its child's announce at its next turn, once; a ring of
agents forwarding to each other is stopped by the mesh's loop guard."""

import asyncio

from agent_host.models.scripted import ContextView, Decision, call, say
from harness.evidence import Record, announced_run
from harness.hosts import GatedModel, by_name, scripted_host
from inboxmesh.events.v1 import events_pb2 as ev
from tests.fixtures import eventually

K = ev.EventKind


def busy_parent(view: ContextView) -> Decision:
    if not view.called("spawn_agent"):
        return call("spawn_agent", agent_name="worker", task="Finish at once with the word 'ready'.", mode="async")
    report = next((m for m in view.inbox if m.kind == "completion"), None)
    if report is not None and not view.called("finish"):
        return call("finish", result=f"worker said {report.text}")
    return say("thinking about something else")


def quick_worker(view: ContextView) -> Decision:
    return say("done") if view.called("finish") else call("finish", result="ready")


async def test_a_busy_parent_gets_the_announce_at_its_next_turn_once(mesh, client, tmp_path):
    gate = asyncio.Event()
    parent_model = GatedModel(busy_parent, {2: gate})  # the parent's second model call is slow
    async with scripted_host(mesh.address, tmp_path, {"parent": parent_model, "worker": quick_worker}) as host:
        parent = await host.start_task("parent", "Start a worker and report what it says.")
        await asyncio.wait_for(parent_model.waiting.wait(), 10)
        worker = by_name(host, "worker")
        run = await eventually(lambda: announced_run(client, worker.record.run_id), message="announce stored")
        await eventually(lambda: len(parent.pending) == 1, message="delivered to the host, waiting for the turn"
                                                                    " boundary")
        assert parent.state == "running" and parent.record.turn == 2, "the parent is busy in turn 2"
        gate.set()
        await eventually(lambda: parent.record.completed and parent.state == "idle",
                         message="parent completed and its last turn over")
    record = await eventually(lambda: _with_completion(client, parent.agent_id), message="completion recorded")
    [stored] = record.of(K.EVENT_KIND_MESSAGE_STORED, recipient=parent.agent_id)
    assert stored.message_id == run.announce_message_id and stored.sender == worker.agent_id
    consumed = record.one(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=stored.message_id, agent_id=parent.agent_id)
    turn_2_end = record.one(K.EVENT_KIND_TURN_ENDED, agent_id=parent.agent_id, turn=2)
    assert consumed.turn == 3 and consumed.event_id > turn_2_end.event_id, "consumed at the next turn boundary"
    assert record.one(K.EVENT_KIND_TASK_COMPLETED, agent_id=parent.agent_id).event_id > consumed.event_id
    assert "ready" in parent.record.result
    assert record.turns_alternate(parent.agent_id) and parent.max_runs_active == 1


async def _with_completion(client, agent_id):
    """The event record once the host's TASK_COMPLETED event is in it."""
    record = await Record.read(client)
    done = record.of(K.EVENT_KIND_TASK_COMPLETED, agent_id=agent_id)
    return record if done and record.turns_alternate(agent_id) else None  # the last turn's end is in too



RING = {"a": "b", "b": "c", "c": "a"}


def ring_lead(view: ContextView) -> Decision:
    if not view.called("spawn_agent"):
        return Decision(calls=[("spawn_agent", {"agent_name": n, "mode": "async",
                                                "task": f"Forward every message you get to {RING[n]}."})
                               for n in ("b", "c", "a")])
    return say("watching")


def forwarder(name: str):
    def policy(view: ContextView) -> Decision:
        if name == "a" and not view.called("send_message"):
            return call("send_message", to=RING[name], text="pass it on")
        forwards = [("send_message", {"to": RING[name], "text": f"pass it on ({m.message_id[:6]})"})
                    for m in view.new if m.kind == "text"]
        return Decision(calls=forwards) if forwards else say("waiting")
    return policy


async def test_a_ring_of_forwarding_agents_is_stopped_by_the_loop_guard(mesh, client, tmp_path):
    """a -> b -> c -> a -> ... would run forever (OpenClaw's 398 overnight
    sends); the hosts carry each message's causal trail and the mesh refuses
    the hop that would visit an agent a sixth time."""
    policies = {"lead": ring_lead, **{n: forwarder(n) for n in RING}}
    async with scripted_host(mesh.address, tmp_path, policies) as host:
        await host.start_task("lead", "Start a, b and c.")
        await eventually(lambda: _refused(client), timeout=30, message="a refused hop")
        await asyncio.sleep(0.5)  # nothing goes round after the refusal
        ids = {by_name(host, n).agent_id for n in RING}
    record = await Record.read(client)
    hops = [e for e in record.of(K.EVENT_KIND_MESSAGE_STORED) if e.sender in ids and e.recipient in ids]
    assert len(hops) == 14, "five visits of a, b and c, minus the refused one"
    [refused] = [e for e in record.of(K.EVENT_KIND_MESSAGE_SENT) if e.detail == "not_permitted"]
    assert refused.recipient == by_name(host, "a").agent_id
    assert len({e.conversation_id for e in hops}) == 1, "the whole ring is one conversation"


async def _refused(client):
    record = await Record.read(client)
    return [e for e in record.of(K.EVENT_KIND_MESSAGE_SENT) if e.detail == "not_permitted"]
