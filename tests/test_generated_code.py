"""The generated package must be exactly what protos/generate.py produces
from protos/ with the pinned grpcio-tools."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("protos_generate", ROOT / "protos" / "generate.py")
    assert spec is not None and spec.loader is not None, "protos/generate.py cannot be loaded"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_package_is_up_to_date(tmp_path):
    generator = _load_generator()
    written = generator.generate(tmp_path)
    assert written, "the generator produced nothing"
    fresh = {p.relative_to(tmp_path) for p in written}
    committed = {
        p.relative_to(ROOT)
        for p in (ROOT / "inboxmesh").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and generator.is_generated(p.relative_to(ROOT))
    }
    assert fresh == committed, (
        f"files differ: only fresh {sorted(fresh - committed)}, only committed {sorted(committed - fresh)}")
    stale = [str(rel) for rel in sorted(fresh) if (tmp_path / rel).read_bytes() != (ROOT / rel).read_bytes()]
    assert not stale, f"regenerate with `python protos/generate.py`: stale {stale}"


def test_contract_has_no_language_specific_payloads():
    """Content is text or bytes with a media type; no pickles, no Python types."""
    from inboxmesh.common.v1 import envelope_pb2

    for proto in (ROOT / "protos").rglob("*.proto"):
        text = proto.read_text().lower()
        assert "pickle" not in text and "python" not in text, proto
    fields = {f.name: f.type for f in envelope_pb2.Content.DESCRIPTOR.fields}
    assert set(fields) == {"text", "data", "media_type"}
    assert sys.modules["inboxmesh.common.v1.envelope_pb2"].DESCRIPTOR.package == "inboxmesh.common.v1"
