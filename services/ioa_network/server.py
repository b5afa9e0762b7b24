"""The reference IOA network server: nodes, spaces, direct and space
messages, redelivery of recent messages on reconnect, and fault injection
for tests. Its own process (`inboxmesh ioa-server`). It behaves like the
networks it stands for: nodes name themselves (no authentication), there is
no offline queue (a message to a node that is not connected is refused),
and a node that reconnects gets its most recent messages again.

Bounds: each node has an outbound queue of `queue_limit` frames; a node that
falls that far behind is disconnected (it gets its recent messages again
when it reconnects). Each space keeps its last `space_history` messages;
each node's redelivery window is its last `history` messages.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.status import to_grpc
from inboxmesh.ioa.v1 import network_pb2 as pb
from inboxmesh.ioa.v1 import network_pb2_grpc
from services.clock import now_us
from services.config import SERVER_TLS_NAMES
from services.grpc_common import ErrorBoundaryInterceptor, receive_limit
from services.tls import TlsFiles, certified_names, listen_credentials

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["IoaNetwork"].full_name
_NODE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_MAX_SPACES_PER_NODE = 1024
_MAX_BATCH = 256
"""Frames one Batch holds at most."""
_MAX_WAITING = 1000
"""Nodes remembered per absent node as having published to it (NodeBack); beyond that, no more are added."""
_MAX_ABSENT = 10_000
"""Absent nodes remembered with such publishers; beyond that, publishes to others are not remembered."""
MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""The largest frame or request the network takes (as a mesh does by default)."""


@dataclass(frozen=True)
class NetworkConfig:
    host: str = "127.0.0.1"
    port: int = 0
    history: int = 50
    """Messages a reconnecting node gets again."""
    space_history: int = 10_000
    """Messages kept per space for ReadSpace."""
    queue_limit: int = 10_000
    """Frames waiting for one node before it is disconnected as too slow."""
    tls: TlsFiles = field(default_factory=lambda: TlsFiles(names=SERVER_TLS_NAMES))
    """TLS with a certificate and key; mutual TLS with a client CA too (services/tls.py)."""
    insecure: bool = False
    """Allow plaintext on an address that is not a loopback one."""
    faults: bool = True
    """Whether InjectFault works (tests); `ioa-server` turns it on only with --faults."""
    reconnect_grace_s: float = 30.0
    """For this long after it starts, the network answers a message to a node it does not know NODE_OFFLINE
    (not connected: the relay tries again, and its sender gets UNAVAILABLE, retry), not UNKNOWN_NODE (no
    such node: the sender's receipt is UNKNOWN_TARGET, final). The network keeps its nodes in memory: once
    restarted it knows each again only when it has reconnected, and a node whose relay is still reconnecting
    is not one that does not exist (the chaos soak's far senders got UNKNOWN_TARGET for the near node so,
    after a restart of the network, before they had ever heard from it). 0: no grace."""


@dataclass
class _Node:
    node_id: str
    recent: collections.deque
    connected: bool = False
    spaces: set[str] = field(default_factory=set)
    queue: asyncio.Queue | None = None
    stop: asyncio.Event | None = None
    delivered: int = 0
    connections: int = 0
    duplicate: int = 0
    delay: int = 0
    delay_ms: int = 0
    reorder: int = 0
    batches: bool = False
    """The node reads Batch frames (Hello.batches)."""


class IoaNetwork(network_pb2_grpc.IoaNetworkServicer):
    def __init__(self, config: NetworkConfig):
        self.config = config
        self.nodes: dict[str, _Node] = {}
        self.spaces: dict[str, collections.deque] = {}
        self.waiting: dict[str, set[str]] = {}
        """Per node not connected now: the nodes whose publishes to it were refused NODE_OFFLINE or
        UNKNOWN_NODE since (each told NodeBack once it connects)."""
        self._space_seq: dict[str, int] = collections.defaultdict(int)
        self.started = time.monotonic()
        """When the network started taking connections (NetworkServer.start): reconnect_grace_s counts from it."""

    # -- the node's stream --------------------------------------------------
    async def Connect(self, request_iterator, context: grpc.aio.ServicerContext):
        frames = request_iterator.__aiter__()
        try:
            first = await anext(frames)
        except StopAsyncIteration:
            return
        node_id = first.hello.node_id
        if first.WhichOneof("frame") != "hello" or not _NODE_ID.fullmatch(node_id):
            await context.abort(*to_grpc(errors.InvalidArgument(
                "the first frame must be hello with a node_id of 1-128 letters, digits, '.', '_' or '-'",
                reason=Reason.BAD_NODE_ID, metadata={"field": "hello.node_id"})))
            return
        if self.config.tls.ca is not None and node_id not in certified_names(context):
            await context.abort(*to_grpc(errors.PermissionDenied(
                f"this connection's certificate does not name node {node_id!r} (its common name or a subject"
                " alternative name must be the node id): a node connects only as itself",
                reason=Reason.NODE_NOT_CERTIFIED, metadata={"node_id": node_id})))
            return
        node, queue, stop = self._attach(first.hello.node_id)
        node.batches = first.hello.batches
        redeliver = list(node.recent)
        await context.write(pb.NetworkFrame(welcome=pb.Welcome(node_id=node.node_id, redelivering=len(redeliver))))
        for message in redeliver:
            queue.put_nowait(pb.NetworkFrame(message=message))
        reader = asyncio.create_task(self._read(node, frames))
        try:
            await self._write(node, queue, stop, context)
        finally:
            reader.cancel()
            if node.queue is queue:
                node.connected = False
            log.info("node %s disconnected", node.node_id)

    def _attach(self, node_id: str) -> tuple[_Node, asyncio.Queue, asyncio.Event]:
        """The node's record with its new connection's queue and stop event."""
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = _Node(node_id, collections.deque(maxlen=self.config.history))
        if node.stop is not None:
            node.stop.set()  # a node has one connection: the newer one wins
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.config.queue_limit)
        stop = asyncio.Event()
        node.queue, node.stop = queue, stop
        node.connected = True
        node.connections += 1
        log.info("node %s connected (connection %d)", node_id, node.connections)
        for waiting in sorted(self.waiting.pop(node_id, ())):
            other = self.nodes.get(waiting)
            if other is not None:
                self._enqueue(other, pb.NetworkFrame(node_back=pb.NodeBack(node_id=node_id)))
        return node, queue, stop

    async def _read(self, node: _Node, frames) -> None:
        async for frame in frames:
            which = frame.WhichOneof("frame")
            if which == "publish":
                self._publish(node, frame.publish)
            elif which == "publish_batch":
                for publish in frame.publish_batch.publishes:
                    self._publish(node, publish)
            elif which == "join" and len(frame.join.space) <= 128 and len(node.spaces) < _MAX_SPACES_PER_NODE:
                node.spaces.add(frame.join.space)  # a bad join is ignored: publishing to it says NOT_A_MEMBER
            elif which == "leave":
                node.spaces.discard(frame.leave.space)

    def _publish(self, node: _Node, publish: pb.Publish) -> None:
        result, targets = self.route(node, publish.message)
        result.publish_id = publish.publish_id
        self._enqueue(node, pb.NetworkFrame(result=result))  # the publisher hears first, then fan-out
        for target in targets:
            self._deliver(target, publish.message)

    async def _write(self, node: _Node, queue: asyncio.Queue, stop: asyncio.Event, context) -> None:
        held: pb.NetworkFrame | None = None
        stopping = asyncio.create_task(stop.wait())
        getting: asyncio.Task | None = None
        try:
            while True:
                getting = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({getting, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if stopping in done:
                    getting.cancel()
                    return
                frame = getting.result()
                if node.batches and not (node.reorder or node.delay or node.duplicate) and not queue.empty():
                    frame = self._batch(frame, queue)  # what waits goes in one frame (faults go one by one)
                if frame.WhichOneof("frame") == "message":
                    if node.reorder and held is None:
                        held = frame
                        continue
                    if node.delay:
                        node.delay -= 1
                        await asyncio.sleep(node.delay_ms / 1000)
                await context.write(frame)
                if frame.WhichOneof("frame") == "message" and node.duplicate:
                    node.duplicate -= 1
                    await context.write(frame)
                if held is not None:
                    node.reorder -= 1
                    await context.write(held)
                    held = None
        finally:  # cancelled or done: leave no task behind
            stopping.cancel()
            if getting is not None:
                getting.cancel()

    @staticmethod
    def _batch(first: pb.NetworkFrame, queue: asyncio.Queue) -> pb.NetworkFrame:
        """`first` and the frames queued behind it (up to _MAX_BATCH; a node's queue holds only messages,
        results and NodeBack frames) as one Batch frame, in order."""
        batch = pb.Batch()
        frame = first
        while True:
            which = frame.WhichOneof("frame")
            getattr(batch.items.add(), which).CopyFrom(getattr(frame, which))
            if len(batch.items) >= _MAX_BATCH or queue.empty():
                return pb.NetworkFrame(batch=batch)
            frame = queue.get_nowait()

    def _enqueue(self, node: _Node, frame: pb.NetworkFrame) -> None:
        if node.queue is None or not node.connected:
            return
        try:
            node.queue.put_nowait(frame)
        except asyncio.QueueFull:
            log.warning("node %s is %d frames behind: disconnecting it", node.node_id, self.config.queue_limit)
            if node.stop is not None:
                node.stop.set()

    # -- routing ------------------------------------------------------------
    def route(self, sender: _Node, message: pb.IoaMessage) -> tuple[pb.PublishResult, list[_Node]]:
        """Accept (or refuse) a message; returns the result for the publisher
        and the nodes to deliver it to."""
        result = pb.PublishResult(ioa_message_id=message.ioa_message_id)
        targets: list[_Node] = []
        if not message.ioa_message_id:
            result.status, result.detail = pb.PUBLISH_STATUS_INVALID, "ioa_message_id is required"
            return result, targets
        getattr(message, "from").node = sender.node_id  # a node speaks only for itself
        message.sent_at_us = now_us()
        target = message.WhichOneof("to")
        if target == "direct":
            node = self.nodes.get(message.direct.node)
            if node is None:
                age = time.monotonic() - self.started
                if age < self.config.reconnect_grace_s and _NODE_ID.fullmatch(message.direct.node):
                    result.status = pb.PUBLISH_STATUS_NODE_OFFLINE
                    result.detail = (f"node {message.direct.node!r} is not connected: this network started"
                                     f" {age:.0f}s ago and its nodes may still be reconnecting")
                else:
                    result.status = pb.PUBLISH_STATUS_UNKNOWN_NODE
                    result.detail = f"no node {message.direct.node!r}"[:200]
                self._wait_for(message.direct.node, sender)
            elif not node.connected:
                result.status, result.detail = pb.PUBLISH_STATUS_NODE_OFFLINE, f"node {node.node_id} is not connected"
                self._wait_for(node.node_id, sender)
            else:
                targets.append(node)
                result.status = pb.PUBLISH_STATUS_OK
        elif target == "space":
            space = message.space
            if space not in sender.spaces:
                result.status = pb.PUBLISH_STATUS_NOT_A_MEMBER
                result.detail = f"{sender.node_id} has not joined {space}"
                return result, targets
            self._space_seq[space] += 1
            message.space_seq = self._space_seq[space]
            self.spaces.setdefault(space, collections.deque(maxlen=self.config.space_history)).append(message)
            targets = [n for n in self.nodes.values() if space in n.spaces and n.connected]
            result.status = pb.PUBLISH_STATUS_OK
        else:
            result.status, result.detail = pb.PUBLISH_STATUS_INVALID, "a message needs a direct address or a space"
        return result, targets

    def _wait_for(self, absent: str, sender: _Node) -> None:
        """Remember that `sender` published to the absent node (bounded: _MAX_ABSENT, _MAX_WAITING)."""
        if not _NODE_ID.fullmatch(absent):
            return
        waiting = self.waiting.get(absent)
        if waiting is None:
            if len(self.waiting) >= _MAX_ABSENT:
                return
            waiting = self.waiting[absent] = set()
        if len(waiting) < _MAX_WAITING:
            waiting.add(sender.node_id)

    def _deliver(self, node: _Node, message: pb.IoaMessage) -> None:
        node.recent.append(message)
        node.delivered += 1
        self._enqueue(node, pb.NetworkFrame(message=message))

    # -- the rest -----------------------------------------------------------
    async def ReadSpace(self, request: pb.ReadSpaceRequest, context) -> pb.ReadSpaceResponse:
        limit = min(request.limit or 100, 1000)
        history = self.spaces.get(request.space, ())
        return pb.ReadSpaceResponse(messages=[m for m in history if m.space_seq > request.after_seq][:limit])

    async def InjectFault(self, request: pb.InjectFaultRequest, context) -> pb.InjectFaultResponse:
        if not self.config.faults:
            await context.abort(*to_grpc(errors.PermissionDenied(
                "fault injection is off on this network (it is for tests: `ioa-server --faults`)",
                reason=Reason.FAULTS_OFF)))
        node = self.nodes.get(request.node_id)
        if node is None:  # refused with ErrorInfo by ErrorBoundaryInterceptor, as every MeshError
            raise errors.NotFound(f"no node {errors.clip(request.node_id)!r}", reason=Reason.NODE_NOT_FOUND)
        kind = request.kind
        if kind == pb.FAULT_KIND_DROP_CONNECTION:
            if node.stop is not None:
                node.stop.set()
        elif kind == pb.FAULT_KIND_DUPLICATE:
            node.duplicate += request.count or 1
        elif kind == pb.FAULT_KIND_DELAY:
            node.delay, node.delay_ms = request.count or 1, request.delay_ms
        elif kind == pb.FAULT_KIND_REORDER:
            node.reorder += request.count or 1
        else:
            raise errors.InvalidArgument(f"unknown fault kind {kind}", reason=Reason.BAD_KIND,
                                         metadata={"field": "kind"})
        log.info("fault %s injected for node %s", pb.FaultKind.Name(kind), node.node_id)
        return pb.InjectFaultResponse()

    async def NetworkStatus(self, request, context) -> pb.NetworkStatusResponse:
        return pb.NetworkStatusResponse(nodes=[
            pb.NodeStatus(node_id=n.node_id, connected=n.connected, spaces=sorted(n.spaces), delivered=n.delivered,
                          connections=n.connections) for n in self.nodes.values()])


class NetworkServer:
    """The network as a server: `async with NetworkServer(config) as network:`."""

    def __init__(self, config: NetworkConfig | None = None):
        self.config = config or NetworkConfig()
        self.network = IoaNetwork(self.config)
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> int:
        self.server, self.port = create_network_server(self.config, self.network)
        await self.server.start()
        self.network.started = time.monotonic()
        log.info("ioa network listening on %s", self.address)
        return self.port

    async def stop(self, grace: float = 0.5) -> None:
        if self.server is not None:
            for node in self.network.nodes.values():
                if node.stop is not None:
                    node.stop.set()
            await self.server.stop(grace)
            self.server = None

    async def __aenter__(self) -> NetworkServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()


def create_network_server(config: NetworkConfig, network: IoaNetwork) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", receive_limit(MAX_REQUEST_BYTES))],
                             interceptors=[ErrorBoundaryInterceptor(MAX_REQUEST_BYTES)])
    network_pb2_grpc.add_IoaNetworkServicer_to_server(network, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
    credentials = listen_credentials(config.tls, config.host, config.insecure, "the IOA network server")
    try:
        address = f"{config.host}:{config.port}"
        port = (server.add_secure_port(address, credentials) if credentials is not None else
                server.add_insecure_port(address))
    except RuntimeError as exc:
        raise RuntimeError(f"could not listen on {config.host}:{config.port}: {exc}") from None
    return server, port
