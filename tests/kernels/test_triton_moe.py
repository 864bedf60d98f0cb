"""Fused MoE router and grouped expert GEMMs (kernels/moe/triton.py) against moe/ref.py."""

from __future__ import annotations

import pytest
import torch
import triton

from flashpd.kernels.dense import triton as dt
from flashpd.kernels.moe import ref as mref
from flashpd.kernels.moe import triton as mt
from flashpd.kernels.quant import ref as qref


def _router(t: int = 20, d: int = 128, e: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).bfloat16()
    w = (torch.randn(e, d, generator=g) * d**-0.5).bfloat16()
    bias = torch.randn(e, generator=g) * 0.1
    return x, w, bias


def test_route_selects_the_reference_experts_and_weights():
    x, w, bias = _router()
    ids, gam = mt.route(x, w, bias, 3, 1.5)
    rids, rgam = mref.route(x, w, bias, 3, 1.5)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(gam, rgam, rtol=1e-6, atol=1e-7)


def test_route_ties_go_to_the_lower_expert_id():
    x, w, _ = _router(t=4, e=8)
    w[4:] = w[:4]  # experts 4..7 duplicate 0..3: every score appears twice
    bias = torch.zeros(8)
    ids, _ = mt.route(x, w, bias, 4, 1.0)
    assert torch.equal(ids, mref.route(x, w, bias, 4, 1.0)[0])


def test_route_without_normalisation_scales_raw_scores():
    x, w, bias = _router(seed=1)
    ids, gam = mt.route(x, w, bias, 2, 1.5, normalize=False)
    rids, rgam = mref.route(x, w, bias, 2, 1.5, normalize=False)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(gam, rgam, rtol=1e-6, atol=1e-7)


def test_moe_with_dequantised_weights_matches_reference():
    x, gw, bias = _router(t=12, d=64, e=4, seed=2)
    g = torch.Generator().manual_seed(3)
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.1).bfloat16()  # noqa: E731
    experts = mref.ExpertWeights(mk(4, 32, 64), mk(4, 32, 64), mk(4, 64, 32))
    shared = mref.ExpertWeights(mk(1, 32, 64), mk(1, 32, 64), mk(1, 64, 32))
    got = mt.moe(x, gw, bias, experts, shared, 2, 1.5, 10.0)
    assert torch.equal(got, mref.moe(x, gw, bias, experts, shared, 2, 1.5, 10.0))


def test_moe_reads_mxfp4_routed_and_fp8_shared_experts_as_stored():
    x, gw, bias = _router(t=10, d=64, e=4, seed=4)
    g = torch.Generator().manual_seed(5)
    packed = [
        qref.quantize_mxfp4_weight(torch.randn(32 if i < 2 else 64, 64 if i < 2 else 32, generator=g) * 0.1)
        for i in range(3)
    ]
    routed = mt.ExpertSet(*(dt.Weights.mxfp4(torch.stack([p] * 4), torch.stack([s] * 4)) for p, s in packed))
    fp8 = [
        qref.quantize_fp8_blockwise(torch.randn(*shape, generator=g) * 0.1) for shape in ((32, 64), (32, 64), (64, 32))
    ]
    shared = mt.ExpertSet(*(dt.Weights.fp8(w, s) for w, s in fp8))
    got = mt.moe_quantized(x, gw, bias, routed, shared, 2, 1.5, 10.0)
    deq = [qref.dequantize_mxfp4_weight(p, s) for p, s in packed]
    ref_routed = mref.ExpertWeights(*(torch.stack([w] * 4) for w in deq))
    ref_shared = mref.ExpertWeights(*(qref.dequantize_fp8_blockwise(w, s)[None] for w, s in fp8))
    assert torch.equal(got, mref.moe(x, gw, bias, ref_routed, ref_shared, 2, 1.5, 10.0))


def test_swiglu_clamps_gate_from_above_and_up_on_both_sides():
    gate = torch.tensor([-30.0, 0.5, 30.0])
    up = torch.tensor([-30.0, 2.0, 30.0])
    torch.testing.assert_close(mt.swiglu(gate, up, 10.0), mref.swiglu(gate, up, 10.0))


def test_split_k_experts_with_swiglu_and_gamma_match_reference(tune):
    """MXFP4 routed + FP8 shared experts through three split-K programs per output block."""
    tune.set("dense", min_k_chunk=32, target_ctas=10_000)
    for fmt in ("skinny", "mx"):
        tune.merge("dense", fmt, block_k=32)
    x, gw, bias = _router(t=6, d=96, e=4, seed=6)
    g = torch.Generator().manual_seed(7)
    shapes = ((64, 96), (64, 96), (96, 64))
    packed = [
        [qref.quantize_mxfp4_weight(torch.randn(*shape, generator=g) * 0.1) for _ in range(4)] for shape in shapes
    ]
    routed = mt.ExpertSet(
        *(dt.Weights.mxfp4(torch.stack([p for p, _ in ps]), torch.stack([s for _, s in ps])) for ps in packed)
    )
    assert dt._plan(routed.w1, tune.dense)[0] == 3
    fp8 = [qref.quantize_fp8_blockwise(torch.randn(*shape, generator=g) * 0.1) for shape in shapes]
    shared = mt.ExpertSet(*(dt.Weights.fp8(w, s) for w, s in fp8))
    got = tune(mt).moe_quantized(x, gw, bias, routed, shared, 2, 1.5, 10.0)
    ref_routed = mref.ExpertWeights(
        *(torch.stack([qref.dequantize_mxfp4_weight(p, s) for p, s in ps]) for ps in packed)
    )
    ref_shared = mref.ExpertWeights(*(qref.dequantize_fp8_blockwise(w, s)[None] for w, s in fp8))
    want = mref.moe(x, gw, bias, ref_routed, ref_shared, 2, 1.5, 10.0)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-2)


def _routing(t: int, e: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=g)


def _tiles(sched):
    return [(int(x), int(a), int(b)) for x, a, b in zip(sched.expert, sched.start, sched.end, strict=True) if a < b]


@pytest.mark.parametrize("count_t", [16, 64])
def test_sort_kernel_orders_pairs_as_the_stable_torch_sort(monkeypatch, count_t):
    """One-launch pair sorting (decode) == the argsort chain (prefill): rows, gamma, tiles, pos."""
    # (64, 64, 6, 2): four token-block programs and four tile programs (256 tiles)
    for t, e, k, block_m in ((1, 64, 6, 16), (19, 8, 3, 4), (40, 16, 4, 16), (64, 64, 6, 2)):
        ids, w = _routing(t, e, k, seed=t)
        monkeypatch.setattr(mt, "SORT_COUNT_T", count_t)  # tokens per counting step
        got = mt.sort_pairs(ids, w, e, block_m)
        monkeypatch.setattr(mt, "SORT_KERNEL_MAX_TOKENS", 0)
        want = mt.sort_pairs(ids, w, e, block_m)
        monkeypatch.undo()
        assert torch.equal(got.rows, want.rows) and torch.equal(got.gamma, want.gamma)
        assert torch.equal(got.pos, want.pos)
        assert _tiles(got.schedule) == _tiles(want.schedule)
        assert got.schedule.start.shape == want.schedule.start.shape
        assert got.schedule.start.shape[0] <= t * k  # one token: top-k tiles, no empty grid


def test_sort_kernel_pos_lists_each_token_pairs_in_ascending_expert_id():
    ids, w = _routing(7, 12, 4, seed=3)
    got = mt.sort_pairs(ids, w, 12, 16)
    sorted_expert = ids.reshape(-1)[torch.argsort(ids.reshape(-1), stable=True)]
    assert torch.equal(sorted_expert[got.pos.long()], ids.sort(dim=-1).values)
    assert torch.equal(got.rows[got.pos.long()], torch.arange(7, dtype=torch.int32)[:, None].expand(7, 4))


def test_combine_sums_in_pos_order_adds_shared_and_rounds_once():
    g = torch.Generator().manual_seed(4)
    y = torch.randn(12, 40, generator=g).bfloat16()
    pos = torch.randperm(12, generator=g).view(4, 3).int()
    shared = torch.randn(4, 40, generator=g).bfloat16()
    want = torch.zeros(4, 40)
    for r in range(3):
        want = want + y[pos[:, r].long()].float()
    assert torch.equal(mt.combine(y, pos, None, torch.float32), want)
    assert torch.equal(mt.combine(y, pos, shared, torch.bfloat16), (want + shared.float()).bfloat16())


def test_router_k_step_keeps_the_gate_tile_in_shared_memory():
    """Many experts take a smaller K step (the released 384 pad to 512: a [512, 128] BF16 tile
    per pipeline stage asked 264 KB of shared memory on the H200); the step divides the
    default, so every slice's K chunk is unchanged."""
    steps = {e: mt.router_block_k(e) for e in (8, 64, 128, 256, 384, 1024)}
    assert steps[64] == steps[128] == mt.ROUTER_BLOCK_K
    for e, k in steps.items():
        assert mt.ROUTER_BLOCK_K % k == 0 and k >= 16
        assert triton.next_power_of_2(e) * k * 2 <= 32 * 1024 or k == 16


def test_route_with_the_released_expert_count_matches_the_reference():
    x, w, bias = _router(t=5, d=64, e=384, seed=3)
    ids, gam = mt.route(x, w, bias, 6, 2.5)
    rids, rgam = mref.route(x, w, bias, 6, 2.5)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(gam, rgam, rtol=1e-5, atol=1e-6)
