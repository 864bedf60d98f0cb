"""Large-tile grouped MXFP4 expert GEMMs (kernels/moe/grouped_large.py) against moe/ref.py."""

from __future__ import annotations

import pytest
import torch

from flashpd.kernels import configs
from flashpd.kernels.dense import triton as dt
from flashpd.kernels.moe import grouped_large as gl
from flashpd.kernels.moe import ref as mref
from flashpd.kernels.quant import ref as qref

LIMIT = 10.0
SMALL = {"block_m": 16, "block_n": 32, "block_k": 64, "warps": 4, "stages": 2, "dot_scaled": False}


def _mxfp4(experts: int, n: int, k: int, g: torch.Generator) -> tuple[dt.Weights, torch.Tensor]:
    """Random MXFP4 weights [E, N, K] with a spread of scales, and their BF16 values."""
    quant = [
        qref.quantize_mxfp4_weight(
            torch.randn(n, k, generator=g) * 0.1 * 2.0 ** torch.randint(-3, 3, (n, 1), generator=g)
        )
        for _ in range(experts)
    ]
    w = dt.Weights.mxfp4(torch.stack([p for p, _ in quant]), torch.stack([s for _, s in quant]))
    deq = torch.stack([qref.dequantize_mxfp4_weight(p, s) for p, s in quant])
    return w, deq


def _pairs(tokens: int, experts: int, top_k: int, g: torch.Generator):
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    order = torch.argsort(ids.reshape(-1), stable=True)
    token_of_pair = (order // top_k).to(torch.int32)
    gamma = (torch.rand(tokens * top_k, generator=g) * 0.5)[order].contiguous()
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    return ids.reshape(-1)[order], token_of_pair, gamma, counts


def _want(x, sorted_ids, token_of_pair, gamma, w1, w3, w2):
    want = torch.empty(token_of_pair.shape[0], w2.shape[1], dtype=torch.bfloat16)
    for e in torch.unique(sorted_ids).tolist():
        sel = (sorted_ids == e).nonzero().flatten()
        want[sel] = mref.expert_ffn(x[token_of_pair[sel].long()], w1[e], w3[e], w2[e], LIMIT, gamma[sel][:, None])
    return want


@pytest.mark.parametrize(
    ("path", "swap", "fused13"),
    [
        ("mx", False, False),
        ("mx", True, False),
        ("mx", True, True),
        ("bf16", False, True),
        ("bf16", True, False),
        ("cublas", False, False),
    ],
)
def test_expert_gemms_match_reference_ffn(tune, monkeypatch, path, swap, fused13):
    """Both GEMMs (gathered SwiGLU with gamma, then down) on pairs sorted by expert; the SwiGLU
    GEMM's N (96) is not a multiple of its block_n (64; 32 W1 + 32 W3 rows when fused13):
    masked weight rows. The caller's schedule has block_m 16; the down GEMM makes its own."""
    g = torch.Generator().manual_seed(0)
    experts, dim, inter, tokens, top_k = 4, 128, 96, 11, 2
    w1, d1 = _mxfp4(experts, inter, dim, g)
    w3, d3 = _mxfp4(experts, inter, dim, g)
    w2, d2 = _mxfp4(experts, dim, inter, g)
    x = torch.randn(tokens, dim, generator=g).bfloat16()
    sorted_ids, token_of_pair, gamma, counts = _pairs(tokens, experts, top_k, g)
    tune.set("moe", large=dict(gemm1={**SMALL, "path": path, "swap": swap, "block_n": 64, "fused13": fused13}))
    tune.set("moe", large=dict(gemm2={**SMALL, "path": path, "swap": swap, "block_m": 32, "block_k": 32}))
    tune.set("moe", large=dict(dequant={"block_r": 16, "block_k": 64, "warps": 4}))
    schedule = dt.grouped_schedule(counts, tokens * top_k, 16)
    assert torch.equal(gl.counts_of(schedule, experts), counts)
    got = gl.expert_gemms(x, token_of_pair, gamma, schedule, w1, w3, w2, LIMIT, cfg=tune.moe.large)
    want = _want(x, sorted_ids, token_of_pair, gamma, d1, d3, d2)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_large_calls_take_the_scratch_paths(tune, monkeypatch):
    """From scratch_min_pairs pairs the *_large configurations run (here: cublas), whatever
    gemm1/gemm2 say (dot_scaled, which the interpreter refuses)."""
    g = torch.Generator().manual_seed(4)
    experts, dim, inter, tokens, top_k = 3, 64, 64, 7, 2
    w1, d1 = _mxfp4(experts, inter, dim, g)
    w3, d3 = _mxfp4(experts, inter, dim, g)
    w2, d2 = _mxfp4(experts, dim, inter, g)
    x = torch.randn(tokens, dim, generator=g).bfloat16()
    sorted_ids, token_of_pair, gamma, counts = _pairs(tokens, experts, top_k, g)
    tune.set("moe", large=dict(scratch_min_pairs=tokens * top_k))
    tune.set("moe", large=dict(gemm1={**SMALL, "dot_scaled": True, "swap": False}))
    tune.set("moe", large=dict(gemm2={**SMALL, "dot_scaled": True, "swap": False}))
    schedule = dt.grouped_schedule(counts, tokens * top_k, 16)
    got = gl.expert_gemms(x, token_of_pair, gamma, schedule, w1, w3, w2, LIMIT, cfg=tune.moe.large)
    want = _want(x, sorted_ids, token_of_pair, gamma, d1, d3, d2)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # scale byte 254: 6 * 2^127 is inf
def test_dequantize_mxfp4_is_exact():
    """Every code and scale byte 0..254 (subnormal 2^-127 to overflow), into a strided view."""
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (2, 8, 96), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 255, (2, 8, 6), generator=g, dtype=torch.uint8)
    scale[0, 0] = torch.tensor([0, 1, 126, 127, 128, 254], dtype=torch.uint8)
    w = dt.Weights.mxfp4(packed, scale)
    want = torch.stack([qref.dequantize_mxfp4_weight(p, s) for p, s in zip(packed, scale, strict=True)])
    buf = torch.full((2, 16, 192), float("nan"), dtype=torch.bfloat16)
    got = gl.dequantize_mxfp4(w, buf[:, 8:])
    assert torch.equal(got, want)
    assert torch.isnan(buf[:, :8]).all()  # nothing outside the view written


def test_rejects_mismatched_schedule_and_formats():
    g = torch.Generator().manual_seed(2)
    w, _ = _mxfp4(2, 32, 64, g)
    a = torch.randn(4, 64).bfloat16()
    out = torch.empty(4, 32, dtype=torch.bfloat16)
    sched = dt.grouped_schedule(torch.tensor([2, 2]), 4, 32)
    with pytest.raises(ValueError, match="block_m"):
        gl.grouped_gemm(a, w, sched, out, tiles=SMALL | {"swap": False})
    with pytest.raises(ValueError, match="MXFP4"):
        gl.grouped_gemm(a, dt.Weights.plain(torch.randn(2, 32, 64)), sched, out, tiles=SMALL)
    with pytest.raises(TypeError, match="bf16"):
        gl.grouped_gemm(a.float(), w, sched, out, tiles=SMALL)


def test_eligible_only_where_both_gemms_tile_their_k(monkeypatch):
    """Prefill-size pairs of a small model (the test presets: K = 32) stay on the generic
    kernels instead of failing inside the large-tile GEMMs; the bench shapes qualify."""
    monkeypatch.setattr(gl.triton_runtime, "interpreting", lambda: False)
    g = torch.Generator().manual_seed(0)
    many = configs.DEFAULT.moe.large.min_pairs
    w1_small, _ = _mxfp4(2, 64, 128, g)
    w2_small, _ = _mxfp4(2, 128, 32, g)
    assert not gl.eligible(w1_small, many, torch.bfloat16, w2_small, cfg=configs.DEFAULT.moe.large)
    w1, _ = _mxfp4(2, 64, 256, g)
    w2, _ = _mxfp4(2, 256, 128, g)
    assert gl.eligible(w1, many, torch.bfloat16, w2, cfg=configs.DEFAULT.moe.large)
    assert not gl.eligible(w1, many - 1, torch.bfloat16, w2, cfg=configs.DEFAULT.moe.large)  # decode sizes
    assert not gl.eligible(w1, many, torch.float32, w2, cfg=configs.DEFAULT.moe.large)
    assert gl.eligible(
        w1, configs.DEFAULT.moe.large.scratch_min_pairs, torch.bfloat16, w2, cfg=configs.DEFAULT.moe.large
    )
