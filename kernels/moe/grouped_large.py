"""Routed MXFP4 experts at prefill sizes (many rows per expert): large-tile grouped GEMMs.

Same math as `moe/ref.py` (expert_ffn on the pairs sorted by expert) and as the grouped GEMM of
`dense/triton.py`, for the case that GEMM's small tiles serve badly: thousands of token-expert
pairs, hundreds of rows per expert. Each of the two GEMMs (SwiGLU GEMM on W1 | W3, down GEMM on
W2) takes one of three paths, GroupedLargeConfig.gemm1 / .gemm2 ["path"]:

"mx": one grouped GEMM launch on the weights as stored, tiles of BLOCK_M pairs x BLOCK_N weight
rows x BLOCK_K, the K loop software-pipelined (num_stages). Program (nb, tile) computes

    acc[p, n] = sum_k A[a_rows[p], k] * W[expert(tile), n, k]            FP32, K walked in order

with the MXFP4 tile (E2M1 nibbles, low nibble = even k; UE8M0 scale per 32 k) handed either to
`tl.dot_scaled` (dot_scaled; on Hopper Triton decodes it in registers; GPU only) or decoded here
to BF16 (exact) and fed to `tl.dot` (runs under the interpreter too). swap computes the
transposed tile acc^T = W . A^T so the decoded weight is the MMA's left operand, which Hopper's
wgmma reads from registers. fused13 (SwiGLU GEMM) runs one accumulator whose first BLOCK_N/2
weight rows are W1's and the next BLOCK_N/2 the same rows of W3.
"bf16": every expert of the weight is decoded once per call into a BF16 scratch buffer
(`dequantize_mxfp4`, exact), then the same grouped GEMM runs on BF16 weights (row gather of A
and the SwiGLU epilogue fused, both operands through shared memory).
"cublas": the same scratch, then torch's grouped BF16 GEMM (torch._grouped_mm, CUTLASS on
Hopper) on the gathered rows, and `swiglu_halves` for the epilogue.

The SwiGLU epilogue is `dense/triton.py`'s: h = bf16(gamma * silu(min(g, L)) * clamp(u, -L, L))
with g, u rounded to BF16 first, as moe.ref.expert_ffn does.

Batch invariance: a row's arithmetic depends on its own values and the weight only (tile sizes
are constants), but this path is opt-in by size (moe/triton.py dispatches here from
GroupedLargeConfig.min_pairs pairs on the GPU), so a token may differ in the last bits between a
prefill-sized call and a decode-sized one, like dense/triton.py's cuBLAS prefill path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.configs import DEFAULT, GroupedLargeConfig
from flashpd.kernels.dense import triton as dense
from flashpd.kernels.dense.triton import DOT_UPCAST, W_MXFP4, W_PLAIN, Weights, swiglu_halves, swiglu_limited
from flashpd.kernels.e2m1 import fp32_e2m1
from flashpd.kernels.quant.triton import e8m0_decode, round_bf16

# Tuned on an H200 (bench/results/h200/gemm_prefill.md).
#   min_pairs      moe/triton.py routes MXFP4 experts here from this many token-expert pairs
#                  (GPU; 6144 = 1024 tokens x top-6)
#   gemm1/2        the SwiGLU GEMM (W1|W3) and the down GEMM (W2) below scratch_min_pairs: path
#                  ("mx", "bf16", "cublas"), tiles block_m/n/k, warps, stages; dot_scaled, swap,
#                  fused13 (see above)
#   scratch_min_pairs, gemm1_large/gemm2_large: from this many pairs the weights' decode into
#                  the scratch buffer pays off; the paths used then
#   dequant        the BF16 decode kernel's rows x K block and warps
# (configs.GroupedLargeConfig: KernelConfigs.moe.large, passed in as `cfg`)
_DEQUANT = DEFAULT.moe.large.dequant  # read-only: the decode tiles when none are given


# ============================================================================ MXFP4 decode
@triton.jit
def _decode_tile(packed, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """packed uint8 [BN, BK/2] + UE8M0 uint8 [BN, BK/32] -> BF16 [BN, BK] in K order (exact)."""
    b = packed.to(tl.int32)
    f = e8m0_decode(scale)  # [BN, BK/32] 2^(s - 127)
    f = tl.reshape(tl.broadcast_to(f[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
    lo = fp32_e2m1(b, f).to(tl.bfloat16)
    hi = fp32_e2m1(b >> 4, f).to(tl.bfloat16)
    return tl.interleave(lo, hi)


@triton.jit
def _mm(a, b, acc, UPCAST: tl.constexpr):
    if UPCAST:  # interpreter: BF16 operands upcast (exact), see dense/triton.py DOT_UPCAST
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _step(
    acc,
    a,
    w_ptr,
    s_ptr,
    w_off,
    s_off,
    k0,
    n_mask,
    EVEN: tl.constexpr,
    DOT_SCALED: tl.constexpr,
    SWAP: tl.constexpr,
    UPCAST: tl.constexpr,
    W_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc + (tile product) for K in [k0, k0 + BLOCK_K) of one weight."""
    if W_BF16:  # plain BF16 weights (a decoded scratch copy): w_off spans BLOCK_K columns
        acc = _mm_w(_load_bf16_tile(w_ptr, w_off, k0, n_mask, EVEN), a, acc, SWAP, UPCAST)
    else:
        packed, scale = _load_mx_tile(w_ptr, s_ptr, w_off, s_off, k0, n_mask, EVEN)
        if DOT_SCALED:
            if SWAP:
                acc = tl.dot_scaled(packed, scale, "e2m1", tl.trans(a), None, "bf16", acc, fast_math=True)
            else:
                acc = tl.dot_scaled(a, None, "bf16", tl.trans(packed), scale, "e2m1", acc, fast_math=True)
        else:
            acc = _mm_w(_decode_tile(packed, scale, BLOCK_N, BLOCK_K), a, acc, SWAP, UPCAST)
    return acc


@triton.jit
def _load_bf16_tile(w_ptr, w_off, k0, n_mask, EVEN: tl.constexpr):
    """A plain BF16 weight tile at K offset k0 (rows past N: 0 unless EVEN)."""
    if EVEN:
        w = tl.load(w_ptr + w_off + k0)
    else:
        w = tl.load(w_ptr + w_off + k0, mask=n_mask, other=0.0)
    return w


@triton.jit
def _load_mx_tile(w_ptr, s_ptr, w_off, s_off, k0, n_mask, EVEN: tl.constexpr):
    """(packed E2M1 bytes, UE8M0 scales) of an MXFP4 weight tile at K offset k0 (rows past N:
    codes 0 and scale 127 unless EVEN)."""
    if EVEN:
        packed = tl.load(w_ptr + w_off + k0 // 2)
        scale = tl.load(s_ptr + s_off + k0 // 32)
    else:
        packed = tl.load(w_ptr + w_off + k0 // 2, mask=n_mask, other=0)
        scale = tl.load(s_ptr + s_off + k0 // 32, mask=n_mask, other=127)
    return packed, scale


@triton.jit
def _mm_w(w, a, acc, SWAP: tl.constexpr, UPCAST: tl.constexpr):
    """acc + W . A^T ([BN, BM], SWAP: the weight as the MMA's M) or A . W^T ([BM, BN])."""
    if SWAP:
        acc = _mm(w, tl.trans(a), acc, UPCAST)
    else:
        acc = _mm(a, tl.trans(w), acc, UPCAST)
    return acc


@triton.jit
def _large_gemm_kernel(
    a_ptr,
    stride_am,
    a_rows_ptr,
    c_ptr,
    stride_cm,
    gamma_ptr,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    N,
    K,
    limit,
    w3_delta,
    s3_delta,
    SWIGLU: tl.constexpr,
    HAS_GAMMA: tl.constexpr,
    GATHER_A: tl.constexpr,
    EVEN: tl.constexpr,
    DOT_SCALED: tl.constexpr,
    SWAP: tl.constexpr,
    UPCAST: tl.constexpr,
    FUSED13: tl.constexpr,
    W_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # W_BF16: W is BF16 [E, N, K] (scales unused), else MXFP4 [E, N, K/2] + UE8M0 [E, N, K/32]
    # FUSED13 (SwiGLU): one accumulator over BLOCK_N weight rows, the first half W1 rows
    # nb*BN/2 + j, the second half the same rows of W3 (w3_delta / s3_delta: element offsets
    # of W3's data and scales from W1's); the epilogue pairs column j with column BN/2 + j.
    nb = tl.program_id(0)
    tile = tl.program_id(1)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start < end:
        e = tl.load(tile_expert_ptr + tile).to(tl.int64)
        p = start + tl.arange(0, BLOCK_M)
        p_mask = p < end
        if GATHER_A:
            a_row = tl.load(a_rows_ptr + p, mask=p_mask, other=0).to(tl.int64)
        else:
            a_row = tl.where(p_mask, p, start).to(tl.int64)  # padding rows re-read a real row
        kh = tl.arange(0, BLOCK_K if W_BF16 else BLOCK_K // 2)
        ks = tl.arange(0, BLOCK_K // 32)
        if FUSED13:
            j = tl.arange(0, BLOCK_N)
            half = j >= BLOCK_N // 2
            n_idx = nb * (BLOCK_N // 2) + tl.where(half, j - BLOCK_N // 2, j)
            n64 = n_idx.to(tl.int64)
            w_off = (
                e * stride_we
                + n64[:, None] * stride_wn
                + kh[None, :]
                + tl.where(half, w3_delta, 0).to(tl.int64)[:, None]
            )
            s_off = (
                e * stride_se
                + n64[:, None] * stride_sn
                + ks[None, :]
                + tl.where(half, s3_delta, 0).to(tl.int64)[:, None]
            )
        else:
            n_idx = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            n64 = n_idx.to(tl.int64)
            w_off = e * stride_we + n64[:, None] * stride_wn + kh[None, :]
            s_off = e * stride_se + n64[:, None] * stride_sn + ks[None, :]
        n_mask = (n_idx < N)[:, None]
        a_ptrs = a_ptr + a_row[:, None] * stride_am + tl.arange(0, BLOCK_K)[None, :]
        if SWAP:
            acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs + k0)  # rows past `end` read a real row; never stored
            acc1 = _step(
                acc1,
                a,
                w1_ptr,
                s1_ptr,
                w_off,
                s_off,
                k0,
                n_mask,
                EVEN,
                DOT_SCALED,
                SWAP,
                UPCAST,
                W_BF16,
                BLOCK_N,
                BLOCK_K,
            )
            if SWIGLU and not FUSED13:
                acc3 = _step(
                    acc3,
                    a,
                    w3_ptr,
                    s3_ptr,
                    w_off,
                    s_off,
                    k0,
                    n_mask,
                    EVEN,
                    DOT_SCALED,
                    SWAP,
                    UPCAST,
                    W_BF16,
                    BLOCK_N,
                    BLOCK_K,
                )
        if SWAP:
            acc1 = tl.trans(acc1)
            acc3 = tl.trans(acc3)
        if FUSED13:  # columns [0, BN/2) are g, [BN/2, BN) u of the same outputs
            acc1, acc3 = tl.split(tl.permute(tl.reshape(acc1, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            n_idx = nb * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        if SWIGLU:  # moe.ref.expert_ffn: g, u rounded to BF16, FP32 SwiGLU, gamma, one rounding
            out = swiglu_limited(round_bf16(acc1), round_bf16(acc3), limit)
            if HAS_GAMMA:
                out = tl.load(gamma_ptr + p, mask=p_mask, other=0.0)[:, None] * out
        else:
            out = acc1
        c = c_ptr + p[:, None].to(tl.int64) * stride_cm + n_idx[None, :]
        tl.store(c, round_bf16(out).to(c_ptr.dtype.element_ty), mask=p_mask[:, None] & (n_idx[None, :] < N))


def _check(a: torch.Tensor, w: Weights, out: torch.Tensor) -> None:
    if not (w.fmt == W_MXFP4 or (w.fmt == W_PLAIN and w.data.dtype == torch.bfloat16)):
        raise ValueError("grouped_large runs MXFP4 or BF16 weights only")
    if a.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise TypeError(f"grouped_large needs bf16 activations and output, got {a.dtype}, {out.dtype}")
    if a.ndim != 2 or a.stride(1) != 1 or out.ndim != 2 or out.stride(1) != 1:
        raise ValueError("grouped_large needs row-major 2-D a and out")
    if a.shape[1] != w.in_dim or out.shape[1] != w.out_dim:
        raise ValueError(f"shapes a {tuple(a.shape)}, W [{w.out_dim}, {w.in_dim}], out {tuple(out.shape)} do not chain")
    if w.data.stride(2) != 1 or (w.scale is not None and w.scale.stride(2) != 1):
        raise ValueError("weight and scale rows must be contiguous")
    triton_runtime.check_device(a, out, w.data)


def _layout(w: Weights) -> tuple:
    return (w.fmt, w.data.dtype, w.data.shape, w.data.stride(), None if w.scale is None else w.scale.stride())


def grouped_gemm(
    a: torch.Tensor,
    w: Weights,
    schedule: dense.TileSchedule,
    out: torch.Tensor,
    a_rows: torch.Tensor | None = None,
    w3: Weights | None = None,
    gamma: torch.Tensor | None = None,
    limit: float = 0.0,
    *,
    tiles: Mapping[str, Any],
) -> torch.Tensor:
    """out[p] = epilogue(A[a_rows[p]] . W[expert(p)]^T), W MXFP4 or BF16 (SwiGLU when w3 is
    given; W1 and W3 share one layout).

    schedule: row tiles of `out` with schedule.block_m == tiles["block_m"] (dense.grouped_schedule).
    tiles: launch configuration (GroupedLargeConfig.gemm1 / .gemm2).
    """
    _check_call(a, w, schedule, out, w3, tiles)
    if out.shape[0] == 0 or schedule.start.shape[0] == 0:
        return out
    _launch(a, w, schedule, out, a_rows, w3, gamma, limit, tiles)
    return out


def _check_call(a, w: Weights, schedule: dense.TileSchedule, out, w3: Weights | None, t: Mapping[str, Any]) -> None:
    _check(a, w, out)
    if w3 is not None and _layout(w3) != _layout(w):
        raise ValueError("SwiGLU W1 and W3 must share format, shape and strides")
    if schedule.block_m != t["block_m"]:
        raise ValueError(f"schedule.block_m {schedule.block_m} != tiles block_m {t['block_m']}")
    if t["dot_scaled"] and w.fmt != W_PLAIN and triton_runtime.interpreting():
        raise ValueError("dot_scaled does not run under the interpreter")
    if w.in_dim % t["block_k"] or t["block_k"] % 32:
        raise ValueError(f"K={w.in_dim} must be a multiple of block_k={t['block_k']} (itself of 32)")


def _launch(a, w: Weights, schedule, out, a_rows, w3: Weights | None, gamma, limit: float, t: Mapping[str, Any]):
    """One program per (per_block output columns, row tile); fused13: W1 | W3 halves of one N block."""
    bf16 = w.fmt == W_PLAIN
    fused = w3 is not None and t.get("fused13", False)
    per_block = t["block_n"] // (2 if fused else 1)  # output columns per program
    _large_gemm_kernel[(triton.cdiv(w.out_dim, per_block), schedule.start.shape[0])](
        *_args(a, w, schedule, out, a_rows, w3, gamma, limit, fused),
        SWIGLU=w3 is not None,
        HAS_GAMMA=gamma is not None,
        GATHER_A=a_rows is not None,
        EVEN=w.out_dim % per_block == 0,
        DOT_SCALED=t["dot_scaled"] and not bf16,
        SWAP=t["swap"],
        UPCAST=DOT_UPCAST,
        FUSED13=fused,
        W_BF16=bf16,
        BLOCK_M=t["block_m"],
        BLOCK_N=t["block_n"],
        BLOCK_K=t["block_k"],
        num_warps=t["warps"],
        num_stages=t["stages"],
        **triton_runtime.launch_options(),
    )


def _scales(w: Weights, w3_: Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """W1's and W3's scales (their data when unscaled: BF16 weights; never read then)."""
    return (w.scale if w.scale is not None else w.data, w3_.scale if w3_.scale is not None else w3_.data)


def _w3_deltas(w: Weights, w3: Weights | None, fused: bool) -> tuple[int, int]:
    """fused13: W3 addressed from W1's pointer: (data offset in elements, scale offset in bytes)."""
    if not fused:
        return 0, 0
    scale1, scale3 = _scales(w, w3)
    return (w3.data.data_ptr() - w.data.data_ptr()) // w.data.element_size(), scale3.data_ptr() - scale1.data_ptr()


def _args(a, w: Weights, schedule, out, a_rows, w3: Weights | None, gamma, limit: float, fused: bool) -> tuple:
    """The kernel's positional arguments, in its signature's order."""
    w3_ = w3 if w3 is not None else w
    scale1, scale3 = _scales(w, w3_)
    return (
        a,
        a.stride(0),
        a_rows if a_rows is not None else schedule.start,
        out,
        out.stride(0),
        gamma if gamma is not None else out,
        w.data,
        scale1,
        w3_.data,
        scale3,
        w.data.stride(0),
        w.data.stride(1),
        scale1.stride(0),
        scale1.stride(1),
        schedule.expert,
        schedule.start,
        schedule.end,
        w.out_dim,
        w.in_dim,
        float(limit),
        *_w3_deltas(w, w3, fused),
    )


# ============================================================================ dequant mode
@triton.jit
def _dequant_kernel(
    w_ptr, s_ptr, y_ptr, rows, N, row_bytes, row_groups, stride_ye, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr
):
    """MXFP4 rows -> BF16 rows, one 32-bit word per packed byte: the word is the BF16 pair
    (k = 2j, 2j + 1) of byte j, so no interleave. Each value is E2M1 * 2^(s - 127) in FP32, whose
    bits below 16 are zero (at most 2 significant bits): the BF16 is its top half (exact)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # row of [E * N, K]
    grp = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)  # 32-value groups of the row
    rmask = (r < rows)[:, None, None] & (grp < row_groups)[None, :, None]
    r64 = r.to(tl.int64)[:, None, None]
    byte = grp[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]  # [1, G, 16]
    b = tl.load(w_ptr + r64 * row_bytes + byte, mask=rmask, other=0).to(tl.int32)
    f = e8m0_decode(tl.load(s_ptr + r64 * row_groups + grp[None, :, None], mask=rmask, other=127))  # [R, G, 1]
    lo = fp32_e2m1(b, f).to(tl.int32, bitcast=True)
    hi = fp32_e2m1(b >> 4, f).to(tl.int32, bitcast=True)
    word = ((lo >> 16) & 0xFFFF) | (hi & -65536)
    y_row = (r64 // N) * stride_ye + (r64 % N) * row_bytes  # in 32-bit words
    tl.store(y_ptr + y_row + byte, word, mask=rmask)


def dequantize_mxfp4(w: Weights, out: torch.Tensor | None = None, tiles: Mapping[str, Any] = _DEQUANT) -> torch.Tensor:
    """MXFP4 weights [E, N, K] -> BF16 [E, N, K] (exact), one launch. `out`: where to write, a
    BF16 [E, N, K] view whose rows are contiguous (a slice of a larger scratch buffer works)."""
    if w.fmt != W_MXFP4 or not w.data.is_contiguous() or not w.scale.is_contiguous():
        raise ValueError("dequantize_mxfp4 takes contiguous MXFP4 weights")
    e, n, k = w.num_experts, w.out_dim, w.in_dim
    if k % 32:
        raise ValueError(f"dequantize_mxfp4 needs K % 32 == 0, got {k}")
    y = out if out is not None else torch.empty(e, n, k, dtype=torch.bfloat16, device=w.data.device)
    if y.shape != (e, n, k) or y.dtype != torch.bfloat16 or y.stride()[1:] != (k, 1) or y.stride(0) % 2:
        raise ValueError(f"out must be a BF16 [{e}, {n}, {k}] view with contiguous rows")
    rows, cfg = e * n, tiles
    groups = k // 32
    block_g = min(cfg["block_k"] // 32, triton.next_power_of_2(groups))
    _dequant_kernel[(triton.cdiv(rows, cfg["block_r"]), triton.cdiv(groups, block_g))](
        w.data,
        w.scale,
        y.view(torch.int32),
        rows,
        n,
        k // 2,
        groups,
        y.stride(0) // 2,
        BLOCK_R=cfg["block_r"],
        BLOCK_G=block_g,
        num_warps=cfg["warps"],
    )
    return y


def _grouped_mm(a: torch.Tensor, w_bf16: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """a [P, K] (rows sorted by expert) . W[e]^T per expert -> [P, N] BF16 (torch's grouped
    GEMM; ends [E] int32 cumulative row counts)."""
    return torch._grouped_mm(a, w_bf16.transpose(1, 2), offs=ends)


_SCRATCH: dict[torch.device, torch.Tensor] = {}


def _scratch(shape: tuple, device: torch.device) -> torch.Tensor:
    """A BF16 view of `shape` on one reused buffer per device (grown on demand): the decoded
    weights of one GEMM live only until the next GEMM's decode."""
    numel = 1
    for d in shape:
        numel *= d
    buf = _SCRATCH.get(device)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=torch.bfloat16, device=device)
        _SCRATCH[device] = buf
    return buf[:numel].view(shape)


# ============================================================================ experts
def counts_of(schedule: dense.TileSchedule, num_experts: int) -> torch.Tensor:
    """Rows per expert [E] int64 of a tile schedule (empty tiles count nothing); no host sync."""
    rows = (schedule.end - schedule.start).clamp_min(0).to(torch.int64)
    idx = schedule.expert.to(torch.int64).clamp(0, num_experts - 1)
    return torch.zeros(num_experts, dtype=torch.int64, device=rows.device).scatter_add_(0, idx, rows)


def block_m(cfg: GroupedLargeConfig) -> int:
    """The row tile the caller's schedule must use (cfg.gemm1["block_m"])."""
    return cfg.gemm1["block_m"]


class _Pairs:
    """Sorted pairs of one MoE call, with the per-expert counts and schedules made on demand."""

    def __init__(self, token_of_pair, gamma, schedule, num_experts):
        self.rows, self.gamma, self.schedule = token_of_pair, gamma, schedule
        self.num_experts = num_experts
        self._counts = None

    @property
    def counts(self) -> torch.Tensor:
        if self._counts is None:
            self._counts = counts_of(self.schedule, self.num_experts)
        return self._counts

    def schedule_for(self, bm: int) -> dense.TileSchedule:
        if bm == self.schedule.block_m:
            return self.schedule
        return dense.grouped_schedule(self.counts, self.rows.shape[0], bm)


def decoded_scratch(w1: Weights, w3: Weights | None = None, dequant: Mapping[str, Any] = _DEQUANT) -> torch.Tensor:
    """Decoded BF16 [E, N, K] of w1, or [E, 2N, K] of w1 | w3 side by side per expert, in the
    reused scratch buffer."""
    e, n, k = w1.num_experts, w1.out_dim, w1.in_dim
    buf = _scratch((e, n * (1 if w3 is None else 2), k), w1.data.device)
    dequantize_mxfp4(w1, buf[:, :n], dequant)
    if w3 is not None:
        dequantize_mxfp4(w3, buf[:, n:], dequant)
    return buf


def swiglu_gemm(
    x: torch.Tensor,
    pairs: _Pairs,
    w1: Weights,
    w3: Weights,
    limit: float,
    tiles: Mapping[str, Any],
    dequant: Mapping[str, Any] = _DEQUANT,
) -> torch.Tensor:
    """h [P, I] BF16 = gamma * SwiGLU(x[rows] . W1^T, x[rows] . W3^T) per pair's expert."""
    path = tiles.get("path", "mx")
    if path == "cublas":
        ends = torch.cumsum(pairs.counts, 0).to(torch.int32)
        gu = _grouped_mm(x[pairs.rows.long()], decoded_scratch(w1, w3, dequant), ends)  # g | u
        return swiglu_halves(gu, pairs.gamma, limit)
    if path == "bf16":
        buf, n = decoded_scratch(w1, w3, dequant), w1.out_dim
        w1, w3 = Weights.plain(buf[:, :n]), Weights.plain(buf[:, n:])
    h = torch.empty(pairs.rows.shape[0], w1.out_dim, dtype=x.dtype, device=x.device)
    return grouped_gemm(
        x,
        w1,
        pairs.schedule_for(tiles["block_m"]),
        h,
        a_rows=pairs.rows,
        w3=w3,
        gamma=pairs.gamma,
        limit=limit,
        tiles=tiles,
    )


def down_gemm(
    h: torch.Tensor, pairs: _Pairs, w2: Weights, tiles: Mapping[str, Any], dequant: Mapping[str, Any] = _DEQUANT
) -> torch.Tensor:
    """y [P, D] BF16 = h . W2^T per pair's expert."""
    path = tiles.get("path", "mx")
    if path == "cublas":
        ends = torch.cumsum(pairs.counts, 0).to(torch.int32)
        return _grouped_mm(h, decoded_scratch(w2, None, dequant), ends)
    if path == "bf16":
        w2 = Weights.plain(decoded_scratch(w2, None, dequant))
    y = torch.empty(h.shape[0], w2.out_dim, dtype=h.dtype, device=h.device)
    return grouped_gemm(h, w2, pairs.schedule_for(tiles["block_m"]), y, tiles=tiles)


def pairs_of(
    token_of_pair: torch.Tensor, gamma: torch.Tensor | None, schedule: dense.TileSchedule, num_experts: int
) -> _Pairs:
    return _Pairs(token_of_pair, gamma, schedule, num_experts)


def expert_gemms(
    x: torch.Tensor,
    token_of_pair: torch.Tensor,
    gamma: torch.Tensor | None,
    schedule: dense.TileSchedule,
    w1: Weights,
    w3: Weights,
    w2: Weights,
    limit: float,
    *,
    cfg: GroupedLargeConfig,
) -> torch.Tensor:
    """Both expert GEMMs on pairs sorted by expert -> y [P, D] BF16.

    x [T, D]; token_of_pair [P] int32, the token of each sorted pair; gamma [P] FP32;
    schedule: the pairs' row tiles (any block_m; block_m() saves a second schedule).
    y[p] = expert_ffn(x[token]) of pair p's expert, with weight gamma[p] (moe.ref.expert_ffn).
    """
    pairs = _Pairs(token_of_pair, gamma, schedule, w1.num_experts)
    large = token_of_pair.shape[0] >= cfg.scratch_min_pairs
    h = swiglu_gemm(x, pairs, w1, w3, limit, cfg.gemm1_large if large else cfg.gemm1, cfg.dequant)
    return down_gemm(h, pairs, w2, cfg.gemm2_large if large else cfg.gemm2, cfg.dequant)


def eligible(
    w: Weights, num_pairs: int, dtype: torch.dtype, w2: Weights | None = None, *, cfg: GroupedLargeConfig
) -> bool:
    """True when moe/triton.py should run MXFP4 experts of num_pairs pairs here (GPU only):
    both GEMMs' K (W1's and, when given, W2's) whole multiples of the K tiles they would take
    (small models, e.g. the test presets, keep the generic kernels)."""
    if not (
        w.fmt == W_MXFP4
        and dtype == torch.bfloat16
        and num_pairs >= cfg.min_pairs
        and not triton_runtime.interpreting()
    ):
        return False
    large = num_pairs >= cfg.scratch_min_pairs
    checks = [(w, cfg.gemm1_large if large else cfg.gemm1)]
    if w2 is not None:
        checks.append((w2, cfg.gemm2_large if large else cfg.gemm2))
    return all(weights.in_dim % tiles.get("block_k", 64) == 0 and weights.in_dim >= 128 for weights, tiles in checks)
