"""The reference IOA network on its own: routing, refusals, space history,
redelivery on reconnect and the faults it injects."""

import asyncio

import grpc
import pytest

from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.ioa.v1 import network_pb2_grpc
from services.ioa_network.server import NetworkConfig, NetworkServer
from tests.ioa_nodes import NodeClient

pytestmark = pytest.mark.store_independent


@pytest.fixture
async def network():
    async with NetworkServer(NetworkConfig(history=5, reconnect_grace_s=0)) as server:
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield server, channel


async def test_a_node_the_network_does_not_know_is_not_connected_yet_within_its_grace_after_starting():
    """reconnect_grace_s after the network started: a node it does not know is NODE_OFFLINE (a relay tries
    again; a restarted network's nodes reconnect one by one), and its publisher is told NodeBack when it
    comes; after the grace, UNKNOWN_NODE."""
    async with NetworkServer(NetworkConfig(reconnect_grace_s=600)) as server:
        async with grpc.aio.insecure_channel(server.address) as channel:
            a, late = NodeClient(channel, "a"), NodeClient(channel, "late")
            await a.connect()
            refused = await a.publish("m1", to=("late", "x"))
            assert refused.status == net.PUBLISH_STATUS_NODE_OFFLINE, refused
            assert "started" in refused.detail and "may still be reconnecting" in refused.detail
            await late.connect()
            back = await a.next("node_back")
            assert back.node_id == "late"
            server.network.started -= 600  # the grace is over
            assert (await a.publish("m2", to=("never", "x"))).status == net.PUBLISH_STATUS_UNKNOWN_NODE
            a.close()
            late.close()


async def test_routing_refusals_and_spaces(network):
    server, channel = network
    a, b = NodeClient(channel, "a"), NodeClient(channel, "b")
    await a.connect()
    await b.connect()
    ok = await a.publish("m1", to=("b", "x"), text="hi")
    assert ok.status == net.PUBLISH_STATUS_OK
    got = await b.next("message")
    assert got.text == "hi" and getattr(got, "from").node == "a", "a node cannot claim another node's name"
    assert (await a.publish("m2", to=("nobody", "x"))).status == net.PUBLISH_STATUS_UNKNOWN_NODE
    assert (await a.publish("m3", space="room")).status == net.PUBLISH_STATUS_NOT_A_MEMBER
    b.close()
    await asyncio.sleep(0.1)
    assert (await a.publish("m4", to=("b", "x"))).status == net.PUBLISH_STATUS_NODE_OFFLINE
    await a.call.write(net.NodeFrame(join=net.JoinSpace(space="room")))
    assert (await a.publish("s1", space="room", text="one")).status == net.PUBLISH_STATUS_OK
    assert (await a.publish("s2", space="room", text="two")).status == net.PUBLISH_STATUS_OK
    stub = network_pb2_grpc.IoaNetworkStub(channel)
    history = await stub.ReadSpace(net.ReadSpaceRequest(space="room", after_seq=1))
    assert [(m.space_seq, m.text) for m in history.messages] == [(2, "two")]
    a.close()


async def test_a_reconnecting_node_gets_its_recent_messages_again(network):
    server, channel = network
    a, b = NodeClient(channel, "a"), NodeClient(channel, "b")
    await a.connect()
    await b.connect()
    for i in range(7):
        await a.publish(f"m{i}", to=("b", "x"), text=str(i))
    for _ in range(7):
        await b.next("message")
    b.close()
    again = NodeClient(channel, "b")
    welcome = await again.connect()
    assert welcome.redelivering == 5, "the last `history` messages"
    assert [(await again.next("message")).ioa_message_id for _ in range(5)] == [f"m{i}" for i in range(2, 7)]
    a.close()
    again.close()


async def test_injected_faults_do_what_they_say(network):
    server, channel = network
    stub = network_pb2_grpc.IoaNetworkStub(channel)
    a, b = NodeClient(channel, "a"), NodeClient(channel, "b")
    await a.connect()
    await b.connect()
    await stub.InjectFault(net.InjectFaultRequest(node_id="b", kind=net.FAULT_KIND_DUPLICATE, count=1))
    await a.publish("dup", to=("b", "x"))
    assert [(await b.next("message")).ioa_message_id for _ in range(2)] == ["dup", "dup"]
    await stub.InjectFault(net.InjectFaultRequest(node_id="b", kind=net.FAULT_KIND_REORDER, count=1))
    await a.publish("first", to=("b", "x"))
    await a.publish("second", to=("b", "x"))
    assert [(await b.next("message")).ioa_message_id for _ in range(2)] == ["second", "first"]
    await stub.InjectFault(net.InjectFaultRequest(node_id="b", kind=net.FAULT_KIND_DELAY, count=1, delay_ms=300))
    start = asyncio.get_running_loop().time()
    await a.publish("slow", to=("b", "x"))
    assert (await b.next("message")).ioa_message_id == "slow"
    assert asyncio.get_running_loop().time() - start >= 0.3
    await stub.InjectFault(net.InjectFaultRequest(node_id="b", kind=net.FAULT_KIND_DROP_CONNECTION))
    await asyncio.wait_for(b.reader, 5)
    status = await stub.NetworkStatus(net.NetworkStatusRequest())
    assert {n.node_id: n.connected for n in status.nodes} == {"a": True, "b": False}
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.InjectFault(net.InjectFaultRequest(node_id="ghost", kind=net.FAULT_KIND_DUPLICATE))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    a.close()


async def test_publish_batches_and_batch_frames_for_nodes_that_read_them(network):
    """A PublishBatch is handled as its publishes one by one, in order; a node that said it reads batches
    gets what waits for it in Batch frames (in order), and one that did not gets single frames."""
    server, channel = network
    a = NodeClient(channel, "a", batches=True)
    b, c = NodeClient(channel, "b", batches=True), NodeClient(channel, "c")
    for node in (a, b, c):
        await node.connect()
    publishes = []
    for i in range(40):
        message = net.IoaMessage(ioa_message_id=f"m{i}", text=str(i), direct=net.Address(node="bc"[i % 2], agent="x"))
        publishes.append(net.Publish(message=message, publish_id=100 + i))
    await a.call.write(net.NodeFrame(publish_batch=net.PublishBatch(publishes=publishes)))
    results = [await a.next("result") for _ in range(40)]
    assert [(r.publish_id, r.status) for r in results] == [(100 + i, net.PUBLISH_STATUS_OK) for i in range(40)]
    assert [(await b.next("message")).ioa_message_id for _ in range(20)] == [f"m{i}" for i in range(0, 40, 2)]
    assert [(await c.next("message")).ioa_message_id for _ in range(20)] == [f"m{i}" for i in range(1, 40, 2)]
    assert max(a.batch_sizes + b.batch_sizes) > 1, "what waited went in one frame"
    assert c.batch_sizes == [], "a node that did not say it reads batches gets none"
    for node in (a, b, c):
        node.close()
