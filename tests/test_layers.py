"""The import graph points one way (docs/architecture.md):

    inboxmesh.cli  ->  agent_host, services          (the only code that sees both sides)
    inboxmesh.cli  ->  inboxmesh.mcp  ->  inboxmesh.client   (the MCP server: a client of the mesh)
    inboxmesh.cli  ->  inboxmesh.a2a  ->  inboxmesh.client   (the A2A gateway: a client of the mesh)
    agent_host     ->  inboxmesh.client
    services       ->  services.store  ->  inboxmesh.client  ->  inboxmesh.<service>.v1 (generated)

Every import statement of a module counts, wherever it stands: at the top, inside a function, or under
`if TYPE_CHECKING:`. The harness, the tests and the benchmarks stand above everything and may import
anything of ours; nothing of ours imports them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.store_independent

ROOT = Path(__file__).resolve().parent.parent
GENERATED = re.compile(r"^inboxmesh\.[a-z]+\.v1(\.|$)")
OURS = ("inboxmesh", "services", "agent_host", "harness", "bench", "tests")

SHARED_BY_SERVERS = ("services.clock", "services.config", "services.faults", "services.tls")
"""Leaf modules of `services` that the store and the reference IOA network may use (clock, frozen
configuration, crash points, TLS files): they import nothing of the mesh."""

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # (module prefix, what its imports of ours may name); the first matching prefix rules
    ("inboxmesh.client", ("inboxmesh.client",)),
    ("inboxmesh.cli", ("inboxmesh.client", "inboxmesh.cli", "inboxmesh.mcp", "inboxmesh.a2a", "services",
                       "agent_host")),
    ("inboxmesh.mcp", ("inboxmesh.client", "inboxmesh.mcp")),  # a client of the mesh, like the CLI's commands
    ("inboxmesh.a2a", ("inboxmesh.client", "inboxmesh.a2a")),  # likewise
    ("services.store", ("inboxmesh.client", "services.store", *SHARED_BY_SERVERS)),
    ("services.ioa_network", ("inboxmesh.client", "services.ioa_network", "services.grpc_common",
                              *SHARED_BY_SERVERS)),
    ("services", ("inboxmesh.client", "services")),
    ("agent_host", ("inboxmesh.client", "agent_host")),
    ("inboxmesh", ()),  # the generated package: protos only
    ("harness", OURS),
    ("bench", OURS),
    ("tests", OURS),
]
FORBIDDEN_INSIDE_SERVICES = {"services.ioa_network": "the mesh does not import the reference IOA network (a "
                             "separate program it reaches over the network contract)"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(dotted: str) -> bool:
    """Whether dotted names a module or package of ours (not a class or function inside one)."""
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_of(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import statement in source, relative ones resolved; for
    `from pkg import name`, pkg.name as well when that is a module of ours."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names
                      if is_module(f"{base}.{alias.name}")]
    return found


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations() -> list[str]:
    found = []
    folders = ["inboxmesh", "services", "agent_host", "harness", "bench", "tests"]
    for path in sorted(p for f in folders for p in (ROOT / f).rglob("*.py") if "__pycache__" not in p.parts):
        name = module_name(path)
        generated = bool(GENERATED.match(name)) or name == "inboxmesh"
        allowed = () if generated else next(rule for prefix, rule in LAYERS if _within(name, (prefix,)))
        for line, target in imports_of(path.read_text(), name, path.name == "__init__.py"):
            if not _within(target, OURS) or GENERATED.match(target) or target == "inboxmesh":
                continue
            where = f"{path.relative_to(ROOT)}:{line}: {name} imports {target}"
            if not _within(target, allowed):
                found.append(where)
            elif _within(name, ("services",)) and not _within(name, ("services.ioa_network",)):
                found += [f"{where}: {why}" for forbidden, why in FORBIDDEN_INSIDE_SERVICES.items()
                          if _within(target, (forbidden,))]
    return found


def test_layers_import_only_downwards():
    found = violations()
    assert not found, "imports against the layering (docs/architecture.md):\n" + "\n".join(found)


def test_the_check_sees_every_kind_of_import():
    """The scan reads imports inside functions and under TYPE_CHECKING, and resolves relative ones."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from services.server import Mesh\n"
        "def later():\n"
        "    import agent_host.host\n"
        "    from .. import cli\n"
        "    from . import errors\n"
    )
    names = {target for _, target in imports_of(source, "inboxmesh.client.probe")}
    assert {"services.server", "agent_host.host", "inboxmesh.cli", "inboxmesh.client.errors"} <= names


def test_the_distribution_ships_the_layers_a_user_needs():
    """pyproject.toml installs the protos with the client and the CLI, the mesh and the host; not the
    harness, the tests or the benchmarks."""
    text = (ROOT / "pyproject.toml").read_text()
    include = re.search(r"\[tool\.setuptools\.packages\.find\]\ninclude = \[([^\]]*)\]", text)
    assert include, "pyproject.toml names what it ships"
    shipped = set(re.findall(r'"([^"]+)"', include.group(1)))
    assert shipped == {"inboxmesh*", "services*", "agent_host*"}, shipped
