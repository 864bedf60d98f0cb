"""FP8 swapped-operand decode GEMMs (kernels/dense/fp8_swap.py) against dense/ref.py."""

from __future__ import annotations

import weakref

import pytest
import torch

from flashpd.kernels import triton_runtime
from flashpd.kernels.dense import fp8_swap as fs
from flashpd.kernels.dense import ref as dref
from flashpd.kernels.dense import triton as dt
from flashpd.kernels.quant import ref as qref

LIMIT = 7.0


@pytest.fixture(autouse=True)
def _small_steps(tune):
    """Interpreter speed: K steps of 64, no per-shape overrides, every layer on."""
    tune.set("dense", fp8_swap={"block_k": 64, "layers": None, "shapes": {}})


def _fp8(n: int, k: int, seed: int, groups: int = 1):
    g = torch.Generator().manual_seed(seed)
    q, s = qref.quantize_fp8_blockwise(torch.randn(groups * n, k, generator=g) * 0.3)
    deq = qref.dequantize_fp8_blockwise(q, s, torch.float32).view(groups, n, k)
    if groups == 1:
        return dt.Weights.fp8(q, s), deq
    return dt.Weights.fp8(q.view(groups, n, k), s.view(groups, -(-n // 32), -1)), deq


def _x(t: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _split(tune, target: int) -> None:
    tune.set("dense", fp8_swap={"target_ctas": target, "min_k_chunk": 64})


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize(
    "n, k, target",
    [
        (64, 128, 1),  # one program, two K steps
        (96, 320, 12),  # N block past N (96 of 128), split-K 5 chunks of 64
        (70, 200, 8),  # N % 32 != 0, K = 200: a K tail (200 = 3 * 64 + 8), masked
    ],
)
def test_plain_gemm_matches_reference(tune, monkeypatch, t, n, k, target):
    _split(tune, target)
    w, deq = _fp8(n, k, seed=n + k)
    x = _x(t, k, seed=t)
    out = torch.empty(t, n, dtype=torch.float32)
    fs.gemm(x, w, out, config=tune.dense.fp8_swap)
    assert _rel(out, dref.linear_fp32(x, deq[0])) < 1e-5
    out16 = fs.gemm(x, w, torch.empty(t, n, dtype=torch.bfloat16), config=tune.dense.fp8_swap)
    torch.testing.assert_close(out16, dref.linear(x, deq[0]), rtol=8e-3, atol=1e-3)


def test_split_plan_depends_on_the_weight_only(tune, monkeypatch):
    _split(tune, 12)
    w, _ = _fp8(96, 320, seed=1)
    assert fs.plan(w, False, 8, tune.dense.fp8_swap) == (5, 64)  # 2 N blocks x 5 chunks of 64 >= 12 programs
    tune.set("dense", fp8_swap={"block_k": 128})
    assert fs.plan(w, False, 8, tune.dense.fp8_swap) == (3, 128)  # chunks are whole K steps: 128, 128, 64


@pytest.mark.parametrize("target", [1, 8])
def test_a_row_does_not_depend_on_the_batch(tune, monkeypatch, target):
    """Rows 1..8 share one kernel: a row's sums are the same alone or in a batch of 8."""
    _split(tune, target)
    w, _ = _fp8(64, 256, seed=3)
    x = _x(8, 256, seed=4)
    full = fs.gemm(x, w, torch.empty(8, 64, dtype=torch.float32), config=tune.dense.fp8_swap)
    for r in (0, 5, 7):
        one = fs.gemm(x[r : r + 1], w, torch.empty(1, 64, dtype=torch.float32), config=tune.dense.fp8_swap)
        assert torch.equal(one, full[r : r + 1])


@pytest.mark.parametrize("target", [1, 6])
def test_swiglu_pair_matches_reference(tune, monkeypatch, target):
    _split(tune, target)
    w1, d1 = _fp8(64, 192, seed=5)
    w3, d3 = _fp8(64, 192, seed=6)
    x = _x(5, 192, seed=7)
    gamma = torch.rand(5, generator=torch.Generator().manual_seed(8)) + 0.5
    got = fs.gemm(x, w1, torch.empty(5, 64, dtype=torch.bfloat16), w3, gamma, LIMIT, config=tune.dense.fp8_swap)
    g = dref.linear(x, d1[0]).float().clamp(max=LIMIT)
    u = dref.linear(x, d3[0]).float().clamp(-LIMIT, LIMIT)
    want = (gamma[:, None] * dref.silu(g) * u).bfloat16()
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("target", [1, 9])
def test_block_diagonal_groups_use_their_own_weight(tune, monkeypatch, target):
    _split(tune, target)
    w, deq = _fp8(64, 160, seed=9, groups=3)  # K = 160: a half step at the end
    x = _x(4 * 3, 160, seed=10)  # 4 tokens x 3 groups, row t * 3 + g
    out = fs.gemm(x, w, torch.empty(12, 64, dtype=torch.float32), config=tune.dense.fp8_swap)
    want = torch.bmm(x.float().view(4, 3, 160).transpose(0, 1), deq.transpose(1, 2))
    assert _rel(out, want.transpose(0, 1).reshape(12, 64)) < 1e-5


def test_counters_are_left_zeroed(tune, monkeypatch):
    _split(tune, 8)
    w, _ = _fp8(64, 256, seed=11)
    fs.gemm(_x(2, 256, seed=12), w, torch.empty(2, 64, dtype=torch.float32), config=tune.dense.fp8_swap)
    assert fs.plan(w, False, 8, tune.dense.fp8_swap)[0] > 1
    assert int(triton_runtime.arrival_counters(torch.device("cpu")).abs().sum()) == 0


def test_eligibility_and_bad_calls(tune):
    w, _ = _fp8(64, 128, seed=13)
    x = _x(65, 128, seed=14)
    assert not fs.eligible(x, w, torch.empty(65, 64), None, cfg=tune.dense.fp8_swap)  # 65 rows: past the widest class
    assert fs.eligible(x[:64], w, torch.empty(64, 64), None, cfg=tune.dense.fp8_swap)
    assert fs.eligible(x[:9], w, torch.empty(9, 64), None, cfg=tune.dense.fp8_swap)
    assert not fs.eligible(x[:8].float(), w, torch.empty(8, 64), None, cfg=tune.dense.fp8_swap)
    plain = dt.Weights.plain(torch.randn(64, 128).bfloat16())
    assert not fs.eligible(x[:8], plain, torch.empty(8, 64), None, cfg=tune.dense.fp8_swap)
    with pytest.raises(ValueError, match="rows per weight"):
        fs.gemm(x, w, torch.empty(65, 64), config=tune.dense.fp8_swap)
    with pytest.raises(ValueError, match="do not chain"):
        fs.gemm(x[:2], w, torch.empty(2, 63), config=tune.dense.fp8_swap)


def test_row_classes_and_their_plans(tune, monkeypatch):
    """A call runs the smallest class >= its rows; the split-K plan counts the class's row
    blocks (of its widest call), never the call's rows."""
    tune.set("dense", fp8_swap={"classes": {8: {"rows": 8}, 16: {"rows": 16}, 64: {"rows": 32}}})
    assert [fs.row_class(r, tune.dense.fp8_swap) for r in (1, 8, 9, 16, 17, 64)] == [8, 8, 16, 16, 64, 64]
    with pytest.raises(ValueError, match="at most 64"):
        fs.row_class(65, tune.dense.fp8_swap)
    _split(tune, 12)
    w, _ = _fp8(96, 320, seed=1)
    assert fs.plan(w, False, 8, tune.dense.fp8_swap) == (5, 64)  # 2 N blocks x 5 chunks >= 12 programs
    assert fs.plan(w, False, 64, tune.dense.fp8_swap) == (3, 128)  # 2 N blocks x 2 row blocks x 3 chunks >= 12
    tune.set("dense", fp8_swap={"classes": {8: {"rows": 8}, 16: {"rows": 16, "block_n": 32}}})
    assert (
        fs.tiles(w, False, 16, tune.dense.fp8_swap)["block_n"] == 32
        and fs.tiles(w, False, 8, tune.dense.fp8_swap)["block_n"] == 64
    )


_CLASSES = {
    8: {"rows": 8},
    16: {"rows": 16, "block_n": 32, "warps": 2},
    32: {"rows": 32},
    64: {"rows": 32, "block_n": 32, "warps": 2},
}


@pytest.mark.parametrize("t", [9, 16, 27, 40, 64])
@pytest.mark.parametrize("target", [1, 12])
def test_wide_rows_match_reference(tune, monkeypatch, t, target):
    """9..64 rows: the 16 / 32 / 64 classes (64 as two row blocks of 32), split-K on and off,
    a K tail and an N block past N."""
    tune.set("dense", fp8_swap={"classes": _CLASSES})
    _split(tune, target)
    w, deq = _fp8(70, 200, seed=t)
    x = _x(t, 200, seed=t + 1)
    out = fs.gemm(x, w, torch.empty(t, 70, dtype=torch.float32), config=tune.dense.fp8_swap)
    assert _rel(out, dref.linear_fp32(x, deq[0])) < 1e-5
    out16 = fs.gemm(x, w, torch.empty(t, 70, dtype=torch.bfloat16), config=tune.dense.fp8_swap)
    torch.testing.assert_close(out16, dref.linear(x, deq[0]), rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("t, target", [(13, 1), (24, 6), (50, 1), (64, 6)])
def test_wide_rows_swiglu_pair(tune, monkeypatch, t, target):
    tune.set("dense", fp8_swap={"classes": _CLASSES})
    _split(tune, target)
    w1, d1 = _fp8(64, 192, seed=21)
    w3, d3 = _fp8(64, 192, seed=22)
    x = _x(t, 192, seed=23)
    gamma = torch.rand(t, generator=torch.Generator().manual_seed(24)) + 0.5
    got = fs.gemm(x, w1, torch.empty(t, 64, dtype=torch.bfloat16), w3, gamma, LIMIT, config=tune.dense.fp8_swap)
    g = dref.linear(x, d1[0]).float().clamp(max=LIMIT)
    u = dref.linear(x, d3[0]).float().clamp(-LIMIT, LIMIT)
    want = (gamma[:, None] * dref.silu(g) * u).bfloat16()
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("t, target", [(12, 1), (33, 9), (64, 9)])
def test_wide_rows_block_diagonal(tune, monkeypatch, t, target):
    tune.set("dense", fp8_swap={"classes": _CLASSES})
    _split(tune, target)
    w, deq = _fp8(64, 160, seed=25, groups=3)
    x = _x(t * 3, 160, seed=26)
    out = fs.gemm(x, w, torch.empty(t * 3, 64, dtype=torch.float32), config=tune.dense.fp8_swap)
    want = torch.bmm(x.float().view(t, 3, 160).transpose(0, 1), deq.transpose(1, 2))
    assert _rel(out, want.transpose(0, 1).reshape(t * 3, 64)) < 1e-5


@pytest.mark.parametrize("cls, target", [(16, 1), (32, 8), (64, 8)])
def test_a_row_does_not_depend_on_the_batch_within_a_class(tune, monkeypatch, cls, target):
    """Within a row class a row's sums are the same in a call of any size of that class (the
    64 class: two row blocks of 32, the row in either). Same positions: the interpreter's
    numpy dot may sum a tile's columns differently by position (the MMA does not)."""
    tune.set("dense", fp8_swap={"classes": _CLASSES})
    _split(tune, target)
    w, _ = _fp8(64, 256, seed=27)
    x = _x(cls, 256, seed=28)
    full = fs.gemm(x, w, torch.empty(cls, 64, dtype=torch.float32), config=tune.dense.fp8_swap)
    lo = cls // 2 + 1  # the smallest call of the class
    for r in (0, lo - 1):
        part = fs.gemm(x[:lo], w, torch.empty(lo, 64, dtype=torch.float32), config=tune.dense.fp8_swap)
        assert torch.equal(part[r], full[r])


def test_layers_switch_and_dense_dispatch(tune, monkeypatch):
    """grouped_gemm sends FP8 calls of <= fp8_swap_max_rows rows here for the listed layers."""
    w, deq = _fp8(64, 128, seed=15)
    x = _x(3, 128, seed=16)
    calls = []
    real = fs.gemm
    monkeypatch.setattr(fs, "gemm", lambda *a, **k: calls.append(1) or real(*a, **k))
    tune.set("dense", fp8_swap_max_rows=8)
    got = tune(dt).linear_weights(x, w, torch.float32)
    assert calls == [1] and _rel(got, dref.linear_fp32(x, deq[0])) < 1e-5
    tune.set("dense", fp8_swap={"layers": ((64, 128, 1, True),)})  # only a SwiGLU pair
    tune(dt).linear_weights(x, w, torch.float32)
    assert calls == [1]
    tune.set("dense", fp8_swap={"layers": None})
    tune.set("dense", fp8_swap_max_rows=0)
    tune(dt).linear_weights(x, w, torch.float32)
    assert calls == [1]


def test_scale_check_is_cached_per_owner_and_rechecked_once_the_owner_is_freed(monkeypatch):
    checks = []
    real_max = torch.Tensor.max

    def counting_max(self, *a, **k):
        checks.append(1)
        return real_max(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "max", counting_max)
    base = torch.full((4, 8), 120, dtype=torch.uint8)
    w = dt.Weights(dt.W_FP8, torch.zeros(4, 8, dtype=torch.uint8), base[:, 2:6])
    assert fs.scales_fit_asm(w) and fs.scales_fit_asm(dt.Weights(dt.W_FP8, w.data, base[:, 2:6]))
    assert len(checks) == 1  # a fresh view of the same base shares the answer
    # a stale entry: the same (address, shape, device) recorded for a tensor since freed
    bad = torch.full((4, 4), 200, dtype=torch.uint8)
    gone = torch.zeros(1)
    key = (bad.data_ptr(), tuple(bad.shape), bad.device)
    fs._SCALES_OK[key] = (weakref.ref(gone), True)
    del gone
    assert not fs.scales_fit_asm(dt.Weights(dt.W_FP8, torch.zeros(4, 4, dtype=torch.uint8), bad))
