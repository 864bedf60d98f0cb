"""Goodput tiers and the seed's two ratios from a study (issue 28's `summary.json`).

A tier is an interactivity floor in tok/s per user (20, 60, 150 by default). A sweep point meets
it when its per-user speed (1 / p90 inter-token latency) is at least the floor and its p90 TTFT
is at most the bound. Per configuration, for each tier:

    met               whether any swept point meets it
    max_concurrency   the largest swept concurrency that meets it (None: none does)
    at_largest_point  it is met at the largest point swept: the true maximum may be higher
    tok_s             total tok/s per GPU (input incl. cached + output) there: the throughput
                      the seed's "5.3x more total throughput at 150 tok/s per user" compares
    output_tok_s      output tok/s per GPU there

Between a baseline and a candidate configuration (the seed's optimizations off / on):

    speedup_low_concurrency    mean over the concurrencies 1-4 both swept of the candidate's
                               per-user end-to-end speed (1 / p90 of e2e per output token) over
                               the baseline's: the seed's "1.9x faster at low concurrency"
    throughput_ratio_at_tier   candidate tok_s / baseline tok_s per tier, both taken over the
                               concurrencies both configurations swept (None where either
                               meets no such point of the tier)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from flashpd.bench.metrics import RunMetrics

DEFAULT_TIERS = (20.0, 60.0, 150.0)
LOW_CONCURRENCY = (1, 2, 3, 4)
SUMMARY_FILE = "summary.json"


def _key(tier: float) -> str:
    return f"{tier:g}"


def _meets(m: RunMetrics, tier: float, ttft_limit_s: float) -> bool:
    if m.interrupted or m.aborted_reason or m.requests == 0:
        return False
    speed, ttft = m.interactivity_itl_tok_s, m.ttft_s.p90
    return math.isfinite(speed) and speed >= tier and math.isfinite(ttft) and ttft <= ttft_limit_s


def tier_points(
    points: Sequence[RunMetrics], tiers: Sequence[float] = DEFAULT_TIERS, ttft_limit_s: float = 5.0
) -> dict[str, dict]:
    """Per tier: the largest concurrency meeting it and the throughput there."""
    out = {}
    largest = max((m.concurrency for m in points), default=None)
    for tier in tiers:
        best = max((m for m in points if _meets(m, tier, ttft_limit_s)), key=lambda m: m.concurrency, default=None)
        out[_key(tier)] = {
            "met": best is not None,
            "max_concurrency": None if best is None else best.concurrency,
            "at_largest_point": best is not None and best.concurrency == largest,
            "tok_s": None if best is None else round(best.total_tok_s_per_gpu, 1),
            "output_tok_s": None if best is None else round(best.output_tok_s_per_gpu, 1),
        }
    return out


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0 or not math.isfinite(num / den):
        return None
    return round(num / den, 3)


def ab_ratios(
    baseline: Sequence[RunMetrics],
    candidate: Sequence[RunMetrics],
    tiers: Sequence[float] = DEFAULT_TIERS,
    ttft_limit_s: float = 5.0,
) -> dict:
    """The seed's two ratios for `candidate` against `baseline` (see the module docstring)."""
    base = {m.concurrency: m for m in baseline}
    low = [
        _ratio(m.interactivity_e2e_tok_s, base[m.concurrency].interactivity_e2e_tok_s)
        for m in candidate
        if m.concurrency in LOW_CONCURRENCY and m.concurrency in base
    ]
    low = [r for r in low if r is not None]
    # the tiers over the points both swept: a point one configuration's call had no time for
    # must not count as the other's advantage
    common = set(base) & {m.concurrency for m in candidate}
    t_base = tier_points([m for m in baseline if m.concurrency in common], tiers, ttft_limit_s)
    t_cand = tier_points([m for m in candidate if m.concurrency in common], tiers, ttft_limit_s)
    return {
        "speedup_low_concurrency": round(sum(low) / len(low), 3) if low else None,
        "low_concurrency_points": len(low),
        "common_concurrency": sorted(common),
        "throughput_ratio_at_tier": {k: _ratio(t_cand[k]["tok_s"], t_base[k]["tok_s"]) for k in t_cand},
    }


def study_summary(
    study: Mapping[str, Sequence[RunMetrics]],
    *,
    baseline: str | None = None,
    candidate: str | None = None,
    tiers: Sequence[float] = DEFAULT_TIERS,
    ttft_limit_s: float = 5.0,
    extra: Mapping | None = None,
) -> dict:
    """The summary of a study: tiers of every configuration (the candidate's at the top level),
    and the A/B ratios when both named configurations are in it."""
    for name in (baseline, candidate):
        if name is not None and name not in study:
            raise KeyError(f"configuration {name!r} not in the study ({sorted(study)})")
    main = candidate if candidate is not None else next(iter(study))
    out = dict(extra or {})
    out.update(
        {
            "configuration": main,
            "ttft_limit_s": ttft_limit_s,
            "tiers": tier_points(study[main], tiers, ttft_limit_s),
            "configurations": {name: tier_points(points, tiers, ttft_limit_s) for name, points in study.items()},
        }
    )
    if baseline is not None and baseline != main:
        out["ab"] = {"baseline": baseline, **ab_ratios(study[baseline], study[main], tiers, ttft_limit_s)}
    return out


def write_summary(study_dir: str | Path, summary: Mapping) -> Path:
    path = Path(study_dir) / SUMMARY_FILE
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return path
