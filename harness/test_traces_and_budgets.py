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
    assert f"stopped at looper ({looper.agent_id}) at turn 6" in outcome.error
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
