"""docs/clients.md is what a host in another language works from (issue 18): its table of authentication
per RPC must be the code's (services/auth_policy.METHOD_POLICIES, row for row), the google.rpc protos it
points to must be the ones the mesh's error details are built from, and the compile command it shows must
compile every proto a client needs."""

from __future__ import annotations

import re
from pathlib import Path

import google.rpc  # type: ignore[import-untyped]
import grpc_tools
import pytest
from grpc_tools import protoc

from services.auth_policy import METHOD_POLICIES

pytestmark = pytest.mark.store_independent

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "clients.md"
THIRD_PARTY = ROOT / "protos" / "third_party"
ROW = re.compile(r"^\| `([A-Za-z0-9_.]+/[A-Za-z]+)` \| `([A-Z_]+)` \|", re.M)


def test_the_authentication_table_is_the_codes_row_for_row():
    documented = dict(ROW.findall(DOC.read_text()))
    served = {name.lstrip("/"): rule.policy.name for name, rule in METHOD_POLICIES.items()}
    assert documented == served, {
        "documented, not served": sorted(documented.keys() - served.keys()),
        "served, not documented": sorted(served.keys() - documented.keys()),
        "other policy": sorted(m for m in documented.keys() & served.keys() if documented[m] != served[m])}


@pytest.mark.parametrize("name", ["status.proto", "error_details.proto"])
def test_the_shipped_google_rpc_protos_are_the_ones_the_mesh_builds_errors_from(name):
    """The mesh's ErrorInfo and Status come from googleapis-common-protos (inboxmesh/client/status.py): the
    copies under protos/third_party must be that package's files, byte for byte."""
    package = Path(next(iter(google.rpc.__path__))) / name
    assert (THIRD_PARTY / "google" / "rpc" / name).read_bytes() == package.read_bytes()


def test_every_proto_a_client_needs_compiles_with_the_two_roots_the_doc_names(tmp_path):
    """protoc with `-I protos -I protos/third_party` (and the well-known types every toolchain ships)."""
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos" / "inboxmesh").rglob("*.proto"))
    rpc = sorted(str(p.relative_to(THIRD_PARTY)) for p in THIRD_PARTY.rglob("*.proto"))
    assert len(protos) >= 8 and rpc == ["google/rpc/error_details.proto", "google/rpc/status.proto"]
    well_known = Path(next(iter(grpc_tools.__path__))) / "_proto"
    rc = protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"-I{THIRD_PARTY}", f"-I{well_known}",
                      f"--descriptor_set_out={tmp_path / 'all.pb'}", *protos, *rpc])
    assert rc == 0 and (tmp_path / "all.pb").stat().st_size > 0
    text = DOC.read_text()
    assert "-I protos -I protos/third_party" in text and '"protos", "protos/third_party"' in text
