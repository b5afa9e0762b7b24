"""A host in another language works from protos/ and docs/clients.md alone: clients/node/sibling.mjs
(Node.js, @grpc/grpc-js and @grpc/proto-loader, no Python) plays the sibling scenario against the mesh
on one Consume stream, and decodes a refused call's google.rpc.Status / ErrorInfo. Proven from the
mesh's own record (registry, event record, message states), not from what the script prints."""

from __future__ import annotations

import asyncio
import json
import subprocess

import grpc
import pytest

from harness.evidence import K, Record
from harness.prepare import ROOT, NotPrepared, node_client
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as inbox_pb
from inboxmesh.registry.v1 import registry_pb2 as reg_pb
from tests.fixtures import ADMIN_TOKEN, eventually

pytestmark = pytest.mark.timeout(120)

SCRIPT = "clients/node/sibling.mjs"
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)


async def run_sibling(address: str) -> dict:
    """Run the Node host against the mesh; its JSON line once it succeeded."""
    try:
        node = node_client()
    except NotPrepared as exc:
        not_prepared = str(exc)
    else:
        not_prepared = ""
    if not_prepared:  # the set-up's job, never a skip: the test fails saying what to run
        pytest.fail(not_prepared, pytrace=False)
    run = await asyncio.create_subprocess_exec(
        str(node.node), SCRIPT, "--address", address, "--timeout", "60", "--heartbeats", "1", cwd=ROOT,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(run.communicate(), timeout=90)
    finally:
        if run.returncode is None:
            run.kill()
            await run.wait()
    output = f"exit {run.returncode}\n--- stdout ---\n{out.decode()}\n--- stderr ---\n{err.decode()}"
    assert run.returncode == 0, output
    lines = out.decode().splitlines()
    assert len(lines) == 1, output  # exactly one JSON line
    result = json.loads(lines[0])
    assert result["ok"] is True, output
    return result


async def message_status(client, sender: str, message_id: str) -> inbox_pb.MessageStatus:
    key = inbox_pb.MessageKey(by_sender=inbox_pb.SenderKey(sender=sender, message_id=message_id))
    response = await client.inbox.GetMessageStatus(inbox_pb.GetMessageStatusRequest(key=key), metadata=ADMIN,
                                                   timeout=10)
    return response.status


async def test_a_node_host_plays_the_sibling_scenario_from_the_protos_alone(mesh, client):
    result = await run_sibling(mesh.address)
    parent, a, b = (result["agents"][role] for role in ("parent", "A", "B"))
    ids, secret = result["messages"], result["secret"]

    async def closed_record() -> Record | None:
        """The record once the stream's end is in it (recorded as the mesh finishes the detach it answered)."""
        record = await Record.read(client)
        return record if len(record.of(K.EVENT_KIND_UNSUBSCRIBED)) >= 3 else None

    record = await eventually(closed_record, message="UNSUBSCRIBED events of the three agents")

    # identities: a top-level parent, A and B its async children, in its scope; B was given nothing but a name
    top = await client.admin_agent(parent)
    assert (top.name, top.mode, top.parent_id, top.scope_id) == ("parent", reg_pb.AGENT_MODE_MAIN, "", parent)
    for name, child_id in (("A", a), ("B", b)):
        child = await client.admin_agent(child_id)
        assert (child.name, child.mode, child.parent_id, child.scope_id, child.depth) == (
            name, reg_pb.AGENT_MODE_ASYNC, parent, parent, 1)
        assert not child.metadata and secret not in (await client.admin_run(child_id=child_id)).task
    for agent_id in (parent, a, b):
        record.one(K.EVENT_KIND_AGENT_REGISTERED, agent_id=agent_id)
        # one Consume stream for all three, ended by one detach naming them all (a detach only ends what its
        # own stream delivers)
        subscribed = record.one(K.EVENT_KIND_SUBSCRIBED, agent_id=agent_id)
        unsubscribed = record.one(K.EVENT_KIND_UNSUBSCRIBED, agent_id=agent_id)
        assert unsubscribed.detail.startswith("detached") and unsubscribed.event_id > subscribed.event_id
    assert len({record.one(K.EVENT_KIND_SUBSCRIBED, agent_id=x).detail for x in (parent, a, b)}) == 1, \
        "all three subscribed from one connection"

    def once(message_id: str, sender: str, recipient: str) -> tuple[int, ev.Event]:
        """Stored, delivered and consumed exactly once, in that order, by the recipient; the id of its STORED
        event and its CONSUMED event."""
        match = {"message_id": message_id, "sender": sender, "recipient": recipient}
        stored = record.one(K.EVENT_KIND_MESSAGE_STORED, **match)
        delivered = record.one(K.EVENT_KIND_MESSAGE_DELIVERED, agent_id=recipient, **match)
        consumed = record.one(K.EVENT_KIND_MESSAGE_CONSUMED, agent_id=recipient, **match)
        assert delivered.detail == "attempt=1"
        assert stored.event_id < delivered.event_id < consumed.event_id
        return stored.event_id, consumed

    # A -> B: the secret, consumed by B
    _, b_took = once(ids["secret"], a, b)
    assert b_took.turn == 1
    to_b = await message_status(client, a, ids["secret"])
    assert to_b.state == inbox_pb.MESSAGE_STATE_CONSUMED and to_b.delivery_attempts == 1
    assert to_b.envelope.recipient == b and secret in to_b.envelope.content.text
    assert to_b.envelope.conversation_id == result["conversation_id"]

    # B -> A: the reply, sent after B consumed the secret, answering A's message, quoting the secret
    reply_stored, a_took = once(ids["reply"], b, a)
    assert a_took.turn == 1 and reply_stored > b_took.event_id
    assert record.one(K.EVENT_KIND_MESSAGE_STORED, message_id=ids["reply"]).in_reply_to == ids["secret"]
    reply = await message_status(client, b, ids["reply"])
    assert reply.state == inbox_pb.MESSAGE_STATE_CONSUMED
    assert (reply.envelope.sender, reply.envelope.kind, reply.envelope.in_reply_to) == (
        b, env_pb.MESSAGE_KIND_REPLY, ids["secret"])
    assert secret in reply.envelope.content.text

    # both report to the parent, which consumes both, one turn each
    report_a_stored, parent_took_a = once(ids["report_a"], a, parent)
    report_b_stored, parent_took_b = once(ids["report_b"], b, parent)
    assert report_a_stored > a_took.event_id, "A reported after it consumed B's reply"
    assert report_b_stored > b_took.event_id, "B reported after it consumed A's message"
    assert [e.turn for e in sorted((parent_took_a, parent_took_b), key=lambda e: e.event_id)] == [1, 2]
    for sender, key in ((a, "report_a"), (b, "report_b")):
        report = await message_status(client, sender, ids[key])
        assert report.state == inbox_pb.MESSAGE_STATE_CONSUMED
        assert report.envelope.kind == env_pb.MESSAGE_KIND_COMPLETION

    # nothing else was stored: the four messages are the whole exchange
    assert sorted(e.message_id for e in record.of(K.EVENT_KIND_MESSAGE_STORED)) == sorted(ids.values())

    # the refused call: A sending as B, decoded from grpc-status-details-bin; nothing of it stored
    error = result["error"]
    assert (error["code"], error["domain"], error["reason"]) == (
        grpc.StatusCode.PERMISSION_DENIED.value[0], "inboxmesh", "SENDER_MISMATCH")
    assert error["metadata"].get("claimed_sender") == b and error["metadata"].get("sender") == a
    assert not [e for e in record.events if e.message_id == error["message_id"]]
    for sender in (a, b):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await message_status(client, sender, error["message_id"])
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND

    assert result["heartbeats"] >= 1
