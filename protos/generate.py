"""Generate the Python code for every .proto under protos/ into ./inboxmesh.

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
    for directory in [package_root, *sorted(p for p in package_root.rglob("*") if p.is_dir())]:
        if directory.name == "__pycache__":
            continue
        init = directory / "__init__.py"
        init.write_text(HEADER)
    return sorted(p for p in package_root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="directory to write the inboxmesh package into")
    args = parser.parse_args(argv)
    written = generate(args.out)
    print(f"generated {len(written)} files under {args.out / PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
