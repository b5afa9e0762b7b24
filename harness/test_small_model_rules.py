"""The host rules the real-model scenarios found for small models (docs/lifecycle.md, docs/real-llm.md),
each through a real host on a real mesh, checked from the tool results the model saw and the event record:
a subagent task that is a label or the agent's own whole task is refused with what its own task says about
that subagent; `wait` is refused to a top-level agent that nothing would wake. (The per-pair message limit:
harness/test_addressing.py.)"""

import asyncio

from agent_host.models.scripted import Decision, call, say
from harness.evidence import K, Record
from harness.hosts import GatedModel, by_name, scripted_host
from harness.test_addressing import tool_results
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from tests.fixtures import eventually
from tests.streams import Collector

TASK = "Create two helpers named A and B. Tell A the word blue. B must greet A."


def delegator(view):
    """A label for A, then the whole task for B, then B's task in its own words, a label for C; then finish."""
    step = len(view.called("spawn_agent"))
    plan = [("A", "greet"), ("B", TASK.upper().replace(".", "!")), ("B", "Greet A when A writes to you."),
            ("C", "go")]
    if step < len(plan):
        return call("spawn_agent", agent_name=plan[step][0], task=plan[step][1])
    return finisher(view)


def finisher(view):
    """Finish (again after a refusal: a parent's finish waits for its children's reports)."""
    done = any("error" not in r.result for r in view.called("finish"))
    return say("done") if done else call("finish", result="done")


async def test_a_label_is_completed_from_the_agents_own_task_and_the_whole_own_task_is_refused(
        mesh, client, tmp_path):
    """min_task_words: in place of a label the subagent gets what the agent's own task says about it (a
    label is refused when it says nothing); refuse_own_task: the agent's own whole task is refused, quoting
    the sentence about that subagent."""
    async with scripted_host(mesh.address, tmp_path, {"lead": delegator, "A": finisher, "B": finisher},
                             min_task_words=3, refuse_own_task=True) as host:
        outcome = await host.run_task("lead", TASK, timeout=30)
        assert outcome.ok, outcome.error
        lead = by_name(host, "lead")
        label, own, proper, unknown = (result for _, result in tool_results(lead, "spawn_agent"))
        a_task = "Create two helpers named A and B. Tell A the word blue. B must greet A."
        assert label["status"] == "started" and label["note"] == (
            "the task 'greet' was too short to be a task: A got what your own task says about A instead:"
            f" {a_task!r}"), label
        assert own == {"error": "that task holds your own whole task: B would do all of it again. Give B only its own"
                                ' part. Your own task says about B: "B must greet A." Give B its task in such'
                                " words."}, own  # the sentence that begins with B
        assert proper["status"] == "started"
        assert unknown == {"error": "the task 'go' is not a task: write C's whole task in plain sentences, with every"
                                    " fact C needs (it knows nothing but its task)"}, unknown
    record = await Record.read(client)
    spawned = [e.detail for e in record.of(K.EVENT_KIND_AGENT_SPAWNED, agent_id=lead.agent_id)]
    assert [d.split(" ")[1] for d in spawned] == ["name=A", "name=B"], "the refused tasks started nobody"
    assert by_name(host, "A").record.task_text == a_task
    assert by_name(host, "B").record.task_text == "Greet A when A writes to you."


def idler(view):
    """Wait at once; told nothing would wake it, finish."""
    if not view.called("wait"):
        return call("wait")
    return call("finish", result="did it myself") if not view.called("finish") else say("done")


async def test_wait_is_refused_to_a_top_level_agent_that_nothing_would_wake(mesh, client, tmp_path):
    async with scripted_host(mesh.address, tmp_path, {"lead": idler}) as host:
        outcome = await host.run_task("lead", "do it", timeout=30)
        assert outcome.ok and outcome.result.startswith("did it myself"), outcome
        [(_, refused)] = tool_results(by_name(host, "lead"), "wait")
        assert refused == {"error": "nothing will wake you: none of your subagents is working. Do your task now."}


def spawn_then_wait(view):
    if not view.called("spawn_agent"):
        return Decision(calls=[("spawn_agent", {"agent_name": "kid", "task": "Finish when told."}), ("wait", {})])
    if view.new and any(m.kind == "completion" for m in view.new):
        return call("finish", result="kid done")
    return say("idle")


async def test_wait_is_allowed_while_a_subagent_works(mesh, client, tmp_path):
    async with scripted_host(mesh.address, tmp_path, {"lead": spawn_then_wait, "kid": finisher}) as host:
        outcome = await host.run_task("lead", "have the kid do it", timeout=30)
        assert outcome.ok, outcome.error
        lead = by_name(host, "lead")
        await eventually(lambda: tool_results(lead, "wait"))
        assert tool_results(lead, "wait") == [({}, {"status": "waiting"})]


def blind_planner(view):
    """The real model's habit: the whole plan in one answer (a spawn, a finish, a wait), written before any
    result is seen; then, seeing a refusal, a proper spawn; a finish once the report is in."""
    if not view.results:
        return Decision(calls=[("spawn_agent", {"agent_name": "kid", "task": "go"}), ("finish", {"result": "done"}),
                               ("wait", {})])
    if len(view.called("spawn_agent")) == 1:
        return Decision(calls=[("spawn_agent", {"agent_name": "kid", "task": "Finish with the word done."}),
                               ("wait", {})])
    if any(m.kind == "completion" for m in view.new):
        return call("finish", result="kid reported")
    return call("wait")


async def test_a_finish_or_wait_written_before_an_error_was_seen_does_not_end_the_run(mesh, client, tmp_path):
    async with scripted_host(mesh.address, tmp_path, {"lead": blind_planner, "kid": finisher},
                             min_task_words=3) as host:
        outcome = await host.run_task("lead", "get it done", timeout=30)  # says nothing about the kid
        assert outcome.ok and outcome.result == "kid reported", outcome
        lead = by_name(host, "lead")
        (_, label), (_, proper) = tool_results(lead, "spawn_agent")
        assert "is not a task" in label["error"] and proper["status"] == "started"
        first_finish = tool_results(lead, "finish")[0][1]
        assert first_finish == {"error": "not finished: spawn_agent failed earlier in this answer; read those errors"
                                         " and deal with them first"}
    record = await Record.read(client)
    ended = [e.detail for e in record.of(K.EVENT_KIND_TURN_ENDED, agent_id=lead.agent_id)]
    assert ended[:2] == ["ran: spawn_agent, finish, wait", "ran: spawn_agent, wait"], ended
    idle = record.of(K.EVENT_KIND_AGENT_IDLE, agent_id=lead.agent_id)
    assert idle and idle[0].turn == 2, "the run went on to turn 2 before the lead idled"


def early_sender(view):
    """Send hello to B on its task (B does not exist yet), then wait; woken again, send again."""
    sends = view.called("send_message")
    if not sends or (len(sends) == 1 and view.called("wait")):
        return call("send_message", to="B", text="hello")
    return call("wait")


def spawn_a(view):
    return Decision(calls=[("spawn_agent", {"agent_name": "A", "task": "Send hello to B."}), ("wait", {})]) \
        if not view.called("spawn_agent") else say("idle")


async def test_an_agent_that_could_not_reach_a_name_is_woken_when_an_agent_of_that_name_joins(
        mesh, client, tmp_path):
    async with scripted_host(mesh.address, tmp_path, {"lead": spawn_a, "A": early_sender,
                                                      "B": lambda v: say("idle")}) as host:
        await host.start_task("lead", "have A greet B")
        await eventually(lambda: len(host.runners) == 2 and by_name(host, "A").state == "idle"
                         and tool_results(by_name(host, "A"), "wait"), message="A tried B, then waited")
        a, lead = by_name(host, "A"), by_name(host, "lead")
        [(_, missed)] = tool_results(a, "send_message")
        assert "no open agent named 'B'" in missed["error"]
        await host.start_child(lead.record, name="B", task="Wait for A's greeting.", mode="async",
                               history=[], budget=lead.budget)
        await eventually(lambda: len(tool_results(a, "send_message")) == 2, message="A sent again")
        assert tool_results(a, "send_message")[1][1]["status"] == "accepted"
        notes = [m["content"] for m in a.conversation.messages if m["role"] == "user" and "joined" in m["content"]]
        assert notes == ["-- B has joined your team now; you could not reach B before."], notes
    record = await Record.read(client)
    woken = [e for e in record.of(K.EVENT_KIND_AGENT_WOKEN, agent_id=a.agent_id) if "joined" in e.detail]
    assert len(woken) == 1 and "B has joined your team now" in woken[0].detail
    b = by_name(host, "B")
    stored = [e for e in record.of(K.EVENT_KIND_MESSAGE_STORED, sender=a.agent_id) if e.recipient == b.agent_id]
    assert len(stored) == 1


def waits_on_a_question(view):
    """Wait whatever comes in; told to answer first, reply; then wait."""
    waits = view.called("wait")
    if waits and "error" in waits[-1].result and not view.called("reply"):
        return call("reply", text="got it")
    return call("wait")


async def test_wait_is_refused_to_an_agent_holding_a_message_it_has_not_answered(mesh, client, tmp_path):
    async with scripted_host(mesh.address, tmp_path, {"lead": spawn_a, "A": waits_on_a_question}) as host:
        lead_runner = await host.start_task("lead", "have A answer")
        await eventually(lambda: len(host.runners) == 2 and tool_results(by_name(host, "A"), "wait"))
        a = by_name(host, "A")
        receipt = await lead_runner.send(a.agent_id, "what is 6*7?")
        await eventually(lambda: tool_results(a, "reply"), message="A answered")
        refusals = [r for _, r in tool_results(a, "wait") if "error" in r]
        assert refusals == [{"error": "nothing will wake you while you hold a message you have not answered:"
                                      f" message_id {receipt.message_id!r} from lead ('what is 6*7?'). Answer it"
                                      " with reply, or finish your task."}], refusals
    record = await Record.read(client)
    replies = [e for e in record.of(K.EVENT_KIND_MESSAGE_STORED, sender=a.agent_id) if e.in_reply_to]
    assert [e.in_reply_to for e in replies] == [receipt.message_id]


def pinger(view):
    """Ask `outside`, wait for the answer, finish with it."""
    if not view.called("send_message"):
        return Decision(calls=[("send_message", {"to": "outside", "text": "ping"}), ("wait", {})])
    answers = [m for m in view.inbox if m.in_reply_to]
    return call("finish", result=answers[0].text) if answers else call("wait")


async def test_wait_is_allowed_to_a_top_level_agent_whose_message_awaits_an_answer(mesh, client, tmp_path):
    """The A2A test's asker (tests/test_a2a_gateway.py) was refused `wait` while its message to a remote agent
    was out, and looped through its 50 turns on a slow run: a sent message not yet answered may wake it.
    `outside` is the lead's child in the mesh, run by no host here (so no subagent of the lead is working)."""
    gate = asyncio.Event()
    async with scripted_host(mesh.address, tmp_path, {"lead": GatedModel(pinger, {1: gate})}) as host:
        lead = await host.start_task("lead", "ask outside")
        outside = await client.agent(lead.agent_id, lead.record.credential).spawn("outside")
        gate.set()
        await eventually(lambda: tool_results(lead, "wait") and lead.state == "idle", message="the lead waits")
        assert [r for _, r in tool_results(lead, "wait")] == [{"status": "waiting"}]
        got = Collector(outside)
        try:
            [ping] = await got.wait_for(1)
            await outside.ack([ping.sequence])
        finally:
            await got.stop()
        await outside.send(lead.agent_id, "pong", kind=env_pb.MESSAGE_KIND_REPLY, in_reply_to=ping.message_id)
        outcome = await host.outcome(lead.agent_id, timeout=30)
        assert outcome.ok and outcome.result.startswith("pong"), outcome
        assert lead.record.turn == 2, "one turn to ask, one to finish: no turn spent on a refused wait"


QUIET = "No message is on its way to you"


def spawns_twice_then_waits(view):
    """Spawn B, then A, then A again with the same task (a retry); then wait for the reports and finish."""
    plan = [("B", "Answer A's message, then wait."), ("A", "Send hello to B."), ("A", "Send hello to B.")]
    step = len(view.called("spawn_agent"))
    if step < len(plan):
        return call("spawn_agent", agent_name=plan[step][0], task=plan[step][1])
    return call("wait") if len([m for m in view.inbox if m.kind == "completion"]) < 2 else finisher(view)


def greeter(view):
    """Send hello to B, wait for the answer, finish with it."""
    if not view.called("send_message"):
        return call("send_message", to="B", text="hello")
    answers = [m for m in view.inbox if m.in_reply_to]
    return call("finish", result=f"B answered {answers[0].text}") if answers else call("wait")


def answerer(finishes_when_told: bool):
    """Answer A's message, then wait; woken with no new message (the quiet tree's note): finish, or wait."""
    def policy(view):
        if any(m.sender_name == "A" for m in view.inbox) and not view.called("reply"):
            return call("reply", text="hello A")
        woken_by_note = view.called("reply") and view.results[-1].name == "wait" and not view.new
        if woken_by_note and finishes_when_told:
            return call("finish", result="answered A")
        return call("wait")
    return policy


async def test_a_subagent_left_with_its_task_open_in_a_quiet_tree_is_woken_once_to_finish(mesh, client, tmp_path):
    """quiet_wake_s: B answered A and waited with its task open, A reported, the lead waited for B's report
    (the real model's run, docs/real-llm.md): the whole tree idle, nothing on its way. B is woken with the
    note and finishes; the lead completes. (And spawning A again with the same task is a retry whose note
    says to wait for A's result.)"""
    async with scripted_host(mesh.address, tmp_path, {"lead": spawns_twice_then_waits, "A": greeter,
                                                      "B": answerer(True)}, quiet_wake_s=0.5) as host:
        outcome = await host.run_task("lead", "have A greet B", timeout=30)
        assert outcome.ok, outcome.error
        lead, b = by_name(host, "lead"), by_name(host, "B")
        retry = tool_results(lead, "spawn_agent")[2][1]
        assert retry["status"] == "already started" and retry["note"] == (
            "A is working on this task: its result comes to you as a message when it finishes, so do not start it"
            " again; wait for it") or retry["note"] == "A has finished this task and its result was sent to you", \
            retry
    record = await Record.read(client)
    woken = [e for e in record.of(K.EVENT_KIND_AGENT_WOKEN, agent_id=b.agent_id) if QUIET in e.detail]
    assert len(woken) == 1, [e.detail for e in record.of(K.EVENT_KIND_AGENT_WOKEN, agent_id=b.agent_id)]
    [done] = record.of(K.EVENT_KIND_TASK_COMPLETED, agent_id=b.agent_id)
    assert done.event_id > woken[0].event_id
    assert not [e for e in record.of(K.EVENT_KIND_AGENT_WOKEN) if QUIET in e.detail and e.agent_id != b.agent_id], \
        "only B's task was open with nothing left to wait for"


async def test_a_quiet_tree_wakes_a_subagent_once_and_never_while_a_message_awaits_an_answer(
        mesh, client, tmp_path):
    """B waits again after the note: it is not woken a second time (no message was consumed since). And
    with a message of A unanswered (B ignores it), nobody is woken: the answer may still come."""
    async with scripted_host(mesh.address, tmp_path, {"lead": spawns_twice_then_waits, "A": greeter,
                                                      "B": answerer(False)}, quiet_wake_s=0.3) as host:
        await host.start_task("lead", "have A greet B")
        await eventually(lambda: len(host.runners) == 3 and len(tool_results(by_name(host, "B"), "wait")) == 3
                         and by_name(host, "B").state == "idle",
                         message="B waited, answered and waited, was woken and waited again")
        b = by_name(host, "B")
        await asyncio.sleep(1.5)  # five quiet periods
        assert len(tool_results(b, "wait")) == 3 and not b.record.completed
    async with scripted_host(mesh.address, tmp_path / "ignores", {"lead": spawns_twice_then_waits, "A": greeter,
                                                                  "B": lambda v: call("wait") if not v.inbox[1:]
                                                                  else say("not answering")},
                             quiet_wake_s=0.3) as host:
        await host.start_task("lead", "have A greet B")
        await eventually(lambda: len(host.runners) == 3 and len(by_name(host, "B").received) == 2
                         and by_name(host, "B").state == "idle" and by_name(host, "A").state == "idle",
                         message="B took A's message and did not answer it")
        await asyncio.sleep(1.5)
        assert by_name(host, "A").actions.unanswered and not by_name(host, "B").record.completed
    record = await Record.read(client)
    woken = [e.agent_id for e in record.of(K.EVENT_KIND_AGENT_WOKEN) if QUIET in e.detail]
    assert woken == [b.agent_id], woken


def replans(view):
    """Spawn X; on its report, write the plan again (X with other words) and finish in the same answer."""
    if not view.called("spawn_agent"):
        return call("spawn_agent", agent_name="X", task="Finish with the word done.")
    if not [m for m in view.inbox if m.kind == "completion"]:
        return call("wait")
    return Decision(calls=[("spawn_agent", {"agent_name": "X", "task": "Say done, then finish."}),
                           ("finish", {"result": "X said done"})])


async def test_a_spawn_of_a_child_it_already_has_does_not_stop_a_finish_in_the_same_answer(mesh, client, tmp_path):
    """A finish after a failed call of the same answer is refused (docs/lifecycle.md), but asking again for a
    child it already has is not a failure of the plan: the real model's lead wrote its spawns again before
    every finish, after both children had reported, until its context was full."""
    async with scripted_host(mesh.address, tmp_path, {"lead": replans, "X": finisher}) as host:
        outcome = await host.run_task("lead", "have X say done", timeout=30)
        assert outcome.ok and outcome.result.startswith("X said done"), outcome
        lead, x = by_name(host, "lead"), by_name(host, "X")
        again = tool_results(lead, "spawn_agent")[1][1]
        assert again == {"error": "you already have a subagent named 'X'; it has finished its task. Choose another"
                                  " name for a new subagent", "existing_child": x.agent_id}, again
        [(_, done)] = tool_results(lead, "finish")
        assert "error" not in done, done


def answers_then_finishes(view):
    """Answer A's message; then finish, as the answer's result says (else wait)."""
    if not [m for m in view.inbox if m.sender_name == "A"]:
        return call("wait")
    replies = view.called("reply")
    if not replies:
        return call("reply", text="thanks, A: I have it")
    if "next" in replies[-1].result and not view.called("finish"):
        return call("finish", result="answered A")
    return call("wait") if not view.called("finish") else say("done")


async def test_an_answer_that_leaves_nothing_to_answer_says_to_finish(mesh, client, tmp_path):
    """The real model's B answered A's message and waited with its task open, while the lead spawned other
    helpers until its turn limit (docs/real-llm.md): an accepted reply that leaves the agent nothing to answer,
    with its task open, says that it can finish. B, which finishes only when told, completes with no quiet
    wake-up (there is none on this host)."""
    async with scripted_host(mesh.address, tmp_path, {"lead": spawns_twice_then_waits, "A": greeter,
                                                      "B": answers_then_finishes}) as host:
        outcome = await host.run_task("lead", "have A greet B", timeout=30)
        assert outcome.ok, outcome.error
        b = by_name(host, "B")
        [(_, answer)] = tool_results(b, "reply")
        assert answer["status"] == "accepted" and answer["next"] == (
            "every message you received is answered; if your task is done, call finish now with your report (what you"
            " sent, and what you received)"), answer
    record = await Record.read(client)
    [done] = record.of(K.EVENT_KIND_TASK_COMPLETED, agent_id=b.agent_id)
    [stored] = [e for e in record.of(K.EVENT_KIND_MESSAGE_STORED) if e.message_id == answer["message_id"]]
    assert done.event_id > stored.event_id


def spawns_both_then_respawns(seen: list[set[str]]):
    """Spawn A and B in one answer; on each wake-up note the tools given, spawn A again while it may (the real
    model's lead did, every turn, while B worked), wait while a child works, finish after both reports."""
    def policy(view):
        if not view.called("spawn_agent"):
            return Decision(calls=[("spawn_agent", {"agent_name": "A", "task": "Finish with the word done."}),
                                   ("spawn_agent", {"agent_name": "B", "task": "Finish with the word done."})])
        seen.append(set(view.tools))
        reports = len([m for m in view.inbox if m.kind == "completion"])
        if reports < 2:
            return call("spawn_agent", agent_name="A", task="Finish, again.") if "spawn_agent" in view.tools \
                else call("wait")
        return finisher(view)
    return policy


async def test_no_spawn_agent_in_a_turn_that_begins_while_a_child_works(mesh, client, tmp_path):
    """spawn_while_children_work=False: a spawn of two children in one answer goes; the turn woken by A's
    report, B still working, is given no spawn_agent (the real model's lead spawned A again, or new helpers,
    every turn, until its turn limit); once both reported it is offered again."""
    seen: list[set[str]] = []
    gate = asyncio.Event()
    async with scripted_host(mesh.address, tmp_path, {"lead": spawns_both_then_respawns(seen), "A": finisher,
                                                      "B": GatedModel(finisher, {1: gate})},
                             spawn_while_children_work=False) as host:
        lead = await host.start_task("lead", "have A and B say done")
        await eventually(lambda: seen, message="the lead woken by A's report")
        gate.set()
        outcome = await host.outcome(lead.agent_id, timeout=30)
        assert outcome.ok, outcome.error
        assert [r["status"] for _, r in tool_results(lead, "spawn_agent")] == ["started", "started"]
    assert "spawn_agent" not in seen[0] and "wait" in seen[0], seen
    assert "spawn_agent" in seen[-1], seen
    record = await Record.read(client)
    assert len(record.of(K.EVENT_KIND_AGENT_SPAWNED, agent_id=lead.agent_id)) == 2
