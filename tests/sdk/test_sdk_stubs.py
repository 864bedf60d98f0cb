"""The committed stubs are what sdk/generate_stubs.py makes from proto/flashpd.proto."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "sdk" / "generate_stubs.py"


def test_committed_stubs_are_up_to_date():
    # In a child process: grpc_tools' bundled protoc crashes when loaded beside torch.
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_sdk_imports_only_grpc_and_protobuf():
    import ast

    sdk = SCRIPT.parent / "flashpd_sdk"
    allowed = {"grpc", "google", "flashpd_sdk", "__future__"}
    stdlib_ok = {"asyncio", "collections", "dataclasses", "json", "logging", "threading", "time", "typing", "uuid"}
    for path in sdk.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            for name in names:
                root = name.split(".")[0]
                assert root in allowed | stdlib_ok, f"{path.name} imports {name}"
