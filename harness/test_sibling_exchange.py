"""The seed's scenario without a language model: a parent creates A and B
through the subagent tool; A holds a random secret that B's task does not
contain; A sends it to B; B receives it from its own inbox (woken, no
polling tool) and replies; A consumes the reply and confirms; both report to
the parent, which consumes both reports and completes. Proven from the
registry, message ids, reply correlation and consumption events."""

import secrets

from harness.hosts import scripted_host
from harness.policies import SIBLING_POLICIES
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.registry.v1 import registry_pb2 as reg

K = ev.EventKind


class Agent:
    """What a scenario keeps of a hosted agent after its host stopped."""

    def __init__(self, runner, client):
        self.agent_id = runner.agent_id
        self.conversation = runner.conversation
        self.handle = client.agent(runner.agent_id, runner.record.credential)


async def test_siblings_exchange_a_secret_through_their_inboxes(mesh, client, tmp_path):
    secret = f"SEC-{secrets.randbelow(10**6):06d}"
    async with scripted_host(mesh.address, tmp_path / "host", SIBLING_POLICIES) as host:
        outcome = await host.run_task("parent", f"Coordinate A and B. The secret code for A is {secret}.",
                                      timeout=30)
        assert outcome.ok, outcome.error
        runners = {r.record.name: r for r in host.runners.values()}
        assert all(r.max_runs_active == 1 for r in host.runners.values()), "one model loop per agent, ever"
    # the host is gone; look at what it left in the mesh with its agents' credentials
    parent, a, b = (Agent(runners[n], client) for n in ("parent", "A", "B"))
    admin = client
    # identities: A and B are children of the parent, in its scope
    for child in (a, b):
        info = await parent.handle.get(child.agent_id)
        assert (info.parent_id, info.scope_id, info.mode) == (parent.agent_id, parent.agent_id, reg.AGENT_MODE_ASYNC)
    (b_task,) = [m for m in b.conversation.messages if m["role"] == "user"][:1]
    assert "kind=task" in b_task["content"] and secret not in b_task["content"], "B's task does not contain the secret"

    events = await admin.admin_events(limit=1000)
    def of(kind, **match):
        return [e for e in events if e.kind == kind and all(getattr(e, k) == v for k, v in match.items())]

    # A -> B, the secret, consumed by B in a turn after B was woken
    (a_to_b,) = of(K.EVENT_KIND_MESSAGE_STORED, sender=a.agent_id, recipient=b.agent_id, in_reply_to="")
    (b_consumed,) = of(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=a_to_b.message_id, agent_id=b.agent_id)
    assert b_consumed.turn > 0
    woken = of(K.EVENT_KIND_AGENT_WOKEN, agent_id=b.agent_id)
    assert any(w.event_id < b_consumed.event_id for w in woken), "B was woken by the arrival"
    consumed_text = (await b.handle.inbox_status(a_to_b.sequence)).envelope.content.text
    assert secret in consumed_text, "the secret is in the message B consumed"

    # B -> A reply, correlated, consumed by A
    (b_reply,) = of(K.EVENT_KIND_MESSAGE_STORED, sender=b.agent_id, recipient=a.agent_id)
    assert b_reply.in_reply_to == a_to_b.message_id
    assert of(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=b_reply.message_id, agent_id=a.agent_id)
    reply_text = (await a.handle.inbox_status(b_reply.sequence)).envelope.content.text
    assert secret in reply_text, "A consumed B's reply quoting the secret"

    # A confirms to B (a reply to B's reply), consumed by B
    (confirm,) = of(K.EVENT_KIND_MESSAGE_STORED, sender=a.agent_id, recipient=b.agent_id,
                    in_reply_to=b_reply.message_id)
    assert of(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=confirm.message_id, agent_id=b.agent_id)

    # both report to the parent through its inbox; the parent consumes both, then completes
    completions = [e for e in of(K.EVENT_KIND_MESSAGE_STORED, recipient=parent.agent_id)]
    assert {e.sender for e in completions} == {a.agent_id, b.agent_id}
    for report in completions:
        status = await parent.handle.status(report.message_id, sender=report.sender)
        assert status.envelope.kind == env_pb.MESSAGE_KIND_COMPLETION
        assert status.envelope.in_reply_to.startswith("task-")
        assert of(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=report.message_id, agent_id=parent.agent_id)
    (done,) = of(K.EVENT_KIND_TASK_COMPLETED, agent_id=parent.agent_id)
    last_report = max(e.event_id for r in completions
                      for e in of(K.EVENT_KIND_MESSAGE_CONSUMED, message_id=r.message_id))
    assert done.event_id > last_report, "the parent completed after consuming both reports"
    assert secret in outcome.result

    # every agent's turns are strictly one after the other
    for runner in (parent, a, b):
        turns = [e for e in events if e.agent_id == runner.agent_id
                 and e.kind in (K.EVENT_KIND_TURN_STARTED, K.EVENT_KIND_TURN_ENDED)]
        kinds = [e.kind for e in turns]
        assert kinds == [K.EVENT_KIND_TURN_STARTED, K.EVENT_KIND_TURN_ENDED] * (len(kinds) // 2)
        assert [e.turn for e in turns] == [t for n in range(1, len(turns) // 2 + 1) for t in (n, n)]
