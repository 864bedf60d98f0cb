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
    assert all("| 8 |" in row for row in rows)  # one descriptor per group (one run)


def test_the_block_major_layout_moves_the_same_bytes_in_one_descriptor_per_run(tmp_path):
    out = tmp_path / "phases.md"
    argv = ["--sizes", "256", "--reps", "2", "--layout", "block_major", "--out", str(out)]
    assert transfer_phases.main(argv) == 0
    table = out.read_text()
    assert "--layout block_major" in table
    (row,) = [line for line in table.splitlines() if line.startswith("| 256 ")]
    head = [c.strip() for c in table.splitlines()[6].strip("|").split("|")]
    cells = dict(zip(head, (c.strip() for c in row.strip("|").split("|")), strict=True))
    assert cells["MB"] == "0.2" and cells["verified"] == "yes"  # 2 blocks x 113,920 B
    assert cells["descs"] == "1"  # one run of one group (the released layout: 8)


def test_layouts_carry_the_released_bytes_per_block():
    from flashpd.bench.transfer_bench import layout_contract

    groups, block = layout_contract("groups"), layout_contract("block_major")
    assert len(groups.groups) == 8 and len(block.groups) == 1
    assert block.bytes_per_block == groups.bytes_per_block == 113_920
    with pytest.raises(ValueError, match="layout"):
        layout_contract("rows")


def test_a_sender_holding_ballast_still_moves_every_byte(tmp_path):
    out = tmp_path / "phases.md"
    argv = ["--sizes", "128", "--reps", "2", "--ballast-gb", "0.02", "--ballast-chunk-mb", "4", "--out", str(out)]
    assert transfer_phases.main(argv) == 0
    table = out.read_text()
    assert "--ballast-gb 0.02 --ballast-chunk-mb 4" in table
    assert len(transfer_phases.ballast("cpu", 0.02, 4, 0)) == 4  # 20 MB in 4 MiB chunks


def test_pushes_beside_threads_contending_for_the_gil_still_move_every_byte(tmp_path):
    import sys
    import time

    out = tmp_path / "phases.md"
    before = sys.getswitchinterval()
    argv = ["--sizes", "128", "--reps", "2", "--busy-threads", "2", "--busy-burst-us", "300"]
    assert transfer_phases.main([*argv, "--switch-interval-us", "500", "--out", str(out)]) == 0
    table = out.read_text()
    assert "--busy-threads 2 --busy-burst-us 300 --busy-idle-us 500 --switch-interval-us 500" in table
    assert sys.getswitchinterval() == before  # the run's interval is put back
    with transfer_phases.BusyThreads(1, 1e-4, 1e-4) as busy:
        while busy.bursts < 3:  # the threads do run (and stop on exit)
            time.sleep(0.001)


def test_writes_prepared_before_cache_cold_work_still_move_every_byte(tmp_path):
    out = tmp_path / "phases.md"
    argv = ["--sizes", "128", "1024", "--reps", "2", "--before-push", "cpu", "--before-push-ms", "2", "--prepare-ahead"]
    assert transfer_phases.main([*argv, "--out", str(out)]) == 0  # 1 when a size's bytes differ
    table = out.read_text()
    assert "--before-push cpu --before-push-ms 2 --prepare-ahead" in table
    assert "| yes |" in table and "| NO |" not in table
    assert transfer_phases.before_push("cpu", 1, "cpu")() is None  # runs ~1 ms, returns
    assert transfer_phases.before_push("none", 1, "cpu") is None
    with pytest.raises(SystemExit, match="cuda"):
        transfer_phases.before_push("gpu", 1, "cpu")
