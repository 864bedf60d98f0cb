"""The CLI works on a machine without Triton: only the kernel commands import it."""

from __future__ import annotations

import subprocess
import sys

# Makes `import triton` fail in the child, as on a CPU machine that never installed it.
NO_TRITON = "import sys; sys.modules['triton'] = None; from flashpd.cli import main; "


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TRITON + code], capture_output=True, text=True, timeout=300)


def test_help_lists_every_command_without_triton():
    out = _run("main(['--help'])")
    assert out.returncode == 0, out.stderr
    for command in ("serve", "generate", "bench", "verify-kernels", "inspect"):
        assert command in out.stdout


def test_inspect_runs_without_triton():
    out = _run("raise SystemExit(main(['inspect', '--preset', 'tiny']))")
    assert out.returncode == 0, out.stderr
