"""Generate the Python code for every .proto under protos/ into ./inboxmesh (beside the hand-written
inboxmesh/client, inboxmesh/cli and inboxmesh/mcp, which it leaves alone).

The one command that produces the generated package (pinned by the
grpcio-tools version in pyproject.toml):

    python protos/generate.py            # write into the repository
    python protos/generate.py --out DIR  # write elsewhere (used by the
                                         # test that checks nothing is stale)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PACKAGE = "inboxmesh"
HEADER = '"""Generated from protos/ by `python protos/generate.py`. Do not edit."""\n'
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
HAND_WRITTEN = ("client", "cli", "mcp", "a2a")
"""Subpackages of inboxmesh/ that are written by hand, beside the generated ones."""


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.joinpath(PACKAGE).rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc for all protos into out_dir; return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    package_root = out_dir / PACKAGE
    generated = [out_dir / PACKAGE / Path(f).with_suffix("").relative_to(PACKAGE) for f in files]
    written = {g.with_name(g.name + suffix) for g in generated for suffix in GENERATED_SUFFIXES}
    directories = {package_root}
    for path in written:
        directories.update(d for d in path.parents if d.is_relative_to(package_root))
    for directory in directories:
        init = directory / "__init__.py"
        init.write_text(HEADER)
        written.add(init)
    return sorted(written)


def is_generated(relative: Path) -> bool:
    """Whether a file under the package (path relative to the repository) is one the generator writes:
    the protos' modules and the `__init__.py` of their folders. The hand-written client, CLI and MCP server
    (`inboxmesh/client`, `inboxmesh/cli`, `inboxmesh/mcp`) live beside them and are left alone."""
    parts = relative.parts
    if len(parts) > 2 and parts[1] in HAND_WRITTEN:
        return False
    return relative.name == "__init__.py" or relative.name.endswith(GENERATED_SUFFIXES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="directory to write the inboxmesh package into")
    args = parser.parse_args(argv)
    written = generate(args.out)
    print(f"generated {len(written)} files under {args.out / PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
