"""CUDA-core routed MXFP4 experts (kernels/moe/gemv.py) against moe/ref.py."""

from __future__ import annotations

import pytest
import torch

from flashpd.kernels.dense import triton as dt
from flashpd.kernels.moe import gemv
from flashpd.kernels.moe import ref as mref
from flashpd.kernels.moe import triton as mt
from flashpd.kernels.quant import ref as qref

LIMIT = 10.0


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Interpreter speed: few programs per launch (block sizes never change a pair's sums)."""
    monkeypatch.setitem(gemv.CONFIG, "up", {**gemv.CONFIG["up"], "block_n": 32})
    monkeypatch.setitem(gemv.CONFIG, "down", {**gemv.CONFIG["down"], "block_n": 32})


def _experts(e: int, d: int, i: int, seed: int) -> mt.ExpertSet:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in ((i, d), (i, d), (d, i)):
        ps = [qref.quantize_mxfp4_weight(torch.randn(n, k, generator=g) * 0.1) for _ in range(e)]
        out.append(dt.Weights.mxfp4(torch.stack([p for p, _ in ps]),
                                    torch.stack([s for _, s in ps])))
    return mt.ExpertSet(*out)


def _batch(t: int, d: int, e: int, k: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return x, ids, torch.rand(t, k, generator=g) * 1.5


def _reference(x, ids, weights, experts: mt.ExpertSet) -> torch.Tensor:
    """moe.ref's routed sum on the dequantised experts, FP32 [T, D]."""
    deq = [torch.stack([qref.dequantize_mxfp4_weight(w.data[j], w.scale[j]).to(x.dtype)
                        for j in range(w.num_experts)])
           for w in (experts.w1, experts.w3, experts.w2)]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for j in torch.unique(ids).tolist():  # ascending expert id, as moe.ref.moe
        tok, slot = torch.nonzero(ids == j, as_tuple=True)
        y = mref.expert_ffn(x[tok], deq[0][j], deq[1][j], deq[2][j], LIMIT,
                            weights[tok, slot][:, None])
        out.index_add_(0, tok, y.float())
    return out


def _gemv(x, ids, weights, experts: mt.ExpertSet, rows: int) -> torch.Tensor:
    pairs = mt.sort_pairs(ids, weights, experts.num_experts, rows)
    y = gemv.expert_rows(x, pairs, experts, LIMIT, rows)
    return mt.combine(y, pairs.pos, None, torch.float32)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("t, rows, d, i", [(1, 1, 64, 32), (5, 2, 96, 64), (6, 4, 64, 32)])
def test_gemv_routed_sum_matches_reference(t, rows, d, i):
    """d = 96: a K step past the last scale group (masked); i = 32, 64: one short K step."""
    experts = _experts(4, d, i, seed=t)
    x, ids, w = _batch(t, d, 4, 2, seed=10 + t)
    assert _rel_err(_gemv(x, ids, w, experts, rows), _reference(x, ids, w, experts)) < 2e-3


def test_gemv_fp32_activations_match_reference():
    experts = _experts(4, 64, 32, seed=3)
    x, ids, w = _batch(3, 64, 4, 2, seed=4, dtype=torch.float32)
    assert _rel_err(_gemv(x, ids, w, experts, 2), _reference(x, ids, w, experts)) < 1e-5


def test_whole_k_steps_take_the_unmasked_loads(monkeypatch):
    """K = 128 in steps of 4 groups (EVEN_K: no K mask on words, scales or x)."""
    for part in ("up", "down"):
        monkeypatch.setitem(gemv.CONFIG, part, {**gemv.CONFIG[part], "groups": 4})
    experts = _experts(4, 128, 128, seed=5)
    x, ids, w = _batch(2, 128, 4, 2, seed=6)
    assert _rel_err(_gemv(x, ids, w, experts, 1), _reference(x, ids, w, experts)) < 2e-3


def test_select_decode_gives_the_bits_decode_results(monkeypatch):
    experts = _experts(4, 64, 32, seed=7)
    x, ids, w = _batch(3, 64, 4, 2, seed=8)
    bits = _gemv(x, ids, w, experts, 2)
    monkeypatch.setitem(gemv.CONFIG, "decode", "select")
    assert torch.equal(_gemv(x, ids, w, experts, 2), bits)


def test_prefetch_does_not_change_results(monkeypatch):
    experts = _experts(4, 96, 32, seed=9)
    x, ids, w = _batch(2, 96, 4, 2, seed=9)
    on = _gemv(x, ids, w, experts, 1)
    for part in ("up", "down"):
        monkeypatch.setitem(gemv.CONFIG, part, {**gemv.CONFIG[part], "prefetch": False})
    assert torch.equal(_gemv(x, ids, w, experts, 1), on)


def test_a_tokens_result_does_not_depend_on_its_batch_or_tile_rows():
    """Batch invariance: token 0 alone (1 row per tile) == token 0 in a batch of 5 (4 rows)."""
    experts = _experts(4, 64, 32, seed=11)
    x, ids, w = _batch(5, 64, 4, 3, seed=12)
    ids[:, 0] = 1  # every token shares expert 1: its tiles hold several rows
    alone = _gemv(x[:1], ids[:1], w[:1], experts, 1)
    assert torch.equal(_gemv(x, ids, w, experts, 4)[:1], alone)


def test_small_batches_of_moe_quantized_take_the_gemv_path(monkeypatch):
    """moe.triton routes <= GEMV_MAX_ROWS tokens here (and only then), same answer (the
    default bound is 0: swap-AB from 1 token)."""
    experts = _experts(4, 64, 32, seed=13)
    x, ids, w = _batch(3, 64, 4, 2, seed=14)
    calls = []
    real = gemv.expert_rows
    monkeypatch.setattr(gemv, "expert_rows", lambda *a: calls.append(a[-1]) or real(*a))
    monkeypatch.setattr(mt, "GEMV_MAX_ROWS", 4)
    got = mt.routed_experts(x, ids, w, experts, LIMIT)
    assert calls == [gemv.tile_rows(3)]
    assert _rel_err(got, _reference(x, ids, w, experts)) < 2e-3
    monkeypatch.setattr(mt, "GEMV_MAX_ROWS", 2)
    mt.routed_experts(x, ids, w, experts, LIMIT)
    assert len(calls) == 1


def test_tile_rows_takes_the_first_entry_covering_the_batch(monkeypatch):
    monkeypatch.setitem(gemv.CONFIG, "rows", ((1, 1), (8, 2), (16, 4)))
    assert [gemv.tile_rows(t) for t in (1, 2, 8, 9, 16)] == [1, 2, 2, 4, 4]
    with pytest.raises(ValueError, match="17 tokens"):
        gemv.tile_rows(17)


def test_only_mxfp4_experts_are_eligible():
    experts = _experts(2, 64, 32, seed=15)
    assert gemv.eligible(experts, torch.bfloat16) and gemv.eligible(experts, torch.float32)
    assert not gemv.eligible(experts, torch.float16)
    plain = mt.ExpertSet.plain(mref.ExpertWeights(torch.zeros(2, 32, 64), torch.zeros(2, 32, 64),
                                                  torch.zeros(2, 64, 32)))
    assert not gemv.eligible(plain, torch.bfloat16)
    x, ids, w = _batch(1, 64, 2, 1, seed=0)
    pairs = mt.sort_pairs(ids, w, 2, 1)
    with pytest.raises(ValueError, match="MXFP4"):
        gemv.expert_rows(x, pairs, plain, LIMIT, 1)
    with pytest.raises(ValueError, match="block_m"):
        gemv.expert_rows(x, pairs, experts, LIMIT, 2)


def test_bench_check_smoke_runs_and_reports_old_and_new(tmp_path):
    """bench/moe_gemv_check.py --smoke: tiny shapes under the interpreter, one variant."""
    import json

    from flashpd.bench import moe_gemv_check

    before = dict(gemv.CONFIG)
    assert moe_gemv_check.main(["--smoke", "--out", str(tmp_path), "--variants", "rows1"]) == 0
    rows = json.loads((tmp_path / "moe_gemv_check.json").read_text())["results"]
    assert {(r["path"], r["m"]) for r in rows} == {
        ("gemv (new)", 1), ("gemv (new)", 3), ("gemv kernels only (prep+up+down)", 3),
        ("grouped GEMM (old)", 3), ("gemv rows1", 3)}
    assert all(r["err"] < 2e-3 for r in rows if r["path"] != "gemv kernels only (prep+up+down)")
    assert "| gemv rows1 | 3 |" in (tmp_path / "moe_gemv_check.md").read_text()
    assert gemv.CONFIG == before and mt.GEMV
