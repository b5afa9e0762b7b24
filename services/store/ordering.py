"""Appending several senders' groups of messages in order on a store whose appends may finish in any order
when run concurrently (JetStream: each append is several requests, and two running at once interleave).

A group waits only for the earlier groups it must follow: those sharing its sender (per-sender order) or
one of its recipients (per-inbox order: sequences in request order). Groups that share neither run at
once. A store that applies queued writes in call order within one commit (SQLite's writer) does not need
this: it appends them all in one write (InboxStore.append_groups). JetStream needs it only for the
groups it cannot append as one (InboxLog.append_many): a batch that names a sender's message id twice
or counts a conversation budget."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from services.store.base import AppendItem, SendOutcome

Append = Callable[[str, list[AppendItem], int], Awaitable[list[SendOutcome]]]
"""(sender id, items, at_us) -> outcomes: one group's append (InboxStore.append)."""


async def append_in_order(append: Append, groups: list[tuple[str, list[AppendItem]]],
                          at_us: int) -> list[list[SendOutcome]]:
    """Each group's append, started once every earlier group sharing its sender or a recipient has
    returned. A group whose predecessor failed fails too, so nothing is stored ahead of what it had to
    follow; the first failure is raised once every append has finished. Cancelled: the appends not
    finished are cancelled with it (nobody would await them)."""
    last: dict[tuple[str, str], asyncio.Task[list[SendOutcome]]] = {}
    tasks: list[asyncio.Task[list[SendOutcome]]] = []
    for sender, items in groups:
        keys = {("sender", sender), *(("inbox", item.envelope.recipient) for item in items)}
        after = {last[key] for key in keys if key in last}
        task = asyncio.ensure_future(_append_after(append, after, sender, items, at_us))
        for key in keys:
            last[key] = task
        tasks.append(task)
    try:
        await asyncio.wait(tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    failures = [task.exception() for task in tasks]  # every one retrieved, the first raised
    first = next((failure for failure in failures if failure is not None), None)
    if first is not None:
        raise first
    return [task.result() for task in tasks]


async def _append_after(append: Append, after: set[asyncio.Task[list[SendOutcome]]], sender: str,
                        items: list[AppendItem], at_us: int) -> list[SendOutcome]:
    for earlier in after:
        await earlier  # raises what it raised: this group must not overtake it
    return await append(sender, items, at_us)
