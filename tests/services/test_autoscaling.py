"""The joint autoscaling policy: demand per role, P:D ratio, delays and drain-safe scale-down."""

from __future__ import annotations

import pytest

from flashpd.services.autoscaling.policy import (
    Limits,
    PolicyConfig,
    Replicas,
    Signals,
    WorkerLoad,
    check_limits,
    decide,
    demand,
)

LIMITS = Limits(min=Replicas(1, 1, 1), max=Replicas(8, 8, 4))
CFG = PolicyConfig(
    prefill_tokens_per_replica=1000,
    decode_seqs_per_replica=10,
    decode_kv_usage=0.5,
    router_requests_per_replica=100,
    downscale_delay_s=30,
    drain_hold_seqs_per_replica=4,
    drain_hold_kv_usage=0.5,
)


def idle(n: int) -> tuple[WorkerLoad, ...]:
    return tuple(WorkerLoad(kv_blocks_total=100) for _ in range(n))


def signals(p=1, d=1, r=1, prefill=None, decode=None, **kw) -> Signals:
    return Signals(
        target=Replicas(p, d, r),
        running=Replicas(p, d, r),
        prefill=idle(p) if prefill is None else prefill,
        decode=idle(d) if decode is None else decode,
        router_reports=kw.pop("router_reports", r),
        **kw,
    )


def test_prefill_demand_follows_queued_tokens():
    s = signals(prefill=(WorkerLoad(queued_prefill_tokens=2500),))
    assert demand(s, CFG, LIMITS)[0].prefill == 3


def test_decode_demand_is_the_larger_of_sequences_and_kv_blocks():
    by_seqs = signals(decode=(WorkerLoad(running=25, kv_blocks_total=100),))
    by_kv = signals(decode=(WorkerLoad(running=1, kv_blocks_used=160, kv_blocks_total=100),))
    assert demand(by_seqs, CFG, LIMITS)[0].decode == 3
    assert demand(by_kv, CFG, LIMITS)[0].decode == 4  # 160 / (0.5 * 100)


def test_router_demand_follows_requests_in_flight():
    assert demand(signals(router_requests=250), CFG, LIMITS)[0].router == 3


def test_demand_is_clamped_to_bounds():
    s = signals(prefill=(WorkerLoad(queued_prefill_tokens=1e6),))
    assert demand(s, CFG, LIMITS)[0].prefill == 8
    assert demand(signals(), CFG, LIMITS)[0] == Replicas(1, 1, 1)


def test_ttft_over_target_adds_prefill_only_when_prefill_has_work():
    cfg = PolicyConfig(**{**CFG.__dict__, "ttft_target_s": 1.0})
    queued = signals(p=2, prefill=(WorkerLoad(queued_prefill_tokens=10),) * 2, ttft_p90_s=2.0)
    assert demand(queued, cfg, LIMITS)[0].prefill == 3
    empty = signals(p=2, ttft_p90_s=2.0)
    assert demand(empty, cfg, LIMITS)[0].prefill == 1


def test_itl_over_target_adds_decode():
    cfg = PolicyConfig(**{**CFG.__dict__, "itl_target_s": 0.05})
    assert demand(signals(d=2, itl_p90_s=0.1), cfg, LIMITS)[0].decode == 3
    assert demand(signals(d=2, itl_p90_s=0.01), cfg, LIMITS)[0].decode == 1


def test_ratio_raises_prefill_with_decode():
    cfg = PolicyConfig(**{**CFG.__dict__, "pd_ratio_min": 0.5, "pd_ratio_max": 2.0})
    s = signals(decode=(WorkerLoad(running=60, kv_blocks_total=100),))
    want = demand(s, cfg, LIMITS)[0]
    assert (want.prefill, want.decode) == (3, 6)


def test_ratio_raises_decode_for_prefill_never_lowers_prefill_demand_below_ratio():
    cfg = PolicyConfig(**{**CFG.__dict__, "pd_ratio_min": 0.5, "pd_ratio_max": 2.0})
    s = signals(prefill=(WorkerLoad(queued_prefill_tokens=6000),))
    want = demand(s, cfg, LIMITS)[0]
    assert (want.prefill, want.decode) == (6, 3)


def test_ratio_caps_prefill_when_decode_is_at_max():
    cfg = PolicyConfig(**{**CFG.__dict__, "pd_ratio_max": 1.0})
    limits = Limits(min=Replicas(1, 1, 1), max=Replicas(8, 2, 4))
    s = signals(prefill=(WorkerLoad(queued_prefill_tokens=6000),))
    want = demand(s, cfg, limits)[0]
    assert (want.prefill, want.decode) == (2, 2)


def test_infeasible_ratio_and_bounds_are_refused():
    cfg = PolicyConfig(**{**CFG.__dict__, "pd_ratio_min": 2.0, "pd_ratio_max": 3.0})
    with pytest.raises(ValueError, match="P:D ratio"):
        check_limits(Limits(min=Replicas(1, 1, 1), max=Replicas(4, 4, 1)), cfg)
    check_limits(Limits(min=Replicas(2, 1, 1), max=Replicas(12, 4, 1)), cfg)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="decode_kv_usage"):
        PolicyConfig(decode_kv_usage=1.5)
    with pytest.raises(ValueError, match="pd_ratio_min"):
        PolicyConfig(pd_ratio_min=2, pd_ratio_max=1)


def test_scale_up_is_immediate_without_upscale_delay():
    s = signals(prefill=(WorkerLoad(queued_prefill_tokens=2500),))
    decision, _ = decide(s, CFG, LIMITS, None, now=0.0)
    assert decision.replicas.prefill == 3


def test_upscale_delay_needs_continuous_demand():
    cfg = PolicyConfig(**{**CFG.__dict__, "upscale_delay_s": 10})
    hot = signals(prefill=(WorkerLoad(queued_prefill_tokens=2500),))
    d0, st = decide(hot, cfg, LIMITS, None, now=0.0)
    d1, st = decide(hot, cfg, LIMITS, st, now=9.0)
    d2, st = decide(signals(), cfg, LIMITS, st, now=9.5)  # demand gone: clock resets
    d3, st = decide(hot, cfg, LIMITS, st, now=15.0)
    d4, st = decide(hot, cfg, LIMITS, st, now=25.0)
    assert [d.replicas.prefill for d in (d0, d1, d2, d3, d4)] == [1, 1, 1, 1, 3]


def test_scale_down_waits_the_downscale_delay():
    s = signals(p=3)
    d0, st = decide(s, CFG, LIMITS, None, now=0.0)
    d1, st = decide(s, CFG, LIMITS, st, now=29.0)
    d2, st = decide(s, CFG, LIMITS, st, now=30.0)
    assert [d.replicas.prefill for d in (d0, d1, d2)] == [3, 3, 1]


def test_decode_scales_down_one_replica_per_delay():
    s = signals(d=3)
    steps = []
    st = None
    for now in (0.0, 30.0, 31.0, 60.0):
        decision, st = decide(s, CFG, LIMITS, st, now=now)
        steps.append(decision.replicas.decode)
        s = signals(d=decision.replicas.decode)
    assert steps == [3, 2, 2, 2]
    decision, st = decide(s, CFG, LIMITS, st, now=61.0)
    assert decision.replicas.decode == 1


def test_decode_scale_down_held_while_sequences_per_replica_above_threshold():
    busy = signals(d=3, decode=(WorkerLoad(running=5, kv_blocks_total=100),) * 3)
    decision, st = decide(busy, CFG, LIMITS, None, now=0.0)
    decision, st = decide(busy, CFG, LIMITS, st, now=100.0)
    assert decision.replicas.decode == 3
    assert any("decode scale-down held" in n for n in decision.notes)


def test_decode_scale_down_held_while_kv_usage_above_threshold():
    full = signals(d=3, decode=(WorkerLoad(kv_blocks_used=60, kv_blocks_total=100),) * 3)
    cfg = PolicyConfig(**{**CFG.__dict__, "decode_kv_usage": 1.0})
    _, st = decide(full, cfg, LIMITS, None, now=0.0)
    decision, _ = decide(full, cfg, LIMITS, st, now=100.0)
    assert decision.demand.decode == 2 and decision.replicas.decode == 3


def test_hold_restarts_the_slack_clock():
    quiet, busy = signals(d=2), signals(d=2, decode=(WorkerLoad(running=9, kv_blocks_total=100),) * 2)
    _, st = decide(quiet, CFG, LIMITS, None, now=0.0)
    _, st = decide(busy, CFG, LIMITS, st, now=20.0)
    d1, st = decide(quiet, CFG, LIMITS, st, now=31.0)
    d2, st = decide(quiet, CFG, LIMITS, st, now=61.0)
    assert (d1.replicas.decode, d2.replicas.decode) == (2, 1)


def test_decode_scale_down_held_while_a_worker_drains_or_has_not_reported():
    draining = signals(d=2, decode=(WorkerLoad(kv_blocks_total=100, draining=True), WorkerLoad(kv_blocks_total=100)))
    missing = signals(d=2, decode=idle(1))
    for s in (draining, missing):
        _, st = decide(s, CFG, LIMITS, None, now=0.0)
        decision, _ = decide(s, CFG, LIMITS, st, now=100.0)
        assert decision.replicas.decode == 2


def test_decode_scale_down_held_while_itl_over_target():
    cfg = PolicyConfig(**{**CFG.__dict__, "itl_target_s": 0.05})
    s = signals(d=3, itl_p90_s=0.06)
    _, st = decide(s, cfg, LIMITS, None, now=0.0)
    decision, _ = decide(s, cfg, LIMITS, st, now=100.0)
    assert decision.replicas.decode >= 3


def test_prefill_follows_decode_down_inside_ratio():
    cfg = PolicyConfig(**{**CFG.__dict__, "pd_ratio_min": 1.0, "pd_ratio_max": 1.0})
    s = signals(p=3, d=3)
    _, st = decide(s, cfg, LIMITS, None, now=0.0)
    decision, _ = decide(s, cfg, LIMITS, st, now=30.0)
    # decode steps down by one; prefill would go to 1 but the ratio keeps it at decode's count
    assert (decision.replicas.prefill, decision.replicas.decode) == (2, 2)


def test_state_is_json_serialisable():
    import json

    _, st = decide(signals(p=3), CFG, LIMITS, None, now=5.0)
    assert json.loads(json.dumps(st)) == st
