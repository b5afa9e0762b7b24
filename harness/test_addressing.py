"""Addressing from an agent's tools: names resolve inside the agent's own
tree, duplicate names are refused with the candidates, unknown and closed
targets and full inboxes come back as the real receipts."""

import asyncio
import json

from agent_host.models.scripted import Decision, call, say
from harness.evidence import K, Record
from harness.hosts import GatedModel, by_name, scripted_host
from tests.fixtures import eventually


def tool_results(runner, name):
    """(arguments, result) of every call of one tool, from the conversation."""
    calls = {}
    found = []
    for message in runner.conversation.messages:
        for c in message.get("tool_calls") or []:
            calls[c["id"]] = c["function"]
        if message["role"] == "tool" and calls[message["tool_call_id"]]["name"] == name:
            found.append((json.loads(calls[message["tool_call_id"]]["arguments"]), json.loads(message["content"])))
    return found


def boss(view):
    step = len(view.results)
    if step == 0:
        return call("spawn_agent", agent_name="worker", task="Answer messages.")
    if step == 1:
        return call("send_message", to="worker", text="for my own worker")
    return say("done")


async def test_the_same_name_in_two_scopes_resolves_inside_each(mesh, client, tmp_path):
    async with scripted_host(mesh.address, tmp_path, {"boss": boss, "worker": lambda v: say("ok")}) as host:
        first = await host.start_task("boss", "one")
        second = await host.start_task("boss", "two")
        await eventually(lambda: len(tool_results(first, "send_message")) == 1
                         and len(tool_results(second, "send_message")) == 1)
        for boss_runner in (first, second):
            (_, spawned), = tool_results(boss_runner, "spawn_agent")
            (_, sent), = tool_results(boss_runner, "send_message")
            assert sent["status"] == "accepted" and sent["to"] == spawned["agent_id"], "its own worker, by name"
        assert (tool_results(first, "spawn_agent")[0][1]["agent_id"]
                != tool_results(second, "spawn_agent")[0][1]["agent_id"])


def twins(view):
    step = len(view.results)
    if step == 0:
        return Decision(calls=[("spawn_agent", {"agent_name": "twin", "task": "wait, one"}),
                               ("spawn_agent", {"agent_name": "twin", "task": "wait, two"})])
    if step == 2:
        return call("wait")
    if step == 3:
        return call("send_message", to="twin", text="which one?")
    if step == 4:
        return call("send_message", to=view.results[0].result["agent_id"], text="you, by id")
    return say("done")


async def test_a_second_child_of_the_same_name_is_refused_and_duplicates_made_elsewhere_are_ambiguous(
        mesh, client, tmp_path):
    """spawn_agent refuses a name an open agent of the team already has (a send by that name would become
    ambiguous in the middle of the run); a twin registered directly through the mesh makes a send by name
    fail with the candidates, and a send by id still works."""
    async with scripted_host(mesh.address, tmp_path, {"lead": twins, "twin": lambda v: say("ok")}) as host:
        lead = await host.start_task("lead", "two twins")
        await eventually(lambda: len(tool_results(lead, "spawn_agent")) == 2 and lead.state == "idle")
        (_, first), (_, second) = tool_results(lead, "spawn_agent")
        assert first["status"] == "started"
        assert second == {"error": "you already have a subagent named 'twin'; it is working on its task. Choose"
                                   " another name for a new subagent", "existing_child": first["agent_id"]}, second
        other = await lead.handle.spawn("twin")  # the mesh itself allows it (names are for display and lookup)
        poker = await lead.handle.spawn("poker")
        await poker.send(lead.agent_id, "go on")
        await eventually(lambda: len(tool_results(lead, "send_message")) == 2)
        ids = [first["agent_id"], other.agent_id]
        (_, by_name_result), (_, by_id_result) = tool_results(lead, "send_message")
        assert "several agents are named 'twin'" in by_name_result["error"]
        assert all(i in by_name_result["error"] for i in ids)
        assert by_id_result["status"] == "accepted" and by_id_result["to"] == ids[0]


def prober(view):
    step = len(view.results)
    plan = [
        ("send_message", {"to": "agt_nobody0000000000", "text": "anyone?"}),
        ("send_message", {"to": "ghost", "text": "anyone?"}),
        ("spawn_agent", {"agent_name": "victim", "task": "wait"}),
        ("close_agent", {"agent": "victim"}),
    ]
    if step < len(plan):
        return call(*plan[step][:1], **plan[step][1])
    if step == len(plan):
        victim = view.results[2].result["agent_id"]
        return call("send_message", to=victim, text="are you closed?")
    return say("done")


async def test_unknown_and_closed_targets_are_reported_to_the_model(mesh, client, tmp_path):
    async with scripted_host(mesh.address, tmp_path, {"prober": prober, "victim": lambda v: say("ok")}) as host:
        lead = await host.start_task("prober", "probe")
        await eventually(lambda: len(tool_results(lead, "send_message")) == 3)
        unknown, ghost, closed = (r for _, r in tool_results(lead, "send_message"))
        assert unknown == {"error": "no agent with id agt_nobody0000000000"}
        assert "no open agent named 'ghost'" in ghost["error"]
        assert closed["status"] == "target_closed" and "closed" in closed["detail"]
        (_, close_result), = tool_results(lead, "close_agent")
        victim_id = tool_results(lead, "spawn_agent")[0][1]["agent_id"]
        assert close_result == {"closed": [victim_id]}
        assert victim_id not in host.runners, "the host stopped the closed agent"
    record = await Record.read(client)
    sent = record.one(K.EVENT_KIND_MESSAGE_SENT, message_id=closed["message_id"])
    assert sent.detail == "target_closed", "the tool showed the mesh's own receipt"


def filler(view):
    step = len(view.results)
    if step == 0:
        return call("spawn_agent", agent_name="sink", task="be busy")
    if step < 4:
        return call("send_message", to="sink", text=f"load {step}")
    return say("done")


async def test_a_full_inbox_is_reported_and_nothing_is_evicted(mesh, client, tmp_path):
    gate, sending = asyncio.Event(), asyncio.Event()
    sink = GatedModel(lambda v: say("busy"), {1: gate})
    lead_model = GatedModel(filler, {2: sending})  # its sends wait until the sink's turn 1 has begun
    async with scripted_host(mesh.address, tmp_path, {"lead": lead_model, "sink": sink},
                             child_inbox_capacity=2) as host:
        lead = await host.start_task("lead", "fill the sink")
        await asyncio.wait_for(sink.waiting.wait(), 30)  # the sink consumed its task, and holds its first call
        sending.set()
        await eventually(lambda: len(tool_results(lead, "send_message")) == 3)
        statuses = [r["status"] for _, r in tool_results(lead, "send_message")]
        # the task message was consumed when sink's turn 1 began; then two fit, the third does not
        assert statuses == ["accepted", "accepted", "inbox_full"], statuses
        full = tool_results(lead, "send_message")[2][1]
        assert "capacity 2" in full["detail"] and "nothing was evicted" in full["detail"]
        gate.set()
        sink_runner = by_name(host, "sink")
        await eventually(lambda: len([m for m in sink_runner.conversation.messages
                                      if m["role"] == "user" and "load" in m["content"]]) == 1)
        loads = [m["content"] for m in sink_runner.conversation.messages if "load" in m["content"]][0]
        assert "load 1" in loads and "load 2" in loads and "load 3" not in loads


def chatty(view):
    """Answer every new message, and also write to the other sibling: a pair that would thank each other
    forever (two small models did, docs/real-llm.md). News from the lead is passed on to the sibling."""
    other = "B" if "You are A" in view.system else "A"
    calls = []
    for m in view.new:
        if m.kind == "task":
            if "start" in m.text:
                calls.append(("send_message", {"to": other, "text": "hello"}))
        elif m.sender_name == "lead":
            calls.append(("send_message", {"to": other, "text": f"news: {m.text}"}))
        elif m.kind != "control":
            calls.append(("reply", {"message_id": m.message_id, "text": "thanks"}))
    return Decision(calls=calls) if calls else say("idle")


def pair_lead(view):
    if not view.called("spawn_agent"):
        return Decision(calls=[("spawn_agent", {"agent_name": "B", "task": "Answer A."}),
                               ("spawn_agent", {"agent_name": "A", "task": "Say hello to B: start."})])
    return say("waiting")


def refusals(runner):
    return [r["error"] for _, r in tool_results(runner, "send_message") + tool_results(runner, "reply")
            if "error" in r]


async def test_messages_to_one_agent_stop_at_the_per_pair_limit_until_a_third_party_writes(mesh, client, tmp_path):
    """max_messages_per_peer (OpenClaw's maxPingPongTurns): two agents answering each other forever send each
    other at most that many messages; a message from a third party lets the agent it reached write again,
    the other still may not. Counted from the event record."""
    async with scripted_host(mesh.address, tmp_path, {"lead": pair_lead, "A": chatty, "B": chatty},
                             max_messages_per_peer=2) as host:
        lead = await host.start_task("lead", "start the pair")
        await eventually(lambda: len(host.runners) == 3 and all(
            r.state == "idle" for r in host.runners.values()) and refusals(by_name(host, "A")),
                         message="A refused a third message")
        a, b = by_name(host, "A"), by_name(host, "B")
        assert refusals(a) == ["you have sent B 2 messages since anyone else wrote to you: no more to B now;"
                               " call finish now with your report: what you sent, and what you received"], refusals(a)
        record = await Record.read(client)

        def between(sender, recipient):
            return [e for e in record.of(K.EVENT_KIND_MESSAGE_STORED, sender=sender.agent_id)
                    if e.recipient == recipient.agent_id]

        assert (len(between(a, b)), len(between(b, a))) == (2, 2) and not refusals(b)
        news = await lead.send(a.agent_id, "the lead writes")
        await eventually(lambda: news.message_id in a.received and refusals(b)
                         and all(r.state == "idle" for r in host.runners.values()), message="news passed on")
        record = await Record.read(client)
        assert (len(between(a, b)), len(between(b, a))) == (3, 2), "A heard from the lead, B did not"
        assert refusals(b) == [refusals(a)[0].replace("B", "A")]
