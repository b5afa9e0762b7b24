"""SharedReads (services/store/jetstream/shared_reads.py): every caller gets a read that began after it
asked, and callers that come while a read is in flight share the next one."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.store.jetstream.shared_reads import BatchedReads, SharedReads

pytestmark = pytest.mark.store_independent


class Source:
    """A value that changes, read slowly: each read returns the value as it was when the read began."""

    def __init__(self) -> None:
        self.value = 0
        self.started: list[int] = []
        self.gate = asyncio.Event()
        self.fail_next = False

    async def read(self, key: str) -> tuple[str, int]:
        seen = self.value
        self.started.append(seen)
        await self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("the read failed")
        return key, seen


async def _turns() -> None:
    """Let every task ready to run take its steps."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_lone_call_reads_at_once():
    source = Source()
    source.gate.set()
    reads = SharedReads(source.read)
    assert await reads.get("a") == ("a", 0)
    assert reads.reads == 1


async def test_calls_during_a_read_share_the_next_one_which_sees_what_changed_before_they_asked():
    source = Source()
    seen: list[tuple[str, int]] = []
    reads = SharedReads(source.read, seen.append)
    first = asyncio.ensure_future(reads.get("a"))
    await _turns()
    assert source.started == [0]
    source.value = 1  # changed after the first read began: the later callers must see it
    later = [asyncio.ensure_future(reads.get("a")) for _ in range(10)]
    other = asyncio.ensure_future(reads.get("b"))  # another key is not held up by a's read
    await _turns()
    assert source.started == [0, 1], "b's read started at once; a's second waits for the first"
    source.gate.set()
    assert await first == ("a", 0)
    assert [await f for f in later] == [("a", 1)] * 10
    assert await other == ("b", 1)
    assert reads.reads == 3 and sorted(seen) == [("a", 0), ("a", 1), ("b", 1)]


async def test_a_failed_read_fails_its_callers_only():
    source = Source()
    reads = SharedReads(source.read)
    source.fail_next = True
    first = asyncio.ensure_future(reads.get("a"))
    await _turns()
    second = asyncio.ensure_future(reads.get("a"))
    source.gate.set()
    with pytest.raises(ConnectionError):
        await first
    assert await second == ("a", 0)
    assert await reads.get("a") == ("a", 0)


async def test_a_caller_that_gives_up_leaves_the_read_to_the_others():
    source = Source()
    reads = SharedReads(source.read)
    first = asyncio.ensure_future(reads.get("a"))
    await _turns()
    waiting = [asyncio.ensure_future(reads.get("a")) for _ in range(2)]
    await _turns()
    waiting[0].cancel()
    source.gate.set()
    assert await first == ("a", 0)
    assert await waiting[1] == ("a", 0)
    assert waiting[0].cancelled()


class ManySource(Source):
    """Source read a batch of keys at a time (BatchedReads): the batches asked for, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[str]] = []

    async def read_many(self, keys: list[str]) -> dict[str, tuple[str, int]]:
        self.batches.append(keys)
        found = {}
        for key in keys:
            if key != "absent":
                found[key] = await self.read(key)
        return found


async def test_keys_asked_for_during_a_batched_read_go_together_in_the_next():
    source = ManySource()
    reads = BatchedReads(source.read_many, ("none", -1))
    first = asyncio.ensure_future(reads.get("a"))
    await _turns()
    assert source.batches == [["a"]], "a lone call reads at once"
    source.value = 1  # changed after the first read began: the later callers must see it
    later = [asyncio.ensure_future(reads.get(key)) for key in ("b", "c", "a", "b", "absent")]
    await _turns()
    assert source.batches == [["a"]], "the others wait for the read in flight"
    source.gate.set()
    assert await first == ("a", 0)
    assert [await f for f in later] == [("b", 1), ("c", 1), ("a", 1), ("b", 1), ("none", -1)]
    assert source.batches == [["a"], ["b", "c", "a", "absent"]] and reads.reads == 2


async def test_a_failed_batched_read_fails_its_callers_only():
    source = ManySource()
    reads = BatchedReads(source.read_many, ("none", -1))
    source.fail_next = True
    first = asyncio.ensure_future(reads.get("a"))
    await _turns()
    second = asyncio.ensure_future(reads.get("b"))
    source.gate.set()
    with pytest.raises(ConnectionError):
        await first
    assert await second == ("b", 0)


@pytest.mark.parametrize("batched", [False, True])
async def test_a_caller_naming_a_moment_takes_a_read_begun_since_in_flight_or_done(batched):
    """`since`: a read of the key begun at that moment or later serves the caller as it is (in flight: its
    answer; done: its value, without a new read); one begun before does not, nor does any without it."""
    source = ManySource()
    reads: SharedReads[tuple[str, int]] | BatchedReads[tuple[str, int]] = (
        BatchedReads(source.read_many, ("none", -1), recent=True) if batched else SharedReads(source.read, recent=True))
    before = time.monotonic()
    first = asyncio.ensure_future(reads.get("a"))
    await _turns()
    source.value = 1
    joined = asyncio.ensure_future(reads.get("a", since=before))  # the read in flight began since: taken
    fresh = asyncio.ensure_future(reads.get("a"))  # no moment: the next read
    source.gate.set()
    assert await first == ("a", 0) and await joined == ("a", 0)
    assert await fresh == ("a", 1)
    assert reads.reads == 2
    assert await reads.get("a", since=before) == ("a", 1) and reads.reads == 2, "the last read done: no new one"
    source.value = 2
    assert await reads.get("a", since=time.monotonic()) == ("a", 2), "every read done began before: a new one"
    assert reads.reads == 3
