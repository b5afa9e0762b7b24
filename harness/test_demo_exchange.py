"""The exchange `inboxmesh up` demonstrates, proven from the event record:
alice's message reaches bob's inbox, bob consumes it and replies, alice
consumes the reply; each step is a recorded event, in order, once."""

from inboxmesh.cli.demo import run_demo
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb

SENT, STORED, DELIVERED, CONSUMED = (ev.EVENT_KIND_MESSAGE_SENT, ev.EVENT_KIND_MESSAGE_STORED,
                                     ev.EVENT_KIND_MESSAGE_DELIVERED, ev.EVENT_KIND_MESSAGE_CONSUMED)


async def test_demo_exchange_is_proven_by_the_event_record(mesh, client):
    lines: list[str] = []
    ids = await run_demo(mesh.address, say=lines.append)
    events = await client.admin_events(after=0, limit=1000)
    by_message: dict[str, list[ev.Event]] = {}
    for event in events:
        by_message.setdefault(event.message_id, []).append(event)

    message = by_message[ids["message"]]
    assert [e.kind for e in message] == [SENT, STORED, DELIVERED, CONSUMED]
    assert {(e.sender, e.recipient) for e in message} == {(ids["alice"], ids["bob"])}
    assert message[0].detail == "accepted"

    reply = by_message[ids["reply"]]
    assert [e.kind for e in reply] == [SENT, STORED, DELIVERED, CONSUMED]
    assert {(e.sender, e.recipient) for e in reply} == {(ids["bob"], ids["alice"])}
    # bob consumed alice's message before he replied, and alice consumed the reply after that
    assert message[-1].event_id < reply[0].event_id < reply[-1].event_id

    status = await client.inbox.GetMessageStatus(
        pb.GetMessageStatusRequest(key=pb.MessageKey(by_sender=pb.SenderKey(sender=ids["bob"],
                                                                            message_id=ids["reply"]))),
        metadata=(("authorization", "Bearer test-admin-token"),), timeout=5)
    assert status.status.state == pb.MESSAGE_STATE_CONSUMED
    assert status.status.envelope.in_reply_to == ids["message"]
    closed = [e.agent_id for e in events if e.kind == ev.EVENT_KIND_AGENT_CLOSED]
    assert set(closed) == {ids["lead"], ids["alice"], ids["bob"]}
    assert any("bob consumed" in line for line in lines)
