"""`flashpd serve` stops on SIGTERM: exit 0, and no process of its Ray instance or Redis is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashpd.services.redis_local import free_port

pytestmark = pytest.mark.net


def _descendants(root: int) -> set[int]:
    """Every live process below `root` (Ray's GCS, raylet, workers, and the local Redis)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(proc.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for_line(proc: subprocess.Popen, needle: str, lines: list[str]) -> None:
    for line in proc.stdout:  # bounded by the pytest timeout
        lines.append(line)
        if needle in line:
            return
    raise AssertionError("flashpd serve exited before serving:\n" + "".join(lines[-40:]))


def test_sigterm_stops_serve_and_leaves_no_ray_or_redis_process(tmp_path):
    grpc_port, http_port = free_port(), free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flashpd.cli",
            "serve",
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--num-blocks",
            "64",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    try:
        _wait_for_line(proc, "flashpd serving", lines)
        started = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "flashpd: stopped" in out
    assert len(started) >= 3  # Redis, GCS, raylet at least
    deadline = time.monotonic() + 30  # reaping is asynchronous; a hang fails, nothing is timed
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in started if _alive(p)] == []
