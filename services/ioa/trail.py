"""The loop guard's trail across IOA (docs/ioa.md, "Loops").

A message's `trail` lists the agents its causal chain passed through. Inside
one mesh the entries are local agent ids; on the network they must stay
unique across meshes, so the relay carries them in the `inboxmesh-trail`
header in network form: a local id `X` of node `N` is `ioa:N/X`, an entry
that already is an IOA address (a peer's agent, met on an earlier crossing)
stays as it is. The receiving node turns its own entries (`ioa:<it>/Y`)
back into local ids `Y`, so its loop guard counts a local agent's visits
whichever way the chain went round.

The header is a JSON list of strings, bounded: at most `max_entries`
entries (the mesh's hop limit) of 1 to MAX_ENTRY_CHARS characters each, in
network form, and max_header_chars() in all. A trail over the bounds is
refused (TrailRefused, which the relay answers with
NOT_PERMITTED), never cut.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from services.store.base import IOA_PREFIX

HEADER = "inboxmesh-trail"
MAX_ENTRY_CHARS = 256
"""Longest trail entry in network form (`ioa:<node>/<agent>`)."""


class TrailRefused(ValueError):
    """The trail is over the header's bounds or not in its format; the
    message says which without echoing the trail."""


def _qualified(entry: str, node: str) -> str:
    return entry if not entry or entry.startswith(IOA_PREFIX) else f"{IOA_PREFIX}{node}/{entry}"


def max_header_chars(max_entries: int) -> int:
    """Longest header value: every entry at its longest, quoted, with commas and brackets."""
    return max_entries * (MAX_ENTRY_CHARS + 3) + 2


def _check(entries: Sequence[str], max_entries: int, whose: str) -> None:
    if len(entries) > max_entries:
        raise TrailRefused(f"loop guard: {whose} trail is {len(entries)} agents long; at most {max_entries} cross IOA")
    for index, entry in enumerate(entries):
        if not entry or len(entry) > MAX_ENTRY_CHARS:
            raise TrailRefused(f"loop guard: entry {index} of {whose} trail is {len(entry)} characters; IOA carries"
                               f" 1 to {MAX_ENTRY_CHARS}")


def encode(trail: Sequence[str], *, node: str, sender: str, max_entries: int) -> str:
    """The header value for a message that local agent `sender` of node
    `node` sends with `trail`. The trail ends with the sender (the relay adds
    it when the mesh has not)."""
    entries = list(trail)
    if not entries or entries[-1] != sender:
        entries.append(sender)
    entries = [_qualified(e, node) for e in entries]
    _check(entries, max_entries, "the message's")
    value = json.dumps(entries, separators=(",", ":"), ensure_ascii=False)
    if len(value) > max_header_chars(max_entries):  # entries full of characters JSON escapes
        raise TrailRefused(f"loop guard: the message's trail is {len(value)} characters as a header; at most"
                           f" {max_header_chars(max_entries)}")
    return value


def decode(value: str | None, *, node: str, sender: tuple[str, str], max_entries: int) -> list[str]:
    """The local trail of a message node `node` received from `sender`
    (node, agent) with header `value` (None: a sender that carries no
    trail, such as a node that is not an inboxmesh relay). It ends with the
    sender's entry."""
    entries: list[str] = []
    if value is not None:
        if len(value) > max_header_chars(max_entries):
            raise TrailRefused(f"loop guard: the {HEADER} header is {len(value)} characters; at most {max_entries}"
                               f" entries of {MAX_ENTRY_CHARS} characters cross IOA")
        try:
            written = json.loads(value)
        except ValueError:
            written = None
        if not isinstance(written, list) or not all(isinstance(e, str) for e in written):
            raise TrailRefused(f"loop guard: the {HEADER} header is not a JSON list of strings")
        # plain ids from the sending node are its local ids (an inboxmesh relay never sends them)
        entries = [_qualified(e, sender[0]) for e in written]
    sender_entry = f"{IOA_PREFIX}{sender[0]}/{sender[1]}"
    if not entries or entries[-1] != sender_entry:
        entries.append(sender_entry)
    _check(entries, max_entries, "the received message's")
    own = f"{IOA_PREFIX}{node}/"
    return [e[len(own):] if e.startswith(own) and len(e) > len(own) else e for e in entries]
