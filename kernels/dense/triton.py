"""Dense ops in Triton: one grouped GEMM that reads the checkpoint's weight formats, RMSNorm,
activations. Same function names and signatures as `dense/ref.py`, plus the format GEMMs.

The GEMM computes, for a list of row tiles each bound to one weight matrix ("expert"):

    C[p, :] = A[a_rows[p], :] . W[expert(p)]^T          FP32 accumulation

with the weight dequantised in registers right before `tl.dot` (model_spec §10):

    W_FMT  layout                                           value
    PLAIN  W [E, N, K] (bf16 or fp32)                       as stored
    MXFP4  W [E, N, K/2] uint8 + S [E, N, K/32] UE8M0       E2M1(nibble) * 2^(S-127), low nibble = even k
    FP8    W [E, N, K] E4M3 + S [E, ceil(N/32), ceil(K/32)] E4M3 * 2^(S-127) per 32x32 tile

Epilogues: STORE (round once to the output dtype) or SWIGLU (two weights W1/W3 share the A
tile; h = gamma * silu(min(g, L)) * clamp(u, -L, L) with g, u rounded to the activation dtype
first, as moe.ref.expert_ffn does, then rounded to the output dtype).

Batch invariance (dense/ref.py): block sizes along K never depend on the number of rows, and
the split of K into chunks (`_plan`: split-K for decode, the same chunks walked in order for
larger GEMMs) depends on the weight's shape only, so a row's result does not depend on how many
rows share the call (up to the tensor-core instruction the compiler picks per tile size; FP8
64-row split-K tiles, 33-64 rows per weight, run the swapped wgmma of DenseConfig.skinny["m64"]).
The exception is opt-in by size: FP8 GEMMs without a row gather (one weight, a SwiGLU pair, or
block-diagonal groups) of >= DenseConfig.cublas_min_rows rows per weight (prefill) run cuBLAS on
the weights dequantised to BF16, which sums in its own order.
BF16 x BF16 products are exact in FP32, so `tl.dot` with FP32 accumulation is the ref's FP32
GEMM up to summation order; FP32 operands use `input_precision="ieee"` (no TF32).
`tl.dot_scaled` (MXFP4 as stored) is behind the constexpr DOT_SCALED, chosen on the GPU by
DenseConfig.mxfp4_decode / .mxfp4_large (or the dot_scaled argument); it does not run under the
Triton 3.6 interpreter, where the dequantise-then-`tl.dot` path runs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
# isort: on

from flashpd.kernels.configs import DEFAULT, DenseConfig, KernelConfigs
from flashpd.kernels.dense.ref import W_FP8, W_MXFP4, W_PLAIN, Weights  # noqa: F401 (re-exported)
from flashpd.kernels.dense.ref import dequantize as dequantize  # torch, re-exported
from flashpd.kernels.e2m1 import e2m1_hi_asm, e2m1_lo_asm, fp32_e2m1
from flashpd.kernels.quant.triton import e4m3_decode, e8m0_decode, round_bf16, round_bf16_if

GEMM_PAD_ROWS = 16  # kept for signature parity with dense/ref.py

EPI_STORE, EPI_SWIGLU = 0, 1
# Launch configuration of the grouped GEMM, tuned on an H200 (bench/kernel_roofline.py; the
# figures are in bench/results/h200/roofline.md).
#   small_rows   GEMMs of at most this many rows (decode) take the split-K grid, and so do
#                GEMMs whose (N blocks x row tiles) grid is under target_ctas programs
#   skinny / mx / plain  split-K tiles for FP8 / MXFP4 / plain weights: N block, K step (a
#                multiple of 32; of 64 for dot_scaled; the K step of the large-M path too, so
#                a row's sums never depend on the path), warps, pipeline stages, wide (one
#                load and one dot per K step instead of 32-wide sub-steps), prefetch (wide:
#                the next K step's tiles loaded into registers before this step's dot),
#                optionally their own target_ctas and max_rows (rows that still take the
#                split-K grid; the routed experts' pairs above it walk K segments); swap
#                (FP8 / plain: acc^T += W . A^T, the dequantised W the MMA's register operand:
#                wgmma m64nBMk16 on Hopper instead of mma.sync m16n8k16 at BLOCK_M = 16);
#                pdl (GPU, FP8): programmatic dependent launch, the first pdl_lines 128-byte lines
#                of each program's weight rows prefetched into L2 before waiting for the
#                previous kernel (schedule-free launches);
#                red_unroll: the split-K reduction loads this many partials at a time (0:
#                all SPLIT at once, unrolled: up to 255 registers and spills at 64-row tiles);
#                deq (FP8 sub-steps): "f32" (FP32 multiply + pack) or "bf16" (one BF16x2
#                multiply per two values, fewer instructions per weight byte);
#                fit_block_n: halve block_n (to >= 32; 64 with swap) for weights whose finest
#                split still leaves the grid under target_ctas (small N: wkv, wq_a);
#                m64: overrides (block_n, warps, stages, swap, red_unroll) for split-K
#                launches with 64-row tiles, 33-64 rows per weight (the K step and the split
#                plan stay the format's); FP8 default: swap + red_unroll 4 (H200, per-layer FP8
#                sum at M = 64: 242.5-243.5 -> 225.6-227.6 us, bench/results/h200/dense_fp8.md)
#   target_ctas  programs a split-K launch aims for; min_k_chunk: the smallest K chunk
#   expert_tiles active experts a grouped MXFP4 weight's split plans for (decode: top-k)
#   mxfp4_decode "dot_scaled": tl.dot_scaled (GPU); "asm": PTX bit moves + one bf16x2
#                multiply per 2 values (GPU); "bits": the same in Triton integer ops (always
#                under the interpreter)
#   mxfp4_large  MXFP4 GEMMs off the split-K grid: "dot_scaled" or "splitk"
#   block_*      large-M tiles; block_m_large is block_m_for's answer above 32 rows
#   prefill      "cublas": FP8 single-weight GEMMs of >= cublas_min_rows rows dequantise the
#                weight to BF16 once per call and run cuBLAS; "triton": `_gemm_kernel`
# Block sizes along K never change a row's arithmetic: K is summed in 16-wide tensor-core
# steps in order within each chunk, and the chunks (SPLIT, k_chunk) depend on the weight's
# shape only (_plan), never on the number of rows.
# (configs.DenseConfig: KernelConfigs.dense, passed in as `cfg`.)
# fp8_swap_max_rows: FP8 calls of <= this many rows per weight (one weight, a SwiGLU pair or
# block-diagonal groups, no schedule or row gather) run dense/fp8_swap.py's swapped kernel (<= 64,
# its row classes 8 / 16 / 32 / 64; 0: off); FLASHPD_FP8_SWAP_MAX_ROWS overrides it at engine
# load, Fp8SwapConfig.layers says which layers. H200: faster than the split-K tiles at M = 1 to
# 64 (bench/results/h200/dense_fp8_swap.md, dense_fp8_rows.md). A row's last bits may differ
# across the bound and across the row classes (another K order or MMA); these are decode-graph
# buckets, so a padded graph batch and its eager batch stay on one side.


# ============================================================================ activations
@triton.jit
def sigmoid_f32(x):
    """1 / (1 + exp(-x)) in FP32 (dense.ref.sigmoid)."""
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def log1p_f32(u):
    """log(1 + u) accurate for small u (Goldberg's trick; libdevice is absent in the interpreter)."""
    w = 1.0 + u
    exact = w == 1.0
    return tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))


@triton.jit
def softplus_f32(x):
    """log(1 + e^x), passing x through above 20 (dense.ref.softplus)."""
    return tl.where(x > 20.0, x, log1p_f32(tl.exp(tl.minimum(x, 20.0))))


# ============================================================================ dot
# Triton 3.6's interpreter mis-reads BF16 operands of tl.dot (NumPy >= 2); there the operands
# are upcast to FP32 first, which is exact (BF16 x BF16 products are exact in FP32 anyway).
DOT_UPCAST = triton_runtime.interpreting()


@triton.jit
def swiglu_limited(g, u, limit):
    """moe.ref.expert_ffn's SwiGLU on FP32 inputs (already rounded as the caller's path rounds):
    silu(min(g, limit)) * clamp(u, -limit, limit)."""
    g = tl.minimum(g, limit)
    return g * sigmoid_f32(g) * tl.minimum(tl.maximum(u, -limit), limit)


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a . b with FP32 accumulation; IEEE for FP32 operands (no TF32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# ============================================================================ weight tiles
@triton.jit
def _dot_scaled_mxfp4(
    a, w_ptr, s_ptr, e, n_idx, k0, N, K, stride_we, stride_wn, stride_se, stride_sn, acc, BLOCK_K: tl.constexpr
):
    """acc + a . W^T with the MXFP4 tile handed to tl.dot_scaled as stored (no dequant here)."""
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    nmask = n_idx[:, None] < N
    base = w_ptr + e.to(tl.int64) * stride_we + n_idx[:, None].to(tl.int64) * stride_wn
    packed = tl.load(base + half[None, :], mask=nmask & (half[None, :] < K // 2), other=0)
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    sbase = s_ptr + e.to(tl.int64) * stride_se + n_idx[:, None].to(tl.int64) * stride_sn
    scale = tl.load(sbase + groups[None, :], mask=nmask & (groups[None, :] < K // 32), other=127)
    return tl.dot_scaled(a, None, "bf16", tl.trans(packed), scale, "e2m1", acc)


# ============================================================================ split-K GEMM
# The serving GEMM (the previous one-program-per-tile kernel is in git history, 7f5b989).
#
#   grid (N blocks, row tiles, SPLIT)          K split into SPLIT chunks of k_chunk (a multiple
#                                              of BLOCK_K), a function of the weight's shape only
#   program (nb, tile, s): rows of `tile` x columns of `nb` over K chunk s in K steps of BLOCK_K:
#   each step one wide load per weight row ([BN, BK/32, 16 or 32] bytes, K grouped by 32 so the
#   scale is one byte per row and group), dequantised in registers, one tl.dot; with PREFETCH the
#   next step's tiles are in flight during this step's dequant and dot
#   SPLIT > 1: FP32 partials -> workspace; the last program of (tile, nb) to arrive (atomic
#   counter) sums them in chunk order 0..SPLIT-1 and runs the epilogue
#
# Small M (decode) runs SPLIT programs side by side so every SM streams weights; large M runs
# one program per tile that walks the same chunks in order (SEGMENTS), adding each chunk's sum
# into the total exactly as the split reduction does, so a row's arithmetic does not depend on
# which path ran it (up to the tensor-core instruction the compiler picks for the tile size).
# MXFP4 nibbles (low = even k) are decoded by bit moves and interleaved back into K order, so
# the bit-trick, asm and tl.dot_scaled paths all sum K in the same order.
# The E2M1 decoders (fp32_e2m1, e2m1_lo_asm / e2m1_hi_asm) are kernels/e2m1.py's.
@triton.jit
def _fp8_scaled(q, s, OUT_DTYPE: tl.constexpr, HW_FP8: tl.constexpr, DEQ_BF16: tl.constexpr):
    """E4M3 bytes q times FP32 power-of-two scales s (broadcast) -> OUT_DTYPE, exact.
    DEQ_BF16 (GPU): E4M3 -> F16 pairs (hardware) -> BF16, then one BF16x2 multiply per two
    values; the interpreter (no HW_FP8) mis-handles BF16 arithmetic and takes the FP32 body,
    which gives the same exact values."""
    if DEQ_BF16 and HW_FP8:
        v = q.to(tl.float8e4nv, bitcast=True).to(tl.float16).to(tl.bfloat16)
        return (v * s.to(tl.bfloat16)).to(OUT_DTYPE)
    else:
        if HW_FP8:
            v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            v = e4m3_decode(q)
        return (v * s).to(OUT_DTYPE)


@triton.jit
def _mma_t(a, w, acc_t, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc_t + w . a^T ([BN, BM], the transpose of mma(a, w^T)). Under the interpreter (UPCAST)
    it is computed as the transpose of mma(a, w^T) so its sums are those of the unswapped path
    bit for bit (NumPy's matmul rounds differently per operand shape)."""
    if UPCAST:
        return tl.trans(mma(a, tl.trans(w), tl.trans(acc_t), IEEE, UPCAST))
    else:
        return mma(w, tl.trans(a), acc_t, IEEE, UPCAST)


@triton.jit
def _sub_step(
    acc1,
    acc3,
    a_ptr,
    a_row,
    stride_am,
    p_mask,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    e64,
    n64,
    nmask,
    gg,
    k_hi,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    W_FMT: tl.constexpr,
    EPILOGUE: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    HW_FP8: tl.constexpr,
    MX_ASM: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWAP: tl.constexpr = False,
    DEQ_BF16: tl.constexpr = False,
):
    """acc += A[:, kk:kk+32] . W[e, n, kk:kk+32]^T, kk = 32 * gg (both weights for SwiGLU);
    columns at or past k_hi are masked unless EVEN_K. SWAP (FP8 / plain): the accumulators are
    transposed, acc^T += W . A^T, so the dequantised W tile is the MMA's first operand (on
    Hopper, wgmma reads it from registers; a second operand goes through shared memory).
    DEQ_BF16 (FP8): the scale multiply in BF16 pairs (exact: a value of <= 4 significant bits
    times a power of two) instead of FP32 multiplies and a pack."""
    dot_dtype = a_ptr.dtype.element_ty
    kk = gg * 32
    if W_FMT == 1:  # MXFP4: bytes [BN, 16] -> even k (low nibbles), odd k (high nibbles)
        j = tl.arange(0, 16)
        if EVEN_K:
            amask = p_mask[:, None]
            wmask = nmask[:, None]
        else:
            kmask = (kk + 2 * j) < k_hi
            amask = p_mask[:, None] & kmask[None, :]
            wmask = nmask[:, None] & kmask[None, :]
        a_base = a_ptr + a_row[:, None] * stride_am + kk + 2 * j[None, :]
        a_even = tl.load(a_base, mask=amask, other=0.0)
        a_odd = tl.load(a_base + 1, mask=amask, other=0.0)
        off = e64 * stride_we + n64[:, None] * stride_wn + gg * 16 + j[None, :]
        soff = e64 * stride_se + n64 * stride_sn + gg
        smask = nmask & (kk < k_hi)  # a group past K: never read (past the scale tensor)
        s1 = e8m0_decode(tl.load(s1_ptr + soff, mask=smask, other=127))[:, None]
        b1 = tl.load(w1_ptr + off, mask=wmask, other=0)
        if MX_ASM:  # 2^126 * scale is exact in BF16 for UE8M0 bytes <= 128
            s1 = (s1 * 8.507059173023462e37).to(tl.bfloat16)
            lo1, hi1 = e2m1_lo_asm(b1, s1), e2m1_hi_asm(b1, s1)
        else:
            lo1 = fp32_e2m1(b1.to(tl.int32), s1).to(dot_dtype)
            hi1 = fp32_e2m1(b1.to(tl.int32) >> 4, s1).to(dot_dtype)
        acc1 = mma(a_even, tl.trans(lo1), acc1, IEEE, UPCAST)
        acc1 = mma(a_odd, tl.trans(hi1), acc1, IEEE, UPCAST)
        if EPILOGUE == 1:
            s3 = e8m0_decode(tl.load(s3_ptr + soff, mask=smask, other=127))[:, None]
            b3 = tl.load(w3_ptr + off, mask=wmask, other=0)
            if MX_ASM:
                s3 = (s3 * 8.507059173023462e37).to(tl.bfloat16)
                lo3, hi3 = e2m1_lo_asm(b3, s3), e2m1_hi_asm(b3, s3)
            else:
                lo3 = fp32_e2m1(b3.to(tl.int32), s3).to(dot_dtype)
                hi3 = fp32_e2m1(b3.to(tl.int32) >> 4, s3).to(dot_dtype)
            acc3 = mma(a_even, tl.trans(lo3), acc3, IEEE, UPCAST)
            acc3 = mma(a_odd, tl.trans(hi3), acc3, IEEE, UPCAST)
    else:
        k_idx = kk + tl.arange(0, 32)
        if EVEN_K:
            amask = p_mask[:, None]
            wmask = nmask[:, None]
        else:
            kmask = k_idx < k_hi
            amask = p_mask[:, None] & kmask[None, :]
            wmask = nmask[:, None] & kmask[None, :]
        a = tl.load(a_ptr + a_row[:, None] * stride_am + k_idx[None, :], mask=amask, other=0.0)
        off = e64 * stride_we + n64[:, None] * stride_wn + k_idx[None, :]
        if W_FMT == 0:
            w1 = tl.load(w1_ptr + off, mask=wmask, other=0.0).to(dot_dtype)
        else:  # FP8: one UE8M0 scale per (32 rows, 32 columns) tile
            soff = e64 * stride_se + (n64 // 32) * stride_sn + gg
            smask = nmask & (kk < k_hi)  # a tile past K: never read
            s1 = e8m0_decode(tl.load(s1_ptr + soff, mask=smask, other=127))[:, None]
            q1 = tl.load(w1_ptr + off, mask=wmask, other=0)
            w1 = _fp8_scaled(q1, s1, dot_dtype, HW_FP8, DEQ_BF16)
        if SWAP:
            acc1 = _mma_t(a, w1, acc1, IEEE, UPCAST)
        else:
            acc1 = mma(a, tl.trans(w1), acc1, IEEE, UPCAST)
        if EPILOGUE == 1:
            if W_FMT == 0:
                w3 = tl.load(w3_ptr + off, mask=wmask, other=0.0).to(dot_dtype)
            else:
                s3 = e8m0_decode(tl.load(s3_ptr + soff, mask=smask, other=127))[:, None]
                q3 = tl.load(w3_ptr + off, mask=wmask, other=0)
                w3 = _fp8_scaled(q3, s3, dot_dtype, HW_FP8, DEQ_BF16)
            if SWAP:
                acc3 = _mma_t(a, w3, acc3, IEEE, UPCAST)
            else:
                acc3 = mma(a, tl.trans(w3), acc3, IEEE, UPCAST)
    return acc1, acc3


@triton.jit
def _load_step(
    w_ptr,
    s_ptr,
    e64,
    n64,
    nmask,
    g0,
    k_hi,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    W_FMT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """W[e, n, 32*g0 : 32*g0+BLOCK_K] as stored, K grouped by 32 (one scale per group and row):
    (raw [BN, BK/32, 16] MXFP4 bytes or [BN, BK/32, 32] FP8 bytes / plain values,
     scale bytes [BN, BK/32]). Steps at or past k_hi load nothing (a prefetch past the chunk's
    end is free). Offsets are multiples of 32 columns the compiler can see, and with EVEN_K
    the mask is constant along K, so each row's 16 or 32 bytes load as 16-byte vectors."""
    G: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, G)
    k0 = g0 * 32
    col, kmask = _step_columns(g0, k_hi, W_FMT, EVEN_K, BLOCK_K)
    ptrs = w_ptr + e64 * stride_we + n64[:, None, None] * stride_wn + col[None, :, :]
    m3 = nmask[:, None, None] & kmask[None, :, :]
    if W_FMT == 0:
        raw = tl.load(ptrs, mask=m3, other=0.0)
    else:
        raw = tl.load(ptrs, mask=m3, other=0)
    gmask = nmask[:, None] & ((k0 + 32 * g) < k_hi)[None, :]
    return raw, _step_scales(s_ptr, e64, n64, g0, g, gmask, stride_se, stride_sn, W_FMT)


@triton.jit
def _step_columns(g0, k_hi, W_FMT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(byte columns [BK/32, 16 or 32], their K mask) of the step from group g0: 16 bytes per
    group for MXFP4 (two codes a byte), else 32; with EVEN_K the mask is constant along K."""
    g = tl.arange(0, BLOCK_K // 32)
    k0 = g0 * 32
    if W_FMT == 1:
        j = tl.arange(0, 16)
        col = g0 * 16 + g[:, None] * 16 + j[None, :]
        if EVEN_K:
            kmask = (k0 < k_hi) & (j[None, :] >= 0)
        else:  # K % 32 == 0 for MXFP4: whole groups in or out
            kmask = ((k0 + 32 * g) < k_hi)[:, None] & (j[None, :] >= 0)
    else:
        j = tl.arange(0, 32)
        col = k0 + g[:, None] * 32 + j[None, :]
        if EVEN_K:
            kmask = (k0 < k_hi) & (j[None, :] >= 0)
        else:
            kmask = col < k_hi
    return col, kmask


@triton.jit
def _step_scales(s_ptr, e64, n64, g0, g, gmask, stride_se, stride_sn, W_FMT: tl.constexpr):
    """Scale bytes [BN, BK/32] of the step's groups: one per (row, group) for MXFP4, one per
    (32 rows, group) for FP8 (127 where masked); plain weights have none (a placeholder)."""
    if W_FMT == 1:
        s = tl.load(s_ptr + e64 * stride_se + n64[:, None] * stride_sn + g0 + g[None, :], mask=gmask, other=127)
    elif W_FMT == 2:
        s = tl.load(s_ptr + e64 * stride_se + (n64[:, None] // 32) * stride_sn + g0 + g[None, :], mask=gmask, other=127)
    else:
        s = gmask.to(tl.uint8)  # plain weights: no scales (never read)
    return s


@triton.jit
def _wide_loads(
    a_base,
    kk,
    p_mask,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    e64,
    n64,
    nmask,
    g0,
    k_hi,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    W_FMT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EPILOGUE: tl.constexpr,
):
    """One wide K step's operands from group g0: the A tile and the raw W1 (and W3 for the
    SwiGLU epilogue; W1's again otherwise) tiles with their scales."""
    k0 = g0 * 32
    a = tl.load(a_base + k0 + kk[None, :], mask=p_mask[:, None] & ((k0 + kk) < k_hi)[None, :], other=0.0)
    r1, q1 = _load_step(
        w1_ptr, s1_ptr, e64, n64, nmask, g0, k_hi, stride_we, stride_wn, stride_se, stride_sn, W_FMT, EVEN_K, BLOCK_K
    )
    if EPILOGUE == 1:
        r3, q3 = _load_step(
            w3_ptr,
            s3_ptr,
            e64,
            n64,
            nmask,
            g0,
            k_hi,
            stride_we,
            stride_wn,
            stride_se,
            stride_sn,
            W_FMT,
            EVEN_K,
            BLOCK_K,
        )
    else:
        r3, q3 = r1, q1
    return a, r1, q1, r3, q3


@triton.jit
def _dequant(
    raw,
    s,
    OUT_DTYPE: tl.constexpr,
    W_FMT: tl.constexpr,
    HW_FP8: tl.constexpr,
    MX_ASM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """_load_step's tile -> [BLOCK_N, BLOCK_K] in OUT_DTYPE, K in natural order (exact)."""
    if W_FMT == 0:
        w = raw.to(OUT_DTYPE)
    elif W_FMT == 1:  # low nibble = even k, high nibble = odd k: interleave back to k order
        sf = e8m0_decode(s)[:, :, None]
        if MX_ASM:  # 2^126 * scale is exact in BF16 for UE8M0 bytes <= 128
            sb = tl.broadcast_to((sf * 8.507059173023462e37).to(tl.bfloat16), raw.shape)
            lo, hi = e2m1_lo_asm(raw, sb), e2m1_hi_asm(raw, sb)
        else:
            bi = raw.to(tl.int32)
            lo = fp32_e2m1(bi, sf).to(OUT_DTYPE)
            hi = fp32_e2m1(bi >> 4, sf).to(OUT_DTYPE)
        w = tl.interleave(lo, hi)
    else:  # FP8: one UE8M0 scale per (32 rows, 32 columns) tile
        if HW_FP8:
            v = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            v = e4m3_decode(raw)
        w = (v * e8m0_decode(s)[:, :, None]).to(OUT_DTYPE)
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _chunk(
    a_ptr,
    a_row,
    stride_am,
    p_mask,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    e,
    n_idx,
    k_lo,
    k_hi,
    N,
    K,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    W_FMT: tl.constexpr,
    EPILOGUE: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_SCALED: tl.constexpr,
    HW_FP8: tl.constexpr,
    MX_ASM: tl.constexpr,
    WIDE: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP: tl.constexpr,
    DEQ_BF16: tl.constexpr,
):
    """Sums over K in [k_lo, k_hi) from zero: (acc1, acc3) [BLOCK_M, BLOCK_N] FP32.

    K is walked in steps of BLOCK_K from group index k_lo // 32 (offsets are multiples of 32
    columns the compiler can see: 16-byte aligned weight rows). EVEN_K (K % BLOCK_K == 0): no K
    masks, so weight rows load as 16-byte vectors. Three step bodies:
      DOT_SCALED  the MXFP4 tile handed to tl.dot_scaled as stored (GPU; element masks)
      WIDE        one [BN, BK/32, 16 | 32] load per weight per step, dequantised in registers,
                  one tl.dot; PREFETCH loads the next step before this step's dequant and dot
      otherwise   32-wide sub-steps, one [BN, 16 | 32] load and one or two K=16 dots each
                  (MXFP4: even k = low nibbles, then odd k); SWAP (FP8 / plain) accumulates
                  the transpose, W . A^T, and transposes once at the end
    """
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dot_dtype = a_ptr.dtype.element_ty
    e64 = e.to(tl.int64)
    n64 = n_idx.to(tl.int64)
    nmask = n_idx < N
    kk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_row[:, None] * stride_am
    G: tl.constexpr = BLOCK_K // 32
    g_lo = k_lo // 32
    g_hi = (k_hi + 31) // 32
    if DOT_SCALED:  # hardware / Triton MXFP4 path (GPU only, see module doc)
        # Element-masked loads, as measured correct on the H200: the same step with the K mask
        # dropped and 16-byte-aligned offsets (vector loads) gave wrong sums at BLOCK_M = 16
        # (Triton 3.6, tl.dot_scaled on Hopper), bench/results/h200/gemm_decode.md.
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_idx = k0 + kk
            a = tl.load(a_base + k_idx[None, :], mask=p_mask[:, None] & (k_idx[None, :] < k_hi), other=0.0)
            acc1 = _dot_scaled_mxfp4(
                a, w1_ptr, s1_ptr, e, n_idx, k0, N, k_hi, stride_we, stride_wn, stride_se, stride_sn, acc1, BLOCK_K
            )
            if EPILOGUE == 1:
                acc3 = _dot_scaled_mxfp4(
                    a, w3_ptr, s3_ptr, e, n_idx, k0, N, k_hi, stride_we, stride_wn, stride_se, stride_sn, acc3, BLOCK_K
                )
    elif WIDE:
        if PREFETCH:
            a, r1, q1, r3, q3 = _wide_loads(
                a_base,
                kk,
                p_mask,
                w1_ptr,
                s1_ptr,
                w3_ptr,
                s3_ptr,
                e64,
                n64,
                nmask,
                g_lo,
                k_hi,
                stride_we,
                stride_wn,
                stride_se,
                stride_sn,
                W_FMT,
                EVEN_K,
                BLOCK_K,
                EPILOGUE,
            )
        for g0 in range(g_lo, g_hi, G):
            if PREFETCH:  # next step in flight during this step's dequant and dot
                na, nr1, nq1, nr3, nq3 = _wide_loads(
                    a_base,
                    kk,
                    p_mask,
                    w1_ptr,
                    s1_ptr,
                    w3_ptr,
                    s3_ptr,
                    e64,
                    n64,
                    nmask,
                    g0 + G,
                    k_hi,
                    stride_we,
                    stride_wn,
                    stride_se,
                    stride_sn,
                    W_FMT,
                    EVEN_K,
                    BLOCK_K,
                    EPILOGUE,
                )
            else:
                a, r1, q1, r3, q3 = _wide_loads(
                    a_base,
                    kk,
                    p_mask,
                    w1_ptr,
                    s1_ptr,
                    w3_ptr,
                    s3_ptr,
                    e64,
                    n64,
                    nmask,
                    g0,
                    k_hi,
                    stride_we,
                    stride_wn,
                    stride_se,
                    stride_sn,
                    W_FMT,
                    EVEN_K,
                    BLOCK_K,
                    EPILOGUE,
                )
            w1 = _dequant(r1, q1, dot_dtype, W_FMT, HW_FP8, MX_ASM, BLOCK_N, BLOCK_K)
            acc1 = mma(a, tl.trans(w1), acc1, IEEE, UPCAST)
            if EPILOGUE == 1:
                w3 = _dequant(r3, q3, dot_dtype, W_FMT, HW_FP8, MX_ASM, BLOCK_N, BLOCK_K)
                acc3 = mma(a, tl.trans(w3), acc3, IEEE, UPCAST)
            if PREFETCH:
                a, r1, q1, r3, q3 = na, nr1, nq1, nr3, nq3
    elif SWAP:
        t1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        t3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for g0 in range(g_lo, g_hi, G):
            for j in tl.static_range(G):
                t1, t3 = _sub_step(
                    t1,
                    t3,
                    a_ptr,
                    a_row,
                    stride_am,
                    p_mask,
                    w1_ptr,
                    s1_ptr,
                    w3_ptr,
                    s3_ptr,
                    e64,
                    n64,
                    nmask,
                    g0 + j,
                    k_hi,
                    stride_we,
                    stride_wn,
                    stride_se,
                    stride_sn,
                    W_FMT,
                    EPILOGUE,
                    IEEE,
                    UPCAST,
                    HW_FP8,
                    MX_ASM,
                    EVEN_K,
                    True,
                    DEQ_BF16,
                )
        acc1 = tl.trans(t1)
        acc3 = tl.trans(t3)
    else:
        for g0 in range(g_lo, g_hi, G):
            for j in tl.static_range(G):
                acc1, acc3 = _sub_step(
                    acc1,
                    acc3,
                    a_ptr,
                    a_row,
                    stride_am,
                    p_mask,
                    w1_ptr,
                    s1_ptr,
                    w3_ptr,
                    s3_ptr,
                    e64,
                    n64,
                    nmask,
                    g0 + j,
                    k_hi,
                    stride_we,
                    stride_wn,
                    stride_se,
                    stride_sn,
                    W_FMT,
                    EPILOGUE,
                    IEEE,
                    UPCAST,
                    HW_FP8,
                    MX_ASM,
                    EVEN_K,
                    False,
                    DEQ_BF16,
                )
    return acc1, acc3


@triton.jit
def _epilogue(
    acc1,
    acc3,
    p,
    p_mask,
    n_idx,
    N,
    c_ptr,
    stride_cm,
    gamma_ptr,
    limit,
    EPILOGUE: tl.constexpr,
    HAS_GAMMA: tl.constexpr,
    ROUND_ACT_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    if EPILOGUE == 1:  # SwiGLU (moe.ref.expert_ffn): g, u rounded to the activation dtype
        out = swiglu_limited(round_bf16_if(acc1, ROUND_ACT_BF16), round_bf16_if(acc3, ROUND_ACT_BF16), limit)
        if HAS_GAMMA:
            out = tl.load(gamma_ptr + p, mask=p_mask, other=0.0)[:, None] * out
    else:
        out = acc1
    c = c_ptr + p[:, None].to(tl.int64) * stride_cm + n_idx[None, :]
    tl.store(c, round_bf16_if(out, OUT_BF16).to(c_ptr.dtype.element_ty), mask=p_mask[:, None] & (n_idx[None, :] < N))


@triton.jit
def _prefetch_l2(ptrs):
    """prefetch.global.L2 of each pointer (no value; kept: not pure)."""
    return tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _pdl_prologue(
    w1_ptr,
    w3_ptr,
    stride_we,
    stride_wn,
    N,
    K,
    k_chunk,
    num_rows,
    groups,
    nb,
    tile,
    EPILOGUE: tl.constexpr,
    SPLIT_GRID: tl.constexpr,
    ROWS: tl.constexpr,
    PF_LINES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Let the next (PDL-launched) kernel start; prefetch into L2 the first PF_LINES 128-byte
    lines of this program's weight rows in its K chunk (weights: never written by an earlier
    kernel; schedule-free launches only, whose weight index needs no load); then wait for the
    previous grid to finish (its writes visible) before anything else is read or written."""
    gdc_launch_dependents()
    if PF_LINES > 0 and ROWS != 0:
        if ROWS == 1:
            e = 0
        else:
            e = tile // tl.cdiv(num_rows // groups, BLOCK_M)
        k_lo = tl.program_id(2) * k_chunk if SPLIT_GRID else 0
        k_hi = tl.minimum(k_lo + k_chunk, K) if SPLIT_GRID else K
        rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col = k_lo + tl.arange(0, PF_LINES) * 128
        ok = (rows[:, None] < N) & (col[None, :] < k_hi)
        off = tl.where(ok, e.to(tl.int64) * stride_we + rows[:, None].to(tl.int64) * stride_wn + col[None, :], 0)
        _prefetch_l2(w1_ptr + off)
        if EPILOGUE == 1:
            _prefetch_l2(w3_ptr + off)
    gdc_wait()


@triton.jit(do_not_specialize=["num_rows"])  # one compiled variant for every decode batch
def _gemm_kernel(
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
    part_ptr,
    count_ptr,
    N,
    K,
    k_chunk,
    num_rows,
    groups,
    limit,
    W_FMT: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HAS_GAMMA: tl.constexpr,
    GATHER_A: tl.constexpr,
    ROUND_ACT_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_SCALED: tl.constexpr,
    HW_FP8: tl.constexpr,
    SPLIT: tl.constexpr,
    SPLIT_GRID: tl.constexpr,
    ROWS: tl.constexpr,
    MX_ASM: tl.constexpr,
    WIDE: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP: tl.constexpr = False,
    DEQ_BF16: tl.constexpr = False,
    RED_UNROLL: tl.constexpr = 0,
    PDL: tl.constexpr = False,
    PF_LINES: tl.constexpr = 0,
):
    # ROWS 0: tiles from the schedule tensors; 1: all rows against weight 0 (no schedule);
    # 2: interleaved groups, row t * groups + g of A and C against weight g (block-diagonal)
    nb = tl.program_id(0)
    tile = tl.program_id(1)
    if PDL:  # programmatic dependent launch (GPU; see grouped_gemm)
        _pdl_prologue(
            w1_ptr,
            w3_ptr,
            stride_we,
            stride_wn,
            N,
            K,
            k_chunk,
            num_rows,
            groups,
            nb,
            tile,
            EPILOGUE,
            SPLIT_GRID,
            ROWS,
            PF_LINES,
            BLOCK_M,
            BLOCK_N,
        )
    if ROWS == 0:
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)
    elif ROWS == 1:
        start = tile * BLOCK_M
        end = tl.minimum(start + BLOCK_M, num_rows)
    else:
        per_group = num_rows // groups
        tiles_per_group = tl.cdiv(per_group, BLOCK_M)
        group = tile // tiles_per_group
        start = (tile - group * tiles_per_group) * BLOCK_M
        end = tl.minimum(start + BLOCK_M, per_group)
    if start < end:
        if ROWS == 0:
            e = tl.load(tile_expert_ptr + tile)
        elif ROWS == 1:
            e = tile * 0
        else:
            e = group
        p = start + tl.arange(0, BLOCK_M)  # rows of C
        p_mask = p < end
        if ROWS == 2:
            p = p * groups + e
        if GATHER_A:
            a_row = tl.load(a_rows_ptr + p, mask=p_mask, other=0).to(tl.int64)
        else:
            a_row = p.to(tl.int64)
        n_idx = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        if SPLIT_GRID:  # one K chunk per program, partials reduced by the last to arrive
            sp = tl.program_id(2)
            k_lo = sp * k_chunk
            acc1, acc3 = _chunk(
                a_ptr,
                a_row,
                stride_am,
                p_mask,
                w1_ptr,
                s1_ptr,
                w3_ptr,
                s3_ptr,
                e,
                n_idx,
                k_lo,
                tl.minimum(k_lo + k_chunk, K),
                N,
                K,
                stride_we,
                stride_wn,
                stride_se,
                stride_sn,
                W_FMT,
                EPILOGUE,
                IEEE,
                UPCAST,
                DOT_SCALED,
                HW_FP8,
                MX_ASM,
                WIDE,
                PREFETCH,
                EVEN_K,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                SWAP,
                DEQ_BF16,
            )
            if SPLIT > 1:
                cell = p[:, None].to(tl.int64) * N + n_idx[None, :]
                cmask = p_mask[:, None] & (n_idx[None, :] < N)
                plane = num_rows.to(tl.int64) * N
                tl.store(part_ptr + sp * plane + cell, acc1, mask=cmask)
                if EPILOGUE == 1:
                    tl.store(part_ptr + (SPLIT + sp) * plane + cell, acc3, mask=cmask)
                tl.debug_barrier()
                counter = count_ptr + tile * tl.num_programs(0) + nb
                arrived = tl.atomic_add(counter, 1, sem="acq_rel")
                if arrived == SPLIT - 1:  # last chunk in: sum the chunks in order
                    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    if RED_UNROLL == 0:  # every partial's load in flight at once
                        for s in tl.static_range(SPLIT):
                            acc1 += tl.load(part_ptr + s * plane + cell, mask=cmask, other=0.0, cache_modifier=".cg")
                            if EPILOGUE == 1:
                                acc3 += tl.load(
                                    part_ptr + (SPLIT + s) * plane + cell, mask=cmask, other=0.0, cache_modifier=".cg"
                                )
                    else:  # RED_UNROLL at a time (fewer registers), still summed in order
                        for s0 in range(0, SPLIT, RED_UNROLL):
                            for j in tl.static_range(RED_UNROLL):
                                rm = cmask & (s0 + j < SPLIT)  # -0.0 + x == x for every x
                                acc1 += tl.load(
                                    part_ptr + (s0 + j) * plane + cell, mask=rm, other=-0.0, cache_modifier=".cg"
                                )
                                if EPILOGUE == 1:
                                    acc3 += tl.load(
                                        part_ptr + (SPLIT + s0 + j) * plane + cell,
                                        mask=rm,
                                        other=-0.0,
                                        cache_modifier=".cg",
                                    )
                    tl.store(counter, 0)  # ready for the next launch
                    _epilogue(
                        acc1,
                        acc3,
                        p,
                        p_mask,
                        n_idx,
                        N,
                        c_ptr,
                        stride_cm,
                        gamma_ptr,
                        limit,
                        EPILOGUE,
                        HAS_GAMMA,
                        ROUND_ACT_BF16,
                        OUT_BF16,
                    )
            else:
                _epilogue(
                    acc1,
                    acc3,
                    p,
                    p_mask,
                    n_idx,
                    N,
                    c_ptr,
                    stride_cm,
                    gamma_ptr,
                    limit,
                    EPILOGUE,
                    HAS_GAMMA,
                    ROUND_ACT_BF16,
                    OUT_BF16,
                )
        else:  # SEGMENTS: the same chunks walked in order by one program
            acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for sp in range(0, SPLIT):
                k_lo = sp * k_chunk
                c1, c3 = _chunk(
                    a_ptr,
                    a_row,
                    stride_am,
                    p_mask,
                    w1_ptr,
                    s1_ptr,
                    w3_ptr,
                    s3_ptr,
                    e,
                    n_idx,
                    k_lo,
                    tl.minimum(k_lo + k_chunk, K),
                    N,
                    K,
                    stride_we,
                    stride_wn,
                    stride_se,
                    stride_sn,
                    W_FMT,
                    EPILOGUE,
                    IEEE,
                    UPCAST,
                    DOT_SCALED,
                    HW_FP8,
                    MX_ASM,
                    WIDE,
                    PREFETCH,
                    EVEN_K,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                    SWAP,
                    DEQ_BF16,
                )
                acc1 += c1
                acc3 += c3
            _epilogue(
                acc1,
                acc3,
                p,
                p_mask,
                n_idx,
                N,
                c_ptr,
                stride_cm,
                gamma_ptr,
                limit,
                EPILOGUE,
                HAS_GAMMA,
                ROUND_ACT_BF16,
                OUT_BF16,
            )


# The split-K kernel as `grouped_gemm` launches it (a module global read at each launch):
# bench tools read its compiled binaries and, offline, stand a recorder in for it.
SPLITK_KERNEL = _gemm_kernel


@dataclass(frozen=True)
class TileSchedule:
    """Row tiles of C: tile t covers rows [start[t], end[t]) of weight expert[t] (empty: start=end)."""

    expert: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    block_m: int


def single_schedule(num_rows: int, block_m: int, device: torch.device) -> TileSchedule:
    """All rows against weight 0."""
    n_tiles = max(1, -(-num_rows // block_m))
    start = torch.arange(n_tiles, dtype=torch.int32, device=device) * block_m
    end = torch.clamp(start + block_m, max=num_rows)
    return TileSchedule(torch.zeros_like(start), start, end, block_m)


def grouped_schedule(counts: torch.Tensor, total_rows: int, block_m: int) -> TileSchedule:
    """counts [E] rows per expert (rows sorted by expert, summing to total_rows) -> tiles.

    Computed on the device without a host sync: the tile count is bounded by
    ceil(total_rows / block_m) + E, and surplus tiles are empty.
    """
    device = counts.device
    counts = counts.to(torch.int64)
    num_experts = counts.shape[0]
    row_off = torch.cumsum(counts, 0) - counts  # [E] first row of each expert
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_off = torch.cumsum(tiles, 0)  # [E] one past the last tile of each expert
    # every non-empty tile holds >= 1 row: at most total_rows tiles (one decode token: top-k)
    max_tiles = max(1, min(total_rows, -(-total_rows // block_m) + num_experts))
    t = torch.arange(max_tiles, device=device)
    expert = torch.searchsorted(tile_off, t, right=True).clamp(max=num_experts - 1)  # [tiles]
    first_tile = tile_off[expert] - tiles[expert]
    start = row_off[expert] + (t - first_tile) * block_m
    end = torch.minimum(start + block_m, row_off[expert] + counts[expert])
    end = torch.where(t < tile_off[-1], end, start)
    return TileSchedule(expert.to(torch.int32), start.to(torch.int32), end.to(torch.int32), block_m)


def grouped_gemm(
    a: torch.Tensor,
    w: Weights,
    schedule: TileSchedule | None,
    out: torch.Tensor,
    a_rows: torch.Tensor | None = None,
    w3: Weights | None = None,
    gamma: torch.Tensor | None = None,
    limit: float = 0.0,
    dot_scaled: bool = False,
    *,
    cfg: DenseConfig = DEFAULT.dense,
) -> torch.Tensor:
    """out[p] = epilogue(A[a_rows[p]] . W[expert(p)]^T); SwiGLU epilogue when w3 is given.

    schedule None: no schedule tensors, nothing launched besides the GEMM; with one weight,
    every row against it; with G weights (and no a_rows), row t * G + g against weight g
    (block-diagonal, see `block_diagonal`). dot_scaled=True (MXFP4 weights, GPU only) feeds the packed tile to tl.dot_scaled
    instead of dequantising it in registers; it is rejected under the interpreter, which cannot
    run it.
    """
    _check_grouped_args(a, w, out, w3, dot_scaled)
    if _nothing_to_do(out, schedule) or _library_path(a, w, schedule, out, a_rows, w3, gamma, limit, dot_scaled, cfg):
        return out
    plan = _splitk_plan(w, schedule, out.shape[0], a_rows, dot_scaled, cfg)
    _launch_splitk(a, w, w3, plan, schedule, out, a_rows, gamma, limit)
    return out


def _check_grouped_args(a: torch.Tensor, w: Weights, out: torch.Tensor, w3: Weights | None, dot_scaled: bool) -> None:
    _check_gemm(a, w, out, w3)
    if dot_scaled and (w.fmt != W_MXFP4 or triton_runtime.interpreting()):
        raise ValueError("dot_scaled needs MXFP4 weights and a GPU (not the interpreter)")


def _nothing_to_do(out: torch.Tensor, schedule: TileSchedule | None) -> bool:
    """No rows, or a schedule of no tiles: nothing is launched."""
    return out.shape[0] == 0 or (schedule is not None and schedule.start.shape[0] == 0)


def _library_path(a, w: Weights, schedule, out, a_rows, w3, gamma, limit: float, dot_scaled: bool, cfg) -> bool:
    """Runs the call on cuBLAS (prefill-sized FP8) or the fp8_swap kernel (decode-sized FP8)
    when it qualifies and says so; False: the split-K kernel runs it."""
    if cublas_eligible(a, w, out, a_rows, w3, dot_scaled, cfg):
        _cublas_gemm(a, w, out, w3, gamma, limit)
        return True
    if (
        w.fmt == W_FP8
        and schedule is None
        and a_rows is None
        and not dot_scaled
        and out.shape[0] <= cfg.fp8_swap_max_rows * w.num_experts
    ):
        from flashpd.kernels.dense import fp8_swap  # imports this module: not at the top

        if fp8_swap.eligible(a, w, out, w3, cfg=cfg.fp8_swap):
            fp8_swap.gemm(a, w, out, w3, gamma, limit, config=cfg.fp8_swap)
            return True
    return False


@dataclass(frozen=True)
class _SplitKPlan:
    """One `grouped_gemm` launch of the split-K kernel: every host-side choice, from the weight's
    format and shape, the row count and the config (never from the data)."""

    rows: int
    groups: int  # G weights block-diagonal (schedule-free), else 1
    single: bool  # schedule-free: row tiles against the weight(s) directly
    block_m: int
    split: int  # K segments of the split-K grid
    chunk: int  # K columns per segment
    small: bool  # the split-K (decode) grid; else one program per output tile, the whole K
    tiles: Mapping[str, Any]
    block_k: int
    grid: tuple[int, int, int]
    dot_scaled: bool
    mx_asm: bool
    swap: bool


def _row_tiles(w: Weights, schedule: TileSchedule | None, rows: int, a_rows, cfg: DenseConfig) -> tuple[int, int, int]:
    """(groups, BLOCK_M, row tiles): the schedule's, or schedule-free tiles over G groups."""
    single = schedule is None
    groups = w.num_experts if single else 1
    if single and groups > 1 and (a_rows is not None or rows % groups):
        raise ValueError(f"block-diagonal GEMM: {rows} rows do not split into {groups} groups (or a_rows was given)")
    block_m = block_m_for(rows // groups, cfg) if single else schedule.block_m
    n_tiles = groups * triton.cdiv(rows // groups, block_m) if single else schedule.start.shape[0]
    return groups, block_m, n_tiles


def _launch_tiles(w: Weights, tiles: Mapping[str, Any], small: bool, block_m: int, cfg: DenseConfig):
    """(tiles, swap) as launched: 64-row decode tiles their own, the large path the config's."""
    if small and block_m >= 64 and "m64" in tiles:  # 64-row decode tiles: their own launch
        tiles = {**tiles, **tiles["m64"]}
    # swap (FP8 / plain): on the K-segment path too, so a row's sums match the split-K grid's
    swap = bool(tiles.get("swap", False)) and w.fmt != W_MXFP4 and not tiles.get("wide", False)
    if not small:
        tiles = {"block_n": cfg.block_n, "warps": cfg.warps, "stages": cfg.stages}
    return tiles, swap


def _splitk_plan(
    w: Weights, schedule: TileSchedule | None, rows: int, a_rows, dot_scaled: bool, cfg: DenseConfig
) -> _SplitKPlan:
    groups, block_m, n_tiles = _row_tiles(w, schedule, rows, a_rows, cfg)
    split, chunk = _plan(w, cfg)
    tiles = _tiles(w, cfg)
    small = rows <= tiles.get("max_rows", cfg.small_rows) or triton.cdiv(
        w.out_dim, tiles["block_n"]
    ) * n_tiles < tiles.get("target_ctas", cfg.target_ctas)
    mx_asm = w.fmt == W_MXFP4 and cfg.mxfp4_decode == "asm" and not DOT_UPCAST
    if w.fmt == W_MXFP4 and not triton_runtime.interpreting():
        dot_scaled = dot_scaled or (cfg.mxfp4_decode == "dot_scaled" if small else cfg.mxfp4_large == "dot_scaled")
    step = tiles["block_k"]  # the format's K step on both paths: never a function of the rows
    tiles, swap = _launch_tiles(w, tiles, small, block_m, cfg)
    block_k = 64 if dot_scaled and not small else step
    grid = (triton.cdiv(w.out_dim, tiles["block_n"]), n_tiles, split if small else 1)
    if small and split > 1:
        triton_runtime.check_counter_slots(grid[0] * n_tiles)
    return _SplitKPlan(
        rows, groups, schedule is None, block_m, split, chunk, small, tiles, block_k, grid, dot_scaled, mx_asm, swap
    )


def _pdl_launch(w: Weights, plan: _SplitKPlan) -> tuple[dict, bool, int]:
    """(launch options, PDL, PF_LINES). pdl (GPU, FP8): launched as a programmatic dependent
    launch; the kernel lets the next one start, prefetches its first weight lines (one byte per
    K column), then waits for the previous grid."""
    launch = triton_runtime.launch_options()
    pdl = bool(plan.tiles.get("pdl", False)) and w.fmt == W_FP8 and not DOT_UPCAST
    pf_lines = 0
    if pdl:
        launch = {**launch, "launch_pdl": True}
        span = plan.chunk if plan.small else w.in_dim
        pf_lines = min(triton.next_power_of_2(triton.cdiv(span, 128)), int(plan.tiles.get("pdl_lines", 4)))
    return launch, pdl, pf_lines


def _weight_args(w: Weights, w3: Weights | None) -> tuple:
    """W1's and W3's data and scales (the data again when unscaled; W1 again without W3), then
    W1's strides and its scales' (0, 0 unscaled)."""
    scale1 = w.scale if w.scale is not None else w.data
    w3_ = w3 if w3 is not None else w
    scale3 = w3_.scale if w3_.scale is not None else w3_.data
    sse, ssn = (scale1.stride(0), scale1.stride(1)) if w.scale is not None else (0, 0)
    return (w.data, scale1, w3_.data, scale3, w.data.stride(0), w.data.stride(1), sse, ssn)


def _splitk_args(a, w: Weights, w3, plan: _SplitKPlan, schedule, out, a_rows, gamma, limit: float) -> tuple:
    """The split-K kernel's positional arguments, in its signature's order."""
    sched = schedule if schedule is not None else _no_schedule(a.device)
    part = triton_runtime.split_partials(
        plan.split if plan.small else 1, w3 is not None, plan.rows, w.out_dim, out, a.device
    )
    return (
        a,
        a.stride(0),
        a_rows if a_rows is not None else sched.start,
        out,
        out.stride(0),
        gamma if gamma is not None else a,
        *_weight_args(w, w3),
        sched.expert,
        sched.start,
        sched.end,
        part,
        triton_runtime.arrival_counters(a.device),
        w.out_dim,
        w.in_dim,
        plan.chunk,
        plan.rows,
        plan.groups,
        float(limit),
    )


def _epilogue_constexprs(a, w: Weights, w3, out, a_rows, gamma) -> dict:
    """What the kernel computes: the weight format, the epilogue and the dtypes."""
    return dict(
        W_FMT=w.fmt,
        EPILOGUE=EPI_SWIGLU if w3 is not None else EPI_STORE,
        HAS_GAMMA=gamma is not None,
        GATHER_A=a_rows is not None,
        ROUND_ACT_BF16=a.dtype == torch.bfloat16,
        OUT_BF16=out.dtype == torch.bfloat16,
        IEEE=a.dtype == torch.float32,
        UPCAST=DOT_UPCAST,
        HW_FP8=not DOT_UPCAST,
    )


def _tile_constexprs(w: Weights, plan: _SplitKPlan) -> dict:
    """How the kernel is tiled: the plan's blocks, split and per-format tile switches."""
    tiles, k_dim, block_k = plan.tiles, w.in_dim, plan.block_k
    return dict(
        DOT_SCALED=plan.dot_scaled,
        SPLIT=plan.split,
        SPLIT_GRID=plan.small,
        ROWS=0 if not plan.single else 1 if plan.groups == 1 else 2,
        MX_ASM=plan.mx_asm,
        WIDE=bool(tiles.get("wide", False)) and not plan.dot_scaled,
        PREFETCH=bool(tiles.get("prefetch", False)) and not plan.dot_scaled,
        EVEN_K=k_dim % block_k == 0 and plan.chunk % block_k == 0,
        BLOCK_M=plan.block_m,
        BLOCK_N=tiles["block_n"],
        BLOCK_K=block_k,
        SWAP=plan.swap,
        DEQ_BF16=w.fmt == W_FP8 and tiles.get("deq", "f32") == "bf16",
        RED_UNROLL=tiles.get("red_unroll", 0) if plan.small and plan.split > 1 else 0,
    )


def _launch_splitk(a, w: Weights, w3, plan: _SplitKPlan, schedule, out, a_rows, gamma, limit: float) -> None:
    launch, pdl, pf_lines = _pdl_launch(w, plan)
    SPLITK_KERNEL[plan.grid](
        *_splitk_args(a, w, w3, plan, schedule, out, a_rows, gamma, limit),
        **_epilogue_constexprs(a, w, w3, out, a_rows, gamma),
        **_tile_constexprs(w, plan),
        PDL=pdl,
        PF_LINES=pf_lines,
        num_warps=plan.tiles["warps"],
        num_stages=plan.tiles["stages"],
        **launch,
    )


def block_diagonal(
    x: torch.Tensor, w: Weights, out_dtype: torch.dtype | None = None, *, tuned: KernelConfigs = DEFAULT
) -> torch.Tensor:
    """x [T, G, K] -> [T, G, N]: out[t, g] = x[t, g] . W[g]^T, one launch, no schedule.

    The GPU forward's wo_a (group g of a token's heads through its own low-rank weight): A and C
    stay in [T, G, .] order, so nothing is gathered or transposed around the GEMM.
    """
    if x.ndim != 3 or x.shape[1] != w.num_experts:
        raise ValueError(f"block_diagonal: x {tuple(x.shape)} for {w.num_experts} weights")
    num_tokens, groups, _ = x.shape
    out = torch.empty(num_tokens * groups, w.out_dim, dtype=out_dtype or x.dtype, device=x.device)
    grouped_gemm(x.reshape(num_tokens * groups, -1).contiguous(), w, None, out, cfg=tuned.dense)
    return out.view(num_tokens, groups, -1)


@functools.cache
def _no_schedule(device: torch.device) -> TileSchedule:
    """Placeholder schedule tensors for schedule-free launches (never read; one per device)."""
    z = torch.zeros(1, dtype=torch.int32, device=device)
    return TileSchedule(z, z, z, 16)


def _tiles(w: Weights, cfg: DenseConfig) -> Mapping[str, Any]:
    """The split-K tiles of w's format (MXFP4 "mx", FP8 "skinny", plain "plain"). With
    fit_block_n, the N block halves (down to 32; 64 with swap) while even the finest split
    (chunks of min_k_chunk) leaves the grid under the target: a function of w's shape only."""
    tiles = cfg.mx if w.fmt == W_MXFP4 else cfg.skinny if w.fmt == W_FP8 else cfg.plain
    if tiles.get("fit_block_n", False):
        target = tiles.get("target_ctas", cfg.target_ctas)
        experts = min(w.num_experts, cfg.expert_tiles) if w.fmt == W_MXFP4 else w.num_experts
        finest = max(1, w.in_dim // cfg.min_k_chunk)
        bn = tiles["block_n"]
        floor = 64 if tiles.get("swap", False) else 32  # swap: wgmma's 64-row operand
        while bn > floor and triton.cdiv(w.out_dim, bn) * experts * finest < target:
            bn //= 2
        if bn != tiles["block_n"]:
            tiles = {**tiles, "block_n": bn}
    return tiles


def _plan(w: Weights, cfg: DenseConfig) -> tuple[int, int]:
    """(SPLIT, k_chunk) of weight w: from its format and shape alone, never from the rows.

    Enough split-K programs that a decode GEMM of one row tile per expert reaches target_ctas
    (a grouped MXFP4 weight, the routed experts, assumes expert_tiles active experts; other
    grouped weights run block-diagonal, every group active), with chunks of >= min_k_chunk.
    """
    k_dim = w.in_dim
    tiles = _tiles(w, cfg)
    step = tiles["block_k"]
    blocks = triton.cdiv(w.out_dim, tiles["block_n"])
    experts = min(w.num_experts, cfg.expert_tiles) if w.fmt == W_MXFP4 else w.num_experts
    want = triton.cdiv(tiles.get("target_ctas", cfg.target_ctas), blocks * experts)
    split = max(1, min(want, k_dim // cfg.min_k_chunk))
    chunk = triton.cdiv(triton.cdiv(k_dim, split), step) * step
    return triton.cdiv(k_dim, chunk), chunk


@triton.jit
def _swiglu_kernel(
    gu_ptr, gamma_ptr, h_ptr, rows, inter, limit, HAS_GAMMA: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (r < rows)[:, None] & (i < inter)[None, :]
    base = r.to(tl.int64)[:, None] * (2 * inter) + i[None, :]
    out = swiglu_limited(
        tl.load(gu_ptr + base, mask=mask, other=0.0).to(tl.float32),
        tl.load(gu_ptr + base + inter, mask=mask, other=0.0).to(tl.float32),
        limit,
    )
    if HAS_GAMMA:
        out = tl.load(gamma_ptr + r, mask=r < rows, other=0.0)[:, None] * out
    tl.store(h_ptr + r.to(tl.int64)[:, None] * inter + i[None, :], round_bf16(out).to(tl.bfloat16), mask=mask)


def swiglu_halves(
    gu: torch.Tensor, gamma: torch.Tensor | None, limit: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """gu [P, 2I] BF16 (g | u) -> h [P, I] BF16 = bf16(gamma * silu(min(g, L)) * clamp(u, -L, L))
    (into `out` when given: contiguous BF16 [P, I]). One launch."""
    rows, inter = gu.shape[0], gu.shape[1] // 2
    if not gu.is_contiguous() or gu.dtype != torch.bfloat16:
        raise ValueError("swiglu_halves takes a contiguous BF16 [P, 2I] tensor")
    h = torch.empty(rows, inter, dtype=torch.bfloat16, device=gu.device) if out is None else out
    if h.shape != (rows, inter) or h.dtype != torch.bfloat16 or not h.is_contiguous():
        raise ValueError(f"swiglu_halves: out must be contiguous BF16 {(rows, inter)}")
    if rows:
        _swiglu_kernel[(triton.cdiv(rows, 32), triton.cdiv(inter, 128))](
            gu,
            gamma if gamma is not None else gu,
            h,
            rows,
            inter,
            float(limit),
            HAS_GAMMA=gamma is not None,
            BLOCK_R=32,
            BLOCK_I=128,
        )
    return h


def cublas_eligible(
    a: torch.Tensor, w: Weights, out: torch.Tensor, a_rows, w3, dot_scaled: bool, cfg: DenseConfig
) -> bool:
    """Prefill-sized FP8 GEMMs without a row gather: one weight (optionally with w3, SwiGLU),
    or G weights block-diagonal (row t * G + g against weight g), >= cublas_min_rows rows per
    weight."""
    groups = w.num_experts
    return (
        cfg.prefill == "cublas"
        and not triton_runtime.interpreting()
        and w.fmt == W_FP8
        and a_rows is None
        and not dot_scaled
        and (w3 is None or (groups == 1 and w3.fmt == W_FP8 and w3.num_experts == 1))
        and a.dtype == out.dtype == torch.bfloat16
        and out.shape[0] == a.shape[0]
        and out.shape[0] % groups == 0
        and out.shape[0] // groups >= cfg.cublas_min_rows
    )


def _cublas_gemm(
    a: torch.Tensor, w: Weights, out: torch.Tensor, w3: Weights | None, gamma: torch.Tensor | None, limit: float
) -> torch.Tensor:
    """`grouped_gemm` of a `cublas_eligible` call: the FP8 weights dequantised to BF16 (exact)
    once per call, cuBLAS BF16 GEMMs (FP32 accumulation, their own summation order).

    SwiGLU: g | u from one GEMM against [W1; W3], each rounded to BF16 (as ROUND_ACT_BF16), then
    gamma * silu(min(g, L)) * clamp(u, -L, L) in FP32, rounded once to out's dtype.
    Block-diagonal (G weights): one batched GEMM over the G strided row groups.
    """
    groups, n_dim = w.num_experts, w.out_dim
    if w3 is not None:
        wt = torch.empty(2 * n_dim, w.in_dim, dtype=torch.bfloat16, device=a.device)
        dequantize_fp8(w, wt[:n_dim])  # [W1; W3], each decoded in place
        dequantize_fp8(w3, wt[n_dim:])
        return swiglu_halves(torch.matmul(a, wt.T), gamma, limit, out)
    if groups == 1:
        torch.matmul(a, dequantize_fp8(w).T, out=out)
        return out
    rows = out.shape[0] // groups
    wt = torch.empty(groups, n_dim, w.in_dim, dtype=torch.bfloat16, device=a.device)
    for g in range(groups):  # [G, N, K], each group decoded in place
        dequantize_fp8(_one_weight(w, g), wt[g])
    y = torch.bmm(a.view(rows, groups, -1).transpose(0, 1), wt.transpose(1, 2))  # [G, T, N]
    out.view(rows, groups, n_dim).copy_(y.transpose(0, 1))
    return out


def _one_weight(w: Weights, g: int) -> Weights:
    return Weights(w.fmt, w.data[g : g + 1], None if w.scale is None else w.scale[g : g + 1])


@triton.jit
def _dequant_fp8_kernel(
    w_ptr, s_ptr, y_ptr, N, K, stride_sn, HW_FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (n[:, None] < N) & (k[None, :] < K)
    off = n[:, None].to(tl.int64) * K + k[None, :]
    q = tl.load(w_ptr + off, mask=mask, other=0)
    if HW_FP8:
        v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = e4m3_decode(q)
    s = tl.load(s_ptr + (n[:, None] // 32) * stride_sn + k[None, :] // 32, mask=mask, other=127)
    tl.store(y_ptr + off, (v * e8m0_decode(s)).to(tl.bfloat16), mask=mask)


def dequantize_fp8(w: Weights, out: torch.Tensor | None = None) -> torch.Tensor:
    """One FP8 32x32-tile weight [N, K] -> BF16 (exact), one launch (into `out` when given: a
    contiguous BF16 [N, K], e.g. a slice of a stacked buffer)."""
    if w.fmt != W_FP8 or w.num_experts != 1:
        raise ValueError("dequantize_fp8 takes one FP8 weight matrix")
    n_dim, k_dim = w.out_dim, w.in_dim
    y = torch.empty(n_dim, k_dim, dtype=torch.bfloat16, device=w.data.device) if out is None else out
    if y.shape != (n_dim, k_dim) or y.dtype != torch.bfloat16 or not y.is_contiguous():
        raise ValueError(f"dequantize_fp8: out must be contiguous BF16 {(n_dim, k_dim)}")
    _dequant_fp8_kernel[(triton.cdiv(n_dim, 32), triton.cdiv(k_dim, 128))](
        w.data[0], w.scale[0], y, n_dim, k_dim, w.scale.stride(1), HW_FP8=not DOT_UPCAST, BLOCK_N=32, BLOCK_K=128
    )
    return y


def _check_gemm(a: torch.Tensor, w: Weights, out: torch.Tensor, w3: Weights | None) -> None:
    if a.ndim != 2 or a.stride(1) != 1 or out.ndim != 2 or out.stride(1) != 1:
        raise ValueError("grouped_gemm needs row-major 2-D a and out")
    if a.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"activations must be bf16 or fp32, got {a.dtype}")
    if a.shape[1] != w.in_dim or out.shape[1] != w.out_dim:
        raise ValueError(f"shapes a {tuple(a.shape)}, W [{w.out_dim}, {w.in_dim}], out {tuple(out.shape)} do not chain")
    if w.fmt == W_PLAIN and w.data.dtype != a.dtype:
        raise TypeError(f"plain weights must match the activation dtype {a.dtype}")
    if w.fmt != W_PLAIN and a.dtype != torch.bfloat16:
        raise TypeError("quantised weights are dequantised to bf16; activations must be bf16")
    if w.fmt == W_MXFP4 and w.in_dim % 32:
        raise ValueError("MXFP4 weights need K % 32 == 0")
    if w3 is not None and (w3.fmt, w3.data.shape) != (w.fmt, w.data.shape):
        raise ValueError("SwiGLU W1 and W3 must share format and shape")
    triton_runtime.check_device(a, out, w.data)


def block_m_for(num_rows: int, cfg: DenseConfig) -> int:
    """Row tile for GEMMs of num_rows rows (per expert): 16, 32, then cfg.block_m_large."""
    return 16 if num_rows <= 16 else 32 if num_rows <= 32 else cfg.block_m_large


def linear_weights(
    x: torch.Tensor, w: Weights, out_dtype: torch.dtype, *, tuned: KernelConfigs = DEFAULT
) -> torch.Tensor:
    """x [T, K] . W^T for a single weight in any format -> [T, N] in out_dtype."""
    if w.num_experts != 1:
        raise ValueError("linear_weights takes one weight matrix")
    out = torch.empty(x.shape[0], w.out_dim, dtype=out_dtype, device=x.device)
    return grouped_gemm(x.contiguous(), w, None, out, cfg=tuned.dense)


def warmup(weights, rows=(1, 8, 64), dtype: torch.dtype = torch.bfloat16, *, tuned: KernelConfigs = DEFAULT) -> int:
    """Compile (and run once) the GEMM variants that `rows`-row calls of each weight take.

    weights: `Weights` of the model's layers (repeats are skipped: variants depend on format,
    shape and expert count only). One-expert weights run as `linear_weights`; grouped ones as
    `block_diagonal` (wo_a, `rows` tokens). Returns the number of calls made.
    """
    seen, calls = set(), 0
    device = kernel_device_of(weights)
    for w in weights:
        key = (w.fmt, w.num_experts, w.out_dim, w.in_dim, w.data.dtype)
        if key in seen:
            continue
        seen.add(key)
        act = dtype if w.fmt != W_PLAIN else w.data.dtype
        for r in rows:
            if w.num_experts == 1:
                linear_weights(torch.randn(r, w.in_dim, device=device).to(act), w, act, tuned=tuned)
            else:
                block_diagonal(torch.randn(r, w.num_experts, w.in_dim, device=device).to(act), w, act, tuned=tuned)
            calls += 1
    return calls


def kernel_device_of(weights) -> torch.device:
    """The device of the first weight in `weights` (the kernel device when there is none)."""
    for w in weights:
        return w.data.device
    return triton_runtime.kernel_device()


# ============================================================================ ref surface
def matmul_nt(a: torch.Tensor, b: torch.Tensor, *, tuned: KernelConfigs = DEFAULT) -> torch.Tensor:
    """a [M, K] @ b[N, K]^T -> [M, N] in FP32 (both operands in a's dtype)."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"matmul_nt shapes {tuple(a.shape)} x {tuple(b.shape)}^T")
    dtype = torch.float32 if torch.float32 in (a.dtype, b.dtype) else a.dtype
    return linear_weights(a.to(dtype), Weights.plain(b.to(dtype)), torch.float32, tuned=tuned)


def linear(x: torch.Tensor, weight: torch.Tensor, *, tuned: KernelConfigs = DEFAULT) -> torch.Tensor:
    """x [T, in] . weight[out, in]^T -> [T, out] in x.dtype, FP32 accumulation."""
    return linear_weights(x, Weights.plain(weight.to(x.dtype)), x.dtype, tuned=tuned)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, *, tuned: KernelConfigs = DEFAULT) -> torch.Tensor:
    """x . weight^T in FP32 (bf16 operands: exact products, FP32 sums)."""
    return matmul_nt(x, weight, tuned=tuned)


def linear_fp8(
    x: torch.Tensor, w_f8: torch.Tensor, scale_u8: torch.Tensor, *, tuned: KernelConfigs = DEFAULT
) -> torch.Tensor:
    """x [T, in] bf16 . dequant(W_fp8 [out, in], 32x32 UE8M0 tiles)^T -> [T, out] bf16."""
    return linear_weights(x, Weights.fp8(w_f8, scale_u8), x.dtype, tuned=tuned)


def linear_mxfp4(
    x: torch.Tensor, packed: torch.Tensor, scale_u8: torch.Tensor, *, tuned: KernelConfigs = DEFAULT
) -> torch.Tensor:
    """x [T, in] bf16 . dequant(MXFP4 [out, in/2], UE8M0 per 1x32)^T -> [T, out] bf16."""
    return linear_weights(x, Weights.mxfp4(packed, scale_u8), x.dtype, tuned=tuned)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, stride_x, stride_y, D, eps, HAS_W: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_D: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * (1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps))
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, round_bf16_if(y, OUT_BF16).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """[..., D] -> [..., D] in x.dtype: FP32 statistic and weight multiply, one rounding.
    Rows may be strided (a column slice of a wider output is read in place)."""
    triton_runtime.check_device(x)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            weight if weight is not None else x2,
            y,
            x2.stride(0),
            y.stride(0),
            x2.shape[1],
            float(eps),
            HAS_W=weight is not None,
            OUT_BF16=x.dtype == torch.bfloat16,
            BLOCK_D=triton.next_power_of_2(x2.shape[1]),
            **triton_runtime.launch_options(),
        )
    return y.reshape(x.shape)


def fp32(x: torch.Tensor) -> torch.Tensor:
    """x as FP32 (no copy when it already is)."""
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bf16(.) in BF16 mode; torch's cast is RNE on both CPU and GPU."""
    return x.to(dtype)


@triton.jit
def _act_kernel(x_ptr, y_ptr, n, threshold, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        y = sigmoid_f32(x)
    elif ACT == 1:
        y = x * sigmoid_f32(x)
    else:
        y = tl.where(x > threshold, x, log1p_f32(tl.exp(tl.minimum(x, threshold))))
    tl.store(y_ptr + offs, y, mask=mask)


def _activation(x: torch.Tensor, act: int, threshold: float = 20.0) -> torch.Tensor:
    triton_runtime.check_device(x)
    flat = x.reshape(-1).contiguous()
    y = torch.empty(flat.shape, dtype=torch.float32, device=x.device)
    if flat.numel():
        block = 1024
        _act_kernel[(triton.cdiv(flat.numel(), block),)](flat, y, flat.numel(), float(threshold), ACT=act, BLOCK=block)
    return y.reshape(x.shape)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _activation(x, 0)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _activation(x, 1)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    return _activation(x, 2, threshold)
