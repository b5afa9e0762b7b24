"""Gateways to agent networks outside the mesh (inboxmesh.gateway.v1, docs/interop.md): today A2A.

A family's gateway agent is one agent of the mesh with a fixed id (derived from the family's name, so every
mesh process of a shared store finds the same one without a lookup table). A gateway process claims it with
the admin token and gets a new credential (earlier ones stop working); it then:

- reads the agent's inbox like any inbox: sends to `a2a:` addresses are stored there by the inbox service
  (InboxService._to_gateway), the address kept in the header `inboxmesh-a2a-to`;
- stores what arrives from outside with `deliver`: messages whose sender is an `a2a:` address, into any local
  agent's inbox, by the ordinary path (InboxWriter.deliver_external: the same receipts, events and
  idempotency, the sender and message id being the key).

The gateway agent is top-level and claimed with the admin token, so it may reach agents of every scope: what
it exposes is the gateway process's choice (`inboxmesh a2a --agent`). A closed gateway agent stays closed:
claiming it again is AGENT_CLOSED."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable

from inboxmesh.client import errors
from inboxmesh.client.addressing import A2A_PREFIX
from inboxmesh.client.errors import Reason
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.registry.v1 import registry_pb2 as reg_pb
from services import auth
from services.clock import now_us
from services.config import InboxLimits
from services.directory import Caller, Directory
from services.store.base import AGENT_OPEN, AgentRecord, AgentStore, SendOutcome

log = logging.getLogger(__name__)

FAMILIES = {"a2a": A2A_PREFIX}
"""Address families a gateway may claim: family -> the prefix of its addresses."""
GATEWAY_KEY = "inboxmesh-gateway"
"""Metadata of a gateway agent: its family."""


def gateway_agent_id(family: str) -> str:
    """The fixed id of a family's gateway agent."""
    return "agt_" + hashlib.sha256(f"inboxmesh-gateway:{family}".encode()).hexdigest()[:20]


Validate = Callable[[str, list[envelope_pb2.Envelope]], None]
"""Checks a gateway's messages as a send's are checked (InboxService.validate_external)."""
Deliver = Callable[[list[envelope_pb2.Envelope]], Awaitable[list[SendOutcome]]]


class GatewayService:
    def __init__(self, agents: AgentStore, directory: Directory, limits: InboxLimits, *, validate: Validate,
                 deliver: Deliver):
        self._agents = agents
        self._directory = directory
        self._limits = limits
        self._validate = validate
        self._deliver = deliver
        self._claiming = asyncio.Lock()

    @staticmethod
    def _family(family: str) -> str:
        if family not in FAMILIES:
            raise errors.InvalidArgument(f"unknown gateway family {errors.clip(family)!r}; known: {sorted(FAMILIES)}",
                                         reason=Reason.UNKNOWN_FAMILY, metadata={"family": errors.clip(family)})
        return family

    async def gateway(self, family: str) -> AgentRecord | None:
        """The family's gateway agent, None while no gateway ever claimed it."""
        return await self._directory.get(gateway_agent_id(family))

    async def claim(self, family: str) -> tuple[AgentRecord, str]:
        """(The gateway agent, a new credential of it): registered on the first claim."""
        family = self._family(family)
        agent_id = gateway_agent_id(family)
        credential = auth.new_credential(agent_id)
        async with self._claiming:
            record = await self._agents.get_agent(agent_id)
            if record is None:
                record = AgentRecord(
                    agent_id=agent_id, name=f"{family}-gateway", mode=reg_pb.AGENT_MODE_MAIN, parent_id="",
                    scope_id=agent_id, depth=0, state=AGENT_OPEN, metadata={GATEWAY_KEY: family},
                    inbox_capacity=self._limits.default_capacity, created_at_us=now_us(),
                    credential_hash=auth.credential_hash(credential))
                try:
                    record = await self._agents.create_agent(record)
                    log.info("%s gateway agent registered as %s", family, agent_id)
                except errors.FailedPrecondition:  # another replica registered it at the same moment
                    record = await self._agents.get_agent(agent_id) or record
            if not record.is_open:
                raise errors.FailedPrecondition(
                    f"the {family} gateway agent {agent_id} was closed ({record.close_reason or 'no reason'}):"
                    " a closed agent stays closed", reason=Reason.AGENT_CLOSED, metadata={"agent_id": agent_id})
            record = await self._agents.set_credential(agent_id, auth.credential_hash(credential))
        self._directory.credential_changed(record)
        log.info("%s gateway %s claimed; earlier credentials revoked", family, agent_id)
        return record, credential

    async def deliver(self, caller: Caller, envelopes: list[envelope_pb2.Envelope]) -> list[SendOutcome]:
        """Store messages from the caller's family's addresses into local inboxes (one outcome each)."""
        agent = caller.require_agent("delivering from a gateway")
        family = agent.metadata.get(GATEWAY_KEY, "")
        if family not in FAMILIES or agent.agent_id != gateway_agent_id(family):
            raise errors.PermissionDenied(f"{agent.agent_id} is not a gateway agent: only a gateway (ClaimGateway)"
                                          " delivers from outside addresses", reason=Reason.NOT_GATEWAY)
        prefix = FAMILIES[family]
        self._validate(prefix, envelopes)
        for env in envelopes:
            env.origin.Clear()
            env.origin.kind = envelope_pb2.ORIGIN_KIND_A2A
        return await self._deliver(envelopes)
