"""What the JetStream store relies on, checked against real nats-server
processes (one node with file storage, a three-node cluster): per-subject
capacity that rejects instead of evicting, Nats-Msg-Id de-duplication, file
storage that survives kill -9, replicas that survive the loss of a node."""

import asyncio
import socket
import urllib.request

import nats
import nats.errors
import pytest
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import APIError

from harness.nats import NatsCluster, NatsNode, wait_for_jetstream

pytestmark = pytest.mark.store_independent

INBOX_FULL_CODE = 10077
"""JetStream's err_code for "maximum messages per subject exceeded"."""


def inbox_stream(replicas: int = 1, capacity: int = 2) -> StreamConfig:
    return StreamConfig(name="FEATURES", subjects=["t.inbox.*"], storage=StorageType.FILE,
                        num_replicas=replicas, max_msgs_per_subject=capacity, discard=DiscardPolicy.NEW,
                        discard_new_per_subject=True, duplicate_window=120.0)


async def test_one_node_rejects_a_full_subject_dedupes_and_survives_kill_9(tmp_path):
    node = NatsNode(tmp_path).start()
    try:
        nc = await nats.connect(node.url)
        js = nc.jetstream()
        await js.add_stream(inbox_stream())
        first = await js.publish("t.inbox.a", b"1", headers={"Nats-Msg-Id": "m1"})
        again = await js.publish("t.inbox.a", b"1", headers={"Nats-Msg-Id": "m1"})
        assert again.duplicate and again.seq == first.seq
        await js.publish("t.inbox.a", b"2", headers={"Nats-Msg-Id": "m2"})
        with pytest.raises(APIError) as full:
            await js.publish("t.inbox.a", b"3", headers={"Nats-Msg-Id": "m3"})
        assert full.value.err_code == INBOX_FULL_CODE, "a full inbox rejects"
        assert (await js.publish("t.inbox.b", b"x")).seq == 3, "other inboxes are not affected"
        assert (await js.get_msg("FEATURES", first.seq)).data == b"1", "nothing was evicted"
        await nc.close()
        node.kill()
        node.start()
        await wait_for_jetstream([node.url])
        nc = await nats.connect(node.url)
        info = await nc.jetstream().stream_info("FEATURES")
        assert info.state.messages == 3, "file storage kept every accepted message"
        await nc.close()
    finally:
        node.kill()


async def test_a_three_node_cluster_keeps_serving_with_one_node_down(tmp_path):
    with NatsCluster(tmp_path) as cluster:
        await wait_for_jetstream(cluster.urls, replicas=3)
        nc = await nats.connect(servers=cluster.urls)
        js = nc.jetstream()
        await js.add_stream(inbox_stream(replicas=3, capacity=100))
        for i in range(10):
            await js.publish("t.inbox.a", f"{i}".encode(), headers={"Nats-Msg-Id": f"m{i}"})
        info = await js.stream_info("FEATURES")
        assert info.config.num_replicas == 3 and info.cluster is not None
        assert len(info.cluster.replicas or []) == 2
        cluster.nodes[0].kill()
        for i in range(10, 20):  # retried with the same id while the cluster elects new leaders
            ack = await _publish_until_stored(js, f"{i}".encode(), f"m{i}")
            assert ack.seq == i + 1
        assert (await js.stream_info("FEATURES")).state.messages == 20
        await nc.close()


async def _publish_until_stored(js, data: bytes, msg_id: str, timeout: float = 60.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await js.publish("t.inbox.a", data, headers={"Nats-Msg-Id": msg_id}, timeout=5)
        except (nats.errors.Error, APIError):  # timeouts, no responders, no stream response: not yet
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_a_restart_forgets_the_msg_id_of_a_deleted_message(tmp_path):
    """nats-server rebuilds its duplicate tracking from the messages it stores when it restarts (or a
    stream's leader changes): the Nats-Msg-Id of a message deleted since (a consumed one) is forgotten, and
    publishing it again stores a new copy, within the duplicate window. The store's idempotency records
    cover that case (the event keeper creates any its writer died before writing: docs/jetstream.md)."""
    node = NatsNode(tmp_path).start()
    try:
        nc = await nats.connect(node.url)
        js = nc.jetstream()
        await js.add_stream(inbox_stream(capacity=10))
        gone = await js.publish("t.inbox.a", b"1", headers={"Nats-Msg-Id": "gone"})
        kept = await js.publish("t.inbox.a", b"2", headers={"Nats-Msg-Id": "kept"})
        await js.delete_msg("FEATURES", gone.seq)
        assert (await js.publish("t.inbox.a", b"1", headers={"Nats-Msg-Id": "gone"})).duplicate, \
            "before a restart the id of a deleted message is still known"
        await nc.close()
        node.kill()
        node.start()
        await wait_for_jetstream([node.url], timeout=30)
        nc = await nats.connect(node.url)
        js = nc.jetstream()
        again = await js.publish("t.inbox.a", b"1", headers={"Nats-Msg-Id": "gone"})
        assert not again.duplicate and again.seq > kept.seq, "after it, the deleted message's id is forgotten"
        assert (await js.publish("t.inbox.a", b"2", headers={"Nats-Msg-Id": "kept"})).duplicate, \
            "a stored message's id is still known"
        await nc.close()
    finally:
        node.kill()


@pytest.mark.parametrize("port", ["monitor", "client"])
def test_a_node_whose_port_another_process_took_meanwhile_starts_on_another(tmp_path, port):
    """A port chosen free and taken by another process before the server listened on it (the test
    command's other lanes open sockets all the time): the node starts on another one (CI, 2026-12-07: a
    cluster node exited with "can't listen to the monitor port" and failed its test)."""
    node = NatsNode(tmp_path / "nats")
    taken = node.http_port if port == "monitor" else node.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        node.start()
        try:
            assert taken not in (node.http_port, node.port)
            with urllib.request.urlopen(f"{node.monitor_url}/varz", timeout=5) as answer:
                assert answer.status == 200
            socket.create_connection(("127.0.0.1", node.port), timeout=5).close()
        finally:
            node.kill()
