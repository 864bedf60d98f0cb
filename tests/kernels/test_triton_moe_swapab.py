"""Swap-AB tensor-core routed MXFP4 experts (kernels/moe/swapab.py) against moe/ref.py."""

from __future__ import annotations

import pytest
import torch

from flashpd.kernels import configs, triton_runtime
from flashpd.kernels.moe import gemv, swapab
from flashpd.kernels.moe import ref as mref
from flashpd.kernels.moe import triton as mt

from .conftest import MOE_LIMIT, mxfp4_experts, rel_err, routed_batch, routed_reference


@pytest.fixture(autouse=True)
def _small_steps(tune):
    """Interpreter speed: K steps of 64 (several steps on the tiny shapes below)."""
    for part in ("up", "down"):
        _merge(tune, part, block_k=64)


def _merge(tune, field: str, **entries) -> None:
    """Entries merged into one of the swap-AB config's launch tables ("up" / "down")."""
    tune.set("moe", swapab={field: {**getattr(tune.moe.swapab, field), **entries}})


def _swapab(x, ids, weights, experts: mt.ExpertSet, rows: int, tune) -> torch.Tensor:
    pairs = mt.sort_pairs(ids, weights, experts.num_experts, rows)
    y = swapab.expert_rows(x, pairs, experts, MOE_LIMIT, rows, cfg=tune.moe.swapab)
    return mt.combine(y, pairs.pos, None, torch.float32)


@pytest.mark.parametrize(
    "t, rows, d, i",
    [
        (1, 8, 64, 64),  # a single pair per tile, every other grid slot empty
        (9, 8, 128, 64),  # full and partial tiles of 8 pairs, two K steps
        (20, 16, 64, 128),  # tiles of 16 (the wgmma form on the GPU)
        (5, 32, 96, 96),  # K = 96: a K step past the last scale group (masked)
    ],
)
def test_routed_sum_matches_reference(tune, t, rows, d, i):
    experts = mxfp4_experts(4, d, i, seed=t)
    x, ids, w = routed_batch(t, d, 4, 2, seed=10 + t)
    assert rel_err(_swapab(x, ids, w, experts, rows, tune), routed_reference(x, ids, w, experts)) < 2e-3


def test_experts_with_more_pairs_than_a_tile_take_several_tiles(tune):
    """Every token picks experts 0 and 1: 11 pairs each, tiles of 8 -> 8 + 3 per expert."""
    experts = mxfp4_experts(4, 64, 64, seed=3)
    x, _, w = routed_batch(11, 64, 4, 2, seed=4)
    ids = torch.tensor([[0, 1]] * 11)
    assert rel_err(_swapab(x, ids, w, experts, 8, tune), routed_reference(x, ids, w, experts)) < 2e-3


def test_a_tokens_result_does_not_depend_on_its_batch(tune):
    """Batch invariance within the path: token 0 alone == token 0 in a batch of 7."""
    experts = mxfp4_experts(4, 64, 64, seed=11)
    x, ids, w = routed_batch(7, 64, 4, 3, seed=12)
    ids[:, 0] = 1  # every token shares expert 1: its tile holds 7 pairs
    alone = _swapab(x[:1], ids[:1], w[:1], experts, 8, tune)
    assert torch.equal(_swapab(x, ids, w, experts, 8, tune)[:1], alone)


def test_k_step_does_not_change_more_than_rounding(tune, monkeypatch):
    experts = mxfp4_experts(4, 128, 64, seed=5)
    x, ids, w = routed_batch(4, 128, 4, 2, seed=6)
    want = routed_reference(x, ids, w, experts)
    for part in ("up", "down"):
        _merge(tune, part, block_k=128)
    assert rel_err(_swapab(x, ids, w, experts, 8, tune), want) < 2e-3


def test_moe_triton_takes_the_path_between_the_gemv_and_swapab_bounds(tune, monkeypatch):
    """routed_experts: <= GEMV_MAX_ROWS tokens GEMV, up to MAX_TOKENS here, above: the
    grouped GEMMs (0 turns the path off)."""
    experts = mxfp4_experts(4, 64, 64, seed=13)
    x, ids, w = routed_batch(6, 64, 4, 2, seed=14)
    calls = []
    real = swapab.expert_rows
    monkeypatch.setattr(swapab, "expert_rows", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    tune.set("moe", gemv_max_rows=2, swapab_max_tokens=6)
    got = tune(mt).routed_experts(x, ids, w, experts, MOE_LIMIT)
    assert calls == [swapab.tile_rows(6, tune.moe.swapab)]
    assert rel_err(got, routed_reference(x, ids, w, experts)) < 2e-3
    tune(mt).routed_experts(x[:2], ids[:2], w[:2], experts, MOE_LIMIT)  # GEMV
    tune(mt).routed_experts(
        torch.cat([x, x[:1]]), torch.cat([ids, ids[:1]]), torch.cat([w, w[:1]]), experts, MOE_LIMIT
    )  # 7 tokens: grouped GEMMs
    tune.set("moe", swapab_max_tokens=0)
    tune(mt).routed_experts(x, ids, w, experts, MOE_LIMIT)
    assert len(calls) == 1
    assert gemv.eligible(experts, torch.bfloat16)


def test_tile_rows_takes_the_first_entry_covering_the_batch():
    cfg = configs.SwapabConfig(rows=((64, 8), (128, 16)))
    assert [swapab.tile_rows(t, cfg) for t in (1, 64, 65, 128)] == [8, 8, 16, 16]
    with pytest.raises(ValueError, match="129 tokens"):
        swapab.tile_rows(129, cfg)


def test_only_mxfp4_experts_and_bf16_activations_are_eligible():
    experts = mxfp4_experts(2, 64, 64, seed=15)
    assert swapab.eligible(experts, torch.bfloat16)
    assert not swapab.eligible(experts, torch.float32)
    plain = mt.ExpertSet.plain(
        mref.ExpertWeights(torch.zeros(2, 64, 64), torch.zeros(2, 64, 64), torch.zeros(2, 64, 64))
    )
    assert not swapab.eligible(plain, torch.bfloat16)
    x, ids, w = routed_batch(1, 64, 2, 1, seed=0)
    pairs = mt.sort_pairs(ids, w, 2, 8)
    with pytest.raises(ValueError, match="MXFP4"):
        swapab.expert_rows(x, pairs, plain, MOE_LIMIT, 8, cfg=configs.DEFAULT.moe.swapab)
    with pytest.raises(ValueError, match="block_m"):
        swapab.expert_rows(x, pairs, experts, MOE_LIMIT, 16, cfg=configs.DEFAULT.moe.swapab)


def test_bench_check_smoke_reports_new_old_and_gemv(tmp_path, benchmark_script):
    """benchmarks/moe_swapab_check.py --smoke: tiny shapes under the interpreter, one variant."""
    import json

    moe_swapab_check = benchmark_script("moe_swapab_check")

    assert moe_swapab_check.main(["--smoke", "--out", str(tmp_path), "--ms", "3", "--variants", "bn32w2"]) == 0
    rows = json.loads((tmp_path / "moe_swapab.json").read_text())["results"]
    assert {(r["path"], r["m"]) for r in rows} == {
        ("swapab (new)", 3),
        ("grouped GEMM (old)", 3),
        ("gemv (default <= 16)", 3),
        ("swapab bn32w2", 3),
    }
    assert all(r["err"] < 2e-3 for r in rows)


@pytest.mark.parametrize(
    "overrides",
    [
        {"up": {"split": 2}, "down": {"split": 3}},  # K = 96, steps of 64: the third split is empty
        {"up": {"split": 4, "block_n": 32, "warps": 2}, "down": {"split": 2}},
        {"up": {"split": 2, "scale_prefetch": True}, "down": {"split": 2, "w_prefetch": True}},
        {"up": {"scale_prefetch": True}, "down": {"w_prefetch": True}},
        {"fold_prep": True},
    ],
)
def test_variants_match_reference_and_leave_counters_zeroed(tune, monkeypatch, overrides):
    """Split-K (partials summed by the last program), register prefetch, no prep launch."""
    for key, value in overrides.items():
        if isinstance(value, dict):
            _merge(tune, key, **value)
        else:
            tune.set("moe", swapab={key: value})
    for t, rows, d, i in ((9, 8, 128, 96), (1, 8, 96, 64), (5, 16, 64, 128)):
        experts = mxfp4_experts(4, d, i, seed=20 + t)
        x, ids, w = routed_batch(t, d, 4, 2, seed=30 + t)
        assert rel_err(_swapab(x, ids, w, experts, rows, tune), routed_reference(x, ids, w, experts)) < 2e-3
    assert not triton_runtime.arrival_counters(torch.device("cpu")).any()


def test_split_k_result_does_not_depend_on_the_batch(tune, monkeypatch):
    """Within a split setting a token's sums are fixed: token 0 alone == token 0 among 7 (its
    expert's tile then holds 7 pairs, and other tiles' programs arrive in another order)."""
    for part, split in (("up", 3), ("down", 2)):
        _merge(tune, part, split=split)
    experts = mxfp4_experts(4, 192, 64, seed=21)
    x, ids, w = routed_batch(7, 192, 4, 3, seed=22)
    ids[:, 0] = 1
    alone = _swapab(x[:1], ids[:1], w[:1], experts, 8, tune)
    assert torch.equal(_swapab(x, ids, w, experts, 8, tune)[:1], alone)


def test_launch_config_takes_the_first_size_entry_covering_the_batch():
    cfg = configs.SwapabConfig(sizes=((2, {}), (4, {"up": {"split": 2}}), (64, {"down": {"block_n": 32}})))
    up, down = dict(cfg.up), dict(cfg.down)
    assert swapab.launch_config("up", 2, cfg) == up
    assert swapab.launch_config("up", 3, cfg) == {**up, "split": 2}
    assert swapab.launch_config("down", 3, cfg) == down
    assert swapab.launch_config("down", 64, cfg) == {**down, "block_n": 32}
    assert swapab.launch_config("down", 65, cfg) == down


def test_default_size_classes_match_reference(tune, monkeypatch):
    """Each size class of the defaults (SwapabConfig.sizes; K steps shrunk to the tiny shapes)."""
    small = tuple(
        (m, {p: {**o, "block_k": 64} for p, o in over.items()}) for m, over in configs.DEFAULT.moe.swapab.sizes
    )
    tune.set("moe", swapab={"sizes": small})
    experts = mxfp4_experts(8, 128, 64, seed=25)
    for t in (1, 4, 16, 64, 65):
        x, ids, w = routed_batch(t, 128, 8, 2, seed=26 + t)
        rows = swapab.tile_rows(t, tune.moe.swapab)
        assert rel_err(_swapab(x, ids, w, experts, rows, tune), routed_reference(x, ids, w, experts)) < 2e-3


def test_bad_split_and_decode_settings_are_named(tune, monkeypatch):
    experts = mxfp4_experts(2, 64, 64, seed=23)
    x, ids, w = routed_batch(2, 64, 2, 1, seed=24)
    _merge(tune, "up", split=0)
    with pytest.raises(ValueError, match="split"):
        _swapab(x, ids, w, experts, 8, tune)
    _merge(tune, "up", split=1)
    tune.set("moe", swapab={"decode": "lut"})
    with pytest.raises(ValueError, match="decode"):
        _swapab(x, ids, w, experts, 8, tune)
