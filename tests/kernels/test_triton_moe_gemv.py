"""CUDA-core routed MXFP4 experts (kernels/moe/gemv.py) against moe/ref.py."""

from __future__ import annotations

import pytest
import torch

from flashpd.kernels import configs
from flashpd.kernels.moe import gemv
from flashpd.kernels.moe import ref as mref
from flashpd.kernels.moe import triton as mt

from .conftest import MOE_LIMIT, mxfp4_experts, rel_err, routed_batch, routed_reference


@pytest.fixture(autouse=True)
def _small_tiles(tune):
    """Interpreter speed: few programs per launch (block sizes never change a pair's sums)."""
    for part in ("up", "down"):
        _merge(tune, part, block_n=32)


def _merge(tune, field: str, **entries) -> None:
    cur = tune.moe.gemv_tiles
    tune.set("moe", gemv_tiles={field: {**getattr(cur, field), **entries}})


def _gemv(x, ids, weights, experts: mt.ExpertSet, rows: int, tune) -> torch.Tensor:
    pairs = mt.sort_pairs(ids, weights, experts.num_experts, rows)
    y = gemv.expert_rows(x, pairs, experts, MOE_LIMIT, rows, cfg=tune.moe.gemv_tiles)
    return mt.combine(y, pairs.pos, None, torch.float32)


@pytest.mark.parametrize("t, rows, d, i", [(1, 1, 64, 32), (5, 2, 96, 64), (6, 4, 64, 32)])
def test_gemv_routed_sum_matches_reference(tune, t, rows, d, i):
    """d = 96: a K step past the last scale group (masked); i = 32, 64: one short K step."""
    experts = mxfp4_experts(4, d, i, seed=t)
    x, ids, w = routed_batch(t, d, 4, 2, seed=10 + t)
    assert rel_err(_gemv(x, ids, w, experts, rows, tune), routed_reference(x, ids, w, experts)) < 2e-3


def test_gemv_fp32_activations_match_reference(tune):
    experts = mxfp4_experts(4, 64, 32, seed=3)
    x, ids, w = routed_batch(3, 64, 4, 2, seed=4, dtype=torch.float32)
    assert rel_err(_gemv(x, ids, w, experts, 2, tune), routed_reference(x, ids, w, experts)) < 1e-5


def test_whole_k_steps_take_the_unmasked_loads(tune, monkeypatch):
    """K = 128 in steps of 4 groups (EVEN_K: no K mask on words, scales or x)."""
    for part in ("up", "down"):
        _merge(tune, part, groups=4)
    experts = mxfp4_experts(4, 128, 128, seed=5)
    x, ids, w = routed_batch(2, 128, 4, 2, seed=6)
    assert rel_err(_gemv(x, ids, w, experts, 1, tune), routed_reference(x, ids, w, experts)) < 2e-3


def test_select_decode_gives_the_bits_decode_results(tune, monkeypatch):
    experts = mxfp4_experts(4, 64, 32, seed=7)
    x, ids, w = routed_batch(3, 64, 4, 2, seed=8)
    bits = _gemv(x, ids, w, experts, 2, tune)
    tune.set("moe", gemv_tiles={"decode": "select"})
    assert torch.equal(_gemv(x, ids, w, experts, 2, tune), bits)


def test_prefetch_does_not_change_results(tune, monkeypatch):
    experts = mxfp4_experts(4, 96, 32, seed=9)
    x, ids, w = routed_batch(2, 96, 4, 2, seed=9)
    on = _gemv(x, ids, w, experts, 1, tune)
    for part in ("up", "down"):
        _merge(tune, part, prefetch=False)
    assert torch.equal(_gemv(x, ids, w, experts, 1, tune), on)


def test_a_tokens_result_does_not_depend_on_its_batch_or_tile_rows(tune):
    """Batch invariance: token 0 alone (1 row per tile) == token 0 in a batch of 5 (4 rows)."""
    experts = mxfp4_experts(4, 64, 32, seed=11)
    x, ids, w = routed_batch(5, 64, 4, 3, seed=12)
    ids[:, 0] = 1  # every token shares expert 1: its tiles hold several rows
    alone = _gemv(x[:1], ids[:1], w[:1], experts, 1, tune)
    assert torch.equal(_gemv(x, ids, w, experts, 4, tune)[:1], alone)


def test_small_batches_of_moe_quantized_take_the_gemv_path(tune, monkeypatch):
    """moe.triton routes <= GEMV_MAX_ROWS tokens here (and only then), same answer (the
    default bound is 0: swap-AB from 1 token)."""
    experts = mxfp4_experts(4, 64, 32, seed=13)
    x, ids, w = routed_batch(3, 64, 4, 2, seed=14)
    calls = []
    real = gemv.expert_rows
    monkeypatch.setattr(gemv, "expert_rows", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    tune.set("moe", gemv_max_rows=4)
    got = tune(mt).routed_experts(x, ids, w, experts, MOE_LIMIT)
    assert calls == [gemv.tile_rows(3, tune.moe.gemv_tiles)]
    assert rel_err(got, routed_reference(x, ids, w, experts)) < 2e-3
    tune.set("moe", gemv_max_rows=2)
    tune(mt).routed_experts(x, ids, w, experts, MOE_LIMIT)
    assert len(calls) == 1


def test_tile_rows_takes_the_first_entry_covering_the_batch(monkeypatch):
    rows = configs.GemvConfig(rows=((1, 1), (8, 2), (16, 4)))
    assert [gemv.tile_rows(t, rows) for t in (1, 2, 8, 9, 16)] == [1, 2, 2, 4, 4]
    with pytest.raises(ValueError, match="17 tokens"):
        gemv.tile_rows(17, rows)


def test_only_mxfp4_experts_are_eligible(tune):
    experts = mxfp4_experts(2, 64, 32, seed=15)
    assert gemv.eligible(experts, torch.bfloat16) and gemv.eligible(experts, torch.float32)
    assert not gemv.eligible(experts, torch.float16)
    plain = mt.ExpertSet.plain(
        mref.ExpertWeights(torch.zeros(2, 32, 64), torch.zeros(2, 32, 64), torch.zeros(2, 64, 32))
    )
    assert not gemv.eligible(plain, torch.bfloat16)
    x, ids, w = routed_batch(1, 64, 2, 1, seed=0)
    pairs = mt.sort_pairs(ids, w, 2, 1)
    with pytest.raises(ValueError, match="MXFP4"):
        gemv.expert_rows(x, pairs, plain, MOE_LIMIT, 1, cfg=tune.moe.gemv_tiles)
    with pytest.raises(ValueError, match="block_m"):
        gemv.expert_rows(x, pairs, experts, MOE_LIMIT, 2, cfg=tune.moe.gemv_tiles)


def test_bench_check_smoke_runs_and_reports_old_and_new(tmp_path, benchmark_script):
    """benchmarks/moe_gemv_check.py --smoke: tiny shapes under the interpreter, one variant."""
    import json

    moe_gemv_check = benchmark_script("moe_gemv_check")

    assert moe_gemv_check.main(["--smoke", "--out", str(tmp_path), "--variants", "rows1"]) == 0
    rows = json.loads((tmp_path / "moe_gemv_check.json").read_text())["results"]
    assert {(r["path"], r["m"]) for r in rows} == {
        ("gemv (new)", 1),
        ("gemv (new)", 3),
        ("gemv kernels only (prep+up+down)", 3),
        ("grouped GEMM (old)", 3),
        ("gemv rows1", 3),
    }
    assert all(r["err"] < 2e-3 for r in rows if r["path"] != "gemv kernels only (prep+up+down)")
    assert "| gemv rows1 | 3 |" in (tmp_path / "moe_gemv_check.md").read_text()
    assert configs.DEFAULT.moe.gemv  # the defaults are data: nothing to restore
