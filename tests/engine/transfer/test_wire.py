import pytest

from flashpd.engine.transfer.wire import TransferNotice, block_runs


def test_notice_round_trip_keeps_block_order_and_compresses_runs():
    notice = TransferNotice("req-7", "prefill-3", (4, 5, 6, 9, 1, 2))
    assert block_runs(notice.dst_block_ids) == [[4, 3], [9, 1], [1, 2]]
    assert TransferNotice.from_bytes(notice.to_bytes()) == notice


@pytest.mark.parametrize("raw", [b"", b"{}", b"[1]", b'{"v": 2, "rid": "r", "inc": "p", "runs": []}',
                                 b'{"v": 1, "rid": "r", "inc": "p", "runs": [[1]]}', b"\xff"])
def test_malformed_notice_raises_value_error(raw):
    with pytest.raises(ValueError):
        TransferNotice.from_bytes(raw)
