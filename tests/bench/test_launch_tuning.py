"""Launch-tuning helpers of the GPU benches: the rule that picks a decode variant from timed
rows (the attention override from the environment: tests/kernels/test_tuning.py)."""

from __future__ import annotations


def _rows(name: str, ms: dict, err: float = 0.005) -> list[dict]:
    return [{"phase": "decode", "rows": b, "variant": name, "ms": t, "rel_err": err} for b, t in ms.items()]


def test_pick_decode_takes_the_fastest_batch_1_variant_that_does_not_slow_the_others(benchmark_script):
    pick_decode = benchmark_script("attention_bench").pick_decode
    rows = (
        _rows("default", {1: 0.023, 8: 0.030, 64: 0.094})
        + _rows("c1", {1: 0.015, 8: 0.031, 64: 0.094})  # 1.03x at B=8: out
        + _rows("mt2", {1: 0.018, 8: 0.0305, 64: 0.090})  # within 2%: in
        + _rows("bad", {1: 0.010, 8: 0.030, 64: 0.094}, err=0.5)  # wrong: out
        + [{"phase": "decode", "rows": 1, "variant": "broken", "error": "x"}]
    )
    assert pick_decode(rows) == "mt2"
    assert pick_decode(_rows("default", {1: 0.02, 8: 0.03})) == "default"
    assert pick_decode(_rows("default", {1: 0.02, 8: 0.03}) + _rows("slow", {1: 0.03, 8: 0.03})) == "default"
