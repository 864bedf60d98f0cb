"""Sparse MQA attention in Triton (model_spec §3.4-§3.6): window ∪ selected compressed entries.

Same function names and signatures as `attention/ref.py` (window_keys, compressed_keys,
sparse_attention), plus the serving kernel `sparse_attention_packed`, one launch per layer:

    q [T, H, d] (pre-RoPE) --RoPE at the query position, rounded as rope.ref--> q'
    keys = FP8 window records (528 B)  rows window_rows[t, :W]   (-1 = empty slot)
         ∪ compressed records          rows comp_rows[t, :K]     (-1 = empty slot)
           NVFP4 (288 B) or, for comparison, FP8 (528 B)
    o = softmax-with-sink(q' . k * scale) . k      (K = V, scores FP32, online softmax)
    --round to q.dtype, inverse RoPE at the query position, round--> out [T, H, d]

Keys are dequantised in registers (exact in BF16) and shared by all the heads of a query
(MQA): the heads-as-M kernel (_heads_kernel) puts every head of a query in the MMA M dimension,
one program per query (plus split-KV ranges for small decode batches); single queries take the
per-head-block kernel (_attn_kernel, one program per (query, block of 32 heads), and its
split-KV path), which is also the gathered-keys `sparse_attention`. Decode batches and prefill
chunks use the same kernels, each query with its own row lists (a prefill chunk passes one row
list per query). The sink enters the running softmax as its initial max with weight
exp(0) = 1 in the denominator.

GPU numerics: P is rounded to BF16 before the P.V product (as FlashAttention does); under the
interpreter every product runs in FP32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.attention.ref import FMT_FP8, FMT_NVFP4
from flashpd.kernels.configs import DEFAULT, AttentionConfig, KernelConfigs
from flashpd.kernels.dense.triton import DOT_UPCAST, mma
from flashpd.kernels.e2m1 import e2m1_lohi_asm
from flashpd.kernels.quant import ref as qref
from flashpd.kernels.quant.triton import e2m1_to_e4m3, e4m3_decode, e8m0_decode, round_bf16

# compressed record formats (codes shared with attention/ref.py): FMT_FP8 E4M3 + UE8M0 per 32
# (the window's record, 528 B at d = 512), FMT_NVFP4 E2M1 + E4M3 per 16 (288 B at d = 512)
# Launch configuration; tuned on an H200 (benchmarks/attention_bench.py, bench/results/h200/attention.md).
# Packed attention (sparse_attention_packed) runs the heads-as-M kernel (_heads_kernel): all
# heads of a query in one program (heads_max per program, >= 16: tl.dot's minimum M), key tiles
# of heads_block_n (32: 7.87 ms per layer at 8,192 rows vs 8.11 / 8.29 ms at 64 and 8.13 at
# 128 on the H200, 96 vs 128 KB of shared memory, 624 vs 728 B of spills; stages 2-3 were
# slower), heads_warps warps, heads_stages pipeline stages, heads_prefetch (next tile's
# bytes loaded before the current one is used), heads_rescale_tau (accumulators rescaled only
# when a row max grows by more than this, log2 units; 0: whenever one grows. The lazy form
# (8, FlashAttention-4 style) was 1.3% faster per prefill layer on the H200 but moved the
# GPU-path forward 4x further from the reference on the smoke model: median row error 0.205
# vs 0.052 after a chunked prefill, bench/results/h200/investigations.md), heads_asm (PTX decode on the GPU).
# heads_trans_s (scores computed transposed, keys in the MMA M dimension: _attend_pairs_t).
# heads_vsplit: one-pass launches (prefill chunks) as two programs per query, each owning half
# of the output channels (_heads_vsplit_kernel; heads_vsplit_block_n keys per tile,
# heads_vsplit_warps warps).
# Batches that leave SMs idle (fewer than heads_split_target programs) cut each query's key tiles into
# ranges (split-KV, heads_split_block_n per tile, heads_split_stages) combined by _attn_combine_kernel;
# heads_split_target 0 turns that off. Batches of at most legacy_max_q queries take the
# previous per-head-block kernels instead (the "legacy" keys below; 0: never). With the default
# legacy_max_q = 1 they serve every one-query call (the B = 1 decode step): a production path
# despite the name, so it stays (issue 27 deleted only paths no default selects).
# Legacy: heads per program, keys per tile, warps, pipeline stages of _attn_kernel (also the
# gathered-keys `sparse_attention`); split-KV: up to split_target programs for batches of at
# most split_max_q queries, each range at least split_min_tiles key tiles, and only when that
# makes >= split_min_splits ranges; split_target 0 turns splitting off.
# fused_combine: the split-KV paths (both kernels) skip _attn_combine_kernel: the last program of
# each (query, head block) to finish its range (arrival counter) combines the partials itself,
# combine_heads heads at a time, in the combine kernel's order (bit-identical), so a decode call
# is one launch (FLASHPD_ATTN_FUSED_COMBINE=1 at engine load: on). Off: slower on the H200 (B = 1 / 8 /
# 64 calls 0.093 / 0.122 / 0.139 ms against 0.023 / 0.030 / 0.094, attn_fused_combine.json).
# (configs.AttentionConfig: KernelConfigs.attention, passed in as `cfg` / `tuned`)


HW_FP8 = not triton_runtime.interpreting()  # hardware E4M3 conversion on the GPU


# ============================================================================ device helpers
@triton.jit
def _rope_rows(x, cos_ptr, sin_ptr, D: tl.constexpr, ROPE_PAIRS: tl.constexpr, partner, inverse: tl.constexpr):
    """Rotate the last 2*ROPE_PAIRS channels of rows x [M, D]; partner[c] = x[c ^ 1]."""
    c = tl.arange(0, D)
    off: tl.constexpr = D - 2 * ROPE_PAIRS
    is_rope = c >= off
    pair = tl.where(is_rope, (c - off) // 2, 0)
    cos = tl.load(cos_ptr + pair, mask=is_rope, other=1.0)
    sin = tl.load(sin_ptr + pair, mask=is_rope, other=0.0)
    if inverse:
        sin = -sin
    signed_sin = tl.where((c & 1) == 0, -sin, sin)  # a' = a cos - b sin, b' = b cos + a sin
    rotated = round_bf16(x * cos[None, :] + partner * signed_sin[None, :])
    return tl.where(is_rope[None, :], rotated, x)


@triton.jit
def _load_q(q_ptr, cos_ptr, sin_ptr, stride_cs, t, heads, hmask, H, D: tl.constexpr, ROPE_PAIRS: tl.constexpr):
    """The [HB, D] query rows of heads `heads` (masked by hmask) of query t, RoPE applied in
    FP32 (ROPE_PAIRS > 0), in q's dtype: the prologue of the split-KV attention kernels."""
    c = tl.arange(0, D)
    q_rows = q_ptr + (t * H + heads[:, None]) * D
    q = tl.load(q_rows + c[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    if ROPE_PAIRS > 0:
        partner = tl.load(q_rows + (c ^ 1)[None, :], mask=hmask[:, None], other=0.0)
        q = _rope_rows(
            q, cos_ptr + t * stride_cs, sin_ptr + t * stride_cs, D, ROPE_PAIRS, partner.to(tl.float32), False
        )
    return q.to(q_ptr.dtype.element_ty)


@triton.jit
def _fp8_values(b, HW: tl.constexpr):
    """E4M3FN bytes -> FP32: the conversion hardware on the GPU, bit arithmetic otherwise."""
    if HW:
        return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return e4m3_decode(b.to(tl.uint8))


@triton.jit
def _record_tile(pool_ptr, stride_p, rows, valid, D: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr):
    """Records at pool rows [BN] -> values [BN, D] in BF16 (exact).

    NVFP4 nibbles are selected per channel from the byte loaded for each channel (c // 2),
    not with tl.interleave: Triton 3.6 mis-lowers a join on the N axis of a dot operand with a
    small K (triton-lang/triton PR #10645), which the P.V product here would be.
    """
    base = pool_ptr + rows[:, None].to(tl.int64) * stride_p
    c = tl.arange(0, D)[None, :]
    m = valid[:, None]
    if FMT == 0:
        val = _fp8_values(tl.load(base + c, mask=m, other=0), HW)
        scale = e8m0_decode(tl.load(base + D + c // 32, mask=m, other=127))
    else:
        byte = tl.load(base + c // 2, mask=m, other=0).to(tl.int32)
        code = (byte >> ((c & 1) * 4)) & 0xF
        val = _fp8_values(e2m1_to_e4m3(code), HW)
        scale = _fp8_values(tl.load(base + D // 2 + c // 16, mask=m, other=0x38), HW)
    return (val * scale).to(tl.bfloat16)


@triton.jit
def _attend(q, keys, valid, m_i, l_i, acc, scale, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of the online softmax; keys [BN, D] are both K and V."""
    s = mma(q, tl.trans(keys), tl.zeros((q.shape[0], keys.shape[0]), tl.float32), IEEE, UPCAST)
    s = tl.where(valid[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = mma(p.to(keys.dtype), keys, acc * alpha[:, None], IEEE, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _store_rows(
    o,
    out_ptr,
    cos_ptr,
    sin_ptr,
    stride_cs,
    t,
    H,
    heads,
    c,
    hmask,
    D: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """Store one query's normalised output rows [HB, D], then undo RoPE on the rope channels
    (partner channels read back from memory, so the inverse rotation uses the rounded values)."""
    if OUT_BF16:
        o = round_bf16(o)
    o_rows = out_ptr + (t * H + heads[:, None]) * D
    tl.store(o_rows + c[None, :], o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    if ROPE_PAIRS > 0:
        tl.debug_barrier()
        partner = tl.load(o_rows + (c ^ 1)[None, :], mask=hmask[:, None], other=0.0)
        o = _rope_rows(o, cos_ptr + t * stride_cs, sin_ptr + t * stride_cs, D, ROPE_PAIRS, partner.to(tl.float32), True)
        tl.debug_barrier()
        tl.store(
            o_rows + c[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=hmask[:, None] & (c[None, :] >= D - 2 * ROPE_PAIRS),
        )


@triton.jit
def _attn_kernel(
    q_ptr,
    out_ptr,
    sink_ptr,
    cos_ptr,
    sin_ptr,
    stride_cs,
    kv_ptr,
    valid_ptr,
    N,  # SRC 0: gathered keys [T, N, D] + valid [T, N]
    win_ptr,
    stride_win,
    win_rows_ptr,
    W,
    comp_ptr,
    stride_comp,
    comp_rows_ptr,
    KC,  # SRC 1
    H,
    scale,
    D: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    SRC: tl.constexpr,
    COMP_FMT: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OUT_BF16: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    HW: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    hmask = heads < H
    q = _load_q(q_ptr, cos_ptr, sin_ptr, stride_cs, t, heads, hmask, H, D, ROPE_PAIRS)
    c = tl.arange(0, D)
    m_i = tl.load(sink_ptr + heads, mask=hmask, other=0.0)  # the sink: running max ...
    l_i = tl.full((HB,), 1.0, tl.float32)  # ... with exp(sink - sink) = 1 in the denominator
    acc = tl.zeros((HB, D), dtype=tl.float32)
    if SRC == 0:
        for n0 in range(0, N, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = tl.load(valid_ptr + t * N + n, mask=n < N, other=0) != 0
            keys = tl.load(kv_ptr + (t * N + n[:, None]) * D + c[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
            m_i, l_i, acc = _attend(q, keys, valid, m_i, l_i, acc, scale, IEEE, UPCAST)
    else:
        for n0 in range(0, W, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            rows = tl.load(win_rows_ptr + t * W + n, mask=n < W, other=-1)
            keys = _record_tile(win_ptr, stride_win, rows, rows >= 0, D, 0, HW)
            m_i, l_i, acc = _attend(q, keys, rows >= 0, m_i, l_i, acc, scale, IEEE, UPCAST)
        for n0 in range(0, KC, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            rows = tl.load(comp_rows_ptr + t * KC + n, mask=n < KC, other=-1)
            keys = _record_tile(comp_ptr, stride_comp, rows, rows >= 0, D, COMP_FMT, HW)
            m_i, l_i, acc = _attend(q, keys, rows >= 0, m_i, l_i, acc, scale, IEEE, UPCAST)
    _store_rows(
        acc / l_i[:, None], out_ptr, cos_ptr, sin_ptr, stride_cs, t, H, heads, c, hmask, D, ROPE_PAIRS, OUT_BF16
    )


# ============================================================================ heads-as-M kernel
# All heads of one query in the MMA M dimension (HB = 64 at the bench shape): each key tile is
# loaded and dequantised once per query, not once per head block, and the tiles are wgmma-sized
# (M = 64 heads, N = BLOCK_N keys, K = D/2 channels per product). The channels are split into
# their even and odd halves (channel 2i / 2i+1 of a record are the low / high nibble of one NVFP4
# byte, or the two bytes of one 16-bit word of an FP8 record): the products run on the two halves
# (S = Q_e.K_e^T + Q_o.K_o^T; O_e += P.K_e, O_o += P.K_o), so no interleave is needed and the
# RoPE pairs (2i, 2i+1) are element i of the two halves.
#
#   grid (T, H/HB, splits): one split normalises and stores (single pass, the sink as the
#   initial max with weight 1); PARTIAL (splits > 1) writes (m, l, acc) partials for
#   _attn_combine_kernel (split-KV decode, each range started at the sink with weight 0). The
#   split count is a run-time value: decode batch sizes share one compiled variant.
#
# The rotated queries are staged through the output rows (rewritten at the end) so that the
# Q operands come from a load: Triton then feeds wgmma from shared memory instead of holding
# Q in registers beside the [HB, D] FP32 accumulators. PREFETCH loads the raw bytes of the next
# key tile before the current one is used (a register prefetch); on the H200 it measured
# slower (more spills), so it is off by default.
#
# ASM (GPU): the records are decoded by PTX blocks that place each code's bits in a BF16's
# fields and rescale with one bf16x2 multiply; those keys are K * 2^-63 exactly,
# which the score scale and the final normalisation undo (powers of two: exact). Otherwise
# (interpreter) the keys are decoded with the FP32 helpers, unscaled.
@triton.jit
def _fp8_pairs_asm(w, s_bf16):
    """16-bit words (E4M3 channel 2i low byte, 2i+1 high byte) * s_bf16 -> (even, odd) BF16.

    Each byte's 7 magnitude bits go to BF16 bits 10..4 and its sign to bit 15 (value * 2^-120,
    subnormals included); s_bf16 = 2^57 * scale makes it value * scale * 2^-63."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t<2>, u<4>, z;
        mov.b32 z, 0;
        prmt.b32 t0, $2, z, 0x4240;
        prmt.b32 t1, $2, z, 0x4341;
        shl.b32 u0, t0, 4;
        shl.b32 u1, t0, 8;
        shl.b32 u2, t1, 4;
        shl.b32 u3, t1, 8;
        and.b32 u1, u1, 0x80008000;
        and.b32 u3, u3, 0x80008000;
        lop3.b32 t0, u0, 0x07F007F0, u1, 0xEA;
        lop3.b32 t1, u2, 0x07F007F0, u3, 0xEA;
        mul.rn.bf16x2 $0, t0, $3;
        mul.rn.bf16x2 $1, t1, $3;
        }""",
        "=r,=r,r,r",
        [w, s_bf16],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _raw_tile(pool_ptr, pool16_ptr, stride_p, rows, first, NPAIRS: tl.constexpr, HALF: tl.constexpr, FMT: tl.constexpr):
    """Raw bytes of channel pairs first..first+NPAIRS-1 (first: a multiple of 16) of the records
    at pool rows [BN] (-1: none) as [BN, scale blocks, pairs per block] codes and
    [BN, scale blocks, 1] scale bytes (each scale byte loaded once); HALF = D / 2."""
    G: tl.constexpr = 16 if FMT == 0 else 8  # channel pairs per scale (32 or 16 channels)
    NB: tl.constexpr = NPAIRS // G
    r = rows[:, None, None].to(tl.int64) * stride_p
    j = first // G + tl.arange(0, NB)[None, :, None]
    i = j * G + tl.arange(0, G)[None, None, :]
    m = rows[:, None, None] >= 0
    if FMT == 0:  # FP8: channel pair i is the 16-bit word i; UE8M0 scale per 32 channels
        code = tl.load(pool16_ptr + r // 2 + i, mask=m, other=0)
        sc = tl.load(pool_ptr + r + 2 * HALF + j, mask=m, other=127)
    else:  # NVFP4: channel pair i is byte i (low nibble first); E4M3 scale per 16 channels
        code = tl.load(pool_ptr + r + i, mask=m, other=0)
        sc = tl.load(pool_ptr + r + HALF + j, mask=m, other=0x38)
    return code, sc


@triton.jit
def _decode_tile(code, sc, FMT: tl.constexpr, ASM: tl.constexpr, HW: tl.constexpr):
    """Raw tile -> (even, odd channels) [BN, D/2] each in BF16: exact K, or K * 2^-63 (ASM)."""
    BN: tl.constexpr = code.shape[0]
    HALF: tl.constexpr = code.shape[1] * code.shape[2]
    if ASM:
        if FMT == 0:  # 2^(byte - 70) = 2^57 * UE8M0 scale (exact, normal for bytes <= 197)
            s = tl.broadcast_to(((sc.to(tl.int32) + 57) << 23).to(tl.float32, bitcast=True).to(tl.bfloat16), code.shape)
            lo, hi = _fp8_pairs_asm(code, s)
        else:
            s = tl.broadcast_to(
                (_fp8_values(sc, HW) * 9.223372036854775808e18).to(tl.bfloat16), code.shape
            )  # 2^63 * E4M3 scale
            lo, hi = e2m1_lohi_asm(code, s)
    else:
        if FMT == 0:
            word = code.to(tl.int32)
            s = e8m0_decode(sc)
            lo = (_fp8_values(word & 0xFF, HW) * s).to(tl.bfloat16)
            hi = (_fp8_values((word >> 8) & 0xFF, HW) * s).to(tl.bfloat16)
        else:
            byte = code.to(tl.int32)
            s = _fp8_values(sc, HW)
            lo = (_fp8_values(e2m1_to_e4m3(byte & 0xF), HW) * s).to(tl.bfloat16)
            hi = (_fp8_values(e2m1_to_e4m3((byte >> 4) & 0xF), HW) * s).to(tl.bfloat16)
    return tl.reshape(lo, (BN, HALF)), tl.reshape(hi, (BN, HALF))


@triton.jit
def _attend_pairs_t(q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, scale, UPCAST: tl.constexpr):
    """_attend_pairs (exact rescale, TAU = 0) with the scores transposed: S^T = K.Q^T puts
    the keys in the MMA M dimension (BLOCK_N = 128 fills both warpgroups of 8 warps, so
    neither computes the other's scores); the softmax reduces over axis 0 and P = (P^T)^T
    feeds the P.V product from shared memory."""
    st = mma(k_e, tl.trans(q_e), tl.zeros((k_e.shape[0], q_e.shape[0]), tl.float32), False, UPCAST)
    st = mma(k_o, tl.trans(q_o), st, False, UPCAST)
    st = tl.where(valid[:, None], st * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, axis=0))
    alpha = tl.exp2(m_i - m_new)
    pt = tl.exp2(st - m_new[None, :])
    l_i = l_i * alpha + tl.sum(pt, axis=0)
    p = tl.trans(pt.to(k_e.dtype))
    acc_e = mma(p, k_e, acc_e * alpha[:, None], False, UPCAST)
    acc_o = mma(p, k_o, acc_o * alpha[:, None], False, UPCAST)
    return m_new, l_i, acc_e, acc_o


@triton.jit
def _attend_pairs(
    q_e,
    q_o,
    k_e,
    k_o,
    valid,
    m_i,
    l_i,
    acc_e,
    acc_o,
    scale,
    TAU: tl.constexpr,
    UPCAST: tl.constexpr,
    TRANS: tl.constexpr,
):
    """One key tile of the online softmax over the channel halves; keys are K and V.

    Scores and the running max m are in log2 units (scale includes log2 e). The accumulators
    are rescaled only when some row's max grows by more than TAU (FlashAttention-4's lazy
    rescaling; TAU = 0: whenever one grows): until then P = 2^(s - m) with a stale m <= the
    true max is at most 2^TAU, and l, acc stay consistent with that m, so o = acc / l is the
    same softmax. TRANS: _attend_pairs_t (exact rescale)."""
    if TRANS:
        return _attend_pairs_t(q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, scale, UPCAST)
    s = mma(q_e, tl.trans(k_e), tl.zeros((q_e.shape[0], k_e.shape[0]), tl.float32), False, UPCAST)
    s = mma(q_o, tl.trans(k_o), s, False, UPCAST)
    s = tl.where(valid[None, :], s * scale, float("-inf"))
    return _softmax_step(s, m_i, l_i, acc_e, acc_o, k_e, k_o, TAU, UPCAST)


@triton.jit
def _softmax_step(s, m_i, l_i, acc_e, acc_o, v_e, v_o, TAU: tl.constexpr, UPCAST: tl.constexpr):
    """Fold one tile's scores s [BM, BN] (log2 units, masked to -inf) into the running max m,
    sum l and the accumulators over the value halves (v_e | v_o); rescaled when some row's max
    grows by more than TAU (see _attend_pairs)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if tl.max(m_new - m_i, axis=0) > TAU:
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc_e = acc_e * alpha[:, None]
        acc_o = acc_o * alpha[:, None]
        m_i = m_new
    p = tl.exp2(s - m_i[:, None])
    l_i = l_i + tl.sum(p, axis=1)
    p = p.to(v_e.dtype)
    acc_e = mma(p, v_e, acc_e, False, UPCAST)
    acc_o = mma(p, v_o, acc_o, False, UPCAST)
    return m_i, l_i, acc_e, acc_o


@triton.jit
def _stage_rope_q(
    q_ptr,
    stage_ptr,
    cos_ptr,
    sin_ptr,
    stride_cs,
    t,
    rows_in,
    hh,
    i,
    hmask,
    D: tl.constexpr,
    HALF: tl.constexpr,
    HB: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
):
    """q rows loaded whole (coalesced), split into the channel halves, RoPE at the query
    position (rounded as rope.ref), stored to the stage rows as [even half | odd half];
    returns the stage pointers [HB, HALF] of the even half (the odd half is + HALF)."""
    q = tl.load(q_ptr + rows_in * D + (hh * D)[:, None] + tl.arange(0, D)[None, :], mask=hmask, other=0.0).to(
        tl.float32
    )
    a, b = tl.split(tl.reshape(q, (HB, HALF, 2)))
    cos, sin = _rope_tables(cos_ptr + t * stride_cs, sin_ptr + t * stride_cs, HALF, ROPE_PAIRS)
    stage = stage_ptr + rows_in * D + (hh * D)[:, None] + i[None, :]
    tl.store(stage, round_bf16(a * cos + b * -sin).to(stage_ptr.dtype.element_ty), mask=hmask)
    tl.store(stage + HALF, round_bf16(b * cos + a * sin).to(stage_ptr.dtype.element_ty), mask=hmask)
    tl.debug_barrier()
    return stage


@triton.jit
def _heads_range(
    q_e,
    q_o,
    m_i,
    l_i,
    acc_e,
    acc_o,
    pool_ptr,
    pool16_ptr,
    stride_p,
    rows_ptr,
    NK,
    lo,
    hi,
    scale,
    HALF: tl.constexpr,
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr,
    TAU: tl.constexpr,
    ASM: tl.constexpr,
    HW: tl.constexpr,
    UPCAST: tl.constexpr,
    TRANS: tl.constexpr,
):
    """Key tiles lo..hi-1 of one row list (rows_ptr [NK]); PREFETCH: the next tile's bytes are
    loaded before the current tile is used."""
    if PREFETCH:
        n = lo * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.load(rows_ptr + n, mask=(n < NK) & (lo < hi), other=-1)
        code, sc = _raw_tile(pool_ptr, pool16_ptr, stride_p, rows, 0, HALF, HALF, FMT)
        for it in range(lo, hi):
            k_e, k_o = _decode_tile(code, sc, FMT, ASM, HW)
            valid = rows >= 0
            n = (it + 1) * BLOCK_N + tl.arange(0, BLOCK_N)
            rows = tl.load(rows_ptr + n, mask=(n < NK) & (it + 1 < hi), other=-1)
            code, sc = _raw_tile(pool_ptr, pool16_ptr, stride_p, rows, 0, HALF, HALF, FMT)
            m_i, l_i, acc_e, acc_o = _attend_pairs(
                q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, scale, TAU, UPCAST, TRANS
            )
    else:
        for it in range(lo, hi):
            n = it * BLOCK_N + tl.arange(0, BLOCK_N)
            rows = tl.load(rows_ptr + n, mask=n < NK, other=-1)
            code, sc = _raw_tile(pool_ptr, pool16_ptr, stride_p, rows, 0, HALF, HALF, FMT)
            k_e, k_o = _decode_tile(code, sc, FMT, ASM, HW)
            m_i, l_i, acc_e, acc_o = _attend_pairs(
                q_e, q_o, k_e, k_o, rows >= 0, m_i, l_i, acc_e, acc_o, scale, TAU, UPCAST, TRANS
            )
    return m_i, l_i, acc_e, acc_o


@triton.jit
def _rope_tables(cos_ptr, sin_ptr, HALF: tl.constexpr, ROPE_PAIRS: tl.constexpr):
    """cos, sin [1, D/2] of one query: 1 and 0 outside the rope pairs, where the rotation
    a * 1 + b * 0 then returns the (already BF16) a unchanged, so no mask is needed."""
    i = tl.arange(0, HALF)
    is_rope = i >= HALF - ROPE_PAIRS
    pair = tl.where(is_rope, i - (HALF - ROPE_PAIRS), 0)
    cos = tl.load(cos_ptr + pair, mask=is_rope, other=1.0)[None, :]
    sin = tl.load(sin_ptr + pair, mask=is_rope, other=0.0)[None, :]
    return cos, sin


@triton.jit
def _heads_kernel(
    q_ptr,
    out_ptr,
    sink_ptr,
    cos_ptr,
    sin_ptr,
    stride_cs,
    win_ptr,
    win16_ptr,
    stride_win,
    win_rows_ptr,
    W,
    comp_ptr,
    comp16_ptr,
    stride_comp,
    comp_rows_ptr,
    KC,
    m_ptr,
    l_ptr,
    acc_ptr,
    H,
    scale,
    tiles_per_split,
    count_ptr,
    D: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    COMP_FMT: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTIAL: tl.constexpr,
    PREFETCH: tl.constexpr,
    TAU: tl.constexpr,
    ASM: tl.constexpr,
    UPCAST: tl.constexpr,
    HW: tl.constexpr,
    TRANS: tl.constexpr,
    FUSED: tl.constexpr = False,
    CH: tl.constexpr = 16,
    OUT_BF16: tl.constexpr = True,
):
    # The prologue and the epilogue compute their addresses and RoPE tables separately (and
    # spelled differently, so the compiler does not merge them): kept alive across the key
    # loop, the [HB, D/2] pointer and table tensors would spill the accumulators.
    HALF: tl.constexpr = D // 2
    UNSHIFT: tl.constexpr = 2.0**63 if ASM else 1.0  # keys as decoded = K / UNSHIFT
    t = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * HB
    sp = tl.program_id(2)
    hh = tl.arange(0, HB)
    i = tl.arange(0, HALF)
    rows_in = t * H + h0  # first (query, head) row of this program
    hmask = (hh + h0)[:, None] < H
    # Q staged through the output rows as [even half | odd half] (RoPE applied), so that the two
    # Q operands are plain contiguous loads (shared-memory wgmma operands)
    stage = _stage_rope_q(
        q_ptr, out_ptr, cos_ptr, sin_ptr, stride_cs, t, rows_in, hh, i, hmask, D, HALF, HB, ROPE_PAIRS
    )
    q_e = tl.load(stage, mask=hmask, other=0.0)
    q_o = tl.load(stage + HALF, mask=hmask, other=0.0)
    LOG2E: tl.constexpr = 1.4426950408889634
    # the sink (log2 units): running max with weight 2^0 = 1, or 0 in a split range
    m_i = tl.load(sink_ptr + h0 + hh, mask=h0 + hh < H, other=0.0) * LOG2E
    l_i = tl.full((HB,), 0.0 if PARTIAL else 1.0, tl.float32)
    acc_e = tl.zeros((HB, HALF), dtype=tl.float32)
    acc_o = tl.zeros((HB, HALF), dtype=tl.float32)
    win_tiles = tl.cdiv(W, BLOCK_N)
    comp_tiles = tl.cdiv(KC, BLOCK_N)
    lo = sp * tiles_per_split
    hi = lo + tiles_per_split
    k_scale = scale * UNSHIFT * LOG2E
    m_i, l_i, acc_e, acc_o = _heads_range(
        q_e,
        q_o,
        m_i,
        l_i,
        acc_e,
        acc_o,
        win_ptr,
        win16_ptr,
        stride_win,
        win_rows_ptr + t * W,
        W,
        tl.minimum(lo, win_tiles),
        tl.minimum(hi, win_tiles),
        k_scale,
        HALF,
        0,
        BLOCK_N,
        PREFETCH,
        TAU,
        ASM,
        HW,
        UPCAST,
        TRANS,
    )
    m_i, l_i, acc_e, acc_o = _heads_range(
        q_e,
        q_o,
        m_i,
        l_i,
        acc_e,
        acc_o,
        comp_ptr,
        comp16_ptr,
        stride_comp,
        comp_rows_ptr + t * KC,
        KC,
        tl.maximum(lo, win_tiles) - win_tiles,
        tl.minimum(hi, win_tiles + comp_tiles) - win_tiles,
        k_scale,
        HALF,
        COMP_FMT,
        BLOCK_N,
        PREFETCH,
        TAU,
        ASM,
        HW,
        UPCAST,
        TRANS,
    )
    # epilogue: addresses again (see above); rows stored whole, channels interleaved again
    off2 = hh[:, None] * D + tl.arange(0, D)[None, :]
    hmask2 = hh[:, None] < H - h0
    if not PARTIAL:
        a = round_bf16(acc_e * UNSHIFT / l_i[:, None])
        b = round_bf16(acc_o * UNSHIFT / l_i[:, None])
        cos2, sin2 = _rope_tables(
            cos_ptr + stride_cs * t, sin_ptr + stride_cs * t, HALF, ROPE_PAIRS
        )  # inverse RoPE on the rounded output
        o = tl.reshape(tl.join(round_bf16(a * cos2 + b * sin2), round_bf16(b * cos2 + a * -sin2)), (HB, D))
        tl.store(out_ptr + D * rows_in + off2, o.to(out_ptr.dtype.element_ty), mask=hmask2)
    else:
        cell = (t * tl.num_programs(2) + sp) * H + h0  # first partial row here
        tl.store(m_ptr + cell + hh, m_i / LOG2E, mask=hh < H - h0)  # natural units
        tl.store(l_ptr + cell + hh, l_i, mask=hh < H - h0)
        o = tl.reshape(tl.join(acc_e * UNSHIFT, acc_o * UNSHIFT), (HB, D))
        tl.store(acc_ptr + D * cell + off2, o, mask=hmask2)
        if FUSED:  # the last range of (t, head block) in combines (fused_combine); the other
            # programs staged and loaded their Q from the output rows before they arrived
            _combine_if_last(
                out_ptr,
                sink_ptr,
                cos_ptr,
                sin_ptr,
                stride_cs,
                m_ptr,
                l_ptr,
                acc_ptr,
                count_ptr,
                t,
                H,
                h0,
                tl.num_programs(2),
                D,
                ROPE_PAIRS,
                HB,
                CH,
                OUT_BF16,
            )


# ---------------------------------------------------------------------------- V split
# VSPLIT (prefill, one pass): two programs per (query, head block), each owning half of the
# output channels, as channel-pair ranges (pairs own*D/4 .. own*D/4 + D/4 - 1, even and odd
# channels of each: the RoPE pairs of an output row stay in one program). Each program still
# scores all channels (S = the sum over both ranges' even / odd halves), so the key tile is
# decoded by both, but the accumulators are [HB, D/4] x 2: with 4 warps and 32-key tiles, two
# programs fit on an SM beside each other (registers and ~96 KB of shared memory each) and
# overlap their loads, decode and MMAs, where the one-program form (8 warps, [HB, D/2] x 2
# accumulators, 128 KB) runs alone. The rotated queries are staged in a scratch copy (stage_ptr,
# [T, H, D]) instead of the output rows, which the other program of the query may already be
# writing.
@triton.jit
def _vsplit_range(
    q_ea,
    q_oa,
    q_eb,
    q_ob,
    m_i,
    l_i,
    acc_e,
    acc_o,
    pool_ptr,
    pool16_ptr,
    stride_p,
    rows_ptr,
    NK,
    own,
    scale,
    HALF: tl.constexpr,
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ASM: tl.constexpr,
    HW: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """All key tiles of one row list (rows_ptr [NK]) for the program owning pair range `own`
    (a: its range, b: the other); exact online softmax (rescaled whenever a row max grows)."""
    QP: tl.constexpr = HALF // 2
    for it in range(0, tl.cdiv(NK, BLOCK_N)):
        n = it * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.load(rows_ptr + n, mask=n < NK, other=-1)
        code, sc = _raw_tile(pool_ptr, pool16_ptr, stride_p, rows, own * QP, QP, HALF, FMT)
        k_ea, k_oa = _decode_tile(code, sc, FMT, ASM, HW)
        code, sc = _raw_tile(pool_ptr, pool16_ptr, stride_p, rows, (1 - own) * QP, QP, HALF, FMT)
        k_eb, k_ob = _decode_tile(code, sc, FMT, ASM, HW)
        s = mma(q_ea, tl.trans(k_ea), tl.zeros((q_ea.shape[0], BLOCK_N), tl.float32), False, UPCAST)
        s = mma(q_oa, tl.trans(k_oa), s, False, UPCAST)
        s = mma(q_eb, tl.trans(k_eb), s, False, UPCAST)
        s = mma(q_ob, tl.trans(k_ob), s, False, UPCAST)
        s = tl.where((rows >= 0)[None, :], s * scale, float("-inf"))
        m_i, l_i, acc_e, acc_o = _softmax_step(
            s, m_i, l_i, acc_e, acc_o, k_ea, k_oa, 0.0, UPCAST
        )  # exact rescale (TAU = 0)
    return m_i, l_i, acc_e, acc_o


@triton.jit
def _heads_vsplit_kernel(
    q_ptr,
    out_ptr,
    stage_ptr,
    sink_ptr,
    cos_ptr,
    sin_ptr,
    stride_cs,
    win_ptr,
    win16_ptr,
    stride_win,
    win_rows_ptr,
    W,
    comp_ptr,
    comp16_ptr,
    stride_comp,
    comp_rows_ptr,
    KC,
    H,
    scale,
    D: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    COMP_FMT: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ASM: tl.constexpr,
    UPCAST: tl.constexpr,
    HW: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    QP: tl.constexpr = D // 4  # channel pairs per program
    UNSHIFT: tl.constexpr = 2.0**63 if ASM else 1.0
    LOG2E: tl.constexpr = 1.4426950408889634
    t = (tl.program_id(0) // 2).to(tl.int64)
    own = tl.program_id(0) % 2
    h0 = tl.program_id(1) * HB
    hh = tl.arange(0, HB)
    i = tl.arange(0, HALF)
    rows_in = t * H + h0
    hmask = (hh + h0)[:, None] < H
    # prologue as in _heads_kernel (both programs of a query stage the same values)
    _stage_rope_q(q_ptr, stage_ptr, cos_ptr, sin_ptr, stride_cs, t, rows_in, hh, i, hmask, D, HALF, HB, ROPE_PAIRS)
    j = tl.arange(0, QP)[None, :]
    qrow = stage_ptr + rows_in * D + (hh * D)[:, None]
    q_ea = tl.load(qrow + own * QP + j, mask=hmask, other=0.0)
    q_oa = tl.load(qrow + HALF + own * QP + j, mask=hmask, other=0.0)
    q_eb = tl.load(qrow + (1 - own) * QP + j, mask=hmask, other=0.0)
    q_ob = tl.load(qrow + HALF + (1 - own) * QP + j, mask=hmask, other=0.0)
    m_i = tl.load(sink_ptr + h0 + hh, mask=h0 + hh < H, other=0.0) * LOG2E
    l_i = tl.full((HB,), 1.0, tl.float32)
    acc_e = tl.zeros((HB, QP), dtype=tl.float32)
    acc_o = tl.zeros((HB, QP), dtype=tl.float32)
    k_scale = scale * UNSHIFT * LOG2E
    m_i, l_i, acc_e, acc_o = _vsplit_range(
        q_ea,
        q_oa,
        q_eb,
        q_ob,
        m_i,
        l_i,
        acc_e,
        acc_o,
        win_ptr,
        win16_ptr,
        stride_win,
        win_rows_ptr + t * W,
        W,
        own,
        k_scale,
        HALF,
        0,
        BLOCK_N,
        ASM,
        HW,
        UPCAST,
    )
    m_i, l_i, acc_e, acc_o = _vsplit_range(
        q_ea,
        q_oa,
        q_eb,
        q_ob,
        m_i,
        l_i,
        acc_e,
        acc_o,
        comp_ptr,
        comp16_ptr,
        stride_comp,
        comp_rows_ptr + t * KC,
        KC,
        own,
        k_scale,
        HALF,
        COMP_FMT,
        BLOCK_N,
        ASM,
        HW,
        UPCAST,
    )
    # epilogue: this program's pairs, normalised, rounded, inverse RoPE, stored interleaved
    a = round_bf16(acc_e * UNSHIFT / l_i[:, None])
    b = round_bf16(acc_o * UNSHIFT / l_i[:, None])
    pair = own * QP + tl.arange(0, QP)
    is_rope = pair >= HALF - ROPE_PAIRS
    rp = tl.where(is_rope, pair - (HALF - ROPE_PAIRS), 0)
    cos2 = tl.load(cos_ptr + stride_cs * t + rp, mask=is_rope, other=1.0)[None, :]
    sin2 = tl.load(sin_ptr + stride_cs * t + rp, mask=is_rope, other=0.0)[None, :]
    o = tl.reshape(tl.join(round_bf16(a * cos2 + b * sin2), round_bf16(b * cos2 + a * -sin2)), (HB, HALF))
    off = hh[:, None] * D + own * HALF + tl.arange(0, HALF)[None, :]
    tl.store(out_ptr + D * rows_in + off, o.to(out_ptr.dtype.element_ty), mask=hh[:, None] < H - h0)


# The heads kernels' JIT functions, for tools that compile or inspect them
# (bench/results/h200/attention.md, benchmarks/attention_bench.py).
HEADS_KERNEL = _heads_kernel
HEADS_VSPLIT_KERNEL = _heads_vsplit_kernel


# ============================================================================ split-KV decode
# Decode batches are a few queries: one program per (query, head block) leaves most SMs idle.
# The key tiles of a query (window tiles, then compressed tiles) are cut into SPLITS ranges;
#
#   _attn_split_kernel   grid (T, H/HB, SPLITS): online softmax over its range, started at the
#                        sink logit with weight 0 -> (m, l, acc) partials [T, SPLITS, H(, D)]
#   _attn_combine_kernel grid (T, H/HB): m = max_s m_s; l = exp(sink - m) + sum_s l_s e^(m_s-m);
#                        o = sum_s acc_s e^(m_s - m) / l -> round, inverse RoPE, store
#
# Starting every range at the sink (finite) keeps empty ranges NaN-free (their l and acc stay 0).
@triton.jit
def _attn_split_kernel(
    q_ptr,
    sink_ptr,
    cos_ptr,
    sin_ptr,
    stride_cs,
    win_ptr,
    stride_win,
    win_rows_ptr,
    W,
    comp_ptr,
    stride_comp,
    comp_rows_ptr,
    KC,
    m_ptr,
    l_ptr,
    acc_ptr,
    H,
    scale,
    tiles_per_split,
    out_ptr,
    count_ptr,
    D: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    COMP_FMT: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    HW: tl.constexpr,
    FUSED: tl.constexpr,
    CH: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    sp = tl.program_id(2)
    hmask = heads < H
    q = _load_q(q_ptr, cos_ptr, sin_ptr, stride_cs, t, heads, hmask, H, D, ROPE_PAIRS)
    c = tl.arange(0, D)
    m_i = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
    l_i = tl.zeros((HB,), tl.float32)
    acc = tl.zeros((HB, D), dtype=tl.float32)
    win_tiles = tl.cdiv(W, BLOCK_N)
    comp_tiles = tl.cdiv(KC, BLOCK_N)
    lo = sp * tiles_per_split
    hi = lo + tiles_per_split
    for i in range(lo, tl.minimum(hi, win_tiles)):
        n = i * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.load(win_rows_ptr + t * W + n, mask=n < W, other=-1)
        keys = _record_tile(win_ptr, stride_win, rows, rows >= 0, D, 0, HW)
        m_i, l_i, acc = _attend(q, keys, rows >= 0, m_i, l_i, acc, scale, IEEE, UPCAST)
    for i in range(tl.maximum(lo, win_tiles) - win_tiles, tl.minimum(hi, win_tiles + comp_tiles) - win_tiles):
        n = i * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.load(comp_rows_ptr + t * KC + n, mask=n < KC, other=-1)
        keys = _record_tile(comp_ptr, stride_comp, rows, rows >= 0, D, COMP_FMT, HW)
        m_i, l_i, acc = _attend(q, keys, rows >= 0, m_i, l_i, acc, scale, IEEE, UPCAST)
    cell = (t * SPLITS + sp) * H + heads  # [HB]
    tl.store(m_ptr + cell, m_i, mask=hmask)
    tl.store(l_ptr + cell, l_i, mask=hmask)
    tl.store(acc_ptr + cell[:, None] * D + c[None, :], acc, mask=hmask[:, None])
    if FUSED:  # the last range of (t, head block) in combines (fused_combine)
        _combine_if_last(
            out_ptr,
            sink_ptr,
            cos_ptr,
            sin_ptr,
            stride_cs,
            m_ptr,
            l_ptr,
            acc_ptr,
            count_ptr,
            t,
            H,
            tl.program_id(1) * HB,
            SPLITS,
            D,
            ROPE_PAIRS,
            HB,
            CH,
            OUT_BF16,
        )


@triton.jit
def _load_partial(ptr, mask, CG: tl.constexpr):
    """A partial written by another program of this launch (CG: through L2, bypassing L1)."""
    if CG:
        return tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _combine_rows(
    out_ptr,
    sink_ptr,
    cos_ptr,
    sin_ptr,
    stride_cs,
    m_ptr,
    l_ptr,
    acc_ptr,
    t,
    H,
    heads,
    D: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    SPLITS,
    CG: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """Merge the SPLITS partials of query t's heads [CH] with the sink (in split order), then
    normalise, round, inverse RoPE and store: _attn_combine_kernel's operations in its order
    (bit-identical), with SPLITS a run-time value (the heads kernel's split count)."""
    hmask = heads < H
    c = tl.arange(0, D)
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
    m = sink
    for s in range(SPLITS):
        m = tl.maximum(m, _load_partial(m_ptr + (t * SPLITS + s) * H + heads, hmask, CG))
    l_sum = tl.exp(sink - m)
    acc = tl.zeros((heads.shape[0], D), dtype=tl.float32)
    for s in range(SPLITS):
        cell = (t * SPLITS + s) * H + heads
        w = tl.exp(_load_partial(m_ptr + cell, hmask, CG) - m)
        l_sum += w * _load_partial(l_ptr + cell, hmask, CG)
        acc += w[:, None] * _load_partial(acc_ptr + cell[:, None] * D + c[None, :], hmask[:, None], CG)
    _store_rows(
        acc / l_sum[:, None], out_ptr, cos_ptr, sin_ptr, stride_cs, t, H, heads, c, hmask, D, ROPE_PAIRS, OUT_BF16
    )


@triton.jit
def _combine_if_last(
    out_ptr,
    sink_ptr,
    cos_ptr,
    sin_ptr,
    stride_cs,
    m_ptr,
    l_ptr,
    acc_ptr,
    count_ptr,
    t,
    H,
    h0,
    SPLITS,
    D: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    HB: tl.constexpr,
    CH: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """fused_combine: called after this program stored its partials; the last of the SPLITS
    programs of (query t, head block) to arrive combines heads h0..h0+HB-1, CH at a time, and
    zeroes the counter for the next launch. The barrier makes every thread's partial stores
    precede the arrival (release); acq_rel makes the others' stores visible to the last one."""
    tl.debug_barrier()
    counter = count_ptr + t * tl.num_programs(1) + tl.program_id(1)
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == SPLITS - 1:
        for c0 in tl.static_range(0, HB, CH):
            _combine_rows(
                out_ptr,
                sink_ptr,
                cos_ptr,
                sin_ptr,
                stride_cs,
                m_ptr,
                l_ptr,
                acc_ptr,
                t,
                H,
                h0 + c0 + tl.arange(0, CH),
                D,
                ROPE_PAIRS,
                SPLITS,
                True,
                OUT_BF16,
            )
        tl.store(counter, 0)  # ready for the next launch


@triton.jit
def _attn_combine_kernel(
    out_ptr,
    sink_ptr,
    cos_ptr,
    sin_ptr,
    stride_cs,
    m_ptr,
    l_ptr,
    acc_ptr,
    H,
    D: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    HB: tl.constexpr,
    SPLITS: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    hmask = heads < H
    c = tl.arange(0, D)
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0)
    m = sink
    for s in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(m_ptr + (t * SPLITS + s) * H + heads, mask=hmask, other=0.0))
    l_sum = tl.exp(sink - m)
    acc = tl.zeros((HB, D), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        cell = (t * SPLITS + s) * H + heads
        w = tl.exp(tl.load(m_ptr + cell, mask=hmask, other=0.0) - m)
        l_sum += w * tl.load(l_ptr + cell, mask=hmask, other=0.0)
        acc += w[:, None] * tl.load(acc_ptr + cell[:, None] * D + c[None, :], mask=hmask[:, None], other=0.0)
    _store_rows(
        acc / l_sum[:, None], out_ptr, cos_ptr, sin_ptr, stride_cs, t, H, heads, c, hmask, D, ROPE_PAIRS, OUT_BF16
    )


def split_plan(num_q: int, num_heads: int, keys: tuple[int, int], cfg: AttentionConfig) -> tuple[int, int]:
    """(splits, tiles per split) for num_q queries over (window, compressed) key slots.

    Splits only while (queries x head blocks) leave SMs idle: up to cfg.split_target
    programs, with at least split_min_tiles key tiles each; 1 = the single-pass kernel.
    """
    if cfg.split_target <= 0 or num_q > cfg.split_max_q:
        return 1, 0
    bn = cfg.split_block_n
    tiles = -(-keys[0] // bn) + -(-keys[1] // bn)
    base = num_q * -(-num_heads // cfg.split_heads)
    splits = min(-(-cfg.split_target // base), max(1, tiles // cfg.split_min_tiles))
    if splits <= 1 or splits < cfg.split_min_splits:
        return 1, 0
    per = -(-tiles // splits)
    return -(-tiles // per), per


def _launch(
    q: torch.Tensor,
    sink: torch.Tensor,
    softmax_scale: float,
    rope,
    src: int,
    kv=None,
    valid=None,
    win=None,
    win_rows=None,
    comp=None,
    comp_rows=None,
    comp_fmt: int = FMT_NVFP4,
    *,
    cfg: AttentionConfig,
) -> torch.Tensor:
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    call = _Call.build(q.contiguous(), out, sink, rope, softmax_scale, (win, win_rows, comp, comp_rows, comp_fmt))
    if src == 1 and _launch_packed(call, cfg):
        return out
    _launch_rows(call, src, kv, valid, cfg)
    return out


@dataclass(frozen=True)
class _Call:
    """One attention call's launch inputs, shared by its kernels' argument lists."""

    q: torch.Tensor  # [T, H, d], contiguous
    out: torch.Tensor  # [T, H, d] in q.dtype
    sink32: torch.Tensor  # FP32 [H]
    cos: torch.Tensor  # FP32 [T, R/2] (no RoPE: a [1, 1] placeholder)
    sin: torch.Tensor
    rope_pairs: int  # 0: no RoPE
    softmax_scale: float
    win: torch.Tensor | None  # the window pool (packed calls)
    win_rows: torch.Tensor | None
    comp: torch.Tensor | None  # the compressed pool (packed calls)
    comp_rows: torch.Tensor | None
    comp_fmt: int

    @classmethod
    def build(cls, q: torch.Tensor, out: torch.Tensor, sink, rope, softmax_scale: float, pools: tuple) -> _Call:
        """pools: (win, win_rows, comp, comp_rows, comp_fmt)."""
        cos, sin, rope_pairs = _rope_tensors(rope, q.device)
        return cls(q, out, sink.to(torch.float32).contiguous(), cos, sin, rope_pairs, float(softmax_scale), *pools)


def _rope_tensors(rope, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cos, sin, pairs) as FP32 contiguous tables; without RoPE, [1, 1] ones and 0 pairs."""
    if rope is not None:
        cos, sin = (r.to(torch.float32).contiguous() for r in rope)
        return cos, sin, cos.shape[1]
    cos = sin = torch.ones(1, 1, dtype=torch.float32, device=device)
    return cos, sin, 0


def _launch_packed(call: _Call, cfg: AttentionConfig) -> bool:
    """The heads-as-M kernel past legacy_max_q queries, else the split-KV kernel when it splits;
    False: neither (the per-query kernel runs the call)."""
    num_q, num_heads = call.q.shape[:2]
    keys = (call.win_rows.shape[1], call.comp_rows.shape[1])
    if num_q > cfg.legacy_max_q:
        block_n, splits, per = heads_plan(num_q, num_heads, keys, cfg)
        hb = heads_block(num_heads, cfg)
        if cfg.heads_vsplit and splits == 1 and call.q.shape[2] >= 64:
            _launch_vsplit(call, hb, cfg)
        else:
            _launch_heads(call, hb, block_n, splits, per, cfg)
        return True
    splits, per = split_plan(num_q, num_heads, keys, cfg)
    if splits > 1:
        _launch_split(call, splits, per, cfg)
        return True
    return False


def _rope_args(call: _Call) -> tuple:
    return (call.sink32, call.cos, call.sin, call.cos.stride(0))


def _pool_args(call: _Call, int16_views: bool) -> tuple:
    """Window then compressed pool: (pool, [its int16 view,] row stride, rows, rows per query)."""
    win16 = (call.win.view(torch.int16),) if int16_views else ()
    comp16 = (call.comp.view(torch.int16),) if int16_views else ()
    return (call.win, *win16, call.win.stride(0), call.win_rows, call.win_rows.shape[1]) + (
        call.comp,
        *comp16,
        call.comp.stride(0),
        call.comp_rows,
        call.comp_rows.shape[1],
    )


def _optional_pool_args(call: _Call, kv, valid, dummy: torch.Tensor) -> tuple:
    """The per-query kernel's keys: dense (kv, valid, N) and / or pools, `dummy` and 0 when absent."""
    win, comp = call.win, call.comp
    return (
        kv if kv is not None else dummy,
        valid if valid is not None else dummy,
        kv.shape[1] if kv is not None else 0,
        win if win is not None else dummy,
        win.stride(0) if win is not None else 0,
        call.win_rows if call.win_rows is not None else dummy,
        call.win_rows.shape[1] if win is not None else 0,
        comp if comp is not None else dummy,
        comp.stride(0) if comp is not None else 0,
        call.comp_rows if call.comp_rows is not None else dummy,
        call.comp_rows.shape[1] if comp is not None else 0,
    )


def _launch_rows(call: _Call, src: int, kv, valid, cfg: AttentionConfig) -> None:
    """The per-query kernel: one program per (query, cfg.heads heads)."""
    q = call.q
    num_q, num_heads, dim = q.shape
    _attn_kernel[(num_q, triton.cdiv(num_heads, cfg.heads))](
        q,
        call.out,
        *_rope_args(call),
        *_optional_pool_args(call, kv, valid, dummy=q),
        num_heads,
        call.softmax_scale,
        D=dim,
        ROPE_PAIRS=call.rope_pairs,
        SRC=src,
        COMP_FMT=call.comp_fmt,
        HB=cfg.heads,
        BLOCK_N=cfg.block_n,
        OUT_BF16=q.dtype == torch.bfloat16,
        IEEE=q.dtype == torch.float32,
        UPCAST=DOT_UPCAST,
        HW=HW_FP8,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
        **triton_runtime.launch_options(),
    )


def heads_block(num_heads: int, cfg: AttentionConfig) -> int:
    """Heads per program of the heads-as-M kernel: all of them up to heads_max (>= 16)."""
    return max(16, min(cfg.heads_max, triton.next_power_of_2(num_heads)))


def heads_plan(num_q: int, num_heads: int, keys: tuple[int, int], cfg: AttentionConfig) -> tuple[int, int, int]:
    """(block_n, splits, tiles per split) of the heads-as-M kernel for num_q queries over
    (window, compressed) key slots: split-KV only while the programs leave SMs idle."""
    target = cfg.heads_split_target
    base = num_q * -(-num_heads // heads_block(num_heads, cfg))
    if target <= 0 or base >= target:
        return cfg.heads_block_n, 1, 1 << 20
    bn = cfg.heads_split_block_n
    tiles = -(-keys[0] // bn) + -(-keys[1] // bn)
    splits = min(-(-target // base), max(tiles, 1))
    if splits <= 1:
        return cfg.heads_block_n, 1, 1 << 20
    per = -(-tiles // splits)
    return bn, -(-tiles // per), per


def _launch_heads(call: _Call, hb: int, block_n: int, splits: int, per: int, cfg: AttentionConfig) -> None:
    """The heads-as-M kernel (hb heads of a query as the MMA's M), split-KV into `splits`
    partials of `per` key tiles when splits > 1, combined in the kernel (fused_combine) or after."""
    num_q, num_heads = call.q.shape[:2]
    blocks = triton.cdiv(num_heads, hb)
    fused = splits > 1 and bool(cfg.fused_combine)
    m, l_, acc = _split_partials(call, splits) if splits > 1 else (call.sink32,) * 3
    count = triton_runtime.arrival_counters(call.q.device, num_q * blocks) if fused else call.sink32
    _heads_kernel[(num_q, blocks, splits)](
        call.q,
        call.out,
        *_rope_args(call),
        *_pool_args(call, int16_views=True),
        m,
        l_,
        acc,
        num_heads,
        call.softmax_scale,
        per,
        count,
        **_heads_constexprs(call, hb, block_n, splits, fused, cfg),
        num_warps=cfg.heads_warps if hb >= 64 else 4,
        num_stages=cfg.heads_split_stages if splits > 1 else cfg.heads_stages,
        **triton_runtime.launch_options(),
    )
    if splits > 1 and not fused:
        _combine(call.out, call.sink32, call.cos, call.sin, m, l_, acc, call.rope_pairs, splits, cfg)


def _split_partials(call: _Call, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP32 split-KV partials of every (query, split, head): running max, sum and [d] values."""
    num_q, num_heads, dim = call.q.shape
    m = torch.empty(num_q, splits, num_heads, dtype=torch.float32, device=call.q.device)
    l_ = torch.empty_like(m)
    acc = torch.empty(num_q, splits, num_heads, dim, dtype=torch.float32, device=call.q.device)
    return m, l_, acc


def _heads_constexprs(call: _Call, hb: int, block_n: int, splits: int, fused: bool, cfg: AttentionConfig) -> dict:
    return dict(
        D=call.q.shape[2],
        ROPE_PAIRS=call.rope_pairs,
        COMP_FMT=call.comp_fmt,
        HB=hb,
        BLOCK_N=block_n,
        PARTIAL=splits > 1,
        PREFETCH=bool(cfg.heads_prefetch),
        TAU=float(cfg.heads_rescale_tau),
        TRANS=bool(cfg.heads_trans_s),
        FUSED=fused,
        CH=combine_chunk(hb, cfg),
        OUT_BF16=call.q.dtype == torch.bfloat16,
        ASM=HW_FP8 and bool(cfg.heads_asm),
        UPCAST=DOT_UPCAST,
        HW=HW_FP8,
    )


def _launch_vsplit(call: _Call, hb: int, cfg: AttentionConfig) -> None:
    """The heads-as-M kernel with the head dim split over two programs (one pass, no split-KV)."""
    q = call.q
    num_q, num_heads, dim = q.shape
    _heads_vsplit_kernel[(2 * num_q, triton.cdiv(num_heads, hb))](
        q,
        call.out,
        torch.empty_like(q),
        *_rope_args(call),
        *_pool_args(call, int16_views=True),
        num_heads,
        call.softmax_scale,
        D=dim,
        ROPE_PAIRS=call.rope_pairs,
        COMP_FMT=call.comp_fmt,
        HB=hb,
        BLOCK_N=cfg.heads_vsplit_block_n,
        ASM=HW_FP8 and bool(cfg.heads_asm),
        UPCAST=DOT_UPCAST,
        HW=HW_FP8,
        num_warps=cfg.heads_vsplit_warps,
        num_stages=cfg.heads_stages,
        **triton_runtime.launch_options(),
    )


def _launch_split(call: _Call, splits: int, per: int, cfg: AttentionConfig) -> None:
    """The per-query split-KV kernel: `splits` partials of `per` key tiles per (query, heads),
    combined in the kernel (fused_combine) or after it."""
    num_q, num_heads, dim = call.q.shape
    hb = cfg.split_heads
    m, l_, acc = _split_partials(call, splits)
    blocks = triton.cdiv(num_heads, hb)
    fused = bool(cfg.fused_combine)
    count = triton_runtime.arrival_counters(call.q.device, num_q * blocks) if fused else m
    _attn_split_kernel[(num_q, blocks, splits)](
        call.q,
        *_rope_args(call),
        *_pool_args(call, int16_views=False),
        m,
        l_,
        acc,
        num_heads,
        call.softmax_scale,
        per,
        call.out,
        count,
        **_split_constexprs(call, hb, splits, fused, cfg),
        num_warps=cfg.split_warps,
        num_stages=cfg.split_stages,
        **triton_runtime.launch_options(),
    )
    if not fused:
        _combine(call.out, call.sink32, call.cos, call.sin, m, l_, acc, call.rope_pairs, splits, cfg)


def _split_constexprs(call: _Call, hb: int, splits: int, fused: bool, cfg: AttentionConfig) -> dict:
    return dict(
        D=call.q.shape[2],
        ROPE_PAIRS=call.rope_pairs,
        COMP_FMT=call.comp_fmt,
        HB=hb,
        BLOCK_N=cfg.split_block_n,
        SPLITS=splits,
        IEEE=call.q.dtype == torch.float32,
        UPCAST=DOT_UPCAST,
        HW=HW_FP8,
        FUSED=fused,
        CH=combine_chunk(hb, cfg),
        OUT_BF16=call.q.dtype == torch.bfloat16,
    )


def _combine(out, sink32, cos, sin, m, l_, acc, rope_pairs: int, splits: int, cfg: AttentionConfig) -> None:
    """The split-KV partials (m, l_, acc) of every (query, head) combined into out, in place:
    one program per query and combine_heads heads."""
    num_q, num_heads, dim = out.shape
    hc = cfg.combine_heads
    _attn_combine_kernel[(num_q, triton.cdiv(num_heads, hc))](
        out,
        sink32,
        cos,
        sin,
        cos.stride(0),
        m,
        l_,
        acc,
        num_heads,
        D=dim,
        ROPE_PAIRS=rope_pairs,
        HB=hc,
        SPLITS=splits,
        OUT_BF16=out.dtype == torch.bfloat16,
        num_warps=4,
        **triton_runtime.launch_options(),
    )


def combine_chunk(heads_per_program: int, cfg: AttentionConfig) -> int:
    """Heads combined at a time by a fused split program (fused_combine): combine_heads, at
    most the program's heads (both powers of two)."""
    return max(1, min(cfg.combine_heads, heads_per_program))


def single_pass_rows(num_heads: int, cfg: AttentionConfig) -> int:
    """The fewest queries that the heads-as-M kernel runs in one pass (no split-KV): the
    variant a prefill chunk compiles."""
    target = cfg.heads_split_target
    blocks = -(-num_heads // heads_block(num_heads, cfg))
    return max(1, -(-target // blocks), cfg.legacy_max_q + 1)


def warmup(
    num_heads: int,
    head_dim: int,
    rope_pairs: int,
    window: int,
    topk: tuple[int, ...],
    comp_format: int = FMT_NVFP4,
    rows=(1, 8, 64),
    *,
    tuned: KernelConfigs = DEFAULT,
) -> int:
    """Compile (and run once) the packed-attention variants of `rows`-query decode calls and
    of a prefill chunk (single_pass_rows queries, the one-pass variant every longer chunk
    takes), so that the first request compiles nothing.

    topk: the compressed-row counts the model's layers pass (0 for window-only layers, else
    index_topk). Returns the number of calls made.
    """
    device = triton_runtime.kernel_device()
    rows = sorted(set(rows) | {single_pass_rows(num_heads, tuned.attention)})
    pools = _warmup_pools(num_heads, head_dim, max(rows) * window + 1, comp_format, device)
    calls = 0
    for r in rows:
        q = torch.randn(r, num_heads, head_dim, device=device).to(torch.bfloat16)
        rope = None
        if rope_pairs:
            rope = (torch.ones(r, rope_pairs, device=device), torch.zeros(r, rope_pairs, device=device))
        win_rows = torch.arange(r * window, dtype=torch.int32, device=device).view(r, window)
        calls += _warmup_topk(q, rope, pools, win_rows, sorted(set(topk)), comp_format, tuned)
    return calls


def _warmup_pools(num_heads: int, head_dim: int, pool_rows: int, comp_format: int, device) -> tuple:
    """(window pool, compressed pool, sinks) of zeros for the warm-up calls."""
    win = torch.zeros(pool_rows, qref.window_fp8_record_bytes(head_dim), dtype=torch.uint8, device=device)
    comp_bytes = (
        qref.nvfp4_record_bytes(head_dim) if comp_format == FMT_NVFP4 else qref.window_fp8_record_bytes(head_dim)
    )
    comp = torch.zeros(pool_rows, comp_bytes, dtype=torch.uint8, device=device)
    return win, comp, torch.zeros(num_heads, device=device)


def _warmup_topk(q, rope, pools: tuple, win_rows, topk: list[int], comp_format: int, tuned: KernelConfigs) -> int:
    """One packed call per compressed-row count (0: window only); returns the calls made."""
    win, comp, sink = pools
    for k in topk:
        comp_rows = torch.zeros(q.shape[0], k, dtype=torch.int32, device=q.device)
        sparse_attention_packed(
            q,
            rope,
            win,
            win_rows,
            comp if k else None,
            comp_rows if k else None,
            sink,
            q.shape[2] ** -0.5,
            comp_format=comp_format,
            tuned=tuned,
        )
    return len(topk)


# ============================================================================ ref surface
def window_keys(
    window_kv: torch.Tensor, window_start: int, q_positions: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """window_kv [Nw, d] (positions window_start..), q_positions [T] -> keys [T, W, d], valid."""
    num_kv = window_kv.shape[0]
    if q_positions.numel() and int(q_positions.max()) >= window_start + num_kv:
        raise ValueError("a query position lies past the window buffer")
    slot_pos = (
        q_positions[:, None] + (torch.arange(window, device=q_positions.device) - (window - 1))[None, :]
    )  # [T, W]
    valid = slot_pos >= window_start
    return window_kv[(slot_pos - window_start).clamp_min(0)], valid


def compressed_keys(entries: torch.Tensor, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """entries [N, d], topk [T, K] (-1 = empty slot) -> keys [T, K, d], valid [T, K]."""
    valid = topk >= 0
    if entries.shape[0] == 0:
        return entries.new_zeros((*topk.shape, entries.shape[1])), valid
    return entries[topk.clamp_min(0)], valid


def sparse_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    sink: torch.Tensor,
    softmax_scale: float,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> torch.Tensor:
    """q [T, H, d], keys [T, N, d] (K = V), valid [T, N], sink [H] FP32 -> [T, H, d] in q.dtype."""
    _check_q(q, sink)
    if keys.ndim != 3 or keys.shape[0] != q.shape[0] or keys.shape[2] != q.shape[2]:
        raise ValueError(f"keys must be [T, N, {q.shape[2]}], got {tuple(keys.shape)}")
    if valid.shape != keys.shape[:2]:
        raise ValueError(f"valid must be {tuple(keys.shape[:2])}, got {tuple(valid.shape)}")
    triton_runtime.check_device(keys, valid)
    return _launch(
        q,
        sink,
        softmax_scale,
        None,
        0,
        kv=keys.to(q.dtype).contiguous(),
        valid=valid.contiguous().view(torch.uint8),
        cfg=tuned.attention,
    )


def sparse_attention_packed(
    q: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    window_pool: torch.Tensor,
    window_rows: torch.Tensor,
    comp_pool: torch.Tensor | None,
    comp_rows: torch.Tensor | None,
    sink: torch.Tensor,
    softmax_scale: float,
    comp_format: int = FMT_NVFP4,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> torch.Tensor:
    """Fused RoPE(q) -> attention over packed window ∪ compressed records -> inverse RoPE.

    q [T, H, d] pre-RoPE; rope = (cos, sin) [T, R/2] at each query's position (None: no RoPE);
    window_pool uint8 [rows, d + d/32], window_rows [T, W] int32 pool rows (-1 empty);
    comp_pool uint8 [rows, record], comp_rows [T, K] int32 pool rows (-1 empty) or None.
    Returns [T, H, d] in q.dtype = inverse_rope(round(attention)).
    """
    pools = _packed_pools(q, sink, rope, window_pool, window_rows, comp_pool, comp_rows, comp_format)
    return _launch(q, sink, softmax_scale, rope, 1, None, None, *pools, cfg=tuned.attention)


def _packed_pools(q, sink, rope, window_pool, window_rows, comp_pool, comp_rows, comp_format: int) -> tuple:
    """The checked pools as `_launch` takes them: (window pool, int32 window rows, compressed
    pool, int32 compressed rows, its format); no compressed pool: the window pool, no rows, FP8."""
    _check_q(q, sink)
    dim = q.shape[2]
    _check_pool(window_pool, window_rows, qref.window_fp8_record_bytes(dim), q.shape[0])
    if comp_pool is None:
        comp_pool, comp_rows = window_pool, window_rows[:, :0]
        comp_format = FMT_FP8
    want = qref.nvfp4_record_bytes(dim) if comp_format == FMT_NVFP4 else qref.window_fp8_record_bytes(dim)
    _check_pool(comp_pool, comp_rows, want, q.shape[0])
    if rope is not None and (rope[0].shape[0] != q.shape[0] or 2 * rope[0].shape[1] > dim):
        raise ValueError(f"rope tables {tuple(rope[0].shape)} do not fit q {tuple(q.shape)}")
    if q.dtype != torch.bfloat16:
        raise TypeError("packed attention computes on bf16 queries")
    win_rows, comp_rows = window_rows.to(torch.int32).contiguous(), comp_rows.to(torch.int32).contiguous()
    return window_pool, win_rows, comp_pool, comp_rows, comp_format


def _check_q(q: torch.Tensor, sink: torch.Tensor) -> None:
    if q.ndim != 3 or sink.shape != (q.shape[1],):
        raise ValueError(f"q must be [T, H, d] and sink [H], got {tuple(q.shape)}, {tuple(sink.shape)}")
    if q.shape[2] & (q.shape[2] - 1) or q.shape[2] < 32:
        raise ValueError(f"head dim {q.shape[2]} must be a power of two >= 32")
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"q must be bf16 or fp32, got {q.dtype}")
    triton_runtime.check_device(q, sink)


def _check_pool(pool: torch.Tensor, rows: torch.Tensor, record_bytes: int, num_q: int) -> None:
    if pool.dtype != torch.uint8 or pool.ndim != 2 or pool.stride(1) != 1:
        raise TypeError("pools are row-major uint8 [rows, record_bytes] tensors")
    if pool.shape[1] != record_bytes:
        raise ValueError(f"pool records are {pool.shape[1]} B, expected {record_bytes} B")
    if rows.ndim != 2 or rows.shape[0] != num_q:
        raise ValueError(f"row lists must be [T, n], got {tuple(rows.shape)}")
    triton_runtime.check_device(pool, rows)
