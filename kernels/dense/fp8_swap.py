"""FP8 32x32 block-scaled dense GEMMs at decode sizes (<= 64 rows per weight), operands swapped.

The split-K GEMM of dense/triton.py computes A[16, K] . W^T with BLOCK_M = 16 rows of which one
to eight are valid, the dequantised weight the MMA's B operand. Here the weight tile is the
MMA's A operand (BLOCK_N weight rows) and the activation rows are its N, ROWS (8, 16, 32 or
64; a constexpr) per program, the missing ones zero:

    acc^T[BN, ROWS] += W[n0:n0+BN, k-step] (E4M3 x UE8M0 -> BF16 in registers) . X[rows, k-step]^T

which Triton 3.6 compiles on sm_90 (bench/results/h200/investigations.md) to mma.sync m16n8k16 with
both operands in registers at ROWS = 8 and at 2 warps, and to wgmma m64nROWSk16 with W from
registers at ROWS >= 16 with 4 or 8 warps (BLOCK_N >= 64). Calls of T rows per weight run the
smallest row class >= T (Fp8SwapConfig.classes); a class may run its rows as several row blocks
of ROWS. dense/ref.py's math:

    out[t] = round(x[t] . deq(W)^T)                                    plain
    out[t] = round(gamma[t] * silu(min(bf16(g), L)) * clamp(bf16(u), -L, L)),
             g = x[t] . deq(W1)^T, u = x[t] . deq(W3)^T                  SwiGLU pair (shared expert)
    out[t, g] = round(x[t, g] . deq(W[g])^T)                           block-diagonal (wo_a groups)

with deq(W)[n, k] = E4M3(W[n, k]) * 2^(S[n // 32, k // 32] - 127) and FP32 accumulation.

Grid (N blocks, row blocks x groups, SPLIT): program (nb, rb * groups + g, s) sums K chunk s
(k_chunk columns, walked in steps of BLOCK_K from its start) for rows t * groups + g,
rb * ROWS <= t < rb * ROWS + ROWS, t < T. SPLIT > 1: FP32 partials go to a workspace and the
last program of (rb, g, nb) to arrive (atomic counter) sums them in chunk order 0..SPLIT-1,
then runs the epilogue. SPLIT and k_chunk are functions of the weight's shape, the config and the
row class only.

Decode of the weight bytes (Fp8SwapConfig.deq):
    "f32"   E4M3 -> FP32 (hardware cvt; bit arithmetic under the interpreter), FP32 multiply by
            the scale, pack to BF16 (exact: a value of <= 4 significant bits times 2^e)
    "asm"   (GPU) PTX: each byte's sign and exponent/mantissa bits moved into a BF16 (prmt
            sign-replicate, shift, and: the value times 2^-120, E4M3 subnormals included), one
            bf16x2 multiply by 2^120 (exact: the E4M3 value), one by the BF16 scale (the same
            rounding as "f32" when the product leaves BF16's normal range: none otherwise)
    "asm1"  (GPU) as "asm" with the two multiplies folded into one by bf16(2^(S - 7)) = 2^120 *
            scale, exact for UE8M0 bytes S <= 134 (scales <= 2^7) only: `gemm` checks a
            weight's scales once, outside graph capture, and takes "asm" for a weight it has
            not checked or whose scales are larger (opt-in; not the default)

Batch invariance: a row's sums depend on the weight's shape, the config and the row class only (the
K chunks, the K step and the MMA instruction are fixed for every T of a class), not on how
many rows of its class share the call. Across classes (8 -> 9, 16 -> 17, 32 -> 33 rows) the
tiles, the split and the MMA may change: a row may differ in the last bits across a class
bound. The decode graphs pad batches to 1/2/4/8/16/32/64 rows, the class bounds, so a padded
graph batch and its eager batch stay in one class. dense/triton.py sends FP8 calls of <=
FP8_SWAP_MAX_ROWS rows per weight here and larger ones to its split-K tiles, which sum in
another order: the same holds across that bound (as the MoE GEMV / grouped GEMM bound).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.configs import Fp8SwapConfig
from flashpd.kernels.dense.triton import DOT_UPCAST, W_FP8, Weights, mma, swiglu_limited
from flashpd.kernels.quant.triton import e4m3_decode, e8m0_decode, round_bf16

# Launch configuration (H200, two runs: bench/results/h200/dense_fp8_swap.md). block_n: weight
# rows per program; block_k: K step (a multiple of 32); warps; stages; target_ctas: programs a
# launch aims for (split-K until N blocks x groups x SPLIT reaches it, chunks of >= min_k_chunk
# columns); max_split: at most this many K chunks; red_unroll: the reduction loads this many
# partials at a time (same order); deq: "f32", "asm" or "asm1" (above; "asm1" measured ~3 us
# per layer faster than "asm" but is exact for scales <= 2^7 only: opt-in); layers: None (every
# FP8 weight) or a set of (N, K, groups, swiglu) the path takes (the rest stay on
# dense/triton.py's split-K tiles); shapes: per-(N, K, groups, swiglu) overrides of the launch
# keys (measured 1.4-1.5 us faster for wo_b, 0.6-1.3 us for the shared expert than uniform).
# classes: row classes, keyed by the most rows per weight each takes (a call of T rows per
# weight runs the smallest class >= T): "rows" = the X^T tile's width (a program's rows, the
# MMA's N; a class wider than its rows runs several row blocks), and overrides of every key
# above (a class's "shapes" replace the top-level ones). The launch (split-K plan included) is
# a function of the weight's shape and the class only: a row's sums do not depend on how many
# rows of its class share the call.
# (configs.Fp8SwapConfig: KernelConfigs.dense.fp8_swap, passed in as `cfg`; the H200 row-class
# measurements are beside its table in kernels/configs.py)
ASM_MAX_SCALE = 134  # UE8M0 bytes the "asm1" decode takes exactly (2^120 * scale fits BF16)
# (data_ptr, shape, device) of a scale tensor -> (a weak reference to the tensor owning that
# memory, all <= 134); an answer whose owner was freed is stale (another tensor may since have
# been allocated at the address) and is checked again
_SCALES_OK: dict[tuple, tuple[weakref.ref, bool]] = {}


# ============================================================================ kernel
@triton.jit
def _e4m3_bf16_asm(q, s_bf16):
    """GPU only: E4M3 bytes q times s_bf16 (= 2^120 * scale) -> BF16, 4 bytes per PTX block.
    prmt spreads two bytes into 16-bit lanes with their sign replicated into the high byte;
    << 4 and the mask 0x87F0 leave sign | exponent-mantissa << 4: a BF16 equal to the E4M3
    value times 2^-120 (E4M3 subnormals become BF16 subnormals, zero stays zero); one bf16x2
    multiply rescales (exact while 2^120 * scale is a BF16: "asm1")."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t<2>;
        prmt.b32 t0, $2, 0, 0x9180;
        prmt.b32 t1, $2, 0, 0xB3A2;
        shl.b32 t0, t0, 4;
        shl.b32 t1, t1, 4;
        and.b32 t0, t0, 0x87F087F0;
        and.b32 t1, t1, 0x87F087F0;
        mul.rn.bf16x2 $0, t0, $3;
        mul.rn.bf16x2 $1, t1, $4;
        }""",
        "=r,=r,r,r,r",
        [q, s_bf16],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _e4m3_bf16_asm2(q, s_bf16):
    """GPU only: E4M3 bytes q times s_bf16 (= the scale) -> BF16, exact for every scale: as
    _e4m3_bf16_asm, then a bf16x2 multiply by 2^120 (0x7B80: the E4M3 value, exact) and one
    by the scale ("asm")."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t<2>, c;
        mov.b32 c, 0x7B807B80;
        prmt.b32 t0, $2, 0, 0x9180;
        prmt.b32 t1, $2, 0, 0xB3A2;
        shl.b32 t0, t0, 4;
        shl.b32 t1, t1, 4;
        and.b32 t0, t0, 0x87F087F0;
        and.b32 t1, t1, 0x87F087F0;
        mul.rn.bf16x2 t0, t0, c;
        mul.rn.bf16x2 t1, t1, c;
        mul.rn.bf16x2 $0, t0, $3;
        mul.rn.bf16x2 $1, t1, $4;
        }""",
        "=r,=r,r,r,r",
        [q, s_bf16],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _load_fp8_tile(w_ptr, s_ptr, w_row, s_row, k0, k_hi, nmask, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(E4M3 codes [BN, BLOCK_K] uint8, UE8M0 scales [BN, BLOCK_K / 32]) of W[rows, k0 : k0 +
    BLOCK_K]; columns at or past k_hi read as 0 (scales as 127) unless EVEN_K."""
    G: tl.constexpr = BLOCK_K // 32
    kk = k0 + tl.arange(0, BLOCK_K)
    gi = k0 // 32 + tl.arange(0, G)
    if EVEN_K:  # no K mask: 16-byte vector loads
        q = tl.load(w_ptr + w_row + kk[None, :], mask=nmask[:, None], other=0)
        smask = nmask[:, None]
    else:
        q = tl.load(w_ptr + w_row + kk[None, :], mask=nmask[:, None] & (kk < k_hi)[None, :], other=0)
        smask = nmask[:, None] & (gi * 32 < k_hi)[None, :]  # a tile past K: never read
    sb = tl.load(s_ptr + s_row + gi[None, :], mask=smask, other=127)  # [BN, G] UE8M0
    return q, sb


@triton.jit
def _per_column(s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BN, BLOCK_K / 32] per-32-column values -> [BN, BLOCK_K], each repeated over its 32."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)), (BLOCK_N, BLOCK_K))


@triton.jit
def _weight_step(
    w_ptr,
    s_ptr,
    w_row,
    s_row,
    k0,
    k_hi,
    nmask,
    DEQ: tl.constexpr,
    HW_FP8: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """W[rows, k0 : k0 + BLOCK_K] dequantised, [BLOCK_N, BLOCK_K] BF16 (exact); columns at or
    past k_hi are zero unless EVEN_K (then none are)."""
    q, sb = _load_fp8_tile(w_ptr, s_ptr, w_row, s_row, k0, k_hi, nmask, EVEN_K, BLOCK_K)
    if DEQ == 2:  # "asm1": bf16(2^(S - 7)): exponent field S + 120 (S <= 134, host-checked)
        s16 = ((sb.to(tl.int32) + 120) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return _e4m3_bf16_asm(q, _per_column(s16, BLOCK_N, BLOCK_K))
    elif DEQ == 1:  # "asm": bf16(2^(S - 127)), exact for every byte (0: the subnormal 2^-127)
        s16 = e8m0_decode(sb).to(tl.bfloat16)
        return _e4m3_bf16_asm2(q, _per_column(s16, BLOCK_N, BLOCK_K))
    else:
        sf = _per_column(e8m0_decode(sb), BLOCK_N, BLOCK_K)
        if HW_FP8:
            v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            v = e4m3_decode(q)
        return (v * sf).to(tl.bfloat16)


@triton.jit
def _chunk_t(
    x_ptr,
    stride_x,
    p,
    tmask,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    w_row,
    s_row,
    nmask,
    k_lo,
    k_hi,
    SWIGLU: tl.constexpr,
    DEQ: tl.constexpr,
    HW_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
):
    """(acc1, acc3) [BLOCK_N, ROWS] FP32: W . X^T over K in [k_lo, k_hi), from zero."""
    acc1 = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    x_row = x_ptr + p.to(tl.int64)[None, :] * stride_x  # [1, ROWS]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            xt = tl.load(x_row + kk[:, None], mask=tmask[None, :], other=0.0)  # [BK, ROWS]
        else:
            xt = tl.load(x_row + kk[:, None], mask=tmask[None, :] & (kk < k_hi)[:, None], other=0.0)
        w1 = _weight_step(w1_ptr, s1_ptr, w_row, s_row, k0, k_hi, nmask, DEQ, HW_FP8, EVEN_K, BLOCK_N, BLOCK_K)
        acc1 = mma(w1, xt, acc1, False, UPCAST)
        if SWIGLU:
            w3 = _weight_step(w3_ptr, s3_ptr, w_row, s_row, k0, k_hi, nmask, DEQ, HW_FP8, EVEN_K, BLOCK_N, BLOCK_K)
            acc3 = mma(w3, xt, acc3, False, UPCAST)
    return acc1, acc3


@triton.jit
def _epilogue_t(
    acc1,
    acc3,
    p,
    tmask,
    n,
    nmask,
    out_ptr,
    stride_out,
    gamma_ptr,
    limit,
    SWIGLU: tl.constexpr,
    HAS_GAMMA: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """out[p, n] = acc1^T (or the SwiGLU of acc1^T, acc3^T), rounded once to out's dtype."""
    if SWIGLU:  # moe.ref.expert_ffn: g, u rounded to bf16 (the activation dtype) first
        val = swiglu_limited(round_bf16(acc1), round_bf16(acc3), limit)
        if HAS_GAMMA:
            val = tl.load(gamma_ptr + p, mask=tmask, other=0.0)[None, :] * val
    else:
        val = acc1
    if OUT_BF16:
        val = round_bf16(val)
    tl.store(
        out_ptr + p.to(tl.int64)[None, :] * stride_out + n[:, None],
        val.to(out_ptr.dtype.element_ty),
        mask=nmask[:, None] & tmask[None, :],
    )


# one compiled variant for every row count of a row class and every split (`split` runtime)
@triton.jit(do_not_specialize=["rows", "split"])
def _fp8_swap_kernel(
    x_ptr,
    stride_x,
    out_ptr,
    stride_out,
    gamma_ptr,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    part_ptr,
    count_ptr,
    N,
    K,
    k_chunk,
    rows,
    groups,
    limit,
    split,
    SWIGLU: tl.constexpr,
    HAS_GAMMA: tl.constexpr,
    OUT_BF16: tl.constexpr,
    DEQ: tl.constexpr,
    HW_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    RED_UNROLL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Program (N block nb, row block rb * groups + g, K chunk sp); rows t * groups + g of x
    and out for t in [rb * ROWS, rb * ROWS + ROWS), t < rows. SPLIT_K: split > 1 chunks."""
    nb = tl.program_id(0)
    g = tl.program_id(1) % groups
    rb = tl.program_id(1) // groups
    sp = tl.program_id(2)
    t = rb * ROWS + tl.arange(0, ROWS)
    tmask = t < rows
    p = t * groups + g  # rows of x and out
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    n64 = n.to(tl.int64)
    g64 = g.to(tl.int64)
    w_row = g64 * stride_we + n64[:, None] * stride_wn  # [BN, 1] bytes
    s_row = g64 * stride_se + (n64 // 32)[:, None] * stride_sn  # [BN, 1]
    k_lo = sp * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)
    acc1, acc3 = _chunk_t(
        x_ptr,
        stride_x,
        p,
        tmask,
        w1_ptr,
        s1_ptr,
        w3_ptr,
        s3_ptr,
        w_row,
        s_row,
        nmask,
        k_lo,
        k_hi,
        SWIGLU,
        DEQ,
        HW_FP8,
        UPCAST,
        EVEN_K,
        BLOCK_N,
        BLOCK_K,
        ROWS,
    )
    if SPLIT_K:
        cell = p.to(tl.int64)[None, :] * N + n64[:, None]  # [BN, ROWS]
        cmask = nmask[:, None] & tmask[None, :]
        plane = (rows * groups).to(tl.int64) * N
        tl.store(part_ptr + sp * plane + cell, acc1, mask=cmask)
        if SWIGLU:
            tl.store(part_ptr + (split + sp) * plane + cell, acc3, mask=cmask)
        tl.debug_barrier()
        counter = count_ptr + tl.program_id(1) * tl.num_programs(0) + nb
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == split - 1:  # last chunk in: sum the chunks in order 0..split-1
            acc1 = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
            acc3 = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
            for s0 in range(0, split, RED_UNROLL):
                for j in tl.static_range(RED_UNROLL):
                    rm = cmask & (s0 + j < split)  # -0.0 + x == x for every x
                    acc1 += tl.load(part_ptr + (s0 + j) * plane + cell, mask=rm, other=-0.0, cache_modifier=".cg")
                    if SWIGLU:
                        acc3 += tl.load(
                            part_ptr + (split + s0 + j) * plane + cell, mask=rm, other=-0.0, cache_modifier=".cg"
                        )
            tl.store(counter, 0)  # ready for the next launch
            _epilogue_t(
                acc1, acc3, p, tmask, n, nmask, out_ptr, stride_out, gamma_ptr, limit, SWIGLU, HAS_GAMMA, OUT_BF16
            )
    else:
        _epilogue_t(acc1, acc3, p, tmask, n, nmask, out_ptr, stride_out, gamma_ptr, limit, SWIGLU, HAS_GAMMA, OUT_BF16)


# ============================================================================ host side
def compiled_variants() -> list:
    """The kernel's variants compiled so far (Triton CompiledKernel: asm, n_regs, ...)."""
    caches = getattr(_fp8_swap_kernel, "device_caches", {})  # empty under the interpreter
    return [k for cache, *_ in caches.values() for k in cache.values()]


def layer_key(w: Weights, swiglu: bool) -> tuple[int, int, int, bool]:
    """(N, K, groups, swiglu): what Fp8SwapConfig.layers / .shapes are keyed by."""
    return (w.out_dim, w.in_dim, w.num_experts, bool(swiglu))


def max_rows(cfg: Fp8SwapConfig) -> int:
    """The most rows per weight a call may have here (the widest row class)."""
    return max(cfg.classes, default=0)


def row_class(rows: int, cfg: Fp8SwapConfig) -> int:
    """The class (cfg.classes key) that runs rows per weight: the smallest >= rows."""
    fits = [c for c in cfg.classes if c >= rows]
    if not fits:
        raise ValueError(f"fp8_swap: {rows} rows per weight, at most {max_rows(cfg)}")
    return min(fits)


def tiles(w: Weights, swiglu: bool, cls: int, config: Fp8SwapConfig) -> dict:
    """The launch keys for weight w in row class cls: the config's fields, the class's
    overrides, then the per-shape overrides (the class's "shapes" if it has them)."""
    base = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    cfg = {**base, **config.classes.get(cls, {})}
    cfg.setdefault("rows", cls)
    return {**cfg, **cfg["shapes"].get(layer_key(w, swiglu), {})}


def plan(w: Weights, swiglu: bool, cls: int, config: Fp8SwapConfig) -> tuple[int, int]:
    """(split, k_chunk) of weight w in row class cls: from its shape and config alone, never
    from the rows. Enough K chunks that N blocks x groups x row blocks (of the class's widest
    call) x split reaches target_ctas, chunks of at least min_k_chunk columns, each a whole
    number of K steps."""
    cfg = tiles(w, swiglu, cls, config)
    k_dim, step = w.in_dim, cfg["block_k"]
    blocks = triton.cdiv(w.out_dim, cfg["block_n"]) * w.num_experts * triton.cdiv(cls, cfg["rows"])
    want = triton.cdiv(cfg["target_ctas"], blocks)
    split = max(1, min(want, k_dim // cfg["min_k_chunk"], int(cfg.get("max_split", 1 << 20))))
    chunk = triton.cdiv(triton.cdiv(k_dim, split), step) * step
    return triton.cdiv(k_dim, chunk), chunk


def eligible(a: torch.Tensor, w: Weights, out: torch.Tensor, w3: Weights | None, *, cfg: Fp8SwapConfig) -> bool:
    """True when `gemm` takes this call: FP8 weight(s), bf16 activations of <= max_rows() rows
    per weight (one weight, a SwiGLU pair of single weights, or G block-diagonal weights), and
    the layer is in cfg.layers (None: every layer)."""
    groups = w.num_experts
    if w.fmt != W_FP8 or a.dtype != torch.bfloat16 or a.shape[0] % groups:
        return False
    if a.shape[0] // groups > max_rows(cfg) or a.shape[0] == 0:
        return False
    if w3 is not None and (groups != 1 or w3.fmt != W_FP8 or w3.data.shape != w.data.shape):
        return False
    layers = cfg.layers
    return layers is None or layer_key(w, w3 is not None) in layers


def scales_fit_asm(*ws: Weights) -> bool:
    """True when every scale byte of ws is <= ASM_MAX_SCALE ("asm1"). Checked once per scale
    tensor (a device sync), never during CUDA-graph capture: there an unchecked weight answers
    False."""
    return all(_scale_fits_asm(w.scale) for w in ws)


def _scale_fits_asm(scale: torch.Tensor) -> bool:
    """The cached answer for `scale`, computed once per owning tensor (a view's base owns its
    memory: the Weights views sliced per call share one answer while the base lives); False
    while a CUDA graph is being captured and no answer is cached."""
    key = (scale.data_ptr(), tuple(scale.shape), scale.device)
    owner = scale._base if scale._base is not None else scale
    entry = _SCALES_OK.get(key)
    if entry is not None and entry[0]() is owner:
        return entry[1]
    if scale.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    ok = bool((scale.max() <= ASM_MAX_SCALE).item())
    _SCALES_OK[key] = (weakref.ref(owner), ok)
    return ok


def gemm(
    a: torch.Tensor,
    w: Weights,
    out: torch.Tensor,
    w3: Weights | None = None,
    gamma: torch.Tensor | None = None,
    limit: float = 0.0,
    *,
    config: Fp8SwapConfig,
) -> torch.Tensor:
    """out = epilogue(a . deq(W)^T) for an `eligible` call (see the module docstring).

    a [T * G, K] bf16 row-major (row t * G + g against weight g); out [T * G, N] bf16 or fp32
    row-major; w3: the SwiGLU pair's second weight; gamma [T] fp32 (SwiGLU only)."""
    _check_call(a, w, out, w3, config)
    rows = a.shape[0] // w.num_experts
    cls = row_class(rows, config)
    cfg = tiles(w, w3 is not None, cls, config)
    split, chunk = plan(w, w3 is not None, cls, config)
    _check_tiles(cfg)
    _launch(a, w, w3, out, gamma, limit, cfg, rows, split, chunk)
    return out


def _check_call(a: torch.Tensor, w: Weights, out: torch.Tensor, w3: Weights | None, config: Fp8SwapConfig) -> None:
    if not eligible(a, w, out, w3, cfg=config):
        raise ValueError(
            f"fp8_swap.gemm: not an FP8 call of <= {max_rows(config)} bf16 rows per "
            f"weight (a {tuple(a.shape)} {a.dtype}, W [{w.num_experts}, "
            f"{w.out_dim}, {w.in_dim}], or the layer is off in config layers)"
        )
    if a.stride(1) != 1 or out.stride(1) != 1 or a.shape[1] != w.in_dim or out.shape != (a.shape[0], w.out_dim):
        raise ValueError(
            f"fp8_swap.gemm: shapes a {tuple(a.shape)}, W [{w.out_dim}, "
            f"{w.in_dim}], out {tuple(out.shape)} do not chain (row-major)"
        )
    for ww in (w, w3) if w3 is not None else (w,):
        if ww.data.stride(-1) != 1 or ww.scale.stride(-1) != 1:
            raise ValueError("fp8_swap.gemm reads weights and scales with contiguous rows")


def _check_tiles(cfg: dict) -> None:
    block_k, width = cfg["block_k"], cfg["rows"]
    if block_k % 32 or block_k < 32:
        raise ValueError(f"fp8_swap config block_k must be a multiple of 32, got {block_k}")
    if width < 8 or width & (width - 1):
        raise ValueError(f"fp8_swap config rows must be a power of two >= 8, got {width}")


def _launch(a, w: Weights, w3: Weights | None, out, gamma, limit: float, cfg: dict, rows: int, split: int, chunk: int):
    """One launch: N blocks x (groups x row blocks) x K segments."""
    groups, n_dim = w.num_experts, w.out_dim
    nblocks, rblocks = triton.cdiv(n_dim, cfg["block_n"]), triton.cdiv(rows, cfg["rows"])
    if split > 1:
        triton_runtime.check_counter_slots(nblocks * groups * rblocks)
    w3_ = w3 if w3 is not None else w
    part = triton_runtime.split_partials(split, w3 is not None, a.shape[0], n_dim, out, a.device)
    _fp8_swap_kernel[(nblocks, groups * rblocks, split)](
        *_args(a, w, w3_, out, gamma, part, rows, chunk, limit, split),
        **_constexprs(w, w3, w3_, out, gamma, cfg, chunk, split),
        num_warps=cfg["warps"],
        num_stages=cfg["stages"],
        **triton_runtime.launch_options(),
    )


def _args(a, w: Weights, w3_: Weights, out, gamma, part, rows: int, chunk: int, limit: float, split: int) -> tuple:
    """The kernel's positional arguments, in its signature's order."""
    return (
        a,
        a.stride(0),
        out,
        out.stride(0),
        gamma if gamma is not None else a,
        w.data,
        w.scale,
        w3_.data,
        w3_.scale,
        w.data.stride(0),
        w.data.stride(1),
        w.scale.stride(0),
        w.scale.stride(1),
        part,
        triton_runtime.arrival_counters(a.device),
        w.out_dim,
        w.in_dim,
        chunk,
        rows,
        w.num_experts,
        float(limit),
        split,
    )


def _deq_mode(cfg: dict, w: Weights, w3_: Weights) -> int:
    """DEQ: 0 fp32 decode (and under the interpreter), 1 bf16, 2 the asm1 decoder (scales fit)."""
    deq = 0 if DOT_UPCAST or cfg["deq"] == "f32" else 1
    if deq and cfg["deq"] == "asm1" and scales_fit_asm(w, w3_):
        deq = 2
    return deq


def _constexprs(w: Weights, w3, w3_: Weights, out, gamma, cfg: dict, chunk: int, split: int) -> dict:
    block_k, k_dim = cfg["block_k"], w.in_dim
    return dict(
        SWIGLU=w3 is not None,
        HAS_GAMMA=gamma is not None,
        OUT_BF16=out.dtype == torch.bfloat16,
        DEQ=_deq_mode(cfg, w, w3_),
        HW_FP8=not DOT_UPCAST,
        UPCAST=DOT_UPCAST,
        EVEN_K=k_dim % block_k == 0 and chunk % block_k == 0,
        SPLIT_K=split > 1,
        RED_UNROLL=max(1, int(cfg["red_unroll"])),
        BLOCK_N=cfg["block_n"],
        BLOCK_K=block_k,
        ROWS=cfg["rows"],
    )


FP8_SWAP_KERNEL = _fp8_swap_kernel  # public name for offline compile reports
