"""docs/delivery-contract.md lists every refusal a client can get (status code and ErrorInfo reason) in
one table; this test reads the code for every (error class, reason) it can raise and fails when the two
disagree in either direction."""

import ast
import re
from pathlib import Path

import pytest

from inboxmesh.client import errors
from inboxmesh.client.status import STATUS_OF
from inboxmesh.ioa.v1 import network_pb2 as net

pytestmark = pytest.mark.store_independent

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "delivery-contract.md"
SCANNED = ("services", "inboxmesh/client")
"""The mesh, the reference IOA network and the Python client (the command line's own messages are printed,
no client receives them)."""
ERROR_CLASSES = {cls.__name__: cls for cls in STATUS_OF}
ROW = re.compile(r"^\| `([A-Z_]+)` \| `([A-Z0-9_]+)` \|")


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = Reason.X assignments (reasons kept in constants)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and (member := _member(node.value)) is not None:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = member
    return found


def _member(value: ast.expr) -> str | None:
    """X of an expression `Reason.X` (None for anything else)."""
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "Reason":
        return value.attr
    return None


def _reasons_of(value: ast.expr, constants: dict[str, str], where: str) -> set[str]:
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        raise AssertionError(f"{where}: reason {value.value!r} as a string; use Reason.{value.value}")
    if (member := _member(value)) is not None:
        assert member in errors.Reason.__members__, f"{where}: Reason.{member} is not a member"
        return {member}
    if isinstance(value, ast.Name) and value.id in constants:
        return {constants[value.id]}
    text = ast.unparse(value)
    if text == "Reason('IOA_' + net.PublishStatus.Name(answer.status))":  # the network's publish refusals
        return {"IOA_" + name for name in net.PublishStatus.keys() if not name.endswith(("UNSPECIFIED", "_OK"))}
    if text == "reason" and where == "services/routing/config.py":  # _Reader.fail(path, problem, reason)
        return set()
    raise AssertionError(f"{where}: a reason the test cannot read ({text}); use a constant")


def _config_reasons(tree: ast.Module) -> set[str]:
    """services/routing/config.py reports its reasons through _Reader.fail(path, problem, reason)."""
    found = {_member(node.args[2]) for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "fail" and len(node.args) == 3}
    assert None not in found, "services/routing/config.py: a fail() reason that is not Reason.X"
    return {member for member in found if member}


def raised_in_code() -> set[tuple[str, str]]:
    """(status code name, reason) of every MeshError the mesh and its Python client construct."""
    found: set[tuple[str, str]] = set()
    for path in sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py")):
        where = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        constants = _constants(tree)
        if where == "services/routing/config.py":
            found |= {("INVALID_ARGUMENT", r) for r in _config_reasons(tree)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            cls = ERROR_CLASSES.get(name)
            if cls is None:
                continue
            code = STATUS_OF[cls].name
            given = [kw.value for kw in node.keywords if kw.arg == "reason"]
            reasons = _reasons_of(given[0], constants, where) if given else {cls.default_reason}
            found |= {(code, reason) for reason in reasons}
    return found


def documented() -> set[tuple[str, str]]:
    text = DOC.read_text()
    section = text[text.index("## Every refusal"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    return {(m.group(1), m.group(2)) for line in section.splitlines() if (m := ROW.match(line))}


def test_the_refusal_table_and_the_code_agree():
    in_code, in_doc = raised_in_code(), documented()
    assert in_code, "the scan found no errors at all"
    missing = sorted(in_code - in_doc)
    stale = sorted(in_doc - in_code - GRPC_OWN)
    assert not missing, f"raised by the code but not in {DOC.name}'s table: {missing}"
    assert not stale, f"in {DOC.name}'s table but raised nowhere: {stale}"


GRPC_OWN = {("RESOURCE_EXHAUSTED", "NONE"), ("UNAVAILABLE", "NONE"), ("DEADLINE_EXCEEDED", "NONE"),
            ("UNIMPLEMENTED", "NONE"), ("CANCELLED", "NONE")}
"""Statuses gRPC itself answers, with no ErrorInfo (the table lists them with reason `NONE`)."""


def test_the_reason_enumeration_is_the_table():
    """errors.Reason lists exactly the reasons of the table (the client and the docs share one list)."""
    in_doc = {reason for _, reason in documented()} - {"NONE"}
    members = set(errors.Reason.__members__)
    assert not members - in_doc, f"Reason members the table does not list: {sorted(members - in_doc)}"
    assert not in_doc - members, f"reasons of the table that Reason lacks: {sorted(in_doc - members)}"


def test_every_error_class_has_a_status():
    for cls in vars(errors).values():
        if isinstance(cls, type) and issubclass(cls, errors.MeshError) and cls is not errors.MeshError:
            assert cls in STATUS_OF, f"{cls.__name__} has no gRPC status in inboxmesh/client/status.py"
