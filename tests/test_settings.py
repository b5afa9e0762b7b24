"""Configuration from flags, the environment and files (services.settings): one precedence for every
setting (flag > environment > file > default), a bad value refused with a message that names where it
came from, and the command line's parser feeding it. The flags are the CLI's own parser's output, the
environment a plain dict, the files real files in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from inboxmesh.cli.main import build_parser
from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from services import settings
from services.config import InboxLimits, MeshConfig, RunsConfig, StoreConfig

pytestmark = pytest.mark.store_independent

ROUTING = """\
agents:
  defaults:
    subagents: {archiveAfterMinutes: 30}
    loopGuard: {maxVisits: 3, conversationBudget: 40}
"""


def up(*argv: str) -> dict[str, object]:
    return vars(build_parser().parse_args(["up", *argv]))


def command(*argv: str) -> dict[str, object]:
    return vars(build_parser().parse_args(["events", *argv]))


def routing_file(tmp_path: Path, text: str = ROUTING) -> str:
    path = tmp_path / "routing.yaml"
    path.write_text(text)
    return str(path)


def test_up_with_nothing_given_has_the_documented_defaults():
    config = settings.mesh_config(up(), {})
    assert (config.host, config.port) == ("127.0.0.1", settings.DEFAULT_PORT)
    assert config.services == MeshConfig().services and config.ioa is None and config.routing is None
    assert config.store == StoreConfig(path=Path(".inboxmesh") / "mesh.db")
    assert config.limits == InboxLimits() and config.runs == RunsConfig()
    assert config.heartbeat_interval_s == MeshConfig().heartbeat_interval_s
    assert config.admin_token, "a random operator token when none is given"
    assert settings.mesh_config(up(), {}).admin_token != config.admin_token


def test_a_flag_wins_over_the_environment_which_wins_over_the_default():
    env = {settings.ENV_ADMIN_TOKEN: "from-env", settings.ENV_DATA_DIR: "/srv/env"}
    given = settings.mesh_config(up("--admin-token", "from-flag", "--data-dir", "/srv/flag"), env)
    assert given.admin_token == "from-flag" and given.store.path == Path("/srv/flag/mesh.db")
    from_env = settings.mesh_config(up(), env)
    assert from_env.admin_token == "from-env" and from_env.store.path == Path("/srv/env/mesh.db")
    assert settings.data_dir(up(), env) == Path("/srv/env")
    assert settings.data_dir(up(), {settings.ENV_DATA_DIR: ""}) == Path(".inboxmesh"), "empty counts as unset"


def test_a_flag_wins_over_the_routing_file_which_wins_over_the_default(tmp_path):
    routing = routing_file(tmp_path)
    from_file = settings.mesh_config(up("--routing", routing), {})
    assert from_file.routing == Path(routing)
    assert (from_file.limits.max_trail_visits, from_file.limits.conversation_budget) == (3, 40)
    assert from_file.runs.archive_after_s == 30 * 60
    flags = settings.mesh_config(up("--routing", routing, "--max-trail-visits", "7", "--conversation-budget", "9",
                                    "--run-archive-after", "2"), {})
    assert (flags.limits.max_trail_visits, flags.limits.conversation_budget) == (7, 9)
    assert flags.runs.archive_after_s == 2 * 60
    without = settings.mesh_config(up("--max-trail-visits", "7"), {})
    assert without.limits.max_trail_visits == 7
    assert without.limits.conversation_budget == InboxLimits().conversation_budget
    assert without.runs.archive_after_s == RunsConfig().archive_after_s


def test_a_routing_file_that_names_no_loop_guard_brings_its_own_defaults(tmp_path):
    """As before the settings were merged in one place: a routing config's loop guard applies to the
    whole mesh, and its documented defaults (docs/routing.md) where it names none."""
    config = settings.mesh_config(up("--routing", routing_file(tmp_path, "agents: {list: [{id: main}]}\n")), {})
    assert (config.limits.max_trail_visits, config.limits.conversation_budget) == (5, 200)
    assert config.runs.archive_after_s == 60 * 60


def test_the_client_commands_take_the_flag_then_the_environment_then_mesh_json_then_the_default(tmp_path):
    data = tmp_path / "data"
    settings.write_state(data, "127.0.0.1:7411", "from-file")
    env = {settings.ENV_DATA_DIR: str(data)}
    flag = settings.client_settings(command("--mesh", "127.0.0.1:7499"), {**env, settings.ENV_ADDRESS: "h:1"})
    assert flag.address == "127.0.0.1:7499" and flag.data_dir == data
    from_env = settings.client_settings(command(), {**env, settings.ENV_ADDRESS: "h:1",
                                                    settings.ENV_ADMIN_TOKEN: "from-env"})
    assert (from_env.address, from_env.admin_token) == ("h:1", "from-env")
    from_file = settings.client_settings(command(), env)
    assert (from_file.address, from_file.admin_token) == ("127.0.0.1:7411", "from-file")
    nothing = settings.client_settings(command("--data-dir", str(tmp_path / "empty")), env)
    assert (nothing.address, nothing.admin_token) == (f"127.0.0.1:{settings.DEFAULT_PORT}", None)
    assert nothing.timeout_s == 10.0 and settings.client_settings(command("--timeout", "3"), {}).timeout_s == 3.0


def test_the_ioa_relay_and_the_jetstream_store_are_assembled_from_their_flags():
    config = settings.mesh_config(up("--port", "0", "--ioa-network", "127.0.0.1:7500", "--store", "jetstream",
                                     "--nats", "nats://a:4222,nats://b:4222", "--nats-replicas", "3"), {})
    assert config.ioa is not None and config.ioa.node_id == "mesh-any" and config.ioa.network == "127.0.0.1:7500"
    assert config.services == (*MeshConfig().services, "relay")
    assert config.store.backend == "jetstream" and config.store.nats_replicas == 3
    assert config.store.nats_urls == ("nats://a:4222", "nats://b:4222")
    assert config.store.nats_monitor_urls == () and not config.store.nats_accept_lazy_fsync, "checked by default"
    checked = settings.mesh_config(up("--store", "jetstream", "--nats", "nats://a:4222", "--nats-monitor",
                                      "http://a:8222, https://b:8223", "--nats-accept-lazy-fsync"), {})
    assert checked.store.nats_monitor_urls == ("http://a:8222", "https://b:8223")
    assert checked.store.nats_accept_lazy_fsync


@pytest.mark.parametrize(("argv", "env", "starts"), [
    (("--port", "70000"), {}, "--port: must be at most 65535, got 70000"),
    (("--max-trail-visits", "0"), {}, "--max-trail-visits: must be at least 1, got 0"),
    (("--heartbeat-interval", "-1"), {}, "--heartbeat-interval: must be a finite number greater than 0, got -1"),
    (("--nats-replicas", "9"), {}, "--nats-replicas: must be at most 5, got 9"),
    (("--nats-monitor", "a:8222"), {}, "--nats-monitor: expected http:// or https:// URLs of the servers'"),
    ((), {settings.ENV_ADMIN_TOKEN: "  "}, f"{settings.ENV_ADMIN_TOKEN}: is empty"),
])
def test_a_bad_value_is_refused_naming_the_setting(argv, env, starts):
    with pytest.raises(errors.InvalidArgument) as caught:
        settings.mesh_config(up(*argv), env)
    assert caught.value.message.startswith(starts), caught.value.message
    assert caught.value.reason == Reason.BAD_VALUE and caught.value.metadata["setting"] == starts.split(":")[0]


def test_text_that_is_not_a_value_is_refused_naming_the_setting():
    """Flags given as text (not through argparse's types) are read by the setting's own parser."""
    with pytest.raises(errors.InvalidArgument) as caught:
        settings.mesh_config({"max_trail_visits": "many"}, {})
    assert caught.value.message == "--max-trail-visits: cannot read 'many': expected an integer"


def test_a_bad_file_value_is_refused_naming_the_file_and_the_key(tmp_path):
    routing = routing_file(tmp_path, "agents: {defaults: {loopGuard: {maxVisits: 0}}}\n")
    with pytest.raises(errors.InvalidArgument) as caught:
        settings.mesh_config(up("--routing", routing), {})
    assert caught.value.message == f"{routing}: agents.defaults.loopGuard.maxVisits: must be at least 1, got 0"
    (tmp_path / "mesh.json").write_text("{not json")
    with pytest.raises(errors.InvalidArgument) as caught:
        settings.client_settings(command("--data-dir", str(tmp_path)), {})
    assert caught.value.message.startswith(f"{tmp_path / 'mesh.json'}: cannot read the mesh's state file")


def test_jetstream_without_nats_servers_is_refused_naming_the_flag():
    with pytest.raises(errors.InvalidArgument) as caught:
        settings.mesh_config(up("--store", "jetstream"), {})
    assert caught.value.message == "--store jetstream needs --nats URL[,URL...]"
