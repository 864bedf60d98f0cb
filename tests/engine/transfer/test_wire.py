import pytest

from flashpd.engine.transfer.base import checked_runs
from flashpd.engine.transfer.wire import TransferNotice, block_runs, write_notice_bytes


def test_notice_round_trip_keeps_block_order_and_compresses_runs():
    notice = TransferNotice("req-7", "prefill-3", (4, 5, 6, 9, 1, 2))
    assert block_runs(notice.dst_block_ids) == [[4, 3], [9, 1], [1, 2]]
    assert TransferNotice.from_bytes(notice.to_bytes()) == notice


@pytest.mark.parametrize("dst", [[4, 5, 6, 9, 1, 2], [7], list(range(300, 1324)), [5, 3, 4, 0]])
def test_a_write_notice_from_runs_names_exactly_the_pushed_blocks(dst):
    src = list(range(len(dst)))
    runs = checked_runs(src, dst, len(dst), 2048)
    got = TransferNotice.from_bytes(write_notice_bytes("req-7", "prefill-3", runs.dst_start, runs.length))
    assert (got.request_id, got.incarnation, got.kind) == ("req-7", "prefill-3", "write")
    assert sorted(got.dst_block_ids) == sorted(dst)


def test_a_one_run_write_notice_is_the_classic_notice_byte_for_byte():
    runs = checked_runs(range(64), range(100, 164), 64, 256)
    fast = write_notice_bytes("r", "t.1", runs.dst_start, runs.length)
    assert fast == TransferNotice("r", "t.1", tuple(range(100, 164))).to_bytes()
    assert runs.dst_start == (100,) and type(runs.dst_start[0]) is int


@pytest.mark.parametrize("request_id", ["req-7", 'a"b\\c', "tab\there", "caf\u00e9 \U0001f600", ""])
@pytest.mark.parametrize("dst", [[4, 5, 6, 9, 1, 2], list(range(300, 1324)), [5, 3, 4, 0]])
def test_write_notices_are_the_classic_notice_byte_for_byte(request_id, dst):
    """The formatted notice is what json.dumps wrote before (receivers of either version read
    it), escapes included."""
    runs = checked_runs(list(range(len(dst))), dst, len(dst), 2048)
    fast = write_notice_bytes(request_id, "inc-\u00e9", runs.dst_start, runs.length)
    assert fast == TransferNotice(request_id, "inc-\u00e9", tuple(dst)).to_bytes()


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{}",
        b"[1]",
        b'{"v": 2, "rid": "r", "inc": "p", "runs": []}',
        b'{"v": 1, "rid": "r", "inc": "p", "runs": [[1]]}',
        b"\xff",
    ],
)
def test_malformed_notice_raises_value_error(raw):
    with pytest.raises(ValueError):
        TransferNotice.from_bytes(raw)


def test_abandon_notices_round_trip_and_old_notices_read_as_writes():
    import json

    n = TransferNotice("r", "", (), kind="abandon_all", before_unix_s=12.5)
    assert TransferNotice.from_bytes(n.to_bytes()) == n
    old = json.dumps({"v": 1, "rid": "r", "inc": "t", "runs": [[3, 2]]}).encode()
    assert TransferNotice.from_bytes(old).kind == "write"
    with pytest.raises(ValueError, match="kind"):
        TransferNotice("r", "t", (), kind="bogus")
