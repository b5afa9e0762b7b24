"""Checks on caller-supplied strings and maps, with errors that name the field."""

from __future__ import annotations

import re
from collections.abc import Iterable

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason

_CONTROL = re.compile(r"[\x00-\x1f]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")
"""Control characters other than tab, newline and carriage return (allowed in free text: tasks, results)."""


def check_text(field: str, value: str, *, max_len: int, required: bool = False, lines: bool = False) -> None:
    """`value` is at most max_len characters without control characters (with `lines`: tabs and line breaks
    are allowed, as in free text)."""
    if required and not value:
        raise errors.InvalidArgument(f"{field} is required", reason=Reason.MISSING_FIELD, metadata={"field": field})
    if len(value) > max_len:
        raise errors.InvalidArgument(
            f"{field} is {len(value)} characters; at most {max_len} allowed",
            reason=Reason.FIELD_TOO_LONG,
            metadata={"field": field},
        )
    if (_CONTROL_BUT_LINES if lines else _CONTROL).search(value):
        raise errors.InvalidArgument(
            f"{field} contains control characters", reason=Reason.BAD_CHARACTERS, metadata={"field": field}
        )


def check_map(field: str, values: dict[str, str], *, max_entries: int = 64, max_value: int = 4096) -> None:
    if len(values) > max_entries:
        raise errors.InvalidArgument(
            f"{field} has {len(values)} entries; at most {max_entries} allowed",
            reason=Reason.TOO_MANY_ENTRIES,
            metadata={"field": field},
        )
    for key, value in values.items():
        check_text(f"{field} key", key, max_len=128, required=True)
        if len(value) > max_value:
            raise errors.InvalidArgument(
                f"{field}[{key!r}] is {len(value)} characters; at most {max_value} allowed",
                reason=Reason.FIELD_TOO_LONG,
                metadata={"field": field},
            )


MAX_STORED_INT = 2**63 - 1
"""The largest integer the stores keep (SQLite's INTEGER is signed 64-bit; protobuf's uint64 goes further)."""


def stored_int(value: int) -> int:
    """A uint64 from a request, within what the stores keep: a cursor or sequence past every stored one
    stays past every stored one."""
    return min(value, MAX_STORED_INT)


def page_size(requested: int, *, default: int = 100, maximum: int = 1000) -> int:
    return min(requested or default, maximum)


PAGE_BYTES = 2 * 1024 * 1024
"""A list page holds at most this many bytes of items (and at least one item), so that it fits every gRPC
client's default 4 MiB receive limit and the mesh's own send limit, however large the items are."""


def fitting(sizes: Iterable[int], max_bytes: int = PAGE_BYTES) -> int:
    """How many of the leading items (of these sizes) fit in max_bytes; at least one if there is one."""
    total = count = 0
    for size in sizes:
        total += size + 16  # a repeated field's tag and length, generously
        if total > max_bytes and count:
            break
        count += 1
    return count
