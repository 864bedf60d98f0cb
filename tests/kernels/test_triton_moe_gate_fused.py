"""The gate in one launch (kernels/moe/triton.py route_sorted, MoeConfig.fused_gate): the router's last
token block also sorts the pairs; outputs identical to route + sort_pairs, counters left zero."""

from __future__ import annotations

import pytest
import torch

from flashpd.kernels import configs, triton_runtime
from flashpd.kernels.moe import ref as mref
from flashpd.kernels.moe import triton as mt

BENCH_EXPERTS, BENCH_TOP_K = 64, 6  # the bench preset's router (model/presets.py)


def _gate(t: int, d: int, e: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).bfloat16()
    w = (torch.randn(e, d, generator=g) * d**-0.5).bfloat16()
    return x, w, torch.randn(e, generator=g) * 0.1


def _assert_same_pairs(got: mt.SortedPairs, want: mt.SortedPairs) -> None:
    assert torch.equal(got.rows, want.rows) and torch.equal(got.gamma, want.gamma)
    assert torch.equal(got.pos, want.pos)
    assert got.schedule.block_m == want.schedule.block_m
    for a, b in (
        (got.schedule.expert, want.schedule.expert),
        (got.schedule.start, want.schedule.start),
        (got.schedule.end, want.schedule.end),
    ):
        assert torch.equal(a, b)  # every tile, the empty surplus ones included


def _counters_zero(device: torch.device) -> bool:
    return not bool(triton_runtime.arrival_counters(device).any())


@pytest.mark.parametrize("t", [1, 3, 8, 64])
@pytest.mark.parametrize("block_m", [16, 2])
def test_fused_gate_gives_route_and_sort_pairs_outputs(tune, monkeypatch, t, block_m):
    """T = 1, 3, 8, 64 at the bench preset's 64 experts / top-6 (tiny width): ids and weights
    bit-identical to `route`, rows / gamma / pos / every tile identical to `sort_pairs`
    (block_m 2 at T = 64: 4 token blocks, 4 blocks of 64 tiles in the one program)."""
    x, w, bias = _gate(t, 256, BENCH_EXPERTS, seed=t)
    tune.set("moe", fused_gate=True)
    tune.set("moe", fused_gate_max_tokens=64)
    real = mt.sort_pairs
    monkeypatch.setattr(mt, "sort_pairs", lambda *a: pytest.fail("fell back to sort_pairs"))
    ids, gam, pairs = tune(mt).route_sorted(x, w, bias, BENCH_TOP_K, 2.5, 1.0, True, block_m)
    assert _counters_zero(x.device)
    want_ids, want_gam = mt.route(x, w, bias, BENCH_TOP_K, 2.5)
    assert torch.equal(ids, want_ids) and torch.equal(gam, want_gam)
    assert torch.equal(ids, mref.route(x, w, bias, BENCH_TOP_K, 2.5)[0])
    _assert_same_pairs(pairs, real(want_ids, want_gam, BENCH_EXPERTS, block_m))


def test_fused_gate_one_program_per_token_block(tune, monkeypatch):
    """ROUTER_SPLIT 1 (no partials: each token block's only program runs the epilogue) with two
    token blocks; gate_temp and normalize=False go through unchanged."""
    x, w, bias = _gate(20, 64, 12, seed=5)
    monkeypatch.setattr(mt, "ROUTER_SPLIT", 1)
    tune.set("moe", fused_gate=True)
    tune.set("moe", fused_gate_max_tokens=64)
    ids, gam, pairs = tune(mt).route_sorted(x, w, bias, 4, 1.5, 0.7, False, 4)
    assert _counters_zero(x.device)
    want_ids, want_gam = mt.route(x, w, bias, 4, 1.5, 0.7, normalize=False)
    assert torch.equal(ids, want_ids) and torch.equal(gam, want_gam)
    _assert_same_pairs(pairs, mt.sort_pairs(want_ids, want_gam, 12, 4))


def test_fused_gate_off_or_past_its_bound_is_route_then_sort(tune, monkeypatch):
    """Switch off (the default), or T > fused_gate_max_tokens: the two launches, same results."""
    assert not configs.DEFAULT.moe.fused_gate  # off by default
    x, w, bias = _gate(5, 128, 16, seed=2)
    tune.set("moe", fused_gate=True)
    want = tune(mt).route_sorted(x, w, bias, 3, 1.0, 1.0, True, 16)
    launches = []
    real = mt.sort_pairs
    monkeypatch.setattr(mt, "sort_pairs", lambda *a: launches.append(a) or real(*a))
    tune.set("moe", fused_gate_max_tokens=4)
    past = tune(mt).route_sorted(x, w, bias, 3, 1.0, 1.0, True, 16)
    tune.set("moe", fused_gate_max_tokens=64)
    tune.set("moe", fused_gate=False)
    off = tune(mt).route_sorted(x, w, bias, 3, 1.0, 1.0, True, 16)
    assert len(launches) == 2  # both fell back to sort_pairs
    for got in (past, off):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        _assert_same_pairs(got[2], want[2])
    assert _counters_zero(x.device)


def test_moe_with_the_fused_gate_sorts_once_and_matches_the_unfused_moe(tune, monkeypatch):
    """mt.moe (bf16 experts, T = 3): with fused_gate on, sort_pairs is not called (the gate's
    pairs are used) and the output is bit-identical to the unfused path's."""
    g = torch.Generator().manual_seed(7)
    e, d, i = 8, 64, 32
    x, gw, bias = _gate(3, d, e, seed=7)
    experts = mref.ExpertWeights(
        *(torch.randn(e, n, k, generator=g).bfloat16() * 0.1 for n, k in ((i, d), (i, d), (d, i)))
    )
    shared = mref.ExpertWeights(
        *(torch.randn(1, n, k, generator=g).bfloat16() * 0.1 for n, k in ((i, d), (i, d), (d, i)))
    )
    tune.set("moe", fused_gate=False)
    want = tune(mt).moe(x, gw, bias, experts, shared, 2, 1.5, 10.0)

    def no_sort(*args):
        raise AssertionError("sort_pairs called with the fused gate on")

    tune.set("moe", fused_gate=True)
    monkeypatch.setattr(mt, "sort_pairs", no_sort)
    got = tune(mt).moe(x, gw, bias, experts, shared, 2, 1.5, 10.0)
    assert torch.equal(got, want)
    assert _counters_zero(x.device)
