"""The short demo `inboxmesh up` runs: two sibling agents exchange a message
and a reply through their inboxes, and the event record shows each step."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from inboxmesh.client.mesh import AgentHandle, MeshClient
from inboxmesh.client.stream import InboxStream
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.registry.v1 import registry_pb2 as reg


async def _next_message(stream: InboxStream, stream_iter, agent: AgentHandle):
    async for item in stream_iter:
        consumed = await stream.consume(agent.agent_id, item.messages)
        if consumed:
            return consumed[0]
    raise RuntimeError(f"{agent}'s inbox stream ended before a message arrived")


def _events_line(events: list[ev.Event], message_id: str, t0: int) -> str:
    steps = [
        f"{ev.EventKind.Name(e.kind).removeprefix('EVENT_KIND_MESSAGE_').lower()} +{(e.at_us - t0) / 1000:.2f}ms"
        for e in events
        if e.message_id == message_id
    ]
    return ", ".join(steps)


async def run_demo(address: str, say: Callable[[str], None] = print,
                   tls: grpc.ChannelCredentials | None = None) -> dict[str, str]:
    """Run the exchange against the mesh at `address` (with TLS when given); returns the ids used."""
    async with MeshClient(address, tls=tls) as mesh:
        lead = await mesh.register("demo-lead")
        alice = await lead.spawn("alice", reg.AGENT_MODE_ASYNC)
        bob = await lead.spawn("bob", reg.AGENT_MODE_ASYNC)
        say(f"demo: registered demo-lead {lead.agent_id} with children alice {alice.agent_id} and bob {bob.agent_id}")
        alice_stream, bob_stream = InboxStream([alice]), InboxStream([bob])
        alice_iter, bob_iter = alice_stream.__aiter__(), bob_stream.__aiter__()
        try:
            receipt = await alice.send(bob.agent_id, "Hello Bob, this is Alice.")
            say(f"demo: alice -> bob {receipt.message_id}: {inbox_pb2.ReceiptStatus.Name(receipt.status)}"
                f" at seq {receipt.sequence}")
            got = await _next_message(bob_stream, bob_iter, bob)
            say(f"demo: bob consumed {got.message_id} from {got.sender}: {got.content.text!r}")
            reply = await bob.reply(got, "Hi Alice, Bob here. Got it.")
            say(f"demo: bob -> alice reply {reply.message_id}: {inbox_pb2.ReceiptStatus.Name(reply.status)}")
            answer = await _next_message(alice_stream, alice_iter, alice)
            say(f"demo: alice consumed {answer.message_id} (in reply to {answer.in_reply_to}): {answer.content.text!r}")
            both = await lead.events(agent_id=bob.agent_id) + await lead.events(agent_id=alice.agent_id)
            events = sorted({e.event_id: e for e in both}.values(), key=lambda e: e.event_id)
            t0 = min(e.at_us for e in events if e.message_id == receipt.message_id)
            say(f"demo: event record of {receipt.message_id}: {_events_line(events, receipt.message_id, t0)}")
            say(f"demo: event record of {reply.message_id}: {_events_line(events, reply.message_id, t0)}")
        finally:
            alice_stream.stop()
            bob_stream.stop()
            await asyncio.gather(alice_iter.aclose(), bob_iter.aclose())
        closed = await lead.close(reason="demo finished")
        say(f"demo: closed {len(closed.closed_agent_ids)} demo agents; the mesh keeps serving")
        return {"lead": lead.agent_id, "alice": alice.agent_id, "bob": bob.agent_id,
                "message": receipt.message_id, "reply": reply.message_id}
