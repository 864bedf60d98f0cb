"""Regenerate the Python stubs in flashpd_sdk/_gen from proto/flashpd.proto.

    python sdk/generate_stubs.py          # rewrite the stubs
    python sdk/generate_stubs.py --check  # exit 1 if the committed stubs are stale

The include path maps proto/ onto the virtual folder `flashpd_sdk/_gen`, so the generated
`flashpd_pb2_grpc.py` imports `flashpd_sdk._gen.flashpd_pb2` as a package module (no sys.path
tricks, no rewriting of generated code). The output is committed and never edited by hand.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

SDK_DIR = Path(__file__).resolve().parent
PROTO_DIR = SDK_DIR.parent / "proto"
GEN_PACKAGE = "flashpd_sdk/_gen"
PROTO_FILES = ("flashpd.proto",)
GENERATED = ("flashpd_pb2.py", "flashpd_pb2.pyi", "flashpd_pb2_grpc.py")


def generate(out_root: Path) -> None:
    """Write the stubs under out_root/flashpd_sdk/_gen."""
    (out_root / GEN_PACKAGE).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{GEN_PACKAGE}={PROTO_DIR}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(PROTO_DIR / name) for name in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


def stale_files() -> list[str]:
    """Names of committed stubs that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh, committed = Path(tmp) / GEN_PACKAGE, SDK_DIR / GEN_PACKAGE
        return [
            name
            for name in GENERATED
            if not (committed / name).exists() or not filecmp.cmp(fresh / name, committed / name, shallow=False)
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale stubs")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: {GEN_PACKAGE}/{name}", file=sys.stderr)
        return 1 if stale else 0
    generate(SDK_DIR)
    init = SDK_DIR / GEN_PACKAGE / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC stubs (sdk/generate_stubs.py); do not edit."""\n')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
