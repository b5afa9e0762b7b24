"""A host that loses its mesh replica carries on with another: two `inboxmesh
up --store jetstream` processes on one nats-server, a host given both
addresses, the replica it uses killed (SIGKILL) in the middle of the
sibling exchange. The exchange finishes, and every message was consumed
exactly once (stored states and the event record, read through the
surviving replica)."""

import asyncio
import secrets

import pytest

from agent_host.models.scripted import Policy, ScriptedModel
from harness.hosts import GatedModel, by_name, scripted_host
from harness.nats import NatsNode
from harness.policies import SIBLING_POLICIES
from inboxmesh.client.mesh import MeshClient
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from tests.fixtures import ADMIN_TOKEN, eventually
from tests.processes import MeshProcess

K = ev.EventKind
pytestmark = [pytest.mark.store_independent, pytest.mark.timeout(180)]


async def test_the_exchange_survives_the_loss_of_the_hosts_replica(tmp_path):
    secret = f"SEC-{secrets.randbelow(10**6):06d}"
    gate = asyncio.Event()
    b_model = GatedModel(SIBLING_POLICIES["B"], {2: gate})  # B's second model call: A's message is in hand
    policies: dict[str, Policy | ScriptedModel] = {**SIBLING_POLICIES, "B": b_model}
    with NatsNode(tmp_path / "nats") as node:
        args = node.mesh_args()
        with MeshProcess(tmp_path / "r1", *args) as r1, MeshProcess(tmp_path / "r2", *args) as r2:
            both = f"ipv4:{r1.address},{r2.address}"  # gRPC tries them in order: r1 while it lives
            async with scripted_host(both, tmp_path / "host", policies) as host:
                parent = await host.start_task("parent", f"Coordinate A and B. The secret code for A is {secret}.")
                await asyncio.wait_for(b_model.waiting.wait(), 30)
                r1.kill()
                gate.set()
                outcome = await host.outcome(parent.agent_id, timeout=90)
                assert outcome.ok, outcome.error
                runners = {n: by_name(host, n) for n in ("parent", "A", "B")}
                reconnects = sum(r.stream.reconnects for r in runners.values() if r.stream is not None)
            assert reconnects >= 1, "the hosts' inbox streams moved to the other replica"
            async with MeshClient(r2.address, admin_token=ADMIN_TOKEN) as admin:
                events = await admin.admin_events(limit=1000)
                stored = [e for e in events if e.kind == K.EVENT_KIND_MESSAGE_STORED]
                consumed = [e for e in events if e.kind == K.EVENT_KIND_MESSAGE_CONSUMED]
                ids = [(e.agent_id, e.message_id) for e in consumed]
                assert len(ids) == len(set(ids)), "no message consumed twice"
                for e in stored:
                    agent = runners[next(n for n, r in runners.items() if r.agent_id == e.recipient)]
                    view = admin.agent(agent.agent_id, agent.record.credential)
                    status = await eventually(lambda v=view, s=e.sequence: v.inbox_status(s), message="status")
                    assert status.state == pb.MESSAGE_STATE_CONSUMED, f"{e.message_id} to {e.recipient}"
            assert secret in outcome.result


async def test_an_ack_whose_answer_was_lost_still_reaches_the_agent(tmp_path):
    """The replica records a consumption and dies before it answers the ack
    (a crash point). The host acks again through the other replica, is told
    "already consumed", and still gives the message to its agent: it was
    consumed by the agent's own first ack, so nothing consumed is lost to
    the model."""
    secret = f"SEC-{secrets.randbelow(10**6):06d}"
    with NatsNode(tmp_path / "nats") as node:
        args = node.mesh_args()
        # the second ack: A's task (both children are registered by then; a registration is not retried)
        with MeshProcess(tmp_path / "r1", *args, env={"INBOXMESH_CRASH_AT": "ack-stored:2"}) as r1, \
                MeshProcess(tmp_path / "r2", *args) as r2:
            async with scripted_host(f"ipv4:{r1.address},{r2.address}", tmp_path / "host", SIBLING_POLICIES) as host:
                parent = await host.start_task("parent", f"Coordinate A and B. The secret code for A is {secret}.")
                outcome = await host.outcome(parent.agent_id, timeout=90)
                assert outcome.ok, outcome.error
                runners = {r.agent_id: r for r in host.runners.values()}
            assert r1.proc is not None and r1.proc.wait(10) == 137, "r1 died at its second ack, after recording it"
            async with MeshClient(r2.address, admin_token=ADMIN_TOKEN) as admin:
                events = await admin.admin_events(limit=1000)
            consumed = [e for e in events if e.kind == K.EVENT_KIND_MESSAGE_CONSUMED]
            assert consumed, "consumptions recorded"
            for e in consumed:
                runner = runners[e.agent_id]
                assert e.message_id in runner.received, f"{runner.record.name} never took in {e.message_id}"
            assert secret in outcome.result
