"""Where configuration comes from: command-line flags, environment variables and files, merged into the
frozen settings of services.config. The only module that reads the environment or a configuration file
for the mesh or for the command line's client commands. The parsed flags and the environment are passed
in (a mapping each), so every rule here can be tested without a process.

One precedence, applied by one function (`_Layers.value`) to every setting:

    a flag given on the command line  >  its environment variable  >  its value in a file  >  its default

Each setting below names the layers it has: most are flags only, a few also have an environment
variable, a few can come from a file. A flag that was not given is None; an environment variable that is
unset or empty counts as not given. Text (from the environment, or a flag argparse left as a string) is
read by the setting's parser; every value, from whichever layer, then passes the setting's check. A bad
value is refused with InvalidArgument (reason BAD_VALUE) whose message starts with where it came from:
the flag (`--port: ...`), the variable (`INBOXMESH_DATA_DIR: ...`) or the file and key. A routing file
that cannot be read or is invalid is refused by its reader (services.routing.config), naming the key.

The files:
- the routing config (`--routing`, docs/routing.md): its `agents.defaults.loopGuard` and
  `agents.defaults.subagents.archiveAfterMinutes` (or their defaults there, when it names none) apply to
  the whole mesh unless a flag sets them;
- a running mesh's state file (`<data dir>/mesh.json`, written by `inboxmesh up`): the address and the
  admin token the client commands use.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from services.config import (
    NATS_TLS_NAMES,
    RELAY_TLS_NAMES,
    SERVER_TLS_NAMES,
    ClientSettings,
    InboxLimits,
    IoaConfig,
    MeshConfig,
    RunsConfig,
    StoreConfig,
    WebConfig,
)
from services.routing.config import RoutingConfig, load_routing_config
from services.tls import TlsFiles

T = TypeVar("T")

DEFAULT_PORT = 7400
"""Where `inboxmesh up` listens, and where the client commands look, when nothing says otherwise."""
DEFAULT_WEB_PORT = 7480
"""Where `inboxmesh up` serves its web view when nothing says otherwise (a free port instead when another
process has it). Not 7401: the README runs a second mesh there (IOA, JetStream, separate services)."""
DEFAULT_DATA_DIR = Path(".inboxmesh")
ENV_ADDRESS = "INBOXMESH_ADDRESS"
ENV_DATA_DIR = "INBOXMESH_DATA_DIR"
ENV_ADMIN_TOKEN = "INBOXMESH_ADMIN_TOKEN"
STATE_FILE = "mesh.json"
"""The state file `inboxmesh up` writes into its data directory."""

_MESH, _LIMITS, _RUNS, _STORE = MeshConfig(), InboxLimits(), RunsConfig(), StoreConfig()
"""The defaults of the frozen configs: the default layer says nothing they do not."""


def _problem_is_none(value: Any) -> str | None:
    return None


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One configuration value and the layers it can come from."""

    key: str
    """Its name in a file layer (and in these tables)."""
    default: Callable[[], T]
    """The default layer (a function: the admin token's default is a new random one)."""
    flag: str | None = None
    """The command-line flag, e.g. "--port"; the parsed flags hold it under argparse's dest ("port")."""
    env: str | None = None
    """The environment variable, when it has one."""
    parse: Callable[[str], T] | None = None
    """Reads the setting's text (environment, or a flag argparse left as text); None: the text is the value."""
    check: Callable[[T], str | None] = _problem_is_none
    """The problem with a value (e.g. "must be at least 1, got 0"), or None when it is fine."""

    @property
    def dest(self) -> str:
        return (self.flag or "").removeprefix("--").replace("-", "_")


def _bad(where: str, problem: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"{where}: {problem}", reason=Reason.BAD_VALUE, metadata={"setting": where})


class _Layers:
    """The layers one merge reads: parsed flags, the environment, and one file's values (with where in the
    file each came from)."""

    def __init__(self, flags: Mapping[str, object], env: Mapping[str, str],
                 file: Mapping[str, tuple[object, str]] | None = None):
        self._flags = flags
        self._env = env
        self._file = file or {}

    def value(self, setting: Setting[T]) -> T:
        """The setting's value by the precedence flag > environment > file > default."""
        if setting.flag is not None and self._flags.get(setting.dest) is not None:
            return self._checked(setting, self._flags[setting.dest], setting.flag)
        if setting.env is not None and self._env.get(setting.env):
            return self._checked(setting, self._env[setting.env], setting.env)
        if setting.key in self._file:
            found, where = self._file[setting.key]
            return self._checked(setting, found, where)
        return setting.default()

    @staticmethod
    def _checked(setting: Setting[T], given: object, where: str) -> T:
        value = given
        if isinstance(given, str) and setting.parse is not None:
            try:
                value = setting.parse(given)
            except ValueError as exc:
                raise _bad(where, f"cannot read {errors.clip(given, 100)!r}: {exc}") from None
        problem = setting.check(cast(T, value))
        if problem is not None:
            raise _bad(where, problem)
        return cast(T, value)


# -- readers and checks -----------------------------------------------------------------------------------
def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("expected an integer") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("expected a number") from None


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list ("a, b,c" -> ("a", "b", "c")); empty items are dropped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _monitor_urls(urls: tuple[str, ...]) -> str | None:
    wrong = [url for url in urls if not url.startswith(("http://", "https://"))]
    if wrong:
        return f"expected http:// or https:// URLs of the servers' monitoring ports, got {wrong[0][:80]!r}"
    return None


def _at_least(low: int, high: int | None = None) -> Callable[[int], str | None]:
    def check(value: int) -> str | None:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"expected an integer, got {value!r}"
        if value < low:
            return f"must be at least {low}, got {value}"
        if high is not None and value > high:
            return f"must be at most {high}, got {value}"
        return None
    return check


def _positive(value: float) -> str | None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return f"expected a number, got {value!r}"
    if not value > 0 or value == float("inf"):
        return f"must be a finite number greater than 0, got {value}"
    return None


def _one_of(*choices: str) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}, got {errors.clip(value, 100)!r}"
    return check


WEB_OFF = -1
"""The web port's value for "no web view" (`--web-port off`)."""


def _web_port(text: str) -> int:
    """A port number, or "off"."""
    if text.strip().lower() == "off":
        return WEB_OFF
    return _integer(text)


def _web_port_value(value: int | None) -> str | None:
    return None if value is None or value == WEB_OFF else _at_least(0, 65535)(value)


def _some(value: tuple[str, ...]) -> str | None:
    return None if value else "names nothing"


def _text(value: str) -> str | None:
    return None if value.strip() else "is empty"


# -- the mesh (`inboxmesh up`) ----------------------------------------------------------------------------
HOST = Setting("host", lambda: _MESH.host, flag="--host", check=_text)
PORT = Setting("port", lambda: DEFAULT_PORT, flag="--port", parse=_integer, check=_at_least(0, 65535))
DATA_DIR = Setting("data_dir", lambda: DEFAULT_DATA_DIR, flag="--data-dir", env=ENV_DATA_DIR, parse=Path)
SERVICES = Setting("services", lambda: _MESH.services, flag="--services", parse=_names, check=_some)
ADMIN_TOKEN = Setting("admin_token", lambda: secrets.token_urlsafe(24), flag="--admin-token",
                      env=ENV_ADMIN_TOKEN, check=_text)
CAPACITY = Setting("default_capacity", lambda: _LIMITS.default_capacity, flag="--capacity", parse=_integer,
                   check=_at_least(1))
HEARTBEAT = Setting("heartbeat_interval_s", lambda: _MESH.heartbeat_interval_s, flag="--heartbeat-interval",
                    parse=_number, check=_positive)
SYNCHRONOUS = Setting("synchronous", lambda: _STORE.synchronous, flag="--synchronous",
                      parse=lambda text: text.strip().upper(), check=_one_of("FULL", "NORMAL"))
CROSS_SCOPE = Setting("allow_cross_scope", lambda: _LIMITS.allow_cross_scope, flag="--allow-cross-scope")
BACKEND = Setting("store", lambda: _STORE.backend, flag="--store", check=_one_of("sqlite", "jetstream"))
NATS = Setting[tuple[str, ...]]("nats", lambda: (), flag="--nats", parse=_names)
NATS_REPLICAS = Setting("nats_replicas", lambda: _STORE.nats_replicas, flag="--nats-replicas", parse=_integer,
                        check=_at_least(1, 5))
NATS_MONITOR = Setting[tuple[str, ...]]("nats_monitor", lambda: _STORE.nats_monitor_urls, flag="--nats-monitor",
                                        parse=_names, check=_monitor_urls)
NATS_LAZY_FSYNC = Setting("nats_accept_lazy_fsync", lambda: _STORE.nats_accept_lazy_fsync,
                          flag="--nats-accept-lazy-fsync")
NATS_TLS_CA = Setting[Path | None]("nats_tls_ca", lambda: None, flag="--nats-tls-ca", env="INBOXMESH_NATS_TLS_CA",
                                   parse=Path)
NATS_TLS_CERT = Setting[Path | None]("nats_tls_cert", lambda: None, flag="--nats-tls-cert",
                                     env="INBOXMESH_NATS_TLS_CERT", parse=Path)
NATS_TLS_KEY = Setting[Path | None]("nats_tls_key", lambda: None, flag="--nats-tls-key",
                                    env="INBOXMESH_NATS_TLS_KEY", parse=Path)
"""TLS to the NATS servers (`tls://` URLs): the CA to trust, and a client certificate for mutual TLS."""
NATS_NAMESPACE = Setting("nats_namespace", lambda: _STORE.nats_namespace, flag="--nats-namespace", check=_text)
IOA_NETWORK = Setting[str | None]("ioa_network", lambda: None, flag="--ioa-network")
NODE_ID = Setting[str | None]("node_id", lambda: None, flag="--node-id")
"""Default (None): mesh-<port>, or mesh-any on port 0."""
IOA_EXPOSE = Setting("ioa_expose", lambda: "all", flag="--ioa-expose", check=_text)
"""Which local agents the IOA network can reach: all, none, or agent:<id>,scope:<id> items."""
IOA_OUTBOX = Setting("ioa_outbox", lambda: False, flag="--ioa-outbox")
"""Sends to an IOA node that cannot be reached go into the outbox unless their request says otherwise."""
WEB_PORT = Setting[int | None]("web_port", lambda: None, flag="--web-port", env="INBOXMESH_WEB_PORT",
                               parse=_web_port, check=_web_port_value)
"""The web view's port on the mesh's host: a number (0: any free one) or "off"; not given (None): the default
port, or any free one when another process has it."""
NO_WEB = Setting("no_web", lambda: False, flag="--no-web")
"""No web view (the same as `--web-port off`)."""
ROUTING = Setting[Path | None]("routing", lambda: None, flag="--routing", parse=Path)
TLS_CERT = Setting[Path | None]("tls_cert", lambda: None, flag="--tls-cert", env="INBOXMESH_TLS_CERT", parse=Path)
TLS_KEY = Setting[Path | None]("tls_key", lambda: None, flag="--tls-key", env="INBOXMESH_TLS_KEY", parse=Path)
TLS_CLIENT_CA = Setting[Path | None]("tls_client_ca", lambda: None, flag="--tls-client-ca",
                                     env="INBOXMESH_TLS_CLIENT_CA", parse=Path)
"""A server's: its certificate and key (TLS), and the CA of the client certificates it requires (mutual TLS)."""
INSECURE = Setting("insecure", lambda: False, flag="--insecure")
BIND_CREDENTIALS = Setting("bind_credentials", lambda: False, flag="--bind-credentials")
"""Agents registered over mutual TLS work only from the client certificate they were registered from."""
"""Allow plaintext on a listen address that is not a loopback one."""
IOA_TLS_CA = Setting[Path | None]("ioa_tls_ca", lambda: None, flag="--ioa-tls-ca", env="INBOXMESH_IOA_TLS_CA",
                                  parse=Path)
IOA_TLS_CERT = Setting[Path | None]("ioa_tls_cert", lambda: None, flag="--ioa-tls-cert",
                                    env="INBOXMESH_IOA_TLS_CERT", parse=Path)
IOA_TLS_KEY = Setting[Path | None]("ioa_tls_key", lambda: None, flag="--ioa-tls-key", env="INBOXMESH_IOA_TLS_KEY",
                                   parse=Path)
"""The relay's connection to the IOA network: the CA it trusts, and its own certificate and key (mutual TLS)."""
MAX_SPAWN_DEPTH = Setting("max_spawn_depth", lambda: _RUNS.max_spawn_depth, flag="--max-spawn-depth",
                          parse=_integer, check=_at_least(1))
MAX_ACTIVE_CHILDREN = Setting("max_active_children", lambda: _RUNS.max_active_children,
                              flag="--max-active-children", parse=_integer, check=_at_least(1))
CONVERSATION_BUDGET = Setting("conversation_budget", lambda: _LIMITS.conversation_budget,
                              flag="--conversation-budget", parse=_integer, check=_at_least(1))
MAX_TRAIL_VISITS = Setting("max_trail_visits", lambda: _LIMITS.max_trail_visits, flag="--max-trail-visits",
                           parse=_integer, check=_at_least(1))
RUN_ARCHIVE_AFTER_MIN = Setting("run_archive_after_min", lambda: _RUNS.archive_after_s / 60,
                                flag="--run-archive-after", parse=_number, check=_positive)


def _routing_layer(path: Path) -> dict[str, tuple[object, str]]:
    """The routing file's mesh-wide values, with the key each comes from (its own defaults where the file
    names none, as docs/routing.md states)."""
    routing = load_routing_config(path)
    guard, subagents = f"{path}: agents.defaults.loopGuard", f"{path}: agents.defaults.subagents"
    return {
        MAX_TRAIL_VISITS.key: (routing.loop_guard.max_visits, f"{guard}.maxVisits"),
        CONVERSATION_BUDGET.key: (routing.loop_guard.conversation_budget, f"{guard}.conversationBudget"),
        RUN_ARCHIVE_AFTER_MIN.key: (routing.archive_after_minutes, f"{subagents}.archiveAfterMinutes"),
    }


def mesh_config(flags: Mapping[str, object], env: Mapping[str, str]) -> MeshConfig:
    """The frozen MeshConfig of `inboxmesh up`, from its parsed flags (argparse dest -> value, None = not
    given) and the environment, by the precedence flag > environment > file > default (module docstring).
    Raises InvalidArgument naming the flag, variable or file key of a bad value."""
    routing = _Layers(flags, env).value(ROUTING)
    layers = _Layers(flags, env, _routing_layer(routing) if routing is not None else None)
    port, services, network, node_id = (layers.value(PORT), layers.value(SERVICES), layers.value(IOA_NETWORK),
                                        layers.value(NODE_ID))
    backend, urls, replicas, namespace = (layers.value(BACKEND), layers.value(NATS), layers.value(NATS_REPLICAS),
                                          layers.value(NATS_NAMESPACE))  # every given flag is checked, used or not
    monitors, lazy_fsync = layers.value(NATS_MONITOR), bool(layers.value(NATS_LAZY_FSYNC))
    store = StoreConfig(path=layers.value(DATA_DIR) / "mesh.db", synchronous=layers.value(SYNCHRONOUS))
    if backend == "jetstream":
        if not urls:
            raise errors.InvalidArgument("--store jetstream needs --nats URL[,URL...]", reason=Reason.BAD_CONFIG,
                                         metadata={"setting": "--nats"})
        store = replace(store, backend="jetstream", nats_urls=urls, nats_replicas=replicas, nats_namespace=namespace,
                        nats_monitor_urls=monitors, nats_accept_lazy_fsync=lazy_fsync,
                        nats_tls=TlsFiles(layers.value(NATS_TLS_CERT), layers.value(NATS_TLS_KEY),
                                          layers.value(NATS_TLS_CA), NATS_TLS_NAMES))
    ioa = None
    if network:
        ioa = IoaConfig(node_id=node_id or f"mesh-{port or 'any'}", network=network,
                        outbox=bool(layers.value(IOA_OUTBOX)), expose=layers.value(IOA_EXPOSE),
                        tls=TlsFiles(layers.value(IOA_TLS_CERT), layers.value(IOA_TLS_KEY), layers.value(IOA_TLS_CA),
                                     RELAY_TLS_NAMES))
        services = tuple(dict.fromkeys((*services, "relay")))
    return MeshConfig(
        host=layers.value(HOST),
        port=port,
        tls=server_tls(flags, env),
        insecure=bool(layers.value(INSECURE)),
        bind_credentials=bool(layers.value(BIND_CREDENTIALS)),
        store=store,
        limits=replace(_LIMITS, default_capacity=layers.value(CAPACITY),
                       allow_cross_scope=bool(layers.value(CROSS_SCOPE)),
                       conversation_budget=layers.value(CONVERSATION_BUDGET),
                       max_trail_visits=layers.value(MAX_TRAIL_VISITS)),
        services=services,
        ioa=ioa,
        admin_token=layers.value(ADMIN_TOKEN),
        heartbeat_interval_s=float(layers.value(HEARTBEAT)),
        runs=replace(_RUNS, max_spawn_depth=layers.value(MAX_SPAWN_DEPTH),
                     max_active_children=layers.value(MAX_ACTIVE_CHILDREN),
                     archive_after_s=float(layers.value(RUN_ARCHIVE_AFTER_MIN)) * 60),
        routing=routing,
        web=_web(flags, layers),
    )


def _web(flags: Mapping[str, object], layers: _Layers) -> WebConfig | None:
    """`up`'s web view: on by default at DEFAULT_WEB_PORT (a free port when that one is taken); --web-port N
    (0: any free port) or INBOXMESH_WEB_PORT; off with --no-web or --web-port off."""
    port, off = layers.value(WEB_PORT), bool(layers.value(NO_WEB))
    if off and flags.get(WEB_PORT.dest) is not None and port != WEB_OFF:
        raise _bad("--no-web", "--web-port asks for a web view that --no-web turns off: give one of them")
    if off or port == WEB_OFF:
        return None
    if port is None:
        return WebConfig(port=DEFAULT_WEB_PORT, any_port_if_taken=True)
    return WebConfig(port=port)


def server_tls(flags: Mapping[str, object], env: Mapping[str, str]) -> TlsFiles:
    """A server's TLS files (`up`, `ioa-server`): --tls-cert, --tls-key, --tls-client-ca, or their variables."""
    layers = _Layers(flags, env)
    return TlsFiles(layers.value(TLS_CERT), layers.value(TLS_KEY), layers.value(TLS_CLIENT_CA), SERVER_TLS_NAMES)


def data_dir(flags: Mapping[str, object], env: Mapping[str, str]) -> Path:
    """The state directory (`--data-dir` > INBOXMESH_DATA_DIR > .inboxmesh): SQLite file and mesh.json."""
    return _Layers(flags, env).value(DATA_DIR)


def routing_rules(config: MeshConfig) -> RoutingConfig | None:
    """The routing config a mesh serves (agents, bindings, sessions, ingress tokens), read from the file
    MeshConfig.routing names; its mesh-wide values reached MeshConfig through mesh_config."""
    return load_routing_config(config.routing) if config.routing is not None else None


# -- the client commands (register, send, tail, status, events, close, run) ---------------------------------
ADDRESS = Setting("address", lambda: f"127.0.0.1:{DEFAULT_PORT}", flag="--mesh", env=ENV_ADDRESS, check=_text)
CLIENT_ADMIN_TOKEN = Setting[str | None]("admin_token", lambda: None, env=ENV_ADMIN_TOKEN)
"""No flag: a command that acts as an agent passes --as; the token is for operators' reads."""
TIMEOUT = Setting("timeout_s", lambda: 10.0, flag="--timeout", parse=_number, check=_positive)
TLS_CA = Setting[Path | None]("tls_ca", lambda: None, flag="--tls-ca", env="INBOXMESH_TLS_CA", parse=Path)
TLS_CLIENT_CERT = Setting[Path | None]("tls_client_cert", lambda: None, flag="--tls-client-cert",
                                       env="INBOXMESH_TLS_CLIENT_CERT", parse=Path)
TLS_CLIENT_KEY = Setting[Path | None]("tls_client_key", lambda: None, flag="--tls-client-key",
                                      env="INBOXMESH_TLS_CLIENT_KEY", parse=Path)
"""A client's: the CA it trusts (TLS), and its own certificate and key for a mesh that requires one."""
CLIENT_TLS_NAMES = ("--tls-client-cert", "--tls-client-key", "--tls-ca")


def client_tls(flags: Mapping[str, object], env: Mapping[str, str]) -> TlsFiles:
    """A client's TLS files (the client commands, `up`'s demo): --tls-ca, --tls-client-cert, --tls-client-key,
    or their variables; none: plaintext."""
    layers = _Layers(flags, env)
    return TlsFiles(layers.value(TLS_CLIENT_CERT), layers.value(TLS_CLIENT_KEY), layers.value(TLS_CA),
                    CLIENT_TLS_NAMES)


def client_settings(flags: Mapping[str, object], env: Mapping[str, str]) -> ClientSettings:
    """Where the client commands find the mesh, by the same precedence; the file is the state file of the
    mesh in the data directory, when there is one."""
    data = data_dir(flags, env)
    state = read_state(data)
    where = str(data / STATE_FILE)
    layers = _Layers(flags, env, {key: (value, f"{where}: {key}") for key, value in state.items()
                                  if key in (ADDRESS.key, CLIENT_ADMIN_TOKEN.key) and value})
    return ClientSettings(address=layers.value(ADDRESS), admin_token=layers.value(CLIENT_ADMIN_TOKEN),
                          data_dir=data, timeout_s=float(layers.value(TIMEOUT)), tls=client_tls(flags, env))


# -- the state file -----------------------------------------------------------------------------------------
def write_state(data: Path, address: str, admin_token: str | None, web: str | None = None) -> Path:
    """Tell other CLI commands where the mesh listens (and its admin token, and its web view's address
    when it serves one); readable by the owner only."""
    data.mkdir(parents=True, exist_ok=True)
    path = data / STATE_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file left by someone else with a looser mode is made the owner's alone first
    with os.fdopen(fd, "w") as handle:
        state: dict[str, Any] = {"address": address, "admin_token": admin_token, "pid": os.getpid()}
        if web is not None:
            state["web"] = web
        json.dump(state, handle)
    return path


def read_state(data: Path) -> dict[str, Any]:
    """What `inboxmesh up` wrote into the data directory; {} when it wrote nothing."""
    path = data / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise errors.InvalidArgument(f"{path}: cannot read the mesh's state file: {exc}",
                                     reason=Reason.BAD_CONFIG_FILE, metadata={"source": str(path)}) from None
    if not isinstance(state, dict):
        raise errors.InvalidArgument(f"{path}: expected a JSON object", reason=Reason.BAD_CONFIG_FILE,
                                     metadata={"source": str(path)})
    return state
