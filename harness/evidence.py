"""Reading a scenario's evidence back from the mesh: the event record and
message states, with an operator's view (admin token)."""

from __future__ import annotations

from inboxmesh.client.mesh import MeshClient
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.runs.v1 import runs_pb2

K = ev.EventKind


class Record:
    """The whole event record at one moment, with small queries over it."""

    def __init__(self, events: list[ev.Event]):
        self.events = events

    @staticmethod
    async def read(client: MeshClient) -> Record:
        events, after = [], 0
        while True:
            page = await client.admin_events(after=after, limit=1000)
            events += page
            if not page:  # (a page is also cut at 2 MiB: only an empty one is the end)
                return Record(events)
            after = page[-1].event_id

    def of(self, kind: int, **match) -> list[ev.Event]:
        return [e for e in self.events if e.kind == kind and all(getattr(e, k) == v for k, v in match.items())]

    def one(self, kind: int, **match) -> ev.Event:
        found = self.of(kind, **match)
        assert len(found) == 1, f"expected one {K.Name(kind)} {match}, found {len(found)}"
        return found[0]

    def turns_alternate(self, agent_id: str) -> bool:
        """TURN_STARTED and TURN_ENDED of an agent strictly alternate, 1, 2, 3..."""
        turns = [e for e in self.events if e.agent_id == agent_id
                 and e.kind in (K.EVENT_KIND_TURN_STARTED, K.EVENT_KIND_TURN_ENDED)]
        expected_kinds = [K.EVENT_KIND_TURN_STARTED, K.EVENT_KIND_TURN_ENDED] * (len(turns) // 2)
        expected_turns = [t for n in range(1, len(turns) // 2 + 1) for t in (n, n)]
        return [e.kind for e in turns] == expected_kinds and [e.turn for e in turns] == expected_turns


async def announced_run(client: MeshClient, run_id: str) -> runs_pb2.SubagentRun | None:
    """The run once its result is stored in its requester's inbox, else None
    (for polling with an admin client)."""
    run = await client.admin_run(run_id=run_id)
    return run if run.announce_state == runs_pb2.ANNOUNCE_STATE_ANNOUNCED else None
