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


def test_drained_request_is_quiet_once_its_write_completes():
    ledger = ReceiverLedger(num_blocks=8)
    ledger.expect("r", [1, 2], 10.0, "t1")
    assert ledger.drain("r", fallback_deadline_s=100.0) == "t1"
    assert ledger.take_quiet(now_s=0.0) == []
    assert not ledger.on_notice("r", "t1", [1])  # counted as late, but the write is tracked
    assert ledger.take_quiet(now_s=0.0) == []
    assert not ledger.on_notice("r", "t1", [2])
    assert ledger.take_quiet(now_s=0.0) == ["t1"]
    assert ledger.num_draining == 0


def test_drained_request_is_quiet_on_abandon_or_at_its_fallback():
    ledger = ReceiverLedger(num_blocks=8)
    ledger.expect("a", [1], 10.0, "ta")
    ledger.expect("b", [2], 10.0, "tb")
    assert ledger.drain("a", 100.0) == "ta" and ledger.drain("b", 50.0) == "tb"
    ledger.on_notice("a", "ta", [], kind="abandon")
    assert ledger.take_quiet(now_s=0.0) == ["ta"]
    assert ledger.take_quiet(now_s=49.9) == []
    assert ledger.take_quiet(now_s=50.0) == ["tb"]


def test_abandoned_live_request_frees_at_once_when_drained():
    ledger = ReceiverLedger(num_blocks=8)
    ledger.expect("r", [3], 10.0, "t1")
    assert ledger.on_notice("r", "t1", [], kind="abandon")
    assert ledger.drain("r", 100.0) is None
    assert ledger.drain("unknown", 100.0) is None


def test_abandon_all_covers_tickets_issued_before_it_only():
    ledger = ReceiverLedger(num_blocks=8)
    ledger.expect("r", [1], 100.0, "old", issued_s=5.0)
    assert ledger.drain("r", 200.0) == "old"
    ledger.on_notice("r", "", [], kind="abandon_all", before_unix_s=6.0)
    assert ledger.take_quiet(now_s=0.0) == ["old"]
    ledger.expect("r", [2], 100.0, "retry", issued_s=7.0)  # issued after: still guarded
    assert ledger.drain("r", 200.0) == "retry"
    ledger.expect("s", [4], 100.0, "s1", issued_s=1.0)
    ledger.on_notice("s", "", [], kind="abandon_all", before_unix_s=2.0)
    assert ledger.drain("s", 200.0) is None  # the notice came first: free at once


def test_expired_request_drains_until_lease_plus_grace():
    ledger = ReceiverLedger(num_blocks=8)
    ledger.expect("r", [1], 10.0, "t1")
    assert ledger.expire(now_s=10.0, grace_s=5.0) == ["r"]
    assert ledger.is_draining("t1") and ledger.take_quiet(now_s=14.9) == []
    assert ledger.take_quiet(now_s=15.0) == ["t1"]


def test_superseded_attempt_drains_while_the_retry_is_live():
    ledger = ReceiverLedger(num_blocks=8)
    ledger.expect("r", [1], 10.0, "old")
    assert ledger.drain("r", 100.0) == "old"
    ledger.expect("r", [2], 10.0, "new")
    assert not ledger.on_notice("r", "old", [1])  # the old write: fenced, but it quiets "old"
    assert ledger.take_quiet(now_s=0.0) == ["old"]
    assert ledger.on_notice("r", "new", [2])
    assert ledger.take_completed() == ["r"]
