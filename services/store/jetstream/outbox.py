"""The IOA outbox on JetStream (base.OutboxStore): a stream of its own, one message an entry (the envelope,
with its sender and times in headers), numbered by the stream's sequence; the msgs bucket's key
`ob.<sender>.<message id>` names the entry a sender's message id has, so a retry finds it (no Nats-Msg-Id:
a message id whose entry was removed gets a new entry). The entries held are counted from the stream's
state at each add. Of two adds of one message id at the same moment, the one whose write of that key comes
first makes the entry (a create-if-absent, or a write at the revision it read); the other removes what
it published and answers the first one's number, as a retry's."""

from __future__ import annotations

import hashlib
import json

from nats.js.errors import KeyWrongLastSequenceError

from inboxmesh.common.v1 import envelope_pb2
from services.store.base import OutboxAdded, OutboxEntry
from services.store.jetstream import kv
from services.store.jetstream.connection import JetStreamConnection

SENDER, EXPIRES, ADDED = "inboxmesh-sender", "inboxmesh-expires-at-us", "inboxmesh-added-at-us"


def _key(sender: str, message_id: str) -> str:
    return "ob." + hashlib.sha256(f"{sender}\x00{message_id}".encode()).hexdigest()


class Outbox:
    def __init__(self, conn: JetStreamConnection):
        self.conn = conn

    async def add(self, entries: list[OutboxEntry], limit: int) -> list[OutboxAdded]:
        added: list[OutboxAdded] = []
        held: int | None = None
        for entry in entries:
            key = _key(entry.sender, entry.envelope.message_id)
            found = await kv.get(self.conn.msgs, key, kv.JSON)
            if found is not None and await self._entry(int(found.value)) is not None:
                added.append(OutboxAdded(int(found.value), new=False))  # a retry of a message the outbox holds
                continue
            if held is None:
                held = (await self.conn.js.stream_info(self.conn.outbox_stream)).state.messages
            if held >= limit:
                added.append(OutboxAdded(0, new=False))
                continue
            ack = await self.conn.js.publish(
                self.conn.outbox_subject, entry.envelope.SerializeToString(), stream=self.conn.outbox_stream,
                headers={SENDER: entry.sender, EXPIRES: str(entry.expires_at_us),
                         ADDED: str(entry.added_at_us)})
            if found is None:
                made = await kv.create(self.conn.msgs, key, ack.seq, kv.JSON)
            else:  # the key names an entry removed since (sent): this one takes its place
                made, = await kv.write_many(self.conn, "msgs", [(key, json.dumps(ack.seq).encode(), found.revision)])
            if made:
                added.append(OutboxAdded(ack.seq, new=True))
                held += 1
                continue
            # another add of this message id wrote the key first: its entry stands, this copy goes
            await self._delete(ack.seq)
            winner = await kv.get(self.conn.msgs, key, kv.JSON)
            added.append(OutboxAdded(int(winner.value) if winner is not None else ack.seq, new=False))
        return added

    async def entries(self, after: int, limit: int) -> list[OutboxEntry]:
        found, _ = await self.conn.direct_batch(self.conn.outbox_stream, self.conn.outbox_subject, after + 1, limit)
        return [self._of(msg) for msg in found]

    async def remove(self, entries: list[OutboxEntry]) -> None:
        """Each entry, and its message id's key while that names it (a removal made again, of an entry whose
        message id has a newer entry since, leaves the newer one's key: a retry still finds it)."""
        for entry in entries:
            await self._delete(entry.number)
            key = _key(entry.sender, entry.envelope.message_id)
            found = await kv.get(self.conn.msgs, key, kv.JSON)
            if found is None or int(found.value) != entry.number:
                continue
            try:
                await self.conn.msgs.delete(key, last=found.revision)
            except KeyWrongLastSequenceError:  # written since: it names another entry now
                pass

    async def _delete(self, number: int) -> None:
        await self.conn.nc.request(f"$JS.API.STREAM.MSG.DELETE.{self.conn.outbox_stream}",
                                   json.dumps({"seq": number, "no_erase": True}).encode(),
                                   timeout=self.conn.config.nats_timeout_s)  # already gone: nothing more

    async def _entry(self, number: int) -> OutboxEntry | None:
        found, _ = await self.conn.direct_batch(self.conn.outbox_stream, self.conn.outbox_subject, number, 1)
        entry = self._of(found[0]) if found else None
        return entry if entry is not None and entry.number == number else None

    @staticmethod
    def _of(msg) -> OutboxEntry:
        headers = msg.headers or {}
        return OutboxEntry(int(headers["Nats-Sequence"]), headers[SENDER],
                           envelope_pb2.Envelope.FromString(msg.data), int(headers[EXPIRES]), int(headers[ADDED]))
