"""JointPolicy as Serve calls it: contexts per deployment in, targets and policy state out.

The contexts are plain stand-ins with AutoscalingContext's attribute names (the seam Serve
calls the policy through)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from flashpd.services.autoscaling.serve import STATE_KEY, JointPolicy, JointPolicyArgs

KWARGS = {
    "prefill_tokens_per_replica": 100,
    "decode_seqs_per_replica": 4,
    "downscale_delay_s": 10,
    "drain_hold_seqs_per_replica": 1,
    "pd_ratio_min": 0.5,
    "pd_ratio_max": 2.0,
}


@dataclass
class Ctx:
    deployment_name: str
    running_replicas: list
    aggregated_metrics: dict
    target_num_replicas: int = 1
    capacity_adjusted_min_replicas: int = 1
    capacity_adjusted_max_replicas: int = 4
    policy_state: dict = field(default_factory=dict)
    current_time: float = 0.0


def _worker_metrics(loads: dict[str, dict]) -> dict:
    names = ("queued_prefill_tokens", "kv_blocks_used", "kv_blocks_total", "running", "waiting", "draining")
    return {n: {rid: float(load.get(n, 0)) for rid, load in loads.items()} for n in names}


def _contexts(
    prefill: dict, decode: dict, router_running: float = 0.0, *, state=None, now=0.0, targets=(1, 1, 1)
) -> dict:
    router = {"requests_running": {"r0": router_running}, "ttft_p90_s": {"r0": 0.0}, "itl_p90_s": {"r0": 0.0}}
    ctxs = {
        "P": Ctx("PrefillServer", list(prefill), _worker_metrics(prefill), targets[0]),
        "D": Ctx(
            "DecodeServer",
            list(decode),
            _worker_metrics(decode),
            targets[1],
            policy_state={STATE_KEY: state} if state else {},
        ),
        "R": Ctx("Router", ["r0"], router, targets[2]),
    }
    for c in ctxs.values():
        c.current_time = now
    return ctxs


def test_one_decision_for_all_three_deployments():
    policy = JointPolicy(**KWARGS)
    ctxs = _contexts({"p0": {"queued_prefill_tokens": 250}}, {"d0": {"running": 10, "kv_blocks_total": 100}})
    targets, state = policy(ctxs)
    assert targets == {"P": 3, "D": 3, "R": 1}
    assert set(state) == {"D"} and STATE_KEY in state["D"]


def test_state_round_trips_through_serve_policy_state():
    policy = JointPolicy(**KWARGS)
    idle = {"d0": {"kv_blocks_total": 100}, "d1": {"kv_blocks_total": 100}}
    targets, state = policy(_contexts({"p0": {}}, idle, targets=(1, 2, 1), now=0.0))
    assert targets["D"] == 2
    targets, _ = policy(_contexts({"p0": {}}, idle, targets=(1, 2, 1), now=10.0, state=state["D"][STATE_KEY]))
    assert targets["D"] == 1


def test_a_replica_without_metrics_holds_its_role():
    policy = JointPolicy(**KWARGS)
    ctxs = _contexts({"p0": {}}, {"d0": {"kv_blocks_total": 100}}, targets=(1, 2, 1))
    ctxs["D"].running_replicas = ["d0", "d1"]  # d1 started, no report yet
    _, state = policy(ctxs)
    ctxs = _contexts(
        {"p0": {}}, {"d0": {"kv_blocks_total": 100}}, targets=(1, 2, 1), now=60.0, state=state["D"][STATE_KEY]
    )
    ctxs["D"].running_replicas = ["d0", "d1"]
    targets, _ = policy(ctxs)
    assert targets["D"] == 2


def test_unknown_app_shape_keeps_targets():
    policy = JointPolicy(**KWARGS)
    ctxs = _contexts({"p0": {}}, {"d0": {}}, targets=(2, 3, 1))
    ctxs["D"].deployment_name = "Other"
    assert policy(ctxs) == ({"P": 2, "D": 3, "R": 1}, {})


def test_bounds_outside_the_ratio_hold_every_target():
    policy = JointPolicy(**{**KWARGS, "pd_ratio_min": 2.0, "pd_ratio_max": 2.0})
    ctxs = _contexts({"p0": {"queued_prefill_tokens": 900}}, {"d0": {}}, targets=(1, 1, 1))
    ctxs["P"].capacity_adjusted_max_replicas = 1  # 1 prefill can never be 2x decode
    assert policy(ctxs) == ({"P": 1, "D": 1, "R": 1}, {})


def test_policy_kwargs_are_checked_naming_the_field():
    with pytest.raises(Exception, match="decode_kv_usage"):
        JointPolicy(decode_kv_usage=2.0)
    with pytest.raises(Exception, match="bogus"):
        JointPolicyArgs.model_validate({"bogus": 1})
