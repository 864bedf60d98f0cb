"""Aggregation on hand-made records, goodput over a sweep, A/B ratios."""

from __future__ import annotations

import dataclasses
import math

import pytest

from flashpd.bench.metrics import Percentiles, aggregate, compare, goodput, hit_rate_by_turn
from flashpd.bench.records import Phase, RequestRecord, RunMeta


def record(
    start_s, ttft_s, itl_s, *, prompt=100, cached=90, ideal=95, phase=Phase.MEASURE, turn=1, error=None, lane=0
) -> RequestRecord:
    output = 0 if ttft_s is None else 1 + len(itl_s)
    end_s = start_s + (ttft_s or 0.0) + sum(itl_s)
    return RequestRecord(
        lane=lane,
        phase=phase,
        tree_id=0,
        request_index=turn,
        agent="main",
        session_id="s",
        parent_session_id=None,
        turn_index=turn,
        think_s=0.0,
        start_s=start_s,
        end_s=end_s,
        ttft_s=ttft_s,
        itl_s=list(itl_s),
        prompt_tokens=prompt,
        expected_output_tokens=output,
        output_tokens=output,
        ideal_cached_tokens=ideal,
        cached_tokens=None if error else cached,
        cached_tokens_prefill=None if error else cached - 10,
        cached_tokens_decode=None if error else 10,
        error_type=error,
        error=error,
    )


def meta(concurrency=1, gpus=2, start=10.0, end=20.0) -> RunMeta:
    return RunMeta(
        name="x",
        target="t",
        concurrency=concurrency,
        num_gpus=gpus,
        window_s=end - start,
        window_start_s=start,
        window_end_s=end,
    )


def test_throughput_counts_tokens_arriving_inside_the_window_per_gpu():
    records = [
        record(8.0, 1.0, [1.0] * 4),  # tokens at 9..13: 4 inside, prompt credited at 9 (outside)
        record(12.0, 0.5, [0.5] * 3),  # tokens at 12.5..14: all 4 inside, prompt inside
        record(19.0, 0.5, [1.0] * 2),  # tokens at 19.5, 20.5, 21.5: 1 inside, prompt inside
    ]
    m = aggregate(meta(), records)
    assert m.output_tokens == 4 + 4 + 1
    assert m.input_tokens == 200
    assert m.output_tok_s_per_gpu == pytest.approx(9 / 10 / 2)
    assert m.total_tok_s_per_gpu == pytest.approx(209 / 10 / 2)


def test_latency_percentiles_and_interactivity_use_measured_requests_only():
    records = [
        record(11.0, 0.2, [0.01] * 9),
        record(12.0, 0.4, [0.03] * 9),
        record(5.0, 9.0, [9.0] * 9, phase=Phase.WARMUP),
    ]
    m = aggregate(meta(), records)
    assert m.requests == 2
    assert m.ttft_s.p50 == pytest.approx(0.3)
    itl_p90 = Percentiles.of([0.01] * 9 + [0.03] * 9).p90
    assert m.interactivity_itl_tok_s == pytest.approx(1 / itl_p90)
    per_token = [(0.2 + 0.09) / 10, (0.4 + 0.27) / 10]
    assert m.interactivity_e2e_tok_s == pytest.approx(1 / Percentiles.of(per_token).p90)
    assert m.e2e_s.p50 == pytest.approx((0.29 + 0.67) / 2)


def test_hit_rates_and_cached_tiers_and_errors():
    records = [
        record(11.0, 0.1, [0.01], prompt=100, cached=60, ideal=90),
        record(12.0, 0.1, [0.01], prompt=300, cached=240, ideal=290),
        record(13.0, None, [], error="Unavailable"),
    ]
    m = aggregate(meta(), records)
    assert m.hit_rate_actual == pytest.approx(300 / 400)
    assert m.hit_rate_ideal == pytest.approx(380 / 400)
    assert (m.cached_tokens_prefill, m.cached_tokens_decode) == (280, 20)
    assert (m.requests, m.errors, m.errors_by_type) == (3, 1, {"Unavailable": 1})


def test_coverage_is_the_union_of_request_spans_within_the_window():
    records = [
        record(8.0, 3.0, []),  # 10..11 inside
        record(12.0, 2.0, []),
        record(13.0, 2.0, []),  # 12..15 overlapping
        record(19.0, 5.0, []),
    ]  # 19..20 inside
    assert aggregate(meta(), records).coverage == pytest.approx((1 + 3 + 1) / 10)


def test_run_without_a_window_has_no_throughput():
    m = aggregate(
        dataclasses.replace(meta(), window_start_s=None, window_end_s=None), [record(1.0, 0.1, [], phase=Phase.PRE)]
    )
    assert m.total_tok_s_per_gpu == 0.0 and m.coverage == 0.0
    assert math.isnan(m.ttft_s.p50)


def point(c, total, output, inter_itl, inter_e2e, ttft_p90):
    base = aggregate(meta(concurrency=c), [record(11.0, 0.1, [0.01])])
    return dataclasses.replace(
        base,
        total_tok_s_per_gpu=total,
        output_tok_s_per_gpu=output,
        interactivity_itl_tok_s=inter_itl,
        interactivity_e2e_tok_s=inter_e2e,
        ttft_s=Percentiles(ttft_p90 / 2, ttft_p90, ttft_p90),
    )


def test_goodput_picks_the_best_point_meeting_both_limits_per_definition():
    sweep = [
        point(1, total=1000, output=100, inter_itl=400, inter_e2e=300, ttft_p90=0.5),
        point(4, total=3000, output=250, inter_itl=200, inter_e2e=160, ttft_p90=2.0),
        point(8, total=5000, output=400, inter_itl=170, inter_e2e=120, ttft_p90=3.0),
        point(16, total=9000, output=700, inter_itl=160, inter_e2e=90, ttft_p90=6.0),  # TTFT too slow
        point(32, total=12000, output=900, inter_itl=100, inter_e2e=60, ttft_p90=9.0),
    ]
    best = {(g.interactivity, g.throughput): (g.tok_s_per_gpu, g.concurrency) for g in goodput(sweep)}
    assert best[("itl", "total")] == (5000, 8)
    assert best[("itl", "output")] == (400, 8)
    assert best[("e2e", "total")] == (3000, 4)
    assert best[("e2e", "output")] == (250, 4)


def test_goodput_cap_is_a_parameter_and_reports_none_when_nothing_qualifies():
    sweep = [point(1, 100, 10, inter_itl=20, inter_e2e=10, ttft_p90=1.0)]
    assert all(g.tok_s_per_gpu is None for g in goodput(sweep))
    assert all(g.concurrency == 1 for g in goodput(sweep, min_interactivity_tok_s=5.0))


def test_hit_rate_by_turn_buckets_powers_of_two():
    records = [
        record(11.0, 0.1, [], turn=0, cached=0, ideal=0),
        record(11.0, 0.1, [], turn=5, cached=50, ideal=90),
        record(11.0, 0.1, [], turn=7, cached=70, ideal=90),
        record(11.0, 0.1, [], turn=8, cached=90, ideal=95, phase=Phase.PRE),
    ]
    rates = hit_rate_by_turn(records)
    assert [(t.turns, t.requests) for t in rates] == [("0", 1), ("4-7", 2)]
    assert rates[1].actual == pytest.approx(0.6) and rates[1].ideal == pytest.approx(0.9)


def test_compare_gives_other_over_baseline_ratios():
    a = point(4, total=1000, output=100, inter_itl=200, inter_e2e=100, ttft_p90=2.0)
    b = dataclasses.replace(point(4, total=1500, output=120, inter_itl=250, inter_e2e=150, ttft_p90=1.0), name="y")
    c = compare(a, b)
    assert c.ratios["total_tok_s_per_gpu"] == pytest.approx(1.5)
    assert c.ratios["interactivity_e2e_tok_s"] == pytest.approx(1.5)
    assert c.latency_ratios["ttft_s_p90"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        compare(a, point(8, 1, 1, 1, 1, 1))
