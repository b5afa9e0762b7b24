"""Ordering properties under concurrency: FIFO per sender-recipient pair,
one total order per inbox, no gaps, no duplicates."""

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inboxmesh.client.mesh import envelope
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from tests.fixtures import contiguous_sequences
from tests.streams import Collector

plans = st.lists(
    st.tuples(st.integers(1, 40), st.sampled_from(["unary", "batch", "stream"]), st.integers(1, 8)),
    min_size=1,
    max_size=5,
)


async def _send_all(sender, recipient_id, count, how, batch):
    texts = [f"{sender.agent_id}:{i}" for i in range(count)]
    sequences = []
    if how == "unary":
        for text in texts:
            sequences.append((await sender.send(recipient_id, text)).sequence)
    elif how == "batch":
        for start in range(0, count, batch):
            receipts = await sender.send_batch([envelope(recipient_id, t) for t in texts[start:start + batch]])
            sequences += [r.sequence for r in receipts]
    else:
        call = sender.send_stream()
        for start in range(0, count, batch):
            await call.write(pb.SendRequest(messages=[envelope(recipient_id, t) for t in texts[start:start + batch]]))
        await call.done_writing()
        async for response in call:
            sequences += [r.sequence for r in response.receipts]
    return texts, sequences


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans, subscribe_first=st.booleans())
async def test_concurrent_senders_keep_pair_fifo_and_one_inbox_order(client, plan, subscribe_first):
    lead = await client.register("lead")
    recipient = await lead.spawn("recipient", inbox_capacity=1000)
    senders = [await lead.spawn(f"s{i}") for i in range(len(plan))]
    sub = Collector(recipient, auto_ack=True) if subscribe_first else None
    try:
        results = await asyncio.gather(*(
            _send_all(s, recipient.agent_id, count, how, batch) for s, (count, how, batch) in zip(senders, plan)))
        total = sum(count for count, _, _ in plan)
        all_sequences = sorted(seq for _, seqs in results for seq in seqs)
        assert len(set(all_sequences)) == total, "sequences must be unique"
        if contiguous_sequences():
            assert all_sequences == list(range(1, total + 1)), "sequences must be contiguous"
        for _, sequences in results:
            assert sequences == sorted(sequences), "a sender's messages must keep their order in the inbox"
        sub = sub or Collector(recipient, auto_ack=True)
        got = await sub.wait_for(total, timeout=30)
        assert [m.sequence for m in got] == all_sequences, "delivery follows the inbox order"
        for sender, (texts, _) in zip(senders, results):
            assert [m.content.text for m in got if m.sender == sender.agent_id] == texts
        assert len({m.message_id for m in got}) == total
    finally:
        if sub is not None:
            await sub.stop()
        await lead.close()


async def test_one_batch_to_several_recipients_keeps_each_pairs_order_and_answers_in_request_order(client):
    """A batch's messages to different recipients may be stored at the same time (JetStream does): each
    recipient's stay in batch order, the receipts come in request order, and a message id named twice in
    one batch is stored once, the first time it is named."""
    lead = await client.register("lead")
    kids = [await lead.spawn(f"k{i}") for i in range(4)]
    batch = [envelope(kids[i % 4].agent_id, f"{i}", message_id=f"m{i}") for i in range(40)]
    receipts = await lead.send_batch(batch)
    assert [r.message_id for r in receipts] == [e.message_id for e in batch]
    assert {r.status for r in receipts} == {pb.RECEIPT_STATUS_ACCEPTED}
    for kid in kids:
        mine = [r.sequence for r, e in zip(receipts, batch) if e.recipient == kid.agent_id]
        assert mine == sorted(mine) and len(set(mine)) == 10, f"{kid.agent_id}'s messages in batch order"
    twice = await lead.send_batch([envelope(kids[0].agent_id, "first", message_id="same"),
                                   envelope(kids[1].agent_id, "second", message_id="same")])
    assert [r.status for r in twice] == [pb.RECEIPT_STATUS_ACCEPTED, pb.RECEIPT_STATUS_DUPLICATE]
