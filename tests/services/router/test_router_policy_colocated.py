"""Pure tests of `choose_colocated`: one worker per request, carried as both legs."""

import pytest

from flashpd.services.api import Unavailable, WorkerStats
from flashpd.services.router.policy import Candidate, RouteQuery, make_policy, ring_walk


def cand(wid, *, hit=0, used=0, total=1000, running=0, pending=0):
    stats = WorkerStats(wid, "i0", "colocated", kv_blocks_used=used, kv_blocks_total=total, running=running)
    return Candidate(stats, hit_tokens=hit, pending_requests=pending)


C = [cand("c0"), cand("c1"), cand("c2")]


def q(prompt=1000, key="s1", bound=()):
    return RouteQuery(prompt, key, frozenset(c.ref for c in bound))


def test_bound_session_keeps_its_worker_as_both_legs():
    d = make_policy("affinity").choose_colocated(q(bound=(C[2],)), C)
    assert d.prefill is d.decode and d.decode.ref.worker_id == "c2"
    assert (d.prefill_reason, d.decode_reason) == ("session", "session")


def test_longest_prefix_wins_among_workers_with_room():
    cands = [cand("c0", hit=256), cand("c1", hit=512), cand("c2", hit=768, used=900)]
    d = make_policy("affinity").choose_colocated(q(), cands)
    assert d.decode.ref.worker_id == "c1" and d.decode_reason == "prefix"
    assert d.prefill_credit_tokens == 384  # align_down(512, 128) - 128


def test_without_hits_the_ring_places_the_session_with_bounded_load():
    d = make_policy("affinity").choose_colocated(q(key="sess-7"), C)
    assert d.decode_reason == "hash"
    assert d.decode.ref.worker_id == ring_walk("sess-7", ("c0", "c1", "c2"))[0]
    home = d.decode.ref.worker_id
    loaded = [cand(c.ref.worker_id, running=50 if c.ref.worker_id == home else 0) for c in C]
    assert make_policy("affinity").choose_colocated(q(key="sess-7"), loaded).decode.ref.worker_id != home


def test_blind_policies_pick_one_worker():
    rr = make_policy("round_robin")
    assert [rr.choose_colocated(q(), C).decode.ref.worker_id for _ in range(4)] == ["c0", "c1", "c2", "c0"]
    pick = make_policy("random", seed=3).choose_colocated(q(), C)
    assert pick.prefill is pick.decode


@pytest.mark.parametrize("name", ["affinity", "random", "round_robin"])
def test_no_colocated_worker_is_unavailable_naming_the_role(name):
    with pytest.raises(Unavailable, match="colocated"):
        make_policy(name).choose_colocated(q(), [])
