"""Swap-AB tensor-core routed MXFP4 experts (kernels/moe/swapab.py) against moe/ref.py."""

from __future__ import annotations

import pytest
import torch

from flashpd.kernels import triton_runtime
from flashpd.kernels.dense import triton as dt
from flashpd.kernels.moe import gemv, swapab
from flashpd.kernels.moe import ref as mref
from flashpd.kernels.moe import triton as mt
from flashpd.kernels.quant import ref as qref

LIMIT = 10.0


@pytest.fixture(autouse=True)
def _small_steps(monkeypatch):
    """Interpreter speed: K steps of 64 (several steps on the tiny shapes below)."""
    for part in ("up", "down"):
        monkeypatch.setitem(swapab.CONFIG, part, {**swapab.CONFIG[part], "block_k": 64})


def _experts(e: int, d: int, i: int, seed: int) -> mt.ExpertSet:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in ((i, d), (i, d), (d, i)):
        ps = [qref.quantize_mxfp4_weight(torch.randn(n, k, generator=g) * 0.1) for _ in range(e)]
        out.append(dt.Weights.mxfp4(torch.stack([p for p, _ in ps]),
                                    torch.stack([s for _, s in ps])))
    return mt.ExpertSet(*out)


def _batch(t: int, d: int, e: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(torch.bfloat16)
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


def _swapab(x, ids, weights, experts: mt.ExpertSet, rows: int) -> torch.Tensor:
    pairs = mt.sort_pairs(ids, weights, experts.num_experts, rows)
    y = swapab.expert_rows(x, pairs, experts, LIMIT, rows)
    return mt.combine(y, pairs.pos, None, torch.float32)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("t, rows, d, i", [
    (1, 8, 64, 64),     # a single pair per tile, every other grid slot empty
    (9, 8, 128, 64),    # full and partial tiles of 8 pairs, two K steps
    (20, 16, 64, 128),  # tiles of 16 (the wgmma form on the GPU)
    (5, 32, 96, 96),    # K = 96: a K step past the last scale group (masked)
])
def test_routed_sum_matches_reference(t, rows, d, i):
    experts = _experts(4, d, i, seed=t)
    x, ids, w = _batch(t, d, 4, 2, seed=10 + t)
    assert _rel_err(_swapab(x, ids, w, experts, rows), _reference(x, ids, w, experts)) < 2e-3


def test_experts_with_more_pairs_than_a_tile_take_several_tiles():
    """Every token picks experts 0 and 1: 11 pairs each, tiles of 8 -> 8 + 3 per expert."""
    experts = _experts(4, 64, 64, seed=3)
    x, _, w = _batch(11, 64, 4, 2, seed=4)
    ids = torch.tensor([[0, 1]] * 11)
    assert _rel_err(_swapab(x, ids, w, experts, 8), _reference(x, ids, w, experts)) < 2e-3


def test_a_tokens_result_does_not_depend_on_its_batch():
    """Batch invariance within the path: token 0 alone == token 0 in a batch of 7."""
    experts = _experts(4, 64, 64, seed=11)
    x, ids, w = _batch(7, 64, 4, 3, seed=12)
    ids[:, 0] = 1  # every token shares expert 1: its tile holds 7 pairs
    alone = _swapab(x[:1], ids[:1], w[:1], experts, 8)
    assert torch.equal(_swapab(x, ids, w, experts, 8)[:1], alone)


def test_k_step_does_not_change_more_than_rounding(monkeypatch):
    experts = _experts(4, 128, 64, seed=5)
    x, ids, w = _batch(4, 128, 4, 2, seed=6)
    want = _reference(x, ids, w, experts)
    for part in ("up", "down"):
        monkeypatch.setitem(swapab.CONFIG, part, {**swapab.CONFIG[part], "block_k": 128})
    assert _rel_err(_swapab(x, ids, w, experts, 8), want) < 2e-3


def test_moe_triton_takes_the_path_between_the_gemv_and_swapab_bounds(monkeypatch):
    """routed_experts: <= GEMV_MAX_ROWS tokens GEMV, up to MAX_TOKENS here, above: the
    grouped GEMMs (0 turns the path off)."""
    experts = _experts(4, 64, 64, seed=13)
    x, ids, w = _batch(6, 64, 4, 2, seed=14)
    calls = []
    real = swapab.expert_rows
    monkeypatch.setattr(swapab, "expert_rows", lambda *a: calls.append(a[-1]) or real(*a))
    monkeypatch.setattr(mt, "GEMV_MAX_ROWS", 2)
    monkeypatch.setattr(swapab, "MAX_TOKENS", 6)
    got = mt.routed_experts(x, ids, w, experts, LIMIT)
    assert calls == [swapab.tile_rows(6)]
    assert _rel_err(got, _reference(x, ids, w, experts)) < 2e-3
    mt.routed_experts(x[:2], ids[:2], w[:2], experts, LIMIT)  # GEMV
    mt.routed_experts(torch.cat([x, x[:1]]), torch.cat([ids, ids[:1]]),
                      torch.cat([w, w[:1]]), experts, LIMIT)  # 7 tokens: grouped GEMMs
    monkeypatch.setattr(swapab, "MAX_TOKENS", 0)
    mt.routed_experts(x, ids, w, experts, LIMIT)
    assert len(calls) == 1
    assert gemv.eligible(experts, torch.bfloat16)


def test_tile_rows_takes_the_first_entry_covering_the_batch(monkeypatch):
    monkeypatch.setitem(swapab.CONFIG, "rows", ((64, 8), (128, 16)))
    assert [swapab.tile_rows(t) for t in (1, 64, 65, 128)] == [8, 8, 16, 16]
    with pytest.raises(ValueError, match="129 tokens"):
        swapab.tile_rows(129)


def test_only_mxfp4_experts_and_bf16_activations_are_eligible():
    experts = _experts(2, 64, 64, seed=15)
    assert swapab.eligible(experts, torch.bfloat16)
    assert not swapab.eligible(experts, torch.float32)
    plain = mt.ExpertSet.plain(mref.ExpertWeights(torch.zeros(2, 64, 64), torch.zeros(2, 64, 64),
                                                  torch.zeros(2, 64, 64)))
    assert not swapab.eligible(plain, torch.bfloat16)
    x, ids, w = _batch(1, 64, 2, 1, seed=0)
    pairs = mt.sort_pairs(ids, w, 2, 8)
    with pytest.raises(ValueError, match="MXFP4"):
        swapab.expert_rows(x, pairs, plain, LIMIT, 8)
    with pytest.raises(ValueError, match="block_m"):
        swapab.expert_rows(x, pairs, experts, LIMIT, 16)


def test_bench_check_smoke_reports_new_old_and_gemv(tmp_path):
    """bench/moe_swapab_check.py --smoke: tiny shapes under the interpreter, one variant."""
    import json

    from flashpd.bench import moe_swapab_check

    before = {k: (dict(v) if isinstance(v, dict) else v) for k, v in swapab.CONFIG.items()}
    bounds = (mt.GEMV, mt.GEMV_MAX_ROWS, swapab.MAX_TOKENS)
    assert moe_swapab_check.main(["--smoke", "--out", str(tmp_path), "--ms", "3",
                                  "--variants", "bn32w2"]) == 0
    rows = json.loads((tmp_path / "moe_swapab.json").read_text())["results"]
    assert {(r["path"], r["m"]) for r in rows} == {
        ("swapab (new)", 3), ("grouped GEMM (old)", 3), ("gemv (default <= 16)", 3),
        ("swapab bn32w2", 3)}
    assert all(r["err"] < 2e-3 for r in rows)
    assert swapab.CONFIG == before and (mt.GEMV, mt.GEMV_MAX_ROWS, swapab.MAX_TOKENS) == bounds


@pytest.mark.parametrize("overrides", [
    {"up": {"split": 2}, "down": {"split": 3}},  # K = 96, steps of 64: the third split is empty
    {"up": {"split": 4, "block_n": 32, "warps": 2}, "down": {"split": 2}},
    {"up": {"split": 2, "scale_prefetch": True}, "down": {"split": 2, "w_prefetch": True}},
    {"up": {"scale_prefetch": True}, "down": {"w_prefetch": True}},
    {"fold_prep": True},
])
def test_variants_match_reference_and_leave_counters_zeroed(monkeypatch, overrides):
    """Split-K (partials summed by the last program), register prefetch, no prep launch."""
    for key, value in overrides.items():
        monkeypatch.setitem(swapab.CONFIG, key, {**swapab.CONFIG[key], **value}
                            if isinstance(value, dict) else value)
    for t, rows, d, i in ((9, 8, 128, 96), (1, 8, 96, 64), (5, 16, 64, 128)):
        experts = _experts(4, d, i, seed=20 + t)
        x, ids, w = _batch(t, d, 4, 2, seed=30 + t)
        assert _rel_err(_swapab(x, ids, w, experts, rows), _reference(x, ids, w, experts)) < 2e-3
    assert not triton_runtime.arrival_counters(torch.device("cpu")).any()


def test_split_k_result_does_not_depend_on_the_batch(monkeypatch):
    """Within a split setting a token's sums are fixed: token 0 alone == token 0 among 7 (its
    expert's tile then holds 7 pairs, and other tiles' programs arrive in another order)."""
    for part, split in (("up", 3), ("down", 2)):
        monkeypatch.setitem(swapab.CONFIG, part, {**swapab.CONFIG[part], "split": split})
    experts = _experts(4, 192, 64, seed=21)
    x, ids, w = _batch(7, 192, 4, 3, seed=22)
    ids[:, 0] = 1
    alone = _swapab(x[:1], ids[:1], w[:1], experts, 8)
    assert torch.equal(_swapab(x, ids, w, experts, 8)[:1], alone)


def test_launch_config_takes_the_first_size_entry_covering_the_batch(monkeypatch):
    monkeypatch.setitem(swapab.CONFIG, "sizes", ((2, {}), (4, {"up": {"split": 2}}),
                                                 (64, {"down": {"block_n": 32}})))
    up, down = swapab.CONFIG["up"], swapab.CONFIG["down"]
    assert swapab.launch_config("up", 2) == up
    assert swapab.launch_config("up", 3) == {**up, "split": 2}
    assert swapab.launch_config("down", 3) == down
    assert swapab.launch_config("down", 64) == {**down, "block_n": 32}
    assert swapab.launch_config("down", 65) == down


def test_default_size_classes_match_reference(monkeypatch):
    """Each CONFIG "sizes" class of the defaults (K steps shrunk to the tiny shapes)."""
    small = tuple((m, {p: {**o, "block_k": 64} for p, o in over.items()})
                  for m, over in swapab.CONFIG["sizes"])
    monkeypatch.setitem(swapab.CONFIG, "sizes", small)
    experts = _experts(8, 128, 64, seed=25)
    for t in (1, 4, 16, 64, 65):
        x, ids, w = _batch(t, 128, 8, 2, seed=26 + t)
        rows = swapab.tile_rows(t)
        assert _rel_err(_swapab(x, ids, w, experts, rows), _reference(x, ids, w, experts)) < 2e-3


def test_bad_split_and_decode_settings_are_named(monkeypatch):
    experts = _experts(2, 64, 64, seed=23)
    x, ids, w = _batch(2, 64, 2, 1, seed=24)
    monkeypatch.setitem(swapab.CONFIG, "up", {**swapab.CONFIG["up"], "split": 0})
    with pytest.raises(ValueError, match="split"):
        _swapab(x, ids, w, experts, 8)
    monkeypatch.setitem(swapab.CONFIG, "up", {**swapab.CONFIG["up"], "split": 1})
    monkeypatch.setitem(swapab.CONFIG, "decode", "lut")
    with pytest.raises(ValueError, match="decode"):
        _swapab(x, ids, w, experts, 8)
