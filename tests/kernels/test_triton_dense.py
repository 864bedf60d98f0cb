"""GEMMs on checkpoint formats and dense ops (kernels/dense/triton.py) against dense/ref.py."""

from __future__ import annotations

import pytest
import torch

from flashpd.kernels import triton_runtime
from flashpd.kernels.dense import ref as dref
from flashpd.kernels.dense import triton as dt
from flashpd.kernels.quant import ref as qref


def _x(t: int = 5, k: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_fp8_tile_scaled_gemm_equals_gemm_on_dequantised_weights(tune):
    w, s = qref.quantize_fp8_blockwise(torch.randn(70, 96, generator=torch.Generator().manual_seed(1)))
    got = tune(dt).linear_fp8(_x(), w, s)
    assert torch.equal(got, dref.linear(_x(), qref.dequantize_fp8_blockwise(w, s)))


def test_mxfp4_gemm_equals_gemm_on_dequantised_weights(tune):
    p, s = qref.quantize_mxfp4_weight(torch.randn(40, 96, generator=torch.Generator().manual_seed(2)))
    got = tune(dt).linear_mxfp4(_x(), p, s)
    assert torch.equal(got, dref.linear(_x(), qref.dequantize_mxfp4_weight(p, s)))


def test_row_results_do_not_depend_on_the_batch(tune):
    x = _x(t=40, seed=3)
    w = _x(t=24, seed=4)
    full = tune(dt).linear(x, w)
    assert torch.equal(tune(dt).linear(x[7:8], w), full[7:8])


def test_fp32_gemm_is_not_tf32(tune):
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 96, generator=g), torch.randn(24, 96, generator=g)
    torch.testing.assert_close(tune(dt).linear_fp32(x, w), x.double().mm(w.double().T).float(), rtol=1e-5, atol=1e-5)


def test_grouped_schedule_covers_each_expert_rows_once():
    counts = torch.tensor([3, 0, 5, 1])
    sched = dt.grouped_schedule(counts, 9, 4)
    covered = [
        (int(e), r) for e, a, b in zip(sched.expert, sched.start, sched.end, strict=True) for r in range(int(a), int(b))
    ]
    assert covered == [(0, 0), (0, 1), (0, 2), (2, 3), (2, 4), (2, 5), (2, 6), (2, 7), (3, 8)]


def test_rms_norm_and_activations_match_reference():
    x = _x(seed=6)
    w = _x(t=1, seed=7)[0]
    assert torch.equal(dt.rms_norm(x, w, 1e-20), dref.rms_norm(x, w, 1e-20))
    z = torch.linspace(-30, 30, 101)
    for name in ("sigmoid", "silu", "softplus"):
        torch.testing.assert_close(getattr(dt, name)(z), getattr(dref, name)(z), rtol=2e-6, atol=1e-7)


def test_rms_norm_reads_a_column_slice_in_place():
    """A column slice of a wider output (the stacked [wq_a; wkv] GEMM's two halves) normalises
    as its contiguous copy does, and the result is contiguous."""
    both = _x(t=5, k=160, seed=8)
    w = _x(t=1, k=96, seed=9)[0]
    for part in (both[:, :96], both[:, 64:]):
        got = dt.rms_norm(part, w[: part.shape[1]], 1e-6)
        assert got.is_contiguous()
        assert torch.equal(got, dref.rms_norm(part.contiguous(), w[: part.shape[1]], 1e-6))


def test_dot_scaled_switch_is_refused_under_the_interpreter(tune):
    p, s = qref.quantize_mxfp4_weight(torch.randn(32, 64))
    sched = dt.single_schedule(2, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="dot_scaled"):
        dt.grouped_gemm(
            _x(t=2, k=64), dt.Weights.mxfp4(p, s), sched, torch.empty(2, 32), dot_scaled=True, cfg=tune.dense
        )


def _force_split(tune) -> None:
    """Chunks of 32 over K = 96: three split-K programs per output block."""
    tune.set("dense", min_k_chunk=32, target_ctas=10_000)
    for fmt in ("skinny", "mx"):
        tune.merge("dense", fmt, block_k=32)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_split_k_gemm_matches_reference(tune, monkeypatch, fmt):
    _force_split(tune)
    g = torch.Generator().manual_seed(8)
    if fmt == "fp8":
        q, s = qref.quantize_fp8_blockwise(torch.randn(70, 96, generator=g))
        w, deq = dt.Weights.fp8(q, s), qref.dequantize_fp8_blockwise(q, s)
    else:
        q, s = qref.quantize_mxfp4_weight(torch.randn(70, 96, generator=g))
        w, deq = dt.Weights.mxfp4(q, s), qref.dequantize_mxfp4_weight(q, s)
    assert dt._plan(w, tune.dense) == (3, 32)
    x = _x(t=5, seed=9)
    got = tune(dt).linear_weights(x, w, torch.bfloat16)
    torch.testing.assert_close(got, dref.linear(x, deq), rtol=8e-3, atol=1e-2)
    assert torch.equal(tune(dt).linear_weights(x, w, torch.bfloat16), got)  # counters were reset
    assert not bool(triton_runtime.arrival_counters(x.device).any())


@pytest.mark.parametrize("swap", [False, True])
def test_split_k_and_k_segments_give_a_row_the_same_result(tune, monkeypatch, swap):
    """Decode (split-K programs) and prefill (one program walking the chunks) agree bit for bit."""
    _force_split(tune)
    tune.set("dense", fp8_swap_max_rows=0)  # 1 row: the split-K tiles, not fp8_swap
    tune.merge("dense", "skinny", **{"block_n": 16, "swap": swap})
    tune.set("dense", target_ctas=9)  # 3 N blocks x 3 chunks
    q, s = qref.quantize_fp8_blockwise(torch.randn(40, 96, generator=torch.Generator().manual_seed(10)))
    w = dt.Weights.fp8(q, s)
    assert dt._plan(w, tune.dense) == (3, 32)
    x = _x(t=200, seed=11)  # 4 row tiles x 3 N blocks >= target_ctas: the K-segment path
    full = tune(dt).linear_weights(x, w, torch.float32)
    for r in (0, 137, 199):
        assert torch.equal(tune(dt).linear_weights(x[r : r + 1], w, torch.float32), full[r : r + 1])


def test_fp8_dequantize_matches_reference():
    q, s = qref.quantize_fp8_blockwise(torch.randn(70, 200, generator=torch.Generator().manual_seed(14)))
    assert torch.equal(dt.dequantize_fp8(dt.Weights.fp8(q, s)), qref.dequantize_fp8_blockwise(q, s))


def test_warmup_runs_each_distinct_weight_shape_once_per_row_count(tune):
    q, s = qref.quantize_fp8_blockwise(torch.randn(64, 96, generator=torch.Generator().manual_seed(15)))
    w = dt.Weights.fp8(q, s)
    grouped = dt.Weights.fp8(torch.stack([q, q]), torch.stack([s, s]))
    assert tune(dt).warmup([w, w, grouped], rows=(1, 3)) == 4


@pytest.mark.parametrize("split", [False, True])
def test_block_diagonal_runs_each_group_through_its_own_weight(tune, monkeypatch, split):
    if split:
        _force_split(tune)
    g = torch.Generator().manual_seed(16)
    q, s = qref.quantize_fp8_blockwise(torch.randn(3 * 64, 96, generator=g))
    w = dt.Weights.fp8(q.view(3, 64, 96), s.view(3, 2, 3))
    x = torch.randn(5, 3, 96, generator=g).bfloat16()
    got = tune(dt).block_diagonal(x, w)
    deq = qref.dequantize_fp8_blockwise(q, s).view(3, 64, 96)
    want = torch.stack([dref.linear(x[:, j], deq[j]) for j in range(3)], dim=1)
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize(
    "body",
    [
        {},
        {"wide": True},
        {"wide": True, "prefetch": True},
        {"swap": True},
        {"deq": "bf16"},
        {"swap": True, "deq": "bf16"},
    ],
)
@pytest.mark.parametrize("k", [96, 256])
def test_k_step_bodies_match_reference(tune, monkeypatch, fmt, body, k):
    """Sub-steps, wide steps, prefetched wide steps and swapped sub-steps (FP8); K steps whole
    (K=256: no K masks, split into chunks of 128) or ragged (K=96 with 64-wide steps)."""
    if fmt == "mxfp4" and ("swap" in body or "deq" in body):
        pytest.skip("swap and deq are FP8 (swap: and plain-weight) sub-step switches")
    key = "skinny" if fmt == "fp8" else "mx"
    tune.set("dense", min_k_chunk=128)
    tune.set("dense", target_ctas=10_000)
    tune.merge("dense", key, **{"block_k": 64, **body})
    g = torch.Generator().manual_seed(20 + k)
    if fmt == "fp8":
        q, s = qref.quantize_fp8_blockwise(torch.randn(40, k, generator=g))
        w, deq = dt.Weights.fp8(q, s), qref.dequantize_fp8_blockwise(q, s)
    else:
        q, s = qref.quantize_mxfp4_weight(torch.randn(40, k, generator=g))
        w, deq = dt.Weights.mxfp4(q, s), qref.dequantize_mxfp4_weight(q, s)
    x = _x(t=3, k=k, seed=21)
    got = tune(dt).linear_weights(x, w, torch.float32)
    torch.testing.assert_close(got, dref.linear_fp32(x, deq), rtol=1e-5, atol=1e-5)
    assert torch.equal(tune(dt).linear_weights(x[1:2], w, torch.float32), got[1:2])


def test_swapped_operands_and_row_tile_overrides_keep_each_row_sum(tune, monkeypatch):
    """swap (acc^T += W . A^T) computes the unswapped tile's sums (under the interpreter bit for
    bit, by construction); m64 launch overrides (N block, warps, stages, swap for 64-row tiles)
    apply to 40 rows only and keep the split plan."""
    _force_split(tune)
    g = torch.Generator().manual_seed(30)
    q, s = qref.quantize_fp8_blockwise(torch.randn(96, 96, generator=g))
    w, deq = dt.Weights.fp8(q, s), qref.dequantize_fp8_blockwise(q, s)
    x = _x(t=40, seed=31)
    plain = [tune(dt).linear_weights(x[r], w, torch.float32) for r in (slice(3, 4), slice(0, 40))]
    torch.testing.assert_close(plain[1], dref.linear_fp32(x, deq), rtol=1e-5, atol=1e-5)
    plan = dt._plan(w, tune.dense)
    tune.set(
        "dense",
        skinny={**tune.dense.skinny, "swap": True, "m64": {"block_n": 32, "warps": 8, "stages": 2, "swap": False}},
    )
    assert dt._plan(w, tune.dense) == plan
    assert torch.equal(tune(dt).linear_weights(x[3:4], w, torch.float32), plain[0])  # swapped
    torch.testing.assert_close(
        tune(dt).linear_weights(x, w, torch.float32), plain[1], rtol=1e-6, atol=1e-6
    )  # 40 rows: 64-row tile, m64 overrides


@pytest.mark.parametrize("swiglu", [False, True])
def test_split_k_reduction_in_groups_sums_the_same_partials_in_order(tune, monkeypatch, swiglu):
    """red_unroll=2 over 3 chunks (a group of 2, then 1 of 2 masked) gives the unrolled sums."""
    _force_split(tune)
    g = torch.Generator().manual_seed(40)
    ws = [dt.Weights.fp8(*qref.quantize_fp8_blockwise(torch.randn(64, 96, generator=g))) for _ in range(2)]
    x = _x(t=5, seed=41)

    def run():
        if swiglu:
            h = torch.empty(5, 64, dtype=torch.bfloat16)
            return dt.grouped_gemm(x, ws[0], None, h, w3=ws[1], limit=10.0, cfg=tune.dense)
        return tune(dt).linear_weights(x, ws[0], torch.float32)

    assert dt._plan(ws[0], tune.dense) == (3, 32)
    want = run()
    tune.merge("dense", "skinny", **{"red_unroll": 2})
    assert torch.equal(run(), want)
    assert not bool(triton_runtime.arrival_counters(x.device).any())


def test_fit_block_n_halves_the_n_block_of_small_weights_only(tune, monkeypatch):
    """fit_block_n: the N block shrinks (never below 32) only while the finest split cannot
    reach target_ctas; the plan and the result follow, from the weight's shape alone."""
    tune.merge("dense", "skinny", **{"block_n": 256, "fit_block_n": True, "target_ctas": 12})
    tune.set("dense", min_k_chunk=32)
    g = torch.Generator().manual_seed(50)
    small = dt.Weights.fp8(*qref.quantize_fp8_blockwise(torch.randn(64, 96, generator=g)))
    big = dt.Weights.fp8(*qref.quantize_fp8_blockwise(torch.randn(1024, 96, generator=g)))
    assert dt._tiles(small, tune.dense)["block_n"] == 32  # 1 or 2 blocks x 3 chunks < 12: down to the floor
    assert dt._tiles(big, tune.dense)["block_n"] == 256  # 4 blocks x 3 chunks = 12
    tune.merge("dense", "skinny", **{"swap": True})
    assert dt._tiles(small, tune.dense)["block_n"] == 64  # swap: wgmma's 64-row operand is the floor
    tune.merge("dense", "skinny", **{"swap": False})
    x = _x(t=3, seed=51)
    want = dref.linear_fp32(x, qref.dequantize_fp8_blockwise(small.data[0].view(torch.float8_e4m3fn), small.scale[0]))
    torch.testing.assert_close(tune(dt).linear_weights(x, small, torch.float32), want, rtol=1e-5, atol=1e-5)


def test_stacked_weights_give_each_part_its_rows(tune):
    """Weights.stack_out: one GEMM over [W_0; W_1] returns x . W_0^T and x . W_1^T side by side;
    a part of N % 32 != 0 (FP8) or of another K is refused."""
    g = torch.Generator().manual_seed(60)
    raw = [torch.randn(64, 96, generator=g), torch.randn(32, 96, generator=g)]
    q = [qref.quantize_fp8_blockwise(r) for r in raw]
    both = dt.Weights.stack_out([dt.Weights.fp8(*qs) for qs in q])
    assert (both.out_dim, both.in_dim, tuple(both.scale.shape)) == (96, 96, (1, 3, 3))
    x = _x(t=3, seed=61)
    want = torch.cat([dref.linear_fp32(x, qref.dequantize_fp8_blockwise(*qs)) for qs in q], 1)
    torch.testing.assert_close(tune(dt).linear_weights(x, both, torch.float32), want, rtol=1e-5, atol=1e-5)
    odd = dt.Weights.fp8(*qref.quantize_fp8_blockwise(torch.randn(40, 96, generator=g)))
    with pytest.raises(ValueError, match="N=40"):
        dt.Weights.stack_out([odd, odd])
    with pytest.raises(ValueError, match="part 1"):
        dt.Weights.stack_out(
            [dt.Weights.fp8(*q[0]), dt.Weights.fp8(*qref.quantize_fp8_blockwise(torch.randn(32, 64, generator=g)))]
        )
