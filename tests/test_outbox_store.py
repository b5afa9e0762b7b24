"""The IOA outbox in the store (base.OutboxStore), on each store: entries numbered in the order added, a
retry of a sender's message id finds its entry, a limit refuses past it, removal, and nothing lost across
a restart of the mesh."""

from inboxmesh.common.v1 import envelope_pb2
from services.server import Mesh
from services.store.base import OutboxEntry


def _entry(sender: str, message_id: str, at: int = 1_000) -> OutboxEntry:
    env = envelope_pb2.Envelope(message_id=message_id, recipient="ioa:far/agt_y", sender=sender,
                                content=envelope_pb2.Content(text=message_id))
    return OutboxEntry(0, sender, env, expires_at_us=at + 10**9, added_at_us=at)


async def test_entries_in_order_retries_found_a_limit_and_a_restart(mesh_config):
    async with Mesh(mesh_config) as mesh:
        store = mesh.store
        numbers = await store.outbox_add([_entry("agt_a", "m1"), _entry("agt_a", "m2"), _entry("agt_b", "m1")], 3)
        assert all(numbers) and numbers == sorted(numbers) and len(set(numbers)) == 3
        again = await store.outbox_add([_entry("agt_a", "m2"), _entry("agt_a", "m3")], 3)
        assert again == [numbers[1], 0], "a retry finds its entry; past the limit, refused"
        listed = await store.outbox_list(0, 10)
        assert [(e.number, e.sender, e.envelope.message_id) for e in listed] == [
            (numbers[0], "agt_a", "m1"), (numbers[1], "agt_a", "m2"), (numbers[2], "agt_b", "m1")]
        assert listed[0].envelope.recipient == "ioa:far/agt_y" and listed[0].expires_at_us == 1_000 + 10**9
        assert [e.number for e in await store.outbox_list(numbers[0], 1)] == [numbers[1]]
        await store.outbox_remove([listed[0]])
        await store.outbox_remove([listed[0]])  # gone already: no error
    async with Mesh(mesh_config) as mesh:  # the same store again
        left = await mesh.store.outbox_list(0, 10)
        assert [e.number for e in left] == numbers[1:]
        later = await mesh.store.outbox_add([_entry("agt_a", "m1"), _entry("agt_a", "m2")], 3)
        assert later[1] == numbers[1] and later[0] > numbers[2], "a removed entry's id is a new entry"
