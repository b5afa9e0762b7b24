"""The answers a Consume stream waits for, and what an ack won: the bookkeeping under
`inboxmesh.client.stream.InboxStream`'s `ack`, `ack_many`, `consume` and `consume_many`.

Every request on the stream that has an answer of its own (an ack, an ack_many; an attach or detach
names the same ids) carries a `request_id`; `Answers` keeps a future per id until the mesh answers it
or the stream is lost. The rest is pure: how an ack_many is split across requests, and which messages
an ack won (the ones to inject into the agent's context, each exactly once).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from inboxmesh.client import errors
from inboxmesh.client.status import ERROR_OF
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.inbox.v1 import inbox_pb2

if TYPE_CHECKING:
    from inboxmesh.client.mesh import AgentHandle

MAX_ACK_SEQUENCES = 10_000
"""The most sequences the mesh takes in one ack or ack_many (docs/delivery-contract.md); consume_many
splits across requests beyond it."""
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass
class ConsumedMany:
    """What one `consume_many` did, per agent."""

    messages: dict[str, list[envelope_pb2.Envelope]] = field(default_factory=dict)
    """The messages each agent's ack won (inject exactly these), in order; an agent whose ack was answered
    is here even when it won nothing."""
    refused: dict[str, errors.MeshError] = field(default_factory=dict)
    """Agents whose ack the mesh refused (nothing of it recorded), with the refusal."""


class Answers:
    """The futures of the requests written on one InboxStream and not answered yet, by request_id (ids are
    unique per stream, across its reconnects)."""

    def __init__(self) -> None:
        self._waiting: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    def expect(self, request_id: int) -> asyncio.Future:
        """A future for the answer to the request `request_id`, about to be written."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        return future

    def answer(self, acked: inbox_pb2.AckResponse) -> None:
        """Hand the answer of one ack to the consume() waiting for it."""
        future = self._waiting.pop(acked.request_id, None)
        if future is None or future.done():
            return
        if acked.HasField("error"):
            future.set_exception(ack_error(acked))
        else:
            future.set_result(list(acked.results))

    def answer_many(self, acked: inbox_pb2.AckManyResponse) -> None:
        """Hand the answer of one ack_many to the ack_many() waiting for it: the AckManyResponse, or the
        refusal of the request as a whole."""
        future = self._waiting.pop(acked.request_id, None)
        if future is None or future.done():
            return
        if acked.HasField("error"):
            future.set_exception(refusal(acked.error))
        else:
            future.set_result(acked)

    def fail_all(self, failure: errors.MeshError) -> None:
        """No answer comes any more (the call was lost): every request waiting fails with `failure`."""
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(failure)
        self._waiting.clear()

    def forget(self, request_id: int, future: asyncio.Future) -> None:
        """A request that was never written: nobody will await its future (the stream's end may already
        have failed it)."""
        self._waiting.pop(request_id, None)
        if not future.done():
            future.cancel()
        elif not future.cancelled():
            future.exception()  # retrieved: it is reported as the write's failure instead


def ack_chunks(acks: Mapping[str, list[int]]) -> list[list[str]]:
    """The agents of an ack_many, split into requests of at most MAX_ACK_SEQUENCES sequences each (an
    agent with more than that alone in its own, which the mesh refuses)."""
    chunks: list[list[str]] = [[]]
    total = 0
    for agent_id, sequences in acks.items():
        if chunks[-1] and total + len(sequences) > MAX_ACK_SEQUENCES:
            chunks.append([])
            total = 0
        chunks[-1].append(agent_id)
        total += len(sequences)
    return [chunk for chunk in chunks if chunk]


def addressed_to(agent_id: str, messages: Iterable[envelope_pb2.Envelope]) -> list[envelope_pb2.Envelope]:
    """The messages of `agent_id`'s inbox among `messages`: the only ones its ack may name."""
    return [m for m in messages if m.recipient == agent_id]


def won(mine: list[envelope_pb2.Envelope], results: Iterable[inbox_pb2.AckResult],
        taken: set[tuple[str, str]] | None) -> list[envelope_pb2.Envelope]:
    """Of the messages one agent acked, those the ack won, in order. Dead-lettered ones are left out, and
    so are already-consumed ones, except when `taken` is given ((sender, message_id) of what the agent
    already took in): an already-consumed message the agent has not taken in was consumed by an earlier
    ack of its own whose answer was lost, so it is the agent's now."""
    results = list(results)
    consumed = {r.sequence for r in results if r.status == inbox_pb2.ACK_STATUS_CONSUMED}
    if taken is None:
        return [m for m in mine if m.sequence in consumed]
    consumed |= {r.sequence for r in results if r.status == inbox_pb2.ACK_STATUS_ALREADY_CONSUMED}
    return [m for m in mine if m.sequence in consumed and (m.sender, m.message_id) not in taken]


def claimed(answer: list[inbox_pb2.AckResult] | inbox_pb2.AckManyResponse
            ) -> list[inbox_pb2.AckResult] | inbox_pb2.AckManyResponse:
    """The answer to an ack written again after the mesh could not process an earlier attempt of it: what
    it finds ALREADY_CONSUMED that attempt consumed (only the agent's own stream acks its inbox, and the
    attempt named the same sequences), so it is CONSUMED by this ack (changed in place)."""
    lists = [answer] if isinstance(answer, list) else [list(acked.results) for acked in answer.acks]
    for results in lists:
        for result in results:
            if result.status == inbox_pb2.ACK_STATUS_ALREADY_CONSUMED:
                result.status = inbox_pb2.ACK_STATUS_CONSUMED
    return answer


def ack_error(acked: inbox_pb2.AckResponse) -> errors.MeshError:
    """The MeshError for an ack the mesh refused on a Consume stream, as the
    unary Ack would have raised it."""
    return refusal(acked.error)


def refusal(error: inbox_pb2.AckError) -> errors.MeshError:
    """The MeshError for a refusal answered on a Consume stream (an ack's, an attach's, a detach's)."""
    code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
    return ERROR_OF.get(code, errors.MeshError)(error.message or code.name,
                                                reason=errors.reason_of(error.reason or code.name),
                                                metadata=dict(error.metadata))


async def consume(agent: AgentHandle, messages: list[envelope_pb2.Envelope]) -> list[envelope_pb2.Envelope]:
    """Like InboxStream.consume, with the unary Ack call (no stream needed)."""
    mine = addressed_to(agent.agent_id, messages)
    if not mine:
        return []
    return won(mine, await agent.ack(m.sequence for m in mine), None)
