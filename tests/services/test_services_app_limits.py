"""Decode admission limits: queued reserves never take the Serve slots running streams need."""

from __future__ import annotations

import pytest

from flashpd.services.app import AppArgs, RoleArgs


def test_default_ongoing_limit_leaves_a_slot_per_stream_beyond_the_queue():
    r = RoleArgs(max_num_seqs=64, max_queued_requests=256)
    assert r.ongoing_limit() == 64 + 256 + RoleArgs.SPARE_CALLS
    assert r.queue_limit() == 256
    assert r.deployment_options()["max_ongoing_requests"] == r.ongoing_limit()


def test_an_explicit_small_ongoing_limit_shrinks_the_queue_instead_of_deadlocking():
    r = RoleArgs(max_num_seqs=64, max_queued_requests=256, max_ongoing_requests=100)
    assert r.queue_limit() == 100 - 64 - RoleArgs.SPARE_CALLS
    assert RoleArgs(max_num_seqs=64, max_ongoing_requests=32).queue_limit() == 0


def test_worker_config_carries_the_queue_limit_and_retry_hint(tmp_path):
    args = AppArgs(
        checkpoint=str(tmp_path),
        redis_url="redis://127.0.0.1:1",
        decode={"max_queued_requests": 5, "retry_after_s": 2.5},
    )
    config = args.worker_config("decode")
    assert config.max_queued_requests == 5 and config.retry_after_s == 2.5


def test_negative_queue_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="max_queued_requests"):
        RoleArgs(max_queued_requests=-1)


def test_graph_width_ratio_is_validated_and_reaches_the_engine_config(tmp_path):
    base = {"checkpoint": str(tmp_path), "redis_url": "redis://127.0.0.1:1"}
    assert AppArgs(**base).worker_config("decode").engine.graph_width_ratio == 2
    assert AppArgs(**base, graph_width_ratio=4).worker_config("prefill").engine.graph_width_ratio == 4
    for bad in (1, -1, 17):
        with pytest.raises(ValueError, match="graph_width_ratio"):
            AppArgs(**base, graph_width_ratio=bad)
    with pytest.raises(ValueError, match="graph_width_tokens"):  # the old name is refused, not ignored
        AppArgs(**base, graph_width_tokens=8192)


def test_kernel_impls_are_validated_at_load_and_reach_the_engine_config(tmp_path):
    base = {"checkpoint": str(tmp_path), "redis_url": "redis://127.0.0.1:1"}
    assert AppArgs(**base).worker_config("decode").engine.kernel_impls == {}
    impls = {"indexer": "ref", "mhc": "ref"}
    for role in ("prefill", "decode"):
        assert AppArgs(**base, kernel_impls=impls).worker_config(role).engine.kernel_impls == impls
    for bad, why in (({"fused_mhc": "ref"}, "unknown kernel op 'fused_mhc'"), ({"mhc": "cuda"}, "no kernel mhc/cuda")):
        with pytest.raises(ValueError, match=f"kernel_impls(.|\n)*{why}"):
            AppArgs(**base, kernel_impls=bad)
