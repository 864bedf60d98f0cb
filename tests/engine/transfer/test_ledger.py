import pytest

from flashpd.engine.transfer.ledger import ReceiverLedger


def test_request_completes_once_all_blocks_arrived_over_several_notices():
    ledger = ReceiverLedger(num_blocks=8)
    ledger.expect("r", [1, 4, 6], lease_deadline_s=10.0, incarnation="p1")
    assert ledger.on_notice("r", "p1", [4])
    assert ledger.take_completed() == []
    assert ledger.on_notice("r", "p1", [1, 6])
    assert ledger.take_completed() == ["r"]
    assert ledger.take_completed() == []
    assert not ledger.on_notice("r", "p1", [1])
    assert ledger.rejection_counts() == {"duplicate": 1}


def test_notices_for_cancelled_expired_unknown_requests_are_rejected_by_reason():
    ledger = ReceiverLedger(num_blocks=8)
    ledger.expect("c", [0], 10.0, "p1")
    ledger.expect("e", [1], 5.0, "p1")
    assert ledger.cancel("c") and not ledger.cancel("c")
    assert ledger.expire(now_s=5.0) == ["e"]
    for rid in ("c", "e", "nobody"):
        assert not ledger.on_notice(rid, "p1", [0, 1])
    assert ledger.rejection_counts() == {"cancelled": 1, "expired": 1, "unknown": 1}
    assert ledger.take_completed() == []


def test_newer_incarnation_supersedes_and_fences_the_old_sender():
    ledger = ReceiverLedger(num_blocks=8)
    ledger.expect("r", [2, 3], 10.0, "p-old")
    ledger.expect("r", [5, 6], 10.0, "p-new")
    assert not ledger.on_notice("r", "p-old", [2, 3])
    assert not ledger.on_notice("r", "p-new", [2, 3])
    assert ledger.on_notice("r", "p-new", [5, 6])
    assert ledger.take_completed() == ["r"]
    assert ledger.rejection_counts() == {"stale_incarnation": 1, "foreign_blocks": 1}


def test_expect_validates_its_arguments():
    ledger = ReceiverLedger(num_blocks=4)
    with pytest.raises(ValueError):
        ledger.expect("r", [4], 1.0, "p")
    with pytest.raises(ValueError):
        ledger.expect("r", [1, 1], 1.0, "p")
    with pytest.raises(ValueError):
        ledger.expect("r", [], 1.0, "p")
    with pytest.raises(ValueError):
        ledger.expect("r", [1], float("inf"), "p")
    ledger.expect("r", [1], 1.0, "p")
    with pytest.raises(ValueError):
        ledger.expect("r", [2], 1.0, "p")


def test_completed_request_is_never_expired():
    ledger = ReceiverLedger(num_blocks=4)
    ledger.expect("r", [0], 1.0, "p")
    ledger.on_notice("r", "p", [0])
    assert ledger.expire(now_s=2.0) == []
    assert ledger.take_completed() == ["r"]
