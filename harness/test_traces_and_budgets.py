"""Runtime evidence in traces, and budgets that stop a task with a report of
where it stopped."""

from agent_host.config import Budget
from agent_host.models.scripted import Decision, call, say
from harness.hosts import by_name, scripted_host
from tests.fixtures import eventually


def answer_everything(view):
    if view.new:
        return Decision(calls=[("reply", {"message_id": m.message_id, "text": "answer"}) for m in view.new])
    return say("idle")


async def test_a_reply_is_traced_in_the_same_trace_as_the_message_it_answers(mesh, client, tmp_path, spans):
    async with scripted_host(mesh.address, tmp_path, {"worker": answer_everything}) as host:
        worker = await host.start_task("worker", "answer")
        await eventually(lambda: worker.state == "idle" and worker.record.turn == 1)
        poker = await worker.handle.spawn("poker")
        receipt = await poker.send(worker.agent_id, "question")
        await eventually(lambda: len(worker.received) == 1 and worker.state == "idle" and worker.record.turn >= 2)
    finished = spans.get_finished_spans()
    send = next(s for s in finished
                if s.name == "send" and s.attributes.get("messaging.message.id") == receipt.message_id)
    trace_id = send.context.trace_id
    in_trace = {s.name: s for s in finished if s.context.trace_id == trace_id}
    assert {"send", "enqueue", "deliver", "consume", "reply", "ack"} <= set(in_trace), sorted(in_trace)
    consume, reply = in_trace["consume"], in_trace["reply"]
    assert consume.parent.span_id == send.context.span_id
    assert reply.parent.span_id == consume.context.span_id, "the reply continues the trace of what it answers"
    reply_send = [s for s in finished if s.name == "send" and s.parent and s.parent.span_id == reply.context.span_id]
    assert reply_send, "the reply's own send span hangs under it"
    wake = [s for s in finished if s.name == "wake" and any(link.context.trace_id == trace_id for link in s.links)]
    assert wake, "the wake-up links to the message that caused it"
    turns = [s for s in finished if s.name == "turn" and s.attributes.get("inboxmesh.agent") == worker.agent_id]
    assert len(turns) >= 2


def looping(view):
    return call("list_agents")


async def test_a_task_over_budget_stops_with_a_report_of_where(mesh, client, tmp_path):
    budget = Budget(max_model_requests=5, max_wall_time_s=30)
    async with scripted_host(mesh.address, tmp_path, {"looper": looping}, budget=budget) as host:
        outcome = await host.run_task("looper", "loop forever", timeout=20)
        looper = by_name(host, "looper")
    assert not outcome.ok
    assert f"stopped at looper ({looper.agent_id}) before turn 6" in outcome.error
    assert "all 5 model requests used" in outcome.error
    assert outcome.budget["model_requests"] == 5 and outcome.budget["max_model_requests"] == 5


async def test_a_slow_task_stops_at_the_wall_time_budget(mesh, client, tmp_path):
    import asyncio

    from harness.hosts import GatedModel

    budget = Budget(max_wall_time_s=0.5)
    model = GatedModel(looping, {1: asyncio.Event()})  # never answers
    async with scripted_host(mesh.address, tmp_path, {"slow": model}, budget=budget) as host:
        outcome = await host.run_task("slow", "take forever", timeout=10)
    assert not outcome.ok
    assert "stopped at slow" in outcome.error and "wall-time budget" in outcome.error


def spawn_then_loop(view):
    return call("list_agents") if view.called("spawn_agent") else call("spawn_agent", agent_name="sleeper",
                                                                            task="sleep", mode="async")


async def test_a_failed_task_consumes_nothing_more_and_says_why(mesh, client, tmp_path):
    """The boss uses up the task's model requests while its child is in a model call and has a message
    pending: the child's run is cancelled and its turn ends saying so; no turn of the failed task consumes
    the pending message (it stays in the inbox until the close dead-letters it with the reason); the boss's
    TASK_FAILED says what ran out, and no turn is left open. All from the record."""
    import asyncio

    from harness.hosts import GatedModel
    from inboxmesh.events.v1 import events_pb2 as ev

    boss_gate, sleeper_gate = asyncio.Event(), asyncio.Event()
    boss = GatedModel(spawn_then_loop, {2: boss_gate}, name="scripted:boss")
    sleeper = GatedModel(looping, {1: sleeper_gate}, name="scripted:sleeper")
    async with scripted_host(mesh.address, tmp_path, {"boss": boss, "sleeper": sleeper},
                             budget=Budget(max_model_requests=4, max_wall_time_s=60)) as host:
        top = await host.start_task("boss", "work")
        await eventually(lambda: sleeper.waiting.is_set(), message="the sleeper in its first model call")
        child = by_name(host, "sleeper")
        poker = await top.handle.spawn("poker")
        receipt = await poker.send(child.agent_id, "are you there?")
        await eventually(lambda: child.pending, message="the message delivered to the sleeper, pending")
        boss_gate.set()
        outcome = await host.outcome(top.agent_id, timeout=20)
        assert not outcome.ok and "all 4 model requests used" in outcome.error
        await eventually(lambda: child.state == "failed", message="the sleeper's run cancelled")
        await asyncio.sleep(0.2)  # a turn that would (wrongly) consume the message has had time to
        assert child.record.turn == 1 and child.pending, "no new turn; the message is still pending"
        reason = f"task failed: {outcome.error}"[:200]
        await host.close(top.agent_id, reason=reason)
    events = await client.admin_events(limit=1000)

    def of(kind, agent_id):
        return [e for e in events if e.kind == kind and e.agent_id == agent_id]

    assert not [e for e in events if e.kind == ev.EVENT_KIND_MESSAGE_CONSUMED
                and e.message_id == receipt.message_id], "the pending message was never consumed"
    dead = [e for e in events if e.kind == ev.EVENT_KIND_MESSAGE_DEAD_LETTERED and e.message_id == receipt.message_id]
    assert [e.detail for e in dead] == ["recipient closed"]
    [closed] = of(ev.EVENT_KIND_AGENT_CLOSED, child.agent_id)
    assert "task failed: stopped at boss" in closed.detail, closed.detail
    for runner_id in (top.agent_id, child.agent_id):
        started = [e.turn for e in of(ev.EVENT_KIND_TURN_STARTED, runner_id)]
        ended = [e.turn for e in of(ev.EVENT_KIND_TURN_ENDED, runner_id)]
        assert started == ended, f"every turn that started ended: {started} vs {ended}"
    [cut] = of(ev.EVENT_KIND_TURN_ENDED, child.agent_id)
    assert cut.detail.startswith("cancelled: the task failed") and "ran: none" in cut.detail, cut.detail
    [cancelled] = of(ev.EVENT_KIND_RUN_CANCELLED, child.agent_id)
    assert "the task failed" in cancelled.detail
    [failed] = of(ev.EVENT_KIND_TASK_FAILED, top.agent_id)
    assert "all 4 model requests used" in failed.detail and failed.turn == 4
    assert not of(ev.EVENT_KIND_TASK_FAILED, child.agent_id), "the task failed once, where it failed"
