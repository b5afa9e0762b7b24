"""The IOA outbox in the store (base.OutboxStore), on each store: entries numbered in the order added, a
retry of a sender's message id finds its entry, a limit refuses past it, removal, and nothing lost across
a restart of the mesh."""

import asyncio

from inboxmesh.common.v1 import envelope_pb2
from services.server import Mesh
from services.store.base import OutboxAdded, OutboxEntry


def _entry(sender: str, message_id: str, at: int = 1_000) -> OutboxEntry:
    env = envelope_pb2.Envelope(message_id=message_id, recipient="ioa:far/agt_y", sender=sender,
                                content=envelope_pb2.Content(text=message_id))
    return OutboxEntry(0, sender, env, expires_at_us=at + 10**9, added_at_us=at)


async def test_entries_in_order_retries_found_a_limit_and_a_restart(mesh_config):
    async with Mesh(mesh_config) as mesh:
        store = mesh.store
        added = await store.outbox_add([_entry("agt_a", "m1"), _entry("agt_a", "m2"), _entry("agt_b", "m1")], 3)
        numbers = [a.number for a in added]
        assert all(numbers) and numbers == sorted(numbers) and len(set(numbers)) == 3
        assert all(a.new for a in added)
        again = await store.outbox_add([_entry("agt_a", "m2"), _entry("agt_a", "m3")], 3)
        assert again == [OutboxAdded(numbers[1], new=False), OutboxAdded(0, new=False)], (
            "a retry finds its entry; past the limit, refused")
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
        assert later[1] == OutboxAdded(numbers[1], new=False)
        assert later[0].new and later[0].number > numbers[2], "a removed entry's id is a new entry"


async def test_adds_of_one_message_id_at_the_same_moment_make_one_entry(mesh_config):
    """Two sends of one message id at once (a client's retry racing its first try): exactly one makes the
    entry, both get its number, and the outbox holds it once."""
    async with Mesh(mesh_config) as mesh:
        store = mesh.store
        for round_ in range(5):
            first, second = await asyncio.gather(store.outbox_add([_entry("agt_a", f"same{round_}")], 100),
                                                 store.outbox_add([_entry("agt_a", f"same{round_}")], 100))
            assert first[0].number == second[0].number != 0
            assert [first[0].new, second[0].new].count(True) == 1, (first, second)
        listed = await store.outbox_list(0, 100)
        assert sorted(e.envelope.message_id for e in listed) == [f"same{r}" for r in range(5)]


async def test_a_removal_made_again_leaves_the_key_of_a_newer_entry_of_the_same_message_id(mesh_config):
    """An entry removed (sent), its message id added again (a new entry), then the first removal made again
    (a pump that retried it): a retry of the message id still finds the newer entry, and makes no third."""
    async with Mesh(mesh_config) as mesh:
        store = mesh.store
        first, = await store.outbox_add([_entry("agt_a", "m1")], 10)
        old = (await store.outbox_list(0, 10))[0]
        await store.outbox_remove([old])
        second, = await store.outbox_add([_entry("agt_a", "m1")], 10)
        assert second.new and second.number > first.number
        await store.outbox_remove([old])  # again
        again, = await store.outbox_add([_entry("agt_a", "m1")], 10)
        assert again == OutboxAdded(second.number, new=False)
        assert [e.number for e in await store.outbox_list(0, 10)] == [second.number]
