"""Exposure rules (docs/ioa.md, "Exposure"): which local agents the IOA network can reach, by the mesh's
`--ioa-expose` and each agent's own word at registration."""

from inboxmesh.inbox.v1 import inbox_pb2 as pb
from tests.ioa_nodes import start_node


async def _team(node, name):
    return await (await node.client.register(f"lead-{name}")).spawn(name)


async def test_exposure_rules_decide_which_agents_the_network_reaches(network, tmp_path):
    """--ioa-expose and an agent's own word at registration (metadata inboxmesh.ioa_exposed): a message
    for a hidden agent is answered NOT_PERMITTED and not stored."""
    alpha = await start_node(network, tmp_path, "alpha")
    listed = await start_node(network, tmp_path, "listed", expose="scope:placeholder")
    closed = await start_node(network, tmp_path, "closed", expose="none")
    try:
        a = await _team(alpha, "a")
        open_lead = await listed.client.register("lead")
        hidden_kid = await open_lead.spawn("hidden")
        volunteer = await open_lead.spawn("volunteer", metadata={"inboxmesh.ioa_exposed": "true"})
        shy = await (await alpha.client.register("shy-lead")).spawn("shy", metadata={"inboxmesh.ioa_exposed": "false"})
        nobody = await (await closed.client.register("lead")).spawn("kid", metadata={"inboxmesh.ioa_exposed": "true"})
        sent = {name: await a.send(address, name) for name, address in (
            ("hidden", listed.address(hidden_kid)), ("volunteer", listed.address(volunteer)),
            ("shy", alpha.address(shy)), ("nobody", closed.address(nobody)))}
        assert sent["volunteer"].status == pb.RECEIPT_STATUS_ACCEPTED
        for name in ("hidden", "shy", "nobody"):
            assert sent[name].status == pb.RECEIPT_STATUS_NOT_PERMITTED, (name, sent[name])
            assert "not reachable from the IOA network" in sent[name].detail
        assert "not listed" in sent["hidden"].detail and "said so" in sent["shy"].detail
        assert "exposes no agent" in sent["nobody"].detail
        assert await listed.mesh.store.get_message_by_sender(f"ioa:alpha/{a.agent_id}",
                                                             f"alpha:{a.agent_id}:{sent['hidden'].message_id}") is None
    finally:
        for node in (alpha, listed, closed):
            await node.stop()
