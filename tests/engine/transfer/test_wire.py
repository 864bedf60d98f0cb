import pytest

from flashpd.engine.transfer.wire import TransferNotice, block_runs


def test_notice_round_trip_keeps_block_order_and_compresses_runs():
    notice = TransferNotice("req-7", "prefill-3", (4, 5, 6, 9, 1, 2))
    assert block_runs(notice.dst_block_ids) == [[4, 3], [9, 1], [1, 2]]
    assert TransferNotice.from_bytes(notice.to_bytes()) == notice


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
