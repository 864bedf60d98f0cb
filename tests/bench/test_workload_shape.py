"""The generator at scale 1 reproduces workload.md's figures (600 trees, fixed seed).

Tolerances are stated per figure: tight for medians of per-request laws (tens of thousands of
draws), wider for figures that depend on a few hundred long sessions (prompt lengths, turns).
"""

from __future__ import annotations

import pytest

from flashpd.bench.workload import WorkloadConfig, generate_workload, summarize


@pytest.fixture(scope="module")
def shape() -> dict[str, float]:
    workload = generate_workload(WorkloadConfig(seed=0, num_trees=600))
    shape = summarize(workload)
    # ids live only in segments (a few per request), never materialised per request
    requests = [r for t in workload.trees for r in t.requests]
    shape["segments_per_request"] = sum(len(r.segments) for r in requests) / len(requests)
    return shape


def within(value: float, target: float, rel: float) -> bool:
    return abs(value - target) <= rel * target


def test_generation_is_fast_because_ids_are_lazy(shape):
    # ~110K requests whose prompts average ~300K tokens: materialising ids would take minutes
    assert shape["requests"] > 80_000
    assert shape["segments_per_request"] < 8


def test_main_prompt_length_p50_near_254k(shape):
    assert within(shape["main_prompt_p50"], 254_000, 0.15)


def test_main_prompt_length_p90_near_651k(shape):
    assert within(shape["main_prompt_p90"], 651_000, 0.15)


def test_new_input_median_mean_and_p99(shape):
    assert within(shape["new_input_p50"], 1_700, 0.05)
    assert within(shape["new_input_mean"], 3_800, 0.10)
    assert within(shape["new_input_p99"], 47_000, 0.25)


def test_main_output_median_mean_and_p90(shape):
    assert within(shape["main_output_p50"], 600, 0.05)
    assert within(shape["main_output_mean"], 1_400, 0.10)
    assert within(shape["main_output_p90"], 3_500, 0.10)


def test_output_median_over_all_requests_near_450(shape):
    assert within(shape["all_output_p50"], 450, 0.10)


def test_turns_per_session(shape):
    assert within(shape["turns_p50"], 65, 0.15)
    assert within(shape["turns_p90"], 330, 0.20)


def test_think_time_percentiles(shape):
    assert within(shape["think_p50_s"], 4.9, 0.10)
    assert within(shape["think_p90_s"], 130, 0.15)
    assert within(shape["think_p99_s"], 3_250, 0.35)


def test_subagent_share_groups_and_group_size(shape):
    assert abs(shape["subagent_tree_share"] - 0.445) <= 0.05
    assert shape["subagent_groups_p50"] == pytest.approx(4, abs=1)
    assert shape["subagent_group_requests_p50"] == pytest.approx(16, abs=2)


def test_subagent_context_median_and_p90(shape):
    assert within(shape["subagent_prompt_p50"], 64_000, 0.15)
    assert within(shape["subagent_prompt_p90"], 196_000, 0.20)


def test_ideal_prefix_hit_rate_near_98_percent(shape):
    assert 0.975 <= shape["ideal_hit_rate"] <= 0.99
