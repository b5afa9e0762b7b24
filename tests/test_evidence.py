"""Evidence: spans joined by the trace context in the envelope, and the
event record (list and live watch)."""

import asyncio

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan

from inboxmesh.client import errors
from inboxmesh.client.tracing import trace_id_of
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from tests.fixtures import eventually
from tests.streams import Collector


async def test_send_enqueue_deliver_ack_form_one_trace(client, spans):
    lead = await client.register("lead")
    a, b = await lead.spawn("a"), await lead.spawn("b")
    sub = Collector(b)
    try:
        receipt = await a.send(b.agent_id, "traced")
        got = (await sub.wait_for(1))[0]
        await b.ack([got.sequence])
        trace_id = trace_id_of(got.trace.traceparent)
        assert trace_id, "the delivered envelope carries W3C trace context"

        def by_name():
            found: dict[str, list[ReadableSpan]] = {}
            for span in spans.get_finished_spans():
                if format(span.context.trace_id, "032x") == trace_id:
                    found.setdefault(span.name, []).append(span)
            return found

        found = await eventually(lambda: (lambda f: f if {"send", "enqueue", "deliver", "ack"} <= set(f) else None)(
            by_name()), message="send, enqueue, deliver and ack spans")
        send = found["send"][0]
        for name in ("enqueue", "deliver", "ack"):
            assert found[name][0].parent.span_id == send.context.span_id, f"{name} is a child of send"
        assert found["enqueue"][0].attributes["inboxmesh.receipt"] == "RECEIPT_STATUS_ACCEPTED"
        assert found["enqueue"][0].attributes["messaging.message.id"] == receipt.message_id
        events = await a.events(message_id=receipt.message_id)
        assert {e.trace_id for e in events} == {trace_id}
    finally:
        await sub.stop()


async def test_event_record_filters_and_watch(client):
    lead = await client.register("lead")
    a, b = await lead.spawn("a"), await lead.spawn("b")
    seen = []

    async def watch():
        async for event in lead.watch_events(agent_id=b.agent_id, from_now=True):
            seen.append(event)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.sleep(0.1)  # let the watch start at "now"
        receipt = await a.send(b.agent_id, "watched")
        await b.ack([receipt.sequence])
        await eventually(lambda: any(e.kind == ev.EVENT_KIND_MESSAGE_CONSUMED for e in seen))
        kinds = [e.kind for e in seen if e.message_id == receipt.message_id]
        assert kinds == [ev.EVENT_KIND_MESSAGE_SENT, ev.EVENT_KIND_MESSAGE_STORED, ev.EVENT_KIND_MESSAGE_CONSUMED]
        assert all(e.recipient == b.agent_id and e.sender == a.agent_id for e in seen)
        ids = [e.event_id for e in seen]
        assert ids == sorted(ids)
    finally:
        watcher.cancel()
    registered = await lead.events(agent_id=a.agent_id, kinds=[ev.EVENT_KIND_AGENT_REGISTERED])
    assert len(registered) == 1 and "name=a" in registered[0].detail
    page = await lead.events(agent_id=b.agent_id, limit=2)
    rest = await lead.events(agent_id=b.agent_id, after=page[-1].event_id)
    assert len(page) == 2 and rest and rest[0].event_id > page[-1].event_id


async def test_events_of_other_scopes_are_private(client):
    lead = await client.register("lead")
    stranger = await client.register("stranger")
    with pytest.raises(errors.PermissionDenied):
        await stranger.events(agent_id=lead.agent_id)
    assert all(e.agent_id == stranger.agent_id or e.sender == stranger.agent_id for e in await stranger.events())
    admin_view = await client.admin_events(agent_id=lead.agent_id)
    assert admin_view and admin_view[0].kind == ev.EVENT_KIND_AGENT_REGISTERED


async def test_runtime_events_are_recorded_for_ones_own_agent_only(client):
    lead = await client.register("lead")
    child = await lead.spawn("child")
    request = ev.RecordEventsRequest(events=[
        ev.Event(kind=ev.EVENT_KIND_TURN_STARTED, turn=1),
        ev.Event(kind=ev.EVENT_KIND_TURN_ENDED, turn=1, detail="2 tool calls"),
    ])
    response = await client.events.RecordEvents(request, metadata=child.metadata, timeout=5)
    assert len(response.event_ids) == 2 and response.event_ids[1] == response.event_ids[0] + 1
    recorded = await lead.events(agent_id=child.agent_id, kinds=[ev.EVENT_KIND_TURN_STARTED, ev.EVENT_KIND_TURN_ENDED])
    assert [(e.event_id, e.kind, e.turn, e.agent_id) for e in recorded] == [
        (response.event_ids[0], ev.EVENT_KIND_TURN_STARTED, 1, child.agent_id),
        (response.event_ids[1], ev.EVENT_KIND_TURN_ENDED, 1, child.agent_id)]
    for bad, code in [
        (ev.Event(kind=ev.EVENT_KIND_MESSAGE_CONSUMED), grpc.StatusCode.INVALID_ARGUMENT),
        (ev.Event(kind=ev.EVENT_KIND_AGENT_WOKEN, agent_id=lead.agent_id), grpc.StatusCode.PERMISSION_DENIED),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.events.RecordEvents(ev.RecordEventsRequest(events=[bad]), metadata=child.metadata, timeout=5)
        assert caught.value.code() == code


async def test_consumption_records_the_turn_and_replies_record_what_they_answer(client):
    lead = await client.register("lead")
    a, b = await lead.spawn("a"), await lead.spawn("b")
    question = await a.send(b.agent_id, "question?", conversation_id="c-7")
    await b.client.inbox.Ack(pb.AckRequest(sequences=[question.sequence], turn=3), metadata=b.metadata, timeout=5)
    got = (await b.inbox_status(question.sequence)).envelope
    answer = await b.reply(got, "answer!")
    consumed = await lead.events(message_id=question.message_id, sender=a.agent_id,
                                 kinds=[ev.EVENT_KIND_MESSAGE_CONSUMED])
    assert [e.turn for e in consumed] == [3]
    stored = await lead.events(message_id=answer.message_id, sender=b.agent_id, kinds=[ev.EVENT_KIND_MESSAGE_STORED])
    assert [(e.in_reply_to, e.conversation_id) for e in stored] == [(question.message_id, "c-7")]


async def test_every_message_event_carries_the_conversation_and_what_it_answers(client):
    """events.proto: message events carry conversation_id and in_reply_to, delivered and consumed too
    (by both delivery paths: from memory and from the store)."""
    lead = await client.register("lead")
    a, b = await lead.spawn("a"), await lead.spawn("b")
    question = await a.send(b.agent_id, "question?", conversation_id="c-9")
    early = Collector(b)
    try:  # delivered straight after the append
        got = (await early.wait_for(1))[0]
    finally:
        await early.stop()
    answer = await b.reply(got, "answer!", conversation_id="c-9")
    late = Collector(a)  # subscribes after the append: delivered from the store
    try:
        reply = (await late.wait_for(1))[0]
        await a.ack([reply.sequence])
    finally:
        await late.stop()
    await b.ack([got.sequence])
    wanted = {ev.EVENT_KIND_MESSAGE_DELIVERED, ev.EVENT_KIND_MESSAGE_CONSUMED}

    async def recorded(message_id, sender, expected):
        found = await lead.events(message_id=message_id, sender=sender, kinds=sorted(wanted))
        return {(e.kind, e.conversation_id, e.in_reply_to) for e in found} == expected

    await eventually(lambda: recorded(question.message_id, a.agent_id, {(k, "c-9", "") for k in wanted}),
                     message="the question's delivered and consumed events with its conversation")
    await eventually(lambda: recorded(answer.message_id, b.agent_id, {(k, "c-9", question.message_id)
                                                                      for k in wanted}),
                     message="the answer's delivered and consumed events with its conversation and question")


async def test_event_pages_and_watch_answers_stay_under_2_mib_and_page_to_the_end(client):
    """Runtime events carry up to 4,096 characters of detail: 1,000 of them are 4 MiB, over a default gRPC
    client's receive limit. A ListEvents page and a WatchEvents answer stop at 2 MiB; paging after the last
    event_id until an empty page reads every event, in order."""
    lead = await client.register("lead")
    child = await lead.spawn("child")
    request = ev.RecordEventsRequest(events=[
        ev.Event(kind=ev.EVENT_KIND_TURN_ENDED, turn=n, detail=f"{n:04d}" + "x" * 4092) for n in range(1000)])
    ids = (await client.events.RecordEvents(request, metadata=child.metadata, timeout=30)).event_ids
    flt = ev.EventFilter(agent_id=child.agent_id, kinds=[ev.EVENT_KIND_TURN_ENDED])
    pages, after = [], 0
    while True:
        page = await client.events.ListEvents(ev.ListEventsRequest(filter=flt, after_event_id=after, limit=1000),
                                              metadata=lead.metadata, timeout=30)
        if not page.events:
            break
        assert page.ByteSize() <= 2 * 1024 * 1024 + 16 * 1024, page.ByteSize()
        pages.append(len(page.events))
        after = page.events[-1].event_id
    assert len(pages) >= 2 and pages[0] < 1000 and sum(pages) == 1000, pages
    answers, seen = [], []
    watch = client.events.WatchEvents(ev.WatchEventsRequest(filter=flt), metadata=lead.metadata)
    try:
        async for answer in watch:
            answers.append(answer.ByteSize())
            seen += [e.event_id for e in answer.events]
            if len(seen) >= 1000:
                break
    finally:
        watch.cancel()
    assert seen == list(ids) and max(answers) <= 2 * 1024 * 1024 + 16 * 1024, answers
