"""mHC in Triton (model_spec §2): write-back + next site's mixes + collapse + RMSNorm, one launch.

Same function names and signatures as `mhc/ref.py` (sinkhorn, hc_mixes, collapse, expand), plus
the fused step of the shifted schedule (§2.4), `expand_mix_collapse`:

    X'     = expand(y; post, comb, X)                    (skipped when y is None: X' = X)
    pre', post', comb' = hc_mixes(X'; fn, base, scale)   coefficient GEMM + Sinkhorn
    x      = RMSNorm_w(collapse(X', pre_in))             (optional)

D is cut into at most MHC_SPLIT slices of CH channels at prefill sizes, MhcConfig.decode_split
at decode sizes (a function of D and the size class only; CH = 128 / 64 at D = 5120), walked
in chunks of 32 channels; a token's bits can therefore differ in the last place between a decode
call and a prefill call, never between two calls of one size class. Per chunk a program loads the four streams once,
forms X'_k (FP32, j ascending, rounded to the stream dtype and stored), accumulates sum(X'^2),
the coefficient GEMM m += X'_k . fn[:, k*D + chunk]^T and the collapsed row. The GEMM runs on
the tensor cores at FP32-level accuracy: BF16 streams are exact in BF16, and fn is split into
three BF16 pieces (hi + mid + lo = 24 bits), three exact-product BF16 MMAs; FP32 streams take
three TF32 products; the interpreter computes IEEE FP32. Each slice's sums form one vector
[24 mixes | sum(X'^2) | sum(x^2)] started from zero, and a token's totals are the slice vectors
added in slice order, 0, 1, ..., whoever adds them: a program that owns every slice of its token
block adds them in registers and stores the total; when the slices of a block are spread over
several programs (decode: one program per slice, so a batch of one still fills 80 programs), each
stores its slice vectors and the last program of the block to arrive adds them in the same order.
Either way the totals are stored and read back one column per per-token vector: the mixes and
the RMSNorm scale are elementwise per token, and so is the Sinkhorn at decode (decode_sk_tok: 16
per-token values, every sum of four added left to right); at prefill it runs on the [BT, S, S]
tile of the totals, the same tile shape for every call of the size class. So a token's results
do not depend on the batch, on how many programs share its block or in what order they finish. The tile shape is the same for every
call of at most MhcConfig.decode_rows tokens (decode); longer calls (prefill) take taller token
blocks, equal up to the tensor-core instruction and in-tile reduction order the compiler picks
per tile shape (as the dense GEMM, dense/triton.py). The RMSNorm needs the whole row's statistic,
so the collapsed row is written raw and normalised in a second, L2-resident pass: over
[BLOCK_T, ND] tiles, or, for a decode block of few tokens, flat over its valid rows (contiguous
in x: one round of loads for one token). At decode on the GPU (decode_spin) every program of a
block instead normalises its own slices once the last one has published the rows' 1/rms, while
the last one runs the Sinkhorn.
S = 4 streams (hc_mult of every preset).
"""

from __future__ import annotations

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.configs import DEFAULT, KernelConfigs, MhcConfig
from flashpd.kernels.dense.triton import DOT_UPCAST, sigmoid_f32
from flashpd.kernels.quant.triton import round_bf16_if

_BLOCK_D = 64  # channels per chunk (GEMM K step: 64 per stream)
# Slices of D (at most): a function of D only, so a token's sums do not depend on the batch.
MHC_SPLIT = 40
_N = 32  # slice vector: comb (16) | pre (S) | post (S) | sum(X'^2) | sum(x^2) | zeros;
# in the totals row, column 26 then holds the row's 1/rms for the RMSNorm pass
# Launch configuration (H200-tuned; benchmarks/mhc_bench.py, bench/results/h200/mhc.md and
# mhc_decode.md):
#   decode_rows      calls of at most this many tokens take the decode tiles
#   decode_block_t   tokens per program at decode (one program per slice and token block)
#   decode_split     slices of D at decode (prefill: MHC_SPLIT); at most D / 64, or with
#                    decode_narrow D / decode_block_d (one chunk per slice)
#   decode_spin      at decode on the GPU, every program of a token block waits for the last
#                    one's 1/rms and normalises its own slices (a block's programs are resident
#                    together: <= 4 blocks x 80 programs at 3 per SM); else the last program
#                    normalises the whole rows (FLASHPD_MHC_SPIN=0 at import: off)
#   decode_pin       at decode on the GPU, the MMA operand X' goes through an opaque move, so
#                    the compiler converts the finished tile to the operand layout once instead
#                    of recomputing the write-back in each warp (4 warps: 4 times)
#   decode_sk_tok    at decode, the Sinkhorn runs on 16 per-token vectors (a token's chain in
#                    one thread, one reciprocal per row or column) instead of the [BT, S, S]
#                    tile, whose column sums cross warps
#   prefill_block_t  tokens per program for longer calls
#   *_block_d        channels per chunk (divides 64); *_stages: software pipelining depth
#   prefill_grid     programs per token block for longer calls (a divisor of the slice
#                    count); None: the fewest reaching target_programs in all
#   norm_elems       elements per [token block, channels] tile of the RMSNorm pass (four in
#                    flight)
#   decode_flat_rows decode blocks of at most this many tokens take the flat RMSNorm pass
#                    instead, flat_elems elements per load (four in flight)
#   red              slice vectors loaded at once by a token block's last program (all 80 of
#                    a decode block: one round)
# decode_narrow (slices of one 32-channel chunk when decode_split asks for more than D / 64) is
# off: with it the GPU-path tests failed on the H200 at the smoke shapes (D = 128: 4 slices of
# 32; decode logits off by a median 0.23 against the reference), cause not found; with 64-channel
# slices and decode_pin / red 80 / decode_spin on they pass (22 of 22, H200, after 71db72c). At
# D = 5120 the default split (80) gives 64-channel slices either way.
# The values: configs.MhcConfig (the H200 entry of configs.TABLE), passed in as `tuned`.


_S = 4


# ============================================================================ device helpers
@triton.jit
def _sinkhorn(logits, ITERS: tl.constexpr, eps, S: tl.constexpr):
    """logits [BT, S(j), S(k)] -> comb: row softmax (+eps), column norm, ITERS-1 x (rows, cols)."""
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    c = e / tl.sum(e, axis=2)[:, :, None] + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in tl.static_range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    return c


@triton.jit
def _norm4(a, b, c, d, eps):
    """(a, b, c, d) / (a + b + c + d + eps), the sum left to right; one reciprocal shared by
    the four (per-token [BT] vectors: each thread holds whole tokens, no cross-thread sums)."""
    r = 1.0 / ((((a + b) + c) + d) + eps)
    return a * r, b * r, c * r, d * r


@triton.jit
def _softmax4(a, b, c, d, eps):
    """Softmax of one comb row (per-token vectors) + eps."""
    m = tl.maximum(tl.maximum(tl.maximum(a, b), c), d)
    ea = tl.exp(a - m)
    eb = tl.exp(b - m)
    ec = tl.exp(c - m)
    ed = tl.exp(d - m)
    r = 1.0 / (((ea + eb) + ec) + ed)
    return ea * r + eps, eb * r + eps, ec * r + eps, ed * r + eps


@triton.jit
def _comb_logit(sp, rmask, rho, s2, base_ptr, i: tl.constexpr, S: tl.constexpr):
    """Comb logit i = j*S + k of each token: s2 * (m_i * rho) + base[2S + i], as [BT]."""
    return s2 * (tl.load(sp + i, mask=rmask, other=0.0) * rho) + tl.load(base_ptr + 2 * S + i)


@triton.jit
def _comb_row(sp, rmask, rho, s2, base_ptr, j: tl.constexpr, eps, S: tl.constexpr):
    """Softmax (+ eps) of comb row j (logits j*S .. j*S+3) of each token, as four [BT]."""
    return _softmax4(
        _comb_logit(sp, rmask, rho, s2, base_ptr, j * S, S),
        _comb_logit(sp, rmask, rho, s2, base_ptr, j * S + 1, S),
        _comb_logit(sp, rmask, rho, s2, base_ptr, j * S + 2, S),
        _comb_logit(sp, rmask, rho, s2, base_ptr, j * S + 3, S),
        eps,
    )


@triton.jit
def _sinkhorn_tok(sp, rmask, rho, s2, base_ptr, comb_ptr, r64, ITERS: tl.constexpr, eps, S: tl.constexpr):
    """The comb Sinkhorn on 16 per-token vectors c{j}{k} (j source, k destination), stored to
    comb_ptr [T, S*S]: the same steps as `_sinkhorn`, each token's chain in one thread."""
    c00, c01, c02, c03 = _comb_row(sp, rmask, rho, s2, base_ptr, 0, eps, S)
    c10, c11, c12, c13 = _comb_row(sp, rmask, rho, s2, base_ptr, 1, eps, S)
    c20, c21, c22, c23 = _comb_row(sp, rmask, rho, s2, base_ptr, 2, eps, S)
    c30, c31, c32, c33 = _comb_row(sp, rmask, rho, s2, base_ptr, 3, eps, S)
    c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)  # columns
    c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
    c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
    c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    for _ in range(ITERS - 1):  # a loop: unrolled, the 19 iterations took ptxas 4x as long
        c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, eps)  # rows
        c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, eps)
        c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, eps)
        c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, eps)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)  # columns
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    out = comb_ptr + r64 * (S * S)
    _store4(out, c00, c01, c02, c03, rmask)
    _store4(out + 4, c10, c11, c12, c13, rmask)
    _store4(out + 8, c20, c21, c22, c23, rmask)
    _store4(out + 12, c30, c31, c32, c33, rmask)


@triton.jit
def _store4(ptr, a, b, c, d, mask):
    """a, b, c, d to ptr + 0..3 (one row of a per-token S x S table)."""
    tl.store(ptr, a, mask=mask)
    tl.store(ptr + 1, b, mask=mask)
    tl.store(ptr + 2, c, mask=mask)
    tl.store(ptr + 3, d, mask=mask)


# ============================================================================ fused kernel
@triton.jit
def _load_cols(ptr, r64, rmask, S: tl.constexpr, k: tl.constexpr):
    """Column k of a per-token [T, S] FP32 table, as [BT]."""
    return tl.load(ptr + r64 * S + k, mask=rmask, other=0.0)


@triton.jit
def _expand_stream(y, pk, c0, c1, c2, c3, x0, x1, x2, x3, BF16: tl.constexpr):
    """X'_k = post_k y + (sum_j comb[j][k] X_j, j ascending), rounded to the stream dtype."""
    mixed = c0[:, None] * x0
    mixed = mixed + c1[:, None] * x1
    mixed = mixed + c2[:, None] * x2
    mixed = mixed + c3[:, None] * x3
    return round_bf16_if(pk[:, None] * y + mixed, BF16)


@triton.jit
def _fn_tile(fn_ptr, k: tl.constexpr, cols, cmask, D, S: tl.constexpr):
    """fn[row(n), k*D + cols] as [32, BD]: rows n < 16 the comb rows, then pre and post."""
    n = tl.arange(0, 32)
    frow = tl.where(n < 16, n + 2 * S, n - 16)
    fmask = (n < (2 + S) * S)[:, None] & cmask[None, :]
    return tl.load(
        fn_ptr + (frow[:, None] * (S * D) + k * D + cols[None, :]),  # int32: < 2^31
        mask=fmask,
        other=0.0,
    )


@triton.jit
def _pin_bf16(x):
    """x (BF16) unchanged, through an opaque register move: the compiler cannot recompute what
    produced x in the MMA operand's layout (which repeats it in every warp of the program) and
    converts the finished tile once instead. GPU only (inline PTX)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.bfloat16, is_pure=False, pack=2)


@triton.jit
def _mix_mma(xk, f, acc, BF16: tl.constexpr, UPCAST: tl.constexpr, PIN: tl.constexpr):
    """acc + X'_k [BT, BD] . f[32, BD]^T at FP32-level accuracy (see the module doc)."""
    if UPCAST:
        return tl.dot(xk, tl.trans(f), acc, input_precision="ieee")
    elif BF16:  # xk holds BF16 values: exact; fn = hi + mid + lo, three exact-product MMAs
        xb = xk.to(tl.bfloat16)
        if PIN:
            xb = _pin_bf16(xb)
        hi = f.to(tl.bfloat16)
        r = f - hi.to(tl.float32)
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(xb, tl.trans(lo), acc)
        acc = tl.dot(xb, tl.trans(mid), acc)
        return tl.dot(xb, tl.trans(hi), acc)
    else:
        return tl.dot(xk, tl.trans(f), acc, input_precision="tf32x3")


@triton.jit(do_not_specialize=["T", "GRID"])
def _mhc_kernel(
    x_ptr,
    xo_ptr,
    y_ptr,
    post_ptr,
    comb_ptr,
    fn_ptr,
    base_ptr,
    scale_ptr,
    pre_in_ptr,
    nw_ptr,
    pre_ptr,
    post_out_ptr,
    comb_out_ptr,
    xc_ptr,
    partial_ptr,
    counter_ptr,
    T,
    D: tl.constexpr,
    GRID,
    norm_eps,
    hc_eps,
    S: tl.constexpr,
    ITERS: tl.constexpr,
    HAS_Y: tl.constexpr,
    COLLAPSE: tl.constexpr,
    HAS_NORM_W: tl.constexpr,
    BF16: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CH: tl.constexpr,
    NSL: tl.constexpr,
    NORM_E: tl.constexpr,
    ND: tl.constexpr,
    FLAT_ROWS: tl.constexpr,
    RED: tl.constexpr,
    SPIN: tl.constexpr,
    PIN: tl.constexpr,
    SK_TOK: tl.constexpr,
):
    """Program (token block, g) of GRID per block walks slices g*NSL/GRID, ... (one compiled
    variant for every GRID); see the module doc for the order."""
    g = tl.program_id(0)  # a token block's programs are adjacent in launch order
    tb = tl.program_id(1)
    rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    r64 = rows.to(tl.int64)
    SS: tl.constexpr = S * S
    SPP = NSL // GRID  # slices per program
    col = tl.arange(0, 32)
    if HAS_Y:  # per-token coefficients, loaded once (S = 4 unrolled by hand)
        p0 = _load_cols(post_ptr, r64, rmask, S, 0)
        p1 = _load_cols(post_ptr, r64, rmask, S, 1)
        p2 = _load_cols(post_ptr, r64, rmask, S, 2)
        p3 = _load_cols(post_ptr, r64, rmask, S, 3)
        c00 = _load_cols(comb_ptr, r64, rmask, SS, 0)
        c01 = _load_cols(comb_ptr, r64, rmask, SS, 1)
        c02 = _load_cols(comb_ptr, r64, rmask, SS, 2)
        c03 = _load_cols(comb_ptr, r64, rmask, SS, 3)
        c10 = _load_cols(comb_ptr, r64, rmask, SS, 4)
        c11 = _load_cols(comb_ptr, r64, rmask, SS, 5)
        c12 = _load_cols(comb_ptr, r64, rmask, SS, 6)
        c13 = _load_cols(comb_ptr, r64, rmask, SS, 7)
        c20 = _load_cols(comb_ptr, r64, rmask, SS, 8)
        c21 = _load_cols(comb_ptr, r64, rmask, SS, 9)
        c22 = _load_cols(comb_ptr, r64, rmask, SS, 10)
        c23 = _load_cols(comb_ptr, r64, rmask, SS, 11)
        c30 = _load_cols(comb_ptr, r64, rmask, SS, 12)
        c31 = _load_cols(comb_ptr, r64, rmask, SS, 13)
        c32 = _load_cols(comb_ptr, r64, rmask, SS, 14)
        c33 = _load_cols(comb_ptr, r64, rmask, SS, 15)
    if COLLAPSE:
        q0 = _load_cols(pre_in_ptr, r64, rmask, S, 0)
        q1 = _load_cols(pre_in_ptr, r64, rmask, S, 1)
        q2 = _load_cols(pre_in_ptr, r64, rmask, S, 2)
        q3 = _load_cols(pre_in_ptr, r64, rmask, S, 3)
    total = tl.zeros((BLOCK_T, 32), dtype=tl.float32)
    for i in range(0, SPP):
        sl = g * SPP + i
        acc = tl.zeros((BLOCK_T, 32), dtype=tl.float32)
        sumsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
        xsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for c in range(0, CH // BLOCK_D):
            cols = sl * CH + c * BLOCK_D + tl.arange(0, BLOCK_D)
            cmask = cols < D
            mask = rmask[:, None] & cmask[None, :]
            xrow = x_ptr + (r64[:, None] * S) * D + cols[None, :]
            x0 = tl.load(xrow, mask=mask, other=0.0).to(tl.float32)
            x1 = tl.load(xrow + D, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(xrow + 2 * D, mask=mask, other=0.0).to(tl.float32)
            x3 = tl.load(xrow + 3 * D, mask=mask, other=0.0).to(tl.float32)
            f0 = _fn_tile(fn_ptr, 0, cols, cmask, D, S)
            f1 = _fn_tile(fn_ptr, 1, cols, cmask, D, S)
            f2 = _fn_tile(fn_ptr, 2, cols, cmask, D, S)
            f3 = _fn_tile(fn_ptr, 3, cols, cmask, D, S)
            if HAS_Y:  # write-back of the finished sublayer
                y = tl.load(y_ptr + r64[:, None] * D + cols[None, :], mask=mask, other=0.0)
                y = y.to(tl.float32)
                n0 = _expand_stream(y, p0, c00, c10, c20, c30, x0, x1, x2, x3, BF16)
                n1 = _expand_stream(y, p1, c01, c11, c21, c31, x0, x1, x2, x3, BF16)
                n2 = _expand_stream(y, p2, c02, c12, c22, c32, x0, x1, x2, x3, BF16)
                n3 = _expand_stream(y, p3, c03, c13, c23, c33, x0, x1, x2, x3, BF16)
                orow = xo_ptr + (r64[:, None] * S) * D + cols[None, :]
                tl.store(orow, n0.to(xo_ptr.dtype.element_ty), mask=mask)
                tl.store(orow + D, n1.to(xo_ptr.dtype.element_ty), mask=mask)
                tl.store(orow + 2 * D, n2.to(xo_ptr.dtype.element_ty), mask=mask)
                tl.store(orow + 3 * D, n3.to(xo_ptr.dtype.element_ty), mask=mask)
            else:
                n0, n1, n2, n3 = x0, x1, x2, x3
            sumsq += tl.sum(n0 * n0 + n1 * n1 + n2 * n2 + n3 * n3, axis=1)
            acc = _mix_mma(n0, f0, acc, BF16, UPCAST, PIN)
            acc = _mix_mma(n1, f1, acc, BF16, UPCAST, PIN)
            acc = _mix_mma(n2, f2, acc, BF16, UPCAST, PIN)
            acc = _mix_mma(n3, f3, acc, BF16, UPCAST, PIN)
            if COLLAPSE:  # x = sum_k pre_k X'_k, k ascending
                xc = q0[:, None] * n0
                xc = xc + q1[:, None] * n1
                xc = xc + q2[:, None] * n2
                xc = round_bf16_if(xc + q3[:, None] * n3, BF16)
                xsq += tl.sum(xc * xc, axis=1)
                tl.store(xc_ptr + r64[:, None] * D + cols[None, :], xc.to(xc_ptr.dtype.element_ty), mask=mask)
        # slice vector: the mixes' columns of acc, then the two statistics (acc is 0 there)
        vec = acc + tl.where(col[None, :] == 24, sumsq[:, None], 0.0)
        vec = vec + tl.where(col[None, :] == 25, xsq[:, None], 0.0)
        if GRID == 1:
            total += vec
        else:
            tl.store(partial_ptr + (sl * T + r64)[:, None] * 32 + col[None, :], vec, mask=rmask[:, None])
    tl.debug_barrier()
    # counters per token block: [arrivals, 1/rms published, departures, unused]
    cnt = counter_ptr + tb * 4
    if GRID == 1:
        arrived = GRID - 1
    else:
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel")
    sums_ptr = partial_ptr + tl.where(GRID == 1, 0, NSL).to(tl.int64) * T * 32
    if arrived == GRID - 1:  # last program of this token block: add the slices in order
        if GRID > 1:
            total = tl.zeros((BLOCK_T, 32), dtype=tl.float32)
            for j0 in range(0, NSL, RED):  # RED loads in flight
                for j in tl.static_range(RED):
                    total += tl.load(
                        partial_ptr + ((j0 + j) * T + r64)[:, None] * 32 + col[None, :],
                        mask=rmask[:, None] & (j0 + j < NSL),
                        other=0.0,
                        cache_modifier=".cg",
                    )
            tl.store(cnt, 0)  # ready for the next launch
        # the totals go through memory and are read back by the same code on every path
        tl.store(sums_ptr + r64[:, None] * 32 + col[None, :], total, mask=rmask[:, None])
        tl.debug_barrier()
        if SPIN:  # publish each row's 1/rms: every program then normalises its own slices
            xsq = tl.load(sums_ptr + r64 * 32 + 25, mask=rmask, other=0.0)
            tl.store(sums_ptr + r64 * 32 + 26, 1.0 / tl.sqrt_rn(xsq / D + norm_eps), mask=rmask)
            tl.debug_barrier()
            tl.atomic_xchg(cnt + 1, 1, sem="release")
        _mhc_finish(
            sums_ptr,
            tb * BLOCK_T,
            T,
            rows,
            rmask,
            base_ptr,
            scale_ptr,
            nw_ptr,
            pre_ptr,
            post_out_ptr,
            comb_out_ptr,
            xc_ptr,
            D,
            norm_eps,
            hc_eps,
            S,
            ITERS,
            COLLAPSE and HAS_NORM_W and not SPIN,
            BF16,
            BLOCK_T,
            NORM_E,
            ND,
            FLAT_ROWS,
            SK_TOK,
        )
    if SPIN:  # (decode on the GPU: a block's programs are resident together) wait for 1/rms
        ready = tl.atomic_add(cnt + 1, 0, sem="acquire")
        while ready == 0:
            ready = tl.atomic_add(cnt + 1, 0, sem="acquire")
        tl.debug_barrier()
        inv = tl.load(sums_ptr + r64 * 32 + 26, mask=rmask, other=0.0, cache_modifier=".cg")
        CH_P2: tl.constexpr = triton.next_power_of_2(CH)
        within = tl.arange(0, CH_P2) < CH
        for i in range(0, SPP):  # one [BLOCK_T, CH] tile per slice
            cols = tl.where(within, (g * SPP + i) * CH + tl.arange(0, CH_P2), D)
            a, w = _norm_load(xc_ptr, nw_ptr, r64, rmask, cols, D)
            _norm_store(xc_ptr, r64, rmask, cols, D, a, inv, w, BF16)
        left = tl.atomic_add(cnt + 2, 1, sem="acq_rel")
        if left == GRID - 1:  # every program has read the flag: ready for the next launch
            tl.store(cnt + 1, 0)
            tl.store(cnt + 2, 0)


@triton.jit
def _norm_part(xc_ptr, nw_ptr, sums_ptr, row0, idx, n, D: tl.constexpr, BF16: tl.constexpr):
    """Elements idx (flat over the block's rows, which are contiguous) of the raw collapsed
    rows (written by this launch: from L2), their weight and their row's 1/rms -> x."""
    m = idx < n
    r = idx // D
    w = tl.load(nw_ptr + (idx - r * D), mask=m, other=0.0).to(tl.float32)
    inv = tl.load(sums_ptr + (row0 + r).to(tl.int64) * 32 + 26, mask=m, other=0.0, cache_modifier=".cg")
    xc = tl.load(xc_ptr + row0.to(tl.int64) * D + idx, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    return round_bf16_if(xc * inv * w, BF16)


@triton.jit
def _norm_load(xc_ptr, nw_ptr, r64, rmask, cols, D: tl.constexpr):
    """Raw collapsed rows r64 x cols (written by this launch: from L2) and the weight, FP32."""
    mask = rmask[:, None] & (cols[None, :] < D)
    xc = tl.load(xc_ptr + r64[:, None] * D + cols[None, :], mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return xc, tl.load(nw_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)


@triton.jit
def _norm_store(xc_ptr, r64, rmask, cols, D: tl.constexpr, xc, inv, w, BF16: tl.constexpr):
    mask = rmask[:, None] & (cols[None, :] < D)
    tl.store(
        xc_ptr + r64[:, None] * D + cols[None, :],
        round_bf16_if(xc * inv[:, None] * w[None, :], BF16).to(xc_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _mhc_finish(
    sums_ptr,
    row0,
    T,
    rows,
    rmask,
    base_ptr,
    scale_ptr,
    nw_ptr,
    pre_ptr,
    post_out_ptr,
    comb_out_ptr,
    xc_ptr,
    D: tl.constexpr,
    norm_eps,
    hc_eps,
    S: tl.constexpr,
    ITERS: tl.constexpr,
    NORM: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NORM_E: tl.constexpr,
    ND: tl.constexpr,
    FLAT_ROWS: tl.constexpr,
    SK_TOK: tl.constexpr,
):
    """Mixes from the full-D totals (sums_ptr: [T, 32], read back from memory), then, with
    NORM, the RMSNorm of the collapsed rows (written raw before)."""
    r64 = rows.to(tl.int64)
    sp = sums_ptr + r64 * 32
    SS: tl.constexpr = S * S
    sidx = tl.arange(0, S)
    sumsq = tl.load(sp + 24, mask=rmask, other=0.0)
    rho = 1.0 / tl.sqrt_rn(sumsq / (S * D) + norm_eps)
    # mixes: m = rho * (fn . z), then pre / post / Sinkhorn(comb); columns: comb | pre | post
    m_pre = tl.load(sp[:, None] + SS + sidx[None, :], mask=rmask[:, None], other=0.0)
    m_post = tl.load(sp[:, None] + SS + S + sidx[None, :], mask=rmask[:, None], other=0.0)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = sigmoid_f32(s0 * (m_pre * rho[:, None]) + tl.load(base_ptr + sidx)[None, :]) + hc_eps
    post = 2.0 * sigmoid_f32(s1 * (m_post * rho[:, None]) + tl.load(base_ptr + S + sidx)[None, :])
    tl.store(pre_ptr + r64[:, None] * S + sidx[None, :], pre, mask=rmask[:, None])
    tl.store(post_out_ptr + r64[:, None] * S + sidx[None, :], post, mask=rmask[:, None])
    if SK_TOK:  # each token's Sinkhorn in one thread (decode)
        _sinkhorn_tok(sp, rmask, rho, s2, base_ptr, comb_out_ptr, r64, ITERS, hc_eps, S)
    else:  # on the [BT, S, S] tile
        k3 = tl.arange(0, S)[None, None, :]
        j3 = tl.arange(0, S)[None, :, None]
        m_comb = tl.load(sp[:, None, None] + j3 * S + k3, mask=rmask[:, None, None], other=0.0)
        base_c = tl.load(base_ptr + 2 * S + j3 * S + k3)
        comb = _sinkhorn(s2 * (m_comb * rho[:, None, None]) + base_c, ITERS, hc_eps, S)
        tl.store(comb_out_ptr + r64[:, None, None] * SS + j3 * S + k3, comb, mask=rmask[:, None, None])
    if NORM:  # second pass: RMSNorm of the collapsed rows (L2-resident)
        xsq = tl.load(sp + 25, mask=rmask, other=0.0)
        inv = 1.0 / tl.sqrt_rn(xsq / D + norm_eps)
        nvalid = tl.minimum(T - row0, BLOCK_T)
        if nvalid <= FLAT_ROWS:  # few rows (decode): the block's rows are contiguous in x,
            # one flat pass over its valid elements, four loads in flight (a decode token:
            # one round, where [BLOCK_T, ND] tiles take D / (4 ND) mostly masked rounds)
            tl.store(sp + 26, inv, mask=rmask)  # 1/rms per row, gathered below
            tl.debug_barrier()
            n = nvalid * D
            base = xc_ptr + row0.to(tl.int64) * D
            for e0 in range(0, n, 4 * NORM_E):
                i0 = e0 + tl.arange(0, NORM_E)
                a0 = _norm_part(xc_ptr, nw_ptr, sums_ptr, row0, i0, n, D, BF16)
                a1 = _norm_part(xc_ptr, nw_ptr, sums_ptr, row0, i0 + NORM_E, n, D, BF16)
                a2 = _norm_part(xc_ptr, nw_ptr, sums_ptr, row0, i0 + 2 * NORM_E, n, D, BF16)
                a3 = _norm_part(xc_ptr, nw_ptr, sums_ptr, row0, i0 + 3 * NORM_E, n, D, BF16)
                ty = xc_ptr.dtype.element_ty
                tl.store(base + i0, a0.to(ty), mask=i0 < n)
                tl.store(base + i0 + NORM_E, a1.to(ty), mask=i0 + NORM_E < n)
                tl.store(base + i0 + 2 * NORM_E, a2.to(ty), mask=i0 + 2 * NORM_E < n)
                tl.store(base + i0 + 3 * NORM_E, a3.to(ty), mask=i0 + 3 * NORM_E < n)
        else:  # [BLOCK_T, ND] tiles, four in flight
            for d0 in range(0, D, 4 * ND):
                c0 = d0 + tl.arange(0, ND)
                a0, w0 = _norm_load(xc_ptr, nw_ptr, r64, rmask, c0, D)
                a1, w1 = _norm_load(xc_ptr, nw_ptr, r64, rmask, c0 + ND, D)
                a2, w2 = _norm_load(xc_ptr, nw_ptr, r64, rmask, c0 + 2 * ND, D)
                a3, w3 = _norm_load(xc_ptr, nw_ptr, r64, rmask, c0 + 3 * ND, D)
                _norm_store(xc_ptr, r64, rmask, c0, D, a0, inv, w0, BF16)
                _norm_store(xc_ptr, r64, rmask, c0 + ND, D, a1, inv, w1, BF16)
                _norm_store(xc_ptr, r64, rmask, c0 + 2 * ND, D, a2, inv, w2, BF16)
                _norm_store(xc_ptr, r64, rmask, c0 + 3 * ND, D, a3, inv, w3, BF16)


def _slices(dim: int, split: int, gran: int = _BLOCK_D) -> tuple[int, int]:
    """(slice count, channels per slice, a multiple of gran) of D: a function of D, the split
    and gran alone (batch invariance)."""
    n = min(split, triton.cdiv(dim, gran))
    ch = triton.cdiv(triton.cdiv(dim, n), gran) * gran
    return triton.cdiv(dim, ch), ch


def _programs_per_block(kind: str, num_tokens: int, block_t: int, nsl: int, cfg: MhcConfig) -> int:
    """Programs per token block: every slice (decode); prefill_grid, or the fewest dividing the
    slice count that reach target_programs (prefill)."""
    grid = nsl if kind == "decode" else cfg.prefill_grid
    if kind == "prefill":
        if grid is None:
            blocks = triton.cdiv(num_tokens, block_t)
            grid = next((g for g in range(1, nsl + 1) if nsl % g == 0 and blocks * g >= cfg.target_programs), nsl)
    if nsl % grid:
        raise ValueError(f"programs per token block {grid} must divide the slice count {nsl}")
    return grid


def launch_plan(num_tokens: int, dim: int, cfg: MhcConfig) -> dict:
    """Tiles of one call: tokens per program, warps, programs per token block, slices."""
    kind = "decode" if num_tokens <= cfg.decode_rows else "prefill"
    block_t, block_d = getattr(cfg, f"{kind}_block_t"), getattr(cfg, f"{kind}_block_d")
    if block_d <= 0 or _BLOCK_D % block_d:
        raise ValueError(f"{kind}_block_d {block_d} must divide {_BLOCK_D}")
    # decode slices may be as narrow as one chunk (decode_split 160 at D = 5120: 32 channels)
    nsl, ch = (
        _slices(dim, cfg.decode_split, block_d if cfg.decode_narrow else _BLOCK_D)
        if kind == "decode"
        else _slices(dim, MHC_SPLIT)
    )
    warps, stages = getattr(cfg, f"{kind}_warps"), getattr(cfg, f"{kind}_stages")
    grid = _programs_per_block(kind, num_tokens, block_t, nsl, cfg)
    return {
        "block_t": block_t,
        "block_d": block_d,
        "warps": warps,
        "stages": stages,
        "grid": grid,
        "nsl": nsl,
        "ch": ch,
        "red": min(nsl, cfg.red),
        "norm_e": triton.next_power_of_2(cfg.flat_elems),
        "norm_d": min(max(16, triton.next_power_of_2(cfg.norm_elems // block_t)), triton.next_power_of_2(dim)),
        "flat_rows": cfg.decode_flat_rows if kind == "decode" else 0,
        "spin": kind == "decode" and bool(cfg.decode_spin) and not triton_runtime.interpreting(),
        "pin": kind == "decode" and bool(cfg.decode_pin) and not DOT_UPCAST,
        "sk_tok": kind == "decode" and bool(cfg.decode_sk_tok),
    }


def kernel_constants(plan: dict) -> dict:
    """The fused kernel's tile constexprs of a launch plan (SPIN aside: it also needs the norm)."""
    return {
        "BLOCK_T": plan["block_t"],
        "BLOCK_D": plan["block_d"],
        "CH": plan["ch"],
        "NSL": plan["nsl"],
        "NORM_E": plan["norm_e"],
        "ND": plan["norm_d"],
        "FLAT_ROWS": plan["flat_rows"],
        "RED": plan["red"],
        "PIN": plan["pin"],
        "SK_TOK": plan["sk_tok"],
    }


def expand_mix_collapse(
    y: torch.Tensor | None,
    streams: torch.Tensor,
    post: torch.Tensor | None,
    comb: torch.Tensor | None,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    pre_in: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One fused mHC step (see module doc).

    y [T, D] | None, streams [T, S, D], post [T, S], comb [T, S, S], fn [(2+S)*S, S*D],
    pre_in [T, S] | None, norm_weight [D] | None ->
    (new streams [T, S, D], pre [T, S], post' [T, S], comb' [T, S, S], x [T, D] | None).
    """
    _check_mhc(y, streams, post, comb, fn, base, scale, pre_in)
    x = streams.contiguous()
    outs = _mhc_outputs(x, y, pre_in)
    if x.shape[0] == 0:
        return outs
    _launch(x, y, post, comb, pre_in, norm_weight, (fn, base, scale, sinkhorn_iters, hc_eps, norm_eps), outs, tuned.mhc)
    return outs


def _mhc_outputs(x: torch.Tensor, y: torch.Tensor | None, pre_in: torch.Tensor | None) -> tuple:
    """(new streams, pre, post', comb', x collapsed or None): new streams are x itself without y."""
    num_tokens, num_streams, dim = x.shape
    new_streams = torch.empty_like(x) if y is not None else x
    pre_o = torch.empty(num_tokens, num_streams, dtype=torch.float32, device=x.device)
    post_o = torch.empty_like(pre_o)
    comb_o = torch.empty(num_tokens, num_streams, num_streams, dtype=torch.float32, device=x.device)
    xc = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device) if pre_in is not None else None
    return new_streams, pre_o, post_o, comb_o, xc


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def _launch(x, y, post, comb, pre_in, norm_weight, params: tuple, outs: tuple, cfg: MhcConfig) -> None:
    """The fused kernel over (programs per token block, token blocks)."""
    fn, base, scale, sinkhorn_iters, hc_eps, norm_eps = params
    num_tokens, dim = x.shape[0], x.shape[2]
    plan = launch_plan(num_tokens, dim, cfg)
    n_blocks = triton.cdiv(num_tokens, plan["block_t"])
    _mhc_kernel[(plan["grid"], n_blocks)](
        x,
        outs[0],
        *_input_args(x, y, post, comb, fn, base, scale, pre_in, norm_weight, dummy=outs[1]),
        *_output_args(outs, plan, n_blocks),
        num_tokens,
        dim,
        plan["grid"],
        float(norm_eps),
        float(hc_eps),
        **_flags(x, y, pre_in, norm_weight, sinkhorn_iters, plan),
        **kernel_constants(plan),
        num_warps=plan["warps"],
        num_stages=plan["stages"],
        **triton_runtime.launch_options(),
    )


def _input_args(x, y, post, comb, fn, base, scale, pre_in, norm_weight, dummy: torch.Tensor) -> tuple:
    """The kernel's inputs after (x, new streams), in its signature's order (fp32 mixes; `dummy`
    for absent ones)."""
    return (
        y.contiguous() if y is not None else x,
        _f32(post) if post is not None else dummy,
        _f32(comb) if comb is not None else dummy,
        _f32(fn),
        _f32(base),
        _f32(scale),
        _f32(pre_in) if pre_in is not None else dummy,
        norm_weight.contiguous() if norm_weight is not None else dummy,
    )


def _output_args(outs: tuple, plan: dict, n_blocks: int) -> tuple:
    """The kernel's outputs, then its scratch: the slice vectors (grid > 1) and after them the
    totals, and the arrival counters."""
    _, pre_o, post_o, comb_o, xc = outs
    num_tokens, dev = pre_o.shape[0], pre_o.device
    partial = torch.empty(plan["nsl"] + 1 if plan["grid"] > 1 else 1, num_tokens, _N, dtype=torch.float32, device=dev)
    return (
        pre_o,
        post_o,
        comb_o,
        xc if xc is not None else pre_o,
        partial,
        triton_runtime.arrival_counters(dev, 4 * n_blocks),
    )


def _flags(x, y, pre_in, norm_weight, sinkhorn_iters: int, plan: dict) -> dict:
    return dict(
        S=x.shape[1],
        ITERS=sinkhorn_iters,
        HAS_Y=y is not None,
        COLLAPSE=pre_in is not None,
        HAS_NORM_W=norm_weight is not None,
        BF16=x.dtype == torch.bfloat16,
        UPCAST=DOT_UPCAST,
        SPIN=plan["spin"] and pre_in is not None and norm_weight is not None,
    )


def _check_mhc(y, streams, post, comb, fn, base, scale, pre_in) -> None:
    if streams.ndim != 3 or streams.shape[1] != _S:
        raise ValueError(f"streams must be [T, {_S}, D], got {tuple(streams.shape)}")
    if streams.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"streams must be bf16 or fp32, got {streams.dtype}")
    num_tokens, s, dim = streams.shape
    if fn.shape != ((2 + s) * s, s * dim) or base.shape != ((2 + s) * s,) or scale.shape != (3,):
        raise ValueError(
            f"mHC params fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale "
            f"{tuple(scale.shape)} do not fit S={s}, D={dim}"
        )
    if y is not None:
        if y.shape != (num_tokens, dim) or post is None or comb is None:
            raise ValueError("expand needs y [T, D], post [T, S] and comb [T, S, S]")
        if post.shape != (num_tokens, s) or comb.shape != (num_tokens, s, s):
            raise ValueError(f"post {tuple(post.shape)} / comb {tuple(comb.shape)} mismatch")
    if pre_in is not None and pre_in.shape != (num_tokens, s):
        raise ValueError(f"pre_in must be [T, S], got {tuple(pre_in.shape)}")
    triton_runtime.check_device(streams, fn)


# ============================================================================ ref surface
def hc_mixes(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, S, D] -> pre [T, S], post [T, S], comb [T, S, S], all FP32 (one launch)."""
    _, pre, post, comb, _ = expand_mix_collapse(
        None, streams, None, None, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, tuned=tuned
    )
    return pre, post, comb


@triton.jit
def _sinkhorn_kernel(l_ptr, c_ptr, T, eps, S: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    idx = rows[:, None].to(tl.int64) * (S * S) + tl.arange(0, S * S)[None, :]
    mask = (rows < T)[:, None]
    logits = tl.reshape(tl.load(l_ptr + idx, mask=mask, other=0.0), (BLOCK_T, S, S))
    comb = tl.reshape(_sinkhorn(logits, ITERS, eps, S), (BLOCK_T, S * S))
    tl.store(c_ptr + idx, comb, mask=mask)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits [T, S, S] -> comb [T, S, S] FP32 (§2.2 step 5)."""
    if iters < 1:
        raise ValueError(f"sinkhorn needs at least one iteration, got {iters}")
    if logits.ndim != 3 or logits.shape[1:] != (_S, _S):
        raise ValueError(f"logits must be [T, {_S}, {_S}], got {tuple(logits.shape)}")
    triton_runtime.check_device(logits)
    lg = logits.to(torch.float32).contiguous()
    comb = torch.empty_like(lg)
    if lg.shape[0]:
        _sinkhorn_kernel[(triton.cdiv(lg.shape[0], 16),)](
            lg, comb, lg.shape[0], float(eps), S=_S, ITERS=iters, BLOCK_T=16
        )
    return comb


@triton.jit
def _collapse_kernel(x_ptr, pre_ptr, out_ptr, D, S: tl.constexpr, BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    out = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(S):
        xk = tl.load(x_ptr + (t * S + k) * D + cols, mask=mask, other=0.0).to(tl.float32)
        pk = tl.load(pre_ptr + t * S + k)
        if k == 0:
            out = pk * xk
        else:
            out = out + pk * xk
    tl.store(out_ptr + t * D + cols, round_bf16_if(out, BF16).to(out_ptr.dtype.element_ty), mask=mask)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [T, S, D], pre [T, S] -> x [T, D] = round(sum_k pre_k X_k)."""
    triton_runtime.check_device(streams, pre)
    num_tokens, s, dim = streams.shape
    x = streams.contiguous()
    out = torch.empty(num_tokens, dim, dtype=streams.dtype, device=streams.device)
    if num_tokens:
        _collapse_kernel[(num_tokens, triton.cdiv(dim, 256))](
            x,
            pre.to(torch.float32).contiguous(),
            out,
            dim,
            S=s,
            BF16=streams.dtype == torch.bfloat16,
            BLOCK_D=256,
            **triton_runtime.launch_options(),
        )
    return out


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(
    y_ptr,
    x_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    T,
    D,
    S: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """[BLOCK_T tokens, BLOCK_D channels] per program; each stream loaded once."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    r64 = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = rmask[:, None] & (cols < D)[None, :]
    y = tl.load(y_ptr + r64[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xrow = x_ptr + (r64[:, None] * S) * D + cols[None, :]
    x0 = tl.load(xrow, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(xrow + D, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xrow + 2 * D, mask=mask, other=0.0).to(tl.float32)
    x3 = tl.load(xrow + 3 * D, mask=mask, other=0.0).to(tl.float32)
    orow = out_ptr + (r64[:, None] * S) * D + cols[None, :]
    for k in tl.static_range(S):
        out = _expand_out(y, post_ptr, comb_ptr, r64, rmask, x0, x1, x2, x3, S, k, BF16)
        tl.store(orow + k * D, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_out(
    y, post_ptr, comb_ptr, r64, rmask, x0, x1, x2, x3, S: tl.constexpr, k: tl.constexpr, BF16: tl.constexpr
):
    """New stream k: post_k * y + sum_j comb[j, k] * x_j (`_expand_stream`), its mixes loaded."""
    SS: tl.constexpr = S * S
    return _expand_stream(
        y,
        _load_cols(post_ptr, r64, rmask, S, k),
        _load_cols(comb_ptr, r64, rmask, SS, k),
        _load_cols(comb_ptr, r64, rmask, SS, S + k),
        _load_cols(comb_ptr, r64, rmask, SS, 2 * S + k),
        _load_cols(comb_ptr, r64, rmask, SS, 3 * S + k),
        x0,
        x1,
        x2,
        x3,
        BF16,
    )


def expand(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y [T, D], streams [T, S, D], post [T, S], comb [T, S, S] -> new streams [T, S, D]."""
    triton_runtime.check_device(y, streams, post, comb)
    num_tokens, s, dim = streams.shape
    x = streams.contiguous()
    out = torch.empty_like(x)
    if num_tokens:
        _expand_kernel[(triton.cdiv(num_tokens, 4), triton.cdiv(dim, 256))](
            y.contiguous(),
            x,
            post.to(torch.float32).contiguous(),
            comb.to(torch.float32).contiguous(),
            out,
            num_tokens,
            dim,
            S=s,
            BF16=streams.dtype == torch.bfloat16,
            BLOCK_T=4,
            BLOCK_D=256,
            **triton_runtime.launch_options(),
        )
    return out
