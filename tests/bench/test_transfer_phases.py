"""bench/transfer_phases.py on the CPU: real NIXL between two processes over loopback, the push
from a thread that never made the pools (the Serve replica's event loop) and from the main one;
every size's bytes verified at the receiver."""

import pytest

pytest.importorskip("nixl")

from flashpd.bench import transfer_phases  # noqa: E402

pytestmark = pytest.mark.net


@pytest.mark.parametrize("loop_thread", ["main", "fresh"])
def test_pushes_are_timed_and_verified_from_either_thread(tmp_path, loop_thread):
    out = tmp_path / "phases.md"
    argv = ["--sizes", "128", "256", "--reps", "2", "--loop-thread", loop_thread, "--out", str(out)]
    assert transfer_phases.main(argv) == 0  # 1 when a size's bytes differ at the receiver
    table = out.read_text()
    assert f"--loop-thread {loop_thread}" in table and "pools on cpu" in table
    rows = [line for line in table.splitlines() if line.startswith("| 128 ") or line.startswith("| 256 ")]
    assert len(rows) == 2 and all(row.rstrip().endswith("| yes |") for row in rows)
