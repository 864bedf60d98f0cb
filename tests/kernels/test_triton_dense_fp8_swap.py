"""FP8 swapped-operand decode GEMMs (kernels/dense/fp8_swap.py) against dense/ref.py."""

from __future__ import annotations

import pytest
import torch

from flashpd.kernels.dense import fp8_swap as fs
from flashpd.kernels.dense import ref as dref
from flashpd.kernels.dense import triton as dt
from flashpd.kernels.quant import ref as qref

LIMIT = 7.0


@pytest.fixture(autouse=True)
def _small_steps(monkeypatch):
    """Interpreter speed: K steps of 64, no per-shape overrides, every layer on."""
    monkeypatch.setattr(fs, "CONFIG", {**fs.CONFIG, "block_k": 64, "layers": None,
                                       "shapes": {}})


def _fp8(n: int, k: int, seed: int, groups: int = 1):
    g = torch.Generator().manual_seed(seed)
    q, s = qref.quantize_fp8_blockwise(torch.randn(groups * n, k, generator=g) * 0.3)
    deq = qref.dequantize_fp8_blockwise(q, s, torch.float32).view(groups, n, k)
    if groups == 1:
        return dt.Weights.fp8(q, s), deq
    return dt.Weights.fp8(q.view(groups, n, k), s.view(groups, -(-n // 32), -1)), deq


def _x(t: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _split(monkeypatch, target: int) -> None:
    monkeypatch.setitem(fs.CONFIG, "target_ctas", target)
    monkeypatch.setitem(fs.CONFIG, "min_k_chunk", 64)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("n, k, target", [
    (64, 128, 1),     # one program, two K steps
    (96, 320, 12),    # N block past N (96 of 128), split-K 5 chunks of 64
    (70, 200, 8),     # N % 32 != 0, K = 200: a K tail (200 = 3 * 64 + 8), masked
])
def test_plain_gemm_matches_reference(monkeypatch, t, n, k, target):
    _split(monkeypatch, target)
    w, deq = _fp8(n, k, seed=n + k)
    x = _x(t, k, seed=t)
    out = torch.empty(t, n, dtype=torch.float32)
    fs.gemm(x, w, out)
    assert _rel(out, dref.linear_fp32(x, deq[0])) < 1e-5
    out16 = fs.gemm(x, w, torch.empty(t, n, dtype=torch.bfloat16))
    torch.testing.assert_close(out16, dref.linear(x, deq[0]), rtol=8e-3, atol=1e-3)


def test_split_plan_depends_on_the_weight_only(monkeypatch):
    _split(monkeypatch, 12)
    w, _ = _fp8(96, 320, seed=1)
    assert fs.plan(w, False) == (5, 64)  # 2 N blocks x 5 chunks of 64 >= 12 programs
    monkeypatch.setitem(fs.CONFIG, "block_k", 128)
    assert fs.plan(w, False) == (3, 128)  # chunks are whole K steps: 128, 128, 64


@pytest.mark.parametrize("target", [1, 8])
def test_a_row_does_not_depend_on_the_batch(monkeypatch, target):
    """Rows 1..8 share one kernel: a row's sums are the same alone or in a batch of 8."""
    _split(monkeypatch, target)
    w, _ = _fp8(64, 256, seed=3)
    x = _x(8, 256, seed=4)
    full = fs.gemm(x, w, torch.empty(8, 64, dtype=torch.float32))
    for r in (0, 5, 7):
        one = fs.gemm(x[r:r + 1], w, torch.empty(1, 64, dtype=torch.float32))
        assert torch.equal(one, full[r:r + 1])


@pytest.mark.parametrize("target", [1, 6])
def test_swiglu_pair_matches_reference(monkeypatch, target):
    _split(monkeypatch, target)
    w1, d1 = _fp8(64, 192, seed=5)
    w3, d3 = _fp8(64, 192, seed=6)
    x = _x(5, 192, seed=7)
    gamma = torch.rand(5, generator=torch.Generator().manual_seed(8)) + 0.5
    got = fs.gemm(x, w1, torch.empty(5, 64, dtype=torch.bfloat16), w3, gamma, LIMIT)
    g = dref.linear(x, d1[0]).float().clamp(max=LIMIT)
    u = dref.linear(x, d3[0]).float().clamp(-LIMIT, LIMIT)
    want = (gamma[:, None] * dref.silu(g) * u).bfloat16()
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("target", [1, 9])
def test_block_diagonal_groups_use_their_own_weight(monkeypatch, target):
    _split(monkeypatch, target)
    w, deq = _fp8(64, 160, seed=9, groups=3)  # K = 160: a half step at the end
    x = _x(4 * 3, 160, seed=10)  # 4 tokens x 3 groups, row t * 3 + g
    out = fs.gemm(x, w, torch.empty(12, 64, dtype=torch.float32))
    want = torch.bmm(x.float().view(4, 3, 160).transpose(0, 1), deq.transpose(1, 2))
    assert _rel(out, want.transpose(0, 1).reshape(12, 64)) < 1e-5


def test_counters_are_left_zeroed(monkeypatch):
    _split(monkeypatch, 8)
    w, _ = _fp8(64, 256, seed=11)
    fs.gemm(_x(2, 256, seed=12), w, torch.empty(2, 64, dtype=torch.float32))
    assert fs.plan(w, False)[0] > 1
    assert int(fs._counters(torch.device("cpu")).abs().sum()) == 0


def test_eligibility_and_bad_calls():
    w, _ = _fp8(64, 128, seed=13)
    x9 = _x(9, 128, seed=14)
    assert not fs.eligible(x9, w, torch.empty(9, 64), None)  # 9 rows: more than the MMA's 8
    assert fs.eligible(x9[:8], w, torch.empty(8, 64), None)
    assert not fs.eligible(x9[:8].float(), w, torch.empty(8, 64), None)
    plain = dt.Weights.plain(torch.randn(64, 128).bfloat16())
    assert not fs.eligible(x9[:8], plain, torch.empty(8, 64), None)
    with pytest.raises(ValueError, match="rows per weight"):
        fs.gemm(x9, w, torch.empty(9, 64))
    with pytest.raises(ValueError, match="do not chain"):
        fs.gemm(x9[:2], w, torch.empty(2, 63))


def test_layers_switch_and_dense_dispatch(monkeypatch):
    """grouped_gemm sends FP8 calls of <= FP8_SWAP_MAX_ROWS rows here for the listed layers."""
    w, deq = _fp8(64, 128, seed=15)
    x = _x(3, 128, seed=16)
    calls = []
    real = fs.gemm
    monkeypatch.setattr(fs, "gemm", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(dt, "FP8_SWAP_MAX_ROWS", 8)
    got = dt.linear_weights(x, w, torch.float32)
    assert calls == [1] and _rel(got, dref.linear_fp32(x, deq[0])) < 1e-5
    monkeypatch.setitem(fs.CONFIG, "layers", {(64, 128, 1, True)})  # only a SwiGLU pair
    dt.linear_weights(x, w, torch.float32)
    assert calls == [1]
    monkeypatch.setitem(fs.CONFIG, "layers", None)
    monkeypatch.setattr(dt, "FP8_SWAP_MAX_ROWS", 0)
    dt.linear_weights(x, w, torch.float32)
    assert calls == [1]
