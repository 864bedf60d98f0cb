"""Goodput tiers and the seed's ratios (bench/tiers.py) on hand-made sweep points, and the
report command writing summary.json over a real (virtual-clock) study."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from flashpd.bench.metrics import Percentiles, RunMetrics
from flashpd.bench.tiers import ab_ratios, study_summary, tier_points


def point(c: int, itl_tok_s: float, e2e_tok_s: float, ttft_p90_s: float, tok_s: float, name: str = "x") -> RunMetrics:
    pct = Percentiles(0.1, ttft_p90_s, ttft_p90_s)
    return RunMetrics(
        name=name,
        concurrency=c,
        num_gpus=1,
        window_s=60.0,
        requests=10,
        errors=0,
        errors_by_type={},
        input_tokens=0,
        output_tokens=0,
        total_tok_s_per_gpu=tok_s,
        output_tok_s_per_gpu=tok_s / 10,
        interactivity_itl_tok_s=itl_tok_s,
        interactivity_e2e_tok_s=e2e_tok_s,
        ttft_s=pct,
        itl_s=pct,
        e2e_s=pct,
        hit_rate_actual=0.9,
        hit_rate_ideal=0.95,
        prompt_tokens=1,
        cached_tokens=1,
        cached_tokens_prefill=0,
        cached_tokens_decode=1,
        coverage=1.0,
    )


# per-user speed falls and throughput rises with concurrency; TTFT breaks the bound at C=16
BASE = [
    point(1, 100, 50, 0.5, 1000),
    point(2, 80, 40, 0.6, 1800),
    point(4, 55, 30, 1.0, 3000),
    point(8, 30, 20, 2.0, 5000),
    point(16, 21, 15, 9.0, 7000),
]
FAST = [
    point(1, 190, 95, 0.3, 1900),
    point(2, 170, 80, 0.4, 3400),
    point(4, 160, 70, 0.5, 6400),
    point(8, 70, 45, 1.0, 11000),
    point(16, 40, 30, 4.0, 16000),
]


def test_a_tier_is_the_largest_concurrency_meeting_speed_and_ttft():
    tiers = tier_points(BASE, (20, 60, 150), ttft_limit_s=5.0)
    assert tiers["20"] == {
        "met": True,
        "max_concurrency": 8,
        "at_largest_point": False,
        "tok_s": 5000.0,
        "output_tok_s": 500.0,
    }
    assert tiers["60"]["max_concurrency"] == 2  # C=4 runs at 55 tok/s/user
    assert tiers["150"] == {
        "met": False,
        "max_concurrency": None,
        "at_largest_point": False,
        "tok_s": None,
        "output_tok_s": None,
    }


def test_a_tier_met_at_the_largest_point_says_the_sweep_bounds_it():
    assert tier_points(FAST, (20,), ttft_limit_s=5.0)["20"]["at_largest_point"] is True


def test_interrupted_aborted_and_nan_points_meet_no_tier():
    bad = [
        replace(BASE[0], interrupted=True),
        replace(BASE[1], aborted_reason="errors"),
        replace(BASE[2], interactivity_itl_tok_s=math.nan),
    ]
    assert all(v["max_concurrency"] is None for v in tier_points(bad, (20,)).values())


def test_ab_ratios_are_the_seeds_two_figures():
    ab = ab_ratios(BASE, FAST, (20, 60, 150), ttft_limit_s=5.0)
    # e2e speed at C = 1, 2, 4: 95/50, 80/40, 70/30
    assert ab["speedup_low_concurrency"] == pytest.approx((1.9 + 2.0 + 70 / 30) / 3, abs=1e-3)
    assert ab["low_concurrency_points"] == 3
    assert ab["throughput_ratio_at_tier"] == {
        "20": 3.2,
        "60": round(11000 / 1800, 3),
        "150": None,
    }  # base meets no 150 point


def test_tier_ratios_use_only_the_points_both_configurations_swept():
    """FAST's C=16 (met at 20 tok/s/user) has no baseline point: the 20 tier compares at C=8."""
    ab = ab_ratios(BASE[:4], FAST, (20,), ttft_limit_s=5.0)
    assert ab["common_concurrency"] == [1, 2, 4, 8]
    assert ab["throughput_ratio_at_tier"] == {"20": round(11000 / 5000, 3)}


def test_study_summary_names_its_configurations_and_refuses_unknown_ones():
    s = study_summary({"base": BASE, "fast": FAST}, baseline="base", candidate="fast", extra={"commit": "abc"})
    assert s["commit"] == "abc" and s["configuration"] == "fast"
    assert s["tiers"]["150"]["max_concurrency"] == 4
    assert set(s["configurations"]) == {"base", "fast"} and s["ab"]["baseline"] == "base"
    with pytest.raises(KeyError, match="nope"):
        study_summary({"base": BASE}, baseline="nope")


def test_report_command_writes_summary_json(study_dir, tmp_path):
    from flashpd.cli import main

    assert (
        main(["bench", "report", str(study_dir), "--tiers", "1,1000000", "--baseline", "base", "--candidate", "fast"])
        == 0
    )
    s = json.loads((study_dir / "summary.json").read_text())
    assert s["configuration"] == "fast" and set(s["tiers"]) == {"1", "1e+06"}
    assert s["tiers"]["1e+06"]["max_concurrency"] is None
    assert s["ab"]["baseline"] == "base"
    with pytest.raises(ValueError, match="--tiers"):
        main(["bench", "report", str(study_dir), "--tiers", "0,x"])


def test_agentx_gpu_report_adds_commit_and_preset(study_dir, rectangular_tables):
    from flashpd.bench.agentx_gpu import main

    assert main(["report", str(study_dir), "--baseline", "base", "--candidate", "fast", "--commit", "abc123"]) == 0
    s = json.loads((study_dir / "summary.json").read_text())
    assert s["commit"] == "abc123" and s["preset"] == "bench" and s["ab"]["baseline"] == "base"
    assert set(s["ab"]["throughput_ratio_at_tier"]) == {"20", "60", "150"}
    assert s["pd_vs_colocated"]["measured"] is False
    assert s["seed"] == {"speedup_low_concurrency": 1.9, "throughput_ratio_at_tier": {"150": 5.3}}
    assert s["errors"]["fast"]["measured_failed"] >= 0
    text = (study_dir / "report.md").read_text()
    needles = ("| 1.9x |", "| 5.3x |", "What one H200 cannot show", "p90 TTFT is at most 5 s", "pareto.png")
    for needle in needles + ('--config "$PWD/infra/serve.h200.baseline.yaml"', "--commit abc123"):
        assert needle in text
    rectangular_tables(text)
    assert (study_dir / "plots" / "pareto.png").stat().st_size > 1000


def test_agentx_gpu_report_fills_pd_vs_colocated_from_a_colocated_sweep(study_dir, rectangular_tables):
    """A colocated sweep in the study: the seed's two ratios of the P/D candidate over it."""
    import shutil

    from flashpd.bench.agentx_gpu import main

    shutil.copytree(study_dir / "base", study_dir / "colocated")
    for meta in (study_dir / "colocated").rglob("meta.json"):  # the study keys runs by their name
        meta.write_text(meta.read_text().replace('"name": "base"', '"name": "colocated"'))
    try:
        assert main(["report", str(study_dir), "--baseline", "base", "--candidate", "fast", "--commit", "abc"]) == 0
    finally:  # the study is shared with the other report tests
        shutil.rmtree(study_dir / "colocated")
    s = json.loads((study_dir / "summary.json").read_text())
    pdc = s["pd_vs_colocated"]
    assert pdc["measured"] is True and (pdc["pd"], pdc["colocated"]) == ("fast", "colocated")
    # the colocated sweep is a copy of base: the ratios are the A/B's
    assert pdc["speedup_low_concurrency"] == s["ab"]["speedup_low_concurrency"]
    assert pdc["throughput_ratio_at_tier"] == s["ab"]["throughput_ratio_at_tier"]
    assert set(pdc["colocated_tiers"]) == {"20", "60", "150"} and "colocated" in s["configurations"]
    text = (study_dir / "report.md").read_text()
    assert "## Disaggregated against colocated on the same GPU" in text and "| P/D over colocated |" in text
    rectangular_tables(text)


def test_agentx_gpu_report_with_one_configuration_has_no_ab_and_says_so(study_dir, tmp_path):
    """The baseline's call lost: the report still comes out, without ratios, saying why."""
    import shutil

    from flashpd.bench.agentx_gpu import main

    shutil.copytree(study_dir / "fast", tmp_path / "fast")
    assert main(["report", str(tmp_path), "--baseline", "base", "--candidate", "fast", "--tiers", "1e9"]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert "ab" not in s and "'base' has no completed point" in s["notes"][0]
    assert s["tiers"]["1e+09"] == {
        "met": False,
        "max_concurrency": None,
        "at_largest_point": False,
        "tok_s": None,
        "output_tok_s": None,
        "configuration": "fast",  # the configuration giving the tier (a speculative sweep may)
        "forced_acceptance_length": None,
    }
    text = (tmp_path / "report.md").read_text()
    assert "No A/B" in text and "**no point meets it**" in text


def test_single_switch_sets_the_candidate_against_each_off_sweep():
    from flashpd.bench.agentx_report import single_switch

    full = [point(1, 100, 90, 0.5, 1000), point(4, 80, 70, 0.8, 3000)]
    no_replay = [point(1, 90, 45, 0.9, 800), point(4, 70, 35, 1.5, 2000)]
    metrics = {"flashpd": full, "off-replay": no_replay, "baseline": no_replay}
    rows = single_switch(metrics, "flashpd", tiers=(20, 60), ttft_limit_s=5.0)
    assert set(rows) == {"replay"}  # only the off-<switch> sweeps
    assert rows["replay"]["speedup_low_concurrency"] == pytest.approx(2.0)
    assert single_switch(metrics, None, tiers=(20,), ttft_limit_s=5.0) == {}
    # another reference (a same-commit run that is itself an off- sweep) is not set against itself
    metrics["off-affinity"] = full
    rows = single_switch(metrics, "off-affinity", tiers=(20, 60), ttft_limit_s=5.0)
    assert set(rows) == {"replay"} and rows["replay"]["speedup_low_concurrency"] == pytest.approx(2.0)


def _copy_config(study_dir, src: str, root, name: str, forced: float | None = None) -> None:
    """`src`'s sweep as configuration `name` under `root`; `forced`: every answered record says its
    acceptance was forced to that length, with 5 drafts and `forced - 1` accepted per verify step."""
    import shutil

    shutil.copytree(study_dir / src, root / name)
    for meta in (root / name).rglob("meta.json"):  # the study keys runs by their name
        meta.write_text(meta.read_text().replace(f'"name": "{src}"', f'"name": "{name}"'))
    if forced is None:
        return
    for path in (root / name).rglob("records.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for r in rows:
            if r["error_type"] is None:
                r.update(forced_acceptance_length=forced, draft_tokens=50, draft_steps=10)
                r["accepted_draft_tokens"] = round(10 * (forced - 1))
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_agentx_report_takes_a_tier_the_candidate_misses_from_the_forced_speculative_sweep(
    study_dir, tmp_path, rectangular_tables
):
    """The candidate (a copy of the slow sweep) meets no point under a 4 ms TTFT bound; the
    forced speculative sweep (a copy of the fast one) does: the tier names it, its concurrency and
    forced acceptance, and the A/B sets it against the baseline for that tier only; every table
    marks it forced."""
    from flashpd.bench.agentx_gpu import main

    root = tmp_path / "study"
    _copy_config(study_dir, "fast", root, "baseline")
    _copy_config(study_dir, "base", root, "flashpd")
    _copy_config(study_dir, "fast", root, "spec", forced=3.5)
    argv = ["report", str(root), "--baseline", "baseline", "--candidate", "flashpd", "--tiers", "20,1e6"]
    assert main([*argv, "--ttft-limit-s", "0.004", "--commit", "c"]) == 0
    s = json.loads((root / "summary.json").read_text())
    assert s["configurations"]["spec"]["forced_acceptance_length"] == 3.5
    assert s["configurations"]["flashpd"]["forced_acceptance_length"] is None
    sp = s["configurations"]["spec"]["speculation"]
    assert sp["forced_requests"] == sp["requests"] > 0 and sp["acceptance_length"] == 3.5
    t20 = s["tiers"]["20"]
    assert t20["met"] and t20["configuration"] == "spec" and t20["forced_acceptance_length"] == 3.5
    assert t20["max_concurrency"] == s["configurations"]["spec"]["20"]["max_concurrency"] == 2
    assert s["tiers"]["1e+06"]["configuration"] == "flashpd" and not s["tiers"]["1e+06"]["met"]
    ab = s["ab"]
    assert ab["candidate_at_tier"] == {"20": "spec", "1e+06": "flashpd"}
    assert ab["throughput_ratio_at_tier"]["20"] == 1.0  # spec and baseline are copies of one sweep
    assert ab["throughput_ratio_at_tier"]["1e+06"] is None and ab["speculative_common_concurrency"] == [1, 2]
    assert ab["speedup_low_concurrency"] < 1  # the low-concurrency ratio stays flashpd's own
    text = (root / "report.md").read_text()
    assert "| spec (**forced AL 3.5**) | 20 | yes | 2" in text and "Benchmark mode: forced acceptance" in text
    assert "takes `spec` as the candidate" in text and "## Speculative decoding" in text
    rectangular_tables(text)


def test_agentx_report_without_a_speculative_sweep_keeps_the_candidate_for_every_tier(study_dir, tmp_path):
    from flashpd.bench.agentx_gpu import main

    root = tmp_path / "study"
    _copy_config(study_dir, "fast", root, "baseline")
    _copy_config(study_dir, "base", root, "flashpd")
    argv = ["report", str(root), "--baseline", "baseline", "--candidate", "flashpd", "--ttft-limit-s", "0.004"]
    assert main(argv) == 0
    s = json.loads((root / "summary.json").read_text())
    assert {t["configuration"] for t in s["tiers"].values()} == {"flashpd"}
    assert set(s["ab"]["candidate_at_tier"].values()) == {"flashpd"}
    assert all(c["forced_acceptance_length"] is None for c in s["configurations"].values())
    assert "forced" not in (root / "report.md").read_text().split("# Details")[0]


def test_the_report_sets_the_single_switches_against_the_named_reference(study_dir, tmp_path):
    from flashpd.bench.agentx_gpu import main

    root = tmp_path / "study"
    _copy_config(study_dir, "fast", root, "baseline")
    _copy_config(study_dir, "base", root, "flashpd")
    _copy_config(study_dir, "fast", root, "off-affinity")  # the same-commit reference
    _copy_config(study_dir, "fast", root, "off-replay")
    argv = ["report", str(root), "--baseline", "baseline", "--candidate", "flashpd"]
    assert main([*argv, "--switch-reference", "off-affinity"]) == 0
    s = json.loads((root / "summary.json").read_text())
    assert s["single_switch_reference"] == "off-affinity" and set(s["single_switch"]) == {"replay"}
    assert s["single_switch"]["replay"]["speedup_low_concurrency"] == 1.0  # copies of one sweep
    assert "`off-affinity` over each sweep with one switch off" in (root / "report.md").read_text()
    with pytest.raises(SystemExit, match="--switch-reference: no sweep named 'off-nothing'"):
        main([*argv, "--switch-reference", "off-nothing"])
