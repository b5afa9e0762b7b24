"""Configuration of a mesh process and of the command line's client commands. Frozen dataclasses only;
merging flags, the environment and files into them lives in services.settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.tls import TlsFiles

SERVER_TLS_NAMES = ("--tls-cert", "--tls-key", "--tls-client-ca")
"""The settings a server's TLS files come from (TlsFiles.names)."""
RELAY_TLS_NAMES = ("--ioa-tls-cert", "--ioa-tls-key", "--ioa-tls-ca")
NATS_TLS_NAMES = ("--nats-tls-cert", "--nats-tls-key", "--nats-tls-ca")
"""The settings the relay's TLS files for its IOA network connection come from."""


@dataclass(frozen=True)
class StoreConfig:
    """Where and how the mesh keeps its state."""

    backend: str = "sqlite"
    """Store implementation: "sqlite" (embedded default) or "jetstream"."""
    path: Path = Path(".inboxmesh/mesh.db")
    """SQLite database file; its directory is created when missing."""
    synchronous: str = "FULL"
    """SQLite `synchronous` pragma. FULL fsyncs every commit (accepted = on
    disk); NORMAL survives a process crash but not a power loss."""
    max_pending_writes: int = 20_000
    """Bound on store operations waiting for the writer. A caller beyond it
    waits (back-pressure) instead of growing memory."""
    max_ops_per_commit: int = 512
    """Most queued operations joined into one transaction (group commit)."""
    busy_timeout_ms: int = 5_000
    """How long to wait for another process holding the database lock."""
    nats_urls: tuple[str, ...] = ()
    """NATS servers of the "jetstream" backend (any of a cluster's nodes)."""
    nats_monitor_urls: tuple[str, ...] = ()
    """Monitoring endpoints of the NATS servers (`nats-server -m PORT`), read at start to check that each
    fsyncs every write (services/store/jetstream/durability.py); empty: port 8222 of each server's host."""
    nats_accept_lazy_fsync: bool = False
    """Start without that check, on servers that may fsync only every two minutes (their default)."""
    nats_replicas: int = 1
    """JetStream replicas of every stream and bucket (3 on a three-node cluster)."""
    nats_tls: TlsFiles = field(default_factory=lambda: TlsFiles(names=NATS_TLS_NAMES))
    """TLS to the NATS servers (with `tls://` URLs): the CA to trust, and a client certificate and key for
    servers that require one."""
    nats_timeout_s: float = 5.0
    """Deadline of each JetStream request."""
    nats_duplicate_window_s: float = 3600.0
    """How long JetStream itself recognises a repeated message id (a durable
    record covers the time after)."""
    nats_namespace: str = "im"
    """Prefix of the streams, subjects and buckets: several meshes (or test
    runs) can share one NATS."""
    max_inbox_capacity: int = 100_000
    """The JetStream backend's per-subject limit: the largest inbox capacity."""


@dataclass(frozen=True)
class InboxLimits:
    """Bounds and rules of the delivery contract."""

    default_capacity: int = 1_000
    """Unconsumed messages an inbox holds before refusing new ones."""
    max_capacity: int = 100_000
    """Largest capacity an agent may ask for at registration."""
    max_message_bytes: int = 256 * 1024
    """Largest serialized envelope accepted; bigger ones fail the request."""
    max_batch_messages: int = 1_000
    """Most messages in one SendRequest."""
    max_in_flight: int = 256
    """Default delivered-but-unacked messages per agent on a stream."""
    max_delivery_attempts: int = 10
    """Deliveries without an ack before a message is dead-lettered."""
    max_hops: int = 32
    """Messages with a larger hop_count are refused (loop prevention)."""
    allow_cross_scope: bool = False
    """Whether agents may send to agents outside their own tree."""
    max_id_length: int = 128
    """Longest message_id / conversation_id accepted."""
    max_trail_visits: int = 5
    """Loop guard: a message is refused when its recipient already appears
    this many times in its causal trail (A -> B -> C -> A chains, not only
    pairs)."""
    conversation_budget: int = 500
    """Loop guard: most agent-to-agent messages one conversation may hold."""


OUTBOX_LIMIT = 10_000
"""Entries the IOA outbox holds at most by default (IoaConfig.outbox_limit; the dead-letter notices a store
adds for IOA senders use it too)."""


@dataclass(frozen=True)
class IoaConfig:
    """The mesh's IOA relay (docs/ioa.md)."""

    node_id: str
    """This mesh's node in the IOA network (no '/' or ':')."""
    network: str
    """host:port of the IOA network server."""
    receipt_timeout_s: float = 10.0
    """How long an outbound send waits for the receiving relay's receipt."""
    inbound_queue: int = 10_000
    """Inbound messages waiting to be stored; the relay stops reading the
    network while it is full."""
    resequence_wait_s: float = 10.0
    """How long a received message waits for the one its sender sent before
    it to the same agent (per-pair order) before it is stored without it
    (an IOA_GAP event): as long as a sending relay keeps publishing a
    message (its receipt_timeout_s) by default."""
    outbox: bool = False
    """Whether a send to an IOA agent whose node cannot be reached now goes
    into the outbox (receipt OUTBOXED) instead of failing UNAVAILABLE, when
    its request does not choose (SendRequest.ioa_delivery)."""
    outbox_limit: int = OUTBOX_LIMIT
    """Entries the outbox holds at most; a send that would go beyond fails
    UNAVAILABLE / IOA_OUTBOX_FULL (nothing kept)."""
    outbox_ttl_s: float = 86_400.0
    """How long an entry waits for its node at most (or until its message's
    own expires_at_us, when earlier); then its outcome is `expired`."""
    expose: str = "all"
    """Which local agents the network can reach: "all" (unless an agent said false at registration),
    "none", or a comma list of agent:<id> and scope:<id> items (services/ioa/exposure.py)."""
    tls: TlsFiles = field(default_factory=lambda: TlsFiles(names=RELAY_TLS_NAMES))
    """How the relay connects to the network: plaintext without files, TLS trusting `ca`, mutual TLS with its
    own certificate and key too (services/tls.py)."""
    hold_limit: int = 10_000
    """Received messages held for their predecessors at most; a message
    that would be held beyond it is not stored and not answered now (its
    sender publishes it again)."""


@dataclass(frozen=True)
class RunsConfig:
    """The subagent run registry (docs/runs.md). A routing config's
    `agents.defaults.subagents` and per-agent `subagents` override the
    limits for the configured agents."""

    max_spawn_depth: int = 3
    """Deepest child allowed (children of a top-level agent are depth 1)."""
    max_active_children: int = 8
    """Running children one agent may have at once."""
    archive_after_s: float = 3600.0
    """The sweeper archives a run this long after it ended and was announced."""
    sweep_interval_s: float = 60.0
    """How often the sweeper looks for work when nothing wakes it sooner."""
    announce_retry_s: float = 1.0
    """How soon an announce refused by a full inbox is tried again."""


@dataclass(frozen=True)
class WebConfig:
    """The mesh's web view (services/webview, docs/webview.md): an HTTP port of its own on the mesh's host,
    read-only, for the operator token."""

    port: int = 0
    """Port on the mesh's host; 0 picks a free one."""
    any_port_if_taken: bool = False
    """When `port` is taken, serve on a free port instead of refusing to start: how the default port of
    `inboxmesh up` behaves (two meshes on one machine both ask for it). A port given explicitly is never
    changed."""
    max_streams: int = 32
    """Live event streams (`/api/events`) served at once; one more is answered 503 with Retry-After."""
    stream_queue: int = 4
    """Batches of events (at most 1,000 each) waiting for one stream's client. When they are all waiting the
    stream's watch waits too: the events stay in the record, and the watcher reads them from the store when
    its own buffer overflows, so a slow client costs no more memory and loses nothing."""
    write_timeout_s: float = 30.0
    """A stream whose client has not taken a write for this long is closed; its EventSource reconnects with
    Last-Event-ID and is served from there."""
    keepalive_s: float = 15.0
    """A comment line goes to an idle stream this often (proxies keep it open; a gone client is noticed)."""
    catch_up_s: float = 10.0
    """How long a snapshot waits for the web view to have read the record up to its last event (the first
    one after the mesh started reads it all); then it answers with what it has read."""
    recent_events: int = 500
    """The newest events a snapshot carries, from which the page draws its first arrows."""
    snapshot_agents: int = 2_000
    """Agents a snapshot lists at most, the newest trees first (the rest are counted, not listed)."""
    tracked_agents: int = 100_000
    """Agents whose live state and inbox depth the web view keeps in memory at most."""


@dataclass(frozen=True)
class MeshConfig:
    """One mesh process: which services it serves, where, on what store."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 0
    """Port to listen on; 0 picks a free one (printed at start)."""
    tls: TlsFiles = field(default_factory=lambda: TlsFiles(names=SERVER_TLS_NAMES))
    """TLS with a certificate and key; mutual TLS with a client CA too (services/tls.py)."""
    insecure: bool = False
    """Allow plaintext on an address that is not a loopback one."""
    bind_credentials: bool = False
    """An agent registered over mutual TLS is bound to the client certificate it was registered from: its
    credential is refused on a connection with another (needs tls.ca)."""
    store: StoreConfig = field(default_factory=StoreConfig)
    """Where and how the mesh keeps its state."""
    limits: InboxLimits = field(default_factory=InboxLimits)
    """Bounds and rules of the delivery contract, the loop guard's among them."""
    services: tuple[str, ...] = ("registry", "inbox", "events")
    """Which services this process serves; they share the store. "relay"
    (the IOA relay) needs `ioa` and runs beside "inbox"."""
    ioa: IoaConfig | None = None
    """Connect the mesh to an IOA network (enables "relay")."""
    admin_token: str | None = None
    """Bearer token that may read and close anything (operators, the CLI).
    None disables admin access."""
    max_request_bytes: int = 8 * 1024 * 1024
    """gRPC receive limit for one request or stream message."""
    heartbeat_interval_s: float = 10.0
    """How often subscription streams carry a heartbeat (and re-check that
    their agents are still open)."""
    grace_period_s: float = 5.0
    """How long shutdown lets in-flight calls finish."""
    runs: RunsConfig = field(default_factory=RunsConfig)
    """Limits and timing of subagent runs."""
    web: WebConfig | None = None
    """The web view; None: no web view (`inboxmesh up` serves one by default, services.settings)."""
    routing: Path | None = None
    """Routing config file (YAML or TOML, docs/routing.md) whose agents, bindings,
    sessions and ingress tokens the mesh serves; None = no routing service
    (ingress refused). Its loop guard and archive time are mesh-wide settings:
    services.settings.mesh_config merges them into `limits` and `runs` (a flag
    wins over them); the Mesh takes `limits` and `runs` as they are."""


@dataclass(frozen=True)
class ClientSettings:
    """Where the command line's client commands (register, send, tail, ...) find a mesh."""

    address: str
    """gRPC target of the mesh (host:port, or several as ipv4:a:p1,b:p2)."""
    admin_token: str | None
    """Operator token the commands may use (events without --as); None: none known."""
    data_dir: Path
    """State directory of a local mesh (its mesh.json names the address and the token)."""
    timeout_s: float
    """Deadline of each call."""
    tls: TlsFiles = field(default_factory=TlsFiles)
    """How to connect: plaintext without files, else TLS (services/tls.py)."""
