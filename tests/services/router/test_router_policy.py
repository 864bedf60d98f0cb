"""Pure tests of the routing policies: exact picks for small, hand-made situations."""

import pytest

from flashpd.services.api import Unavailable, WorkerStats
from flashpd.services.router.policy import (
    AffinityPolicy,
    Candidate,
    RandomPolicy,
    RoundRobinPolicy,
    RouteQuery,
    make_policy,
    ring_walk,
)


def cand(role, wid, *, hit=0, queued=0, used=0, total=1000, running=0, pending=0):
    stats = WorkerStats(
        wid, "i0", role, queued_prefill_tokens=queued, kv_blocks_used=used, kv_blocks_total=total, running=running
    )
    return Candidate(stats, hit_tokens=hit, pending_prefill_tokens=pending)


P = [cand("prefill", "p0"), cand("prefill", "p1"), cand("prefill", "p2")]
D = [cand("decode", "d0"), cand("decode", "d1"), cand("decode", "d2")]


def q(prompt=1000, key="s1", bound=(), preferred=()):
    return RouteQuery(prompt, key, frozenset(c.ref for c in bound), frozenset(c.ref for c in preferred))


def test_bound_session_keeps_its_pair():
    d = AffinityPolicy().choose(q(bound=(P[2], D[1])), P, D)
    assert (d.prefill.ref.worker_id, d.decode.ref.worker_id) == ("p2", "d1")
    assert (d.prefill_reason, d.decode_reason) == ("session", "session")


def test_binding_to_a_missing_worker_is_ignored_for_that_tier_only():
    gone = cand("decode", "d9")
    d = AffinityPolicy().choose(q(bound=(P[0], gone)), P, D)
    assert d.prefill.ref.worker_id == "p0" and d.prefill_reason == "session"
    assert d.decode_reason == "hash"


def test_prefill_prefers_usable_credit_over_a_short_queue():
    # p0 holds 512 cached tokens (credit 384) but has 300 queued; p1 is idle without a hit
    ps = [cand("prefill", "p0", hit=512, queued=300), cand("prefill", "p1")]
    d = AffinityPolicy().choose(q(prompt=1000), ps, D)
    assert d.prefill.ref.worker_id == "p0"  # 300 + 1000 - 384 = 916 < 1000
    assert d.prefill_reason == "prefix"
    assert d.prefill_credit_tokens == 384


def test_prefill_load_outweighs_a_small_credit():
    ps = [cand("prefill", "p0", hit=512, queued=2000), cand("prefill", "p1")]
    assert AffinityPolicy().choose(q(), ps, D).prefill.ref.worker_id == "p1"


def test_a_hit_within_the_replay_tail_earns_no_prefill_credit():
    # 200 tokens: align_down = 128, minus the 128 replayed = 0 -> hashing, not prefix scoring
    ps = [cand("prefill", "p0", hit=200), cand("prefill", "p1")]
    assert AffinityPolicy().choose(q(), ps, D).prefill_reason == "hash"


def test_router_pending_tokens_count_as_load():
    ps = [cand("prefill", "p0", hit=512, pending=5000), cand("prefill", "p1", hit=512)]
    assert AffinityPolicy().choose(q(), ps, D).prefill.ref.worker_id == "p1"


def test_decode_prefers_the_longest_hit_among_similarly_loaded():
    ds = [
        cand("decode", "d0", hit=256, used=100),
        cand("decode", "d1", hit=768, used=150),
        cand("decode", "d2", used=50),
    ]
    d = AffinityPolicy(decode_slack=0.10).choose(q(), P, ds)
    assert d.decode.ref.worker_id == "d1" and d.decode_reason == "prefix"


def test_decode_avoids_a_nearly_full_worker_despite_its_hit():
    ds = [cand("decode", "d0", hit=768, used=990), cand("decode", "d1", used=100)]
    assert AffinityPolicy().choose(q(), P, ds).decode.ref.worker_id == "d1"


def test_new_sessions_hash_consistently():
    picks = {AffinityPolicy().choose(q(key="session-42"), P, D).decode.ref.worker_id for _ in range(5)}
    assert len(picks) == 1
    assert picks == {ring_walk("session-42", ("d0", "d1", "d2"))[0]}


def test_new_sessions_spread_over_workers():
    picks = {AffinityPolicy().choose(q(key=f"s{i}"), P, D).decode.ref.worker_id for i in range(60)}
    assert picks == {"d0", "d1", "d2"}


def test_hashing_skips_workers_over_the_load_bound():
    home = ring_walk("s7", ("d0", "d1", "d2"))[0]
    ds = [cand("decode", w, running=30 if w == home else 0) for w in ("d0", "d1", "d2")]
    d = AffinityPolicy(load_slack=0.25).choose(q(key="s7"), P, ds)
    assert d.decode.ref.worker_id != home
    assert d.decode.ref.worker_id == ring_walk("s7", ("d0", "d1", "d2"))[1]


def test_ring_is_stable_when_a_worker_joins():
    before = {f"s{i}": ring_walk(f"s{i}", ("d0", "d1", "d2"))[0] for i in range(200)}
    after = {f"s{i}": ring_walk(f"s{i}", ("d0", "d1", "d2", "d3"))[0] for i in range(200)}
    moved = [k for k in before if before[k] != after[k]]
    assert all(after[k] == "d3" for k in moved)  # only keys taken over by the new worker move
    assert 0 < len(moved) < 100


def test_parent_session_breaks_ties():
    d = AffinityPolicy().choose(q(key="child", preferred=(P[1], D[2])), P, D)
    assert (d.prefill.ref.worker_id, d.decode.ref.worker_id) == ("p1", "d2")


def test_no_worker_is_unavailable():
    with pytest.raises(Unavailable, match="prefill"):
        AffinityPolicy().choose(q(), [], D)
    with pytest.raises(Unavailable, match="decode"):
        RoundRobinPolicy().choose(q(), P, [])


def test_round_robin_cycles_blind_to_sessions_and_prefixes():
    policy = RoundRobinPolicy()
    ps = [cand("prefill", "p0", hit=4096), *P[1:]]
    picks = [policy.choose(q(bound=(P[0], D[0])), ps, D) for _ in range(4)]
    assert [p.prefill.ref.worker_id for p in picks] == ["p0", "p1", "p2", "p0"]
    assert [p.decode.ref.worker_id for p in picks] == ["d0", "d1", "d2", "d0"]


def test_random_is_seeded_and_blind():
    a = [RandomPolicy(seed=3).choose(q(bound=(P[0], D[0])), P, D).decode.ref for _ in range(1)]
    b = [RandomPolicy(seed=3).choose(q(), P, D).decode.ref for _ in range(1)]
    assert a == b
    policy = RandomPolicy(seed=1)
    assert {policy.choose(q(), P, D).decode.ref.worker_id for _ in range(50)} == {"d0", "d1", "d2"}


def test_make_policy_is_strict():
    assert make_policy("round_robin").name == "round_robin"
    with pytest.raises(ValueError, match="routing must be one of"):
        make_policy("least_loaded")
