"""mHC in Triton (model_spec §2): write-back + next site's mixes + collapse + RMSNorm, one launch.

Same function names and signatures as `mhc/ref.py` (sinkhorn, hc_mixes, collapse, expand), plus
the fused step of the shifted schedule (§2.4), `expand_mix_collapse`:

    X'     = expand(y; post, comb, X)                    (skipped when y is None: X' = X)
    pre', post', comb' = hc_mixes(X'; fn, base, scale)   coefficient GEMM + Sinkhorn
    x      = RMSNorm_w(collapse(X', pre_in))             (optional)

One program owns 16 (32 for long prefills) tokens and walks D in chunks of 64 channels; per
chunk it loads the four streams once, forms X'_k (FP32, j ascending, rounded to the stream dtype
and stored), accumulates sum(X'^2), the coefficient GEMM m += X'_k . fn[:, k*D + chunk]^T (FP32
operands as three TF32 products on the GPU, FP32-level accuracy; IEEE FP32 in the interpreter),
and the collapsed row. The
RMSNorm needs the whole row's statistic, so the collapsed row is written raw and normalised in
a second, L2-resident pass of the same program. S = 4 streams (hc_mult of every preset).
"""

from __future__ import annotations

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.dense.triton import DOT_UPCAST, mma_tf32x3, round_bf16, sigmoid_f32

_BLOCK_D = 32


_BLOCK_T = 16
# Slices of D per token block. A constant, so a token's sums do not depend on the batch; it
# spreads a decode batch (a few token blocks) over SPLIT x more programs.
MHC_SPLIT = 8

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters; every launch leaves them zeroed again."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf
_S = 4


# ============================================================================ device helpers
@triton.jit
def _round(x, BF16: tl.constexpr):
    if BF16:
        x = round_bf16(x)
    return x


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
def _pick(x3, group, g: tl.constexpr):
    """x3 [BT, G, S] -> [BT, S], the row `g` of the middle axis."""
    return tl.sum(tl.where(group == g, x3, 0.0), axis=1)


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
    return _round(pk[:, None] * y + mixed, BF16)


@triton.jit
def _mix_dot(xk, fn_ptr, k: tl.constexpr, cols, D, m_comb, m_pp, S: tl.constexpr,
             UPCAST: tl.constexpr):
    """m += X'_k . fn[:, k*D + cols]^T for the comb rows (16) and the pre/post rows (2S, padded)."""
    n16 = tl.arange(0, 16)
    fcol = (k * D + cols)[None, :]
    fmask = cols[None, :] < D
    f_comb = tl.load(fn_ptr + (2 * S + n16[:, None]).to(tl.int64) * (S * D) + fcol, mask=fmask,
                     other=0.0)  # [16, BD]
    f_pp = tl.load(fn_ptr + n16[:, None].to(tl.int64) * (S * D) + fcol,
                   mask=fmask & (n16[:, None] < 2 * S), other=0.0)
    return (mma_tf32x3(xk, tl.trans(f_comb), m_comb, UPCAST),
            mma_tf32x3(xk, tl.trans(f_pp), m_pp, UPCAST))


@triton.jit
def _mhc_kernel(
    x_ptr, xo_ptr, y_ptr, post_ptr, comb_ptr, fn_ptr, base_ptr, scale_ptr, pre_in_ptr, nw_ptr,
    pre_ptr, post_out_ptr, comb_out_ptr, xc_ptr, partial_ptr, counter_ptr, T, D, chunk,
    norm_eps, hc_eps,
    S: tl.constexpr, ITERS: tl.constexpr, HAS_Y: tl.constexpr, COLLAPSE: tl.constexpr,
    HAS_NORM_W: tl.constexpr, BF16: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
):
    """Program (token block, slice) walks its slice of D; the last slice to finish reduces the
    partial sums in slice order and runs the mixes, Sinkhorn and the RMSNorm pass."""
    tb = tl.program_id(0)
    sp = tl.program_id(1)
    rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    r64 = rows.to(tl.int64)
    SS: tl.constexpr = S * S
    n16 = tl.arange(0, 16)
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
    sumsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    xsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    m_comb = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
    m_pp = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
    d_end = tl.minimum(sp * chunk + chunk, D)
    for d0 in range(sp * chunk, d_end, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (cols[None, :] < d_end)
        xrow = x_ptr + (r64[:, None] * S) * D + cols[None, :]
        x0 = tl.load(xrow, mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(xrow + D, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xrow + 2 * D, mask=mask, other=0.0).to(tl.float32)
        x3 = tl.load(xrow + 3 * D, mask=mask, other=0.0).to(tl.float32)
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
        m_comb, m_pp = _mix_dot(n0, fn_ptr, 0, cols, D, m_comb, m_pp, S, UPCAST)
        m_comb, m_pp = _mix_dot(n1, fn_ptr, 1, cols, D, m_comb, m_pp, S, UPCAST)
        m_comb, m_pp = _mix_dot(n2, fn_ptr, 2, cols, D, m_comb, m_pp, S, UPCAST)
        m_comb, m_pp = _mix_dot(n3, fn_ptr, 3, cols, D, m_comb, m_pp, S, UPCAST)
        if COLLAPSE:  # x = sum_k pre_k X'_k, k ascending
            xc = q0[:, None] * n0
            xc = xc + q1[:, None] * n1
            xc = xc + q2[:, None] * n2
            xc = _round(xc + q3[:, None] * n3, BF16)
            xsq += tl.sum(xc * xc, axis=1)
            tl.store(xc_ptr + r64[:, None] * D + cols[None, :], xc.to(xc_ptr.dtype.element_ty),
                     mask=mask)
    if SPLIT == 1:
        _mhc_finish(sumsq, xsq, m_comb, m_pp, rows, rmask, base_ptr, scale_ptr, nw_ptr, pre_ptr,
                    post_out_ptr, comb_out_ptr, xc_ptr, D, norm_eps, hc_eps, S, ITERS,
                    COLLAPSE, HAS_NORM_W, BF16, BLOCK_T, BLOCK_D, False)
    else:
        # partials [SPLIT, T, 64]: m_comb (16) | m_pp (16) | sumsq | xsq
        part = partial_ptr + (sp * T + r64) * 64  # [BT]
        tl.store(part[:, None] + n16[None, :], m_comb, mask=rmask[:, None])
        tl.store(part[:, None] + 16 + n16[None, :], m_pp, mask=rmask[:, None])
        tl.store(part + 32, sumsq, mask=rmask)
        tl.store(part + 33, xsq, mask=rmask)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tb, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # last slice of this token block: reduce in slice order
            m_comb = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
            m_pp = tl.zeros((BLOCK_T, 16), dtype=tl.float32)
            sumsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
            xsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
            for i in tl.static_range(SPLIT):
                pi = partial_ptr + (i * T + r64) * 64  # [BT]
                m_comb += tl.load(pi[:, None] + n16[None, :], mask=rmask[:, None], other=0.0,
                                  cache_modifier=".cg")
                m_pp += tl.load(pi[:, None] + 16 + n16[None, :], mask=rmask[:, None], other=0.0,
                                cache_modifier=".cg")
                sumsq += tl.load(pi + 32, mask=rmask, other=0.0, cache_modifier=".cg")
                xsq += tl.load(pi + 33, mask=rmask, other=0.0, cache_modifier=".cg")
            tl.store(counter_ptr + tb, 0)  # ready for the next launch
            _mhc_finish(sumsq, xsq, m_comb, m_pp, rows, rmask, base_ptr, scale_ptr, nw_ptr,
                        pre_ptr, post_out_ptr, comb_out_ptr, xc_ptr, D, norm_eps, hc_eps, S,
                        ITERS, COLLAPSE, HAS_NORM_W, BF16, BLOCK_T, BLOCK_D, True)


@triton.jit
def _mhc_finish(sumsq, xsq, m_comb, m_pp, rows, rmask, base_ptr, scale_ptr, nw_ptr, pre_ptr,
                post_out_ptr, comb_out_ptr, xc_ptr, D, norm_eps, hc_eps, S: tl.constexpr,
                ITERS: tl.constexpr, COLLAPSE: tl.constexpr, HAS_NORM_W: tl.constexpr,
                BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                FROM_L2: tl.constexpr):
    """Mixes from the full-D sums, then RMSNorm of the collapsed rows (written raw before)."""
    r64 = rows.to(tl.int64)
    SS: tl.constexpr = S * S
    n16 = tl.arange(0, 16)
    # mixes: m = rho * (fn . z), then pre / post / Sinkhorn(comb)
    rho = 1.0 / tl.sqrt_rn(sumsq / (S * D) + norm_eps)
    base_pp = tl.load(base_ptr + n16, mask=n16 < 2 * S, other=0.0)
    base_c = tl.load(base_ptr + 2 * S + n16)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pp = tl.reshape(m_pp * rho[:, None], (BLOCK_T, 4, S))  # rows: pre, post, pad, pad
    group = tl.arange(0, 4)[None, :, None]
    bpp = tl.reshape(base_pp, (4, S))[None, :, :]
    pre = sigmoid_f32(s0 * _pick(pp, group, 0) + _pick(bpp, group, 0)) + hc_eps  # [BT, S]
    post = 2.0 * sigmoid_f32(s1 * _pick(pp, group, 1) + _pick(bpp, group, 1))
    logits = s2 * (m_comb * rho[:, None]) + base_c[None, :]
    comb = tl.reshape(_sinkhorn(tl.reshape(logits, (BLOCK_T, S, S)), ITERS, hc_eps, S),
                      (BLOCK_T, SS))
    sidx = tl.arange(0, S)[None, :]
    tl.store(pre_ptr + r64[:, None] * S + sidx, pre, mask=rmask[:, None])
    tl.store(post_out_ptr + r64[:, None] * S + sidx, post, mask=rmask[:, None])
    tl.store(comb_out_ptr + r64[:, None] * SS + n16[None, :], comb, mask=rmask[:, None])
    if COLLAPSE and HAS_NORM_W:  # second pass: RMSNorm of the collapsed row (L2-resident)
        inv = 1.0 / tl.sqrt_rn(xsq / D + norm_eps)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = rmask[:, None] & (cols[None, :] < D)
            ptr = xc_ptr + r64[:, None] * D + cols[None, :]
            if FROM_L2:  # written by other programs of this launch
                xc = tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            else:
                xc = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(nw_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
            tl.store(ptr, _round(xc * inv[:, None] * w[None, :], BF16).to(xc_ptr.dtype.element_ty),
                     mask=mask)


def expand_mix_collapse(
    y: torch.Tensor | None, streams: torch.Tensor, post: torch.Tensor | None,
    comb: torch.Tensor | None, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    sinkhorn_iters: int, hc_eps: float, norm_eps: float, pre_in: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One fused mHC step (see module doc).

    y [T, D] | None, streams [T, S, D], post [T, S], comb [T, S, S], fn [(2+S)*S, S*D],
    pre_in [T, S] | None, norm_weight [D] | None ->
    (new streams [T, S, D], pre [T, S], post' [T, S], comb' [T, S, S], x [T, D] | None).
    """
    _check_mhc(y, streams, post, comb, fn, base, scale, pre_in)
    num_tokens, num_streams, dim = streams.shape
    dev = streams.device
    x = streams.contiguous()
    new_streams = torch.empty_like(x) if y is not None else x
    pre_o = torch.empty(num_tokens, num_streams, dtype=torch.float32, device=dev)
    post_o = torch.empty_like(pre_o)
    comb_o = torch.empty(num_tokens, num_streams, num_streams, dtype=torch.float32, device=dev)
    xc = torch.empty(num_tokens, dim, dtype=x.dtype, device=dev) if pre_in is not None else None
    if num_tokens == 0:
        return new_streams, pre_o, post_o, comb_o, xc
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    dummy = pre_o
    n_blocks = triton.cdiv(num_tokens, _BLOCK_T)
    split = MHC_SPLIT if dim >= MHC_SPLIT * _BLOCK_D else 1
    chunk = triton.cdiv(triton.cdiv(dim, split), _BLOCK_D) * _BLOCK_D
    partial = torch.empty(split, num_tokens, 64, dtype=torch.float32, device=dev)
    _mhc_kernel[(n_blocks, split)](
        x, new_streams, y.contiguous() if y is not None else x,
        f32(post) if post is not None else dummy, f32(comb) if comb is not None else dummy,
        f32(fn), f32(base), f32(scale), f32(pre_in) if pre_in is not None else dummy,
        norm_weight if norm_weight is not None else dummy, pre_o, post_o, comb_o,
        xc if xc is not None else dummy, partial, _counters(dev, n_blocks), num_tokens, dim,
        chunk, float(norm_eps), float(hc_eps),
        S=num_streams, ITERS=sinkhorn_iters, HAS_Y=y is not None, COLLAPSE=pre_in is not None,
        HAS_NORM_W=norm_weight is not None, BF16=x.dtype == torch.bfloat16, UPCAST=DOT_UPCAST,
        BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D, SPLIT=split, num_warps=8,
        **triton_runtime.launch_options())
    return new_streams, pre_o, post_o, comb_o, xc


def _check_mhc(y, streams, post, comb, fn, base, scale, pre_in) -> None:
    if streams.ndim != 3 or streams.shape[1] != _S:
        raise ValueError(f"streams must be [T, {_S}, D], got {tuple(streams.shape)}")
    if streams.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"streams must be bf16 or fp32, got {streams.dtype}")
    num_tokens, s, dim = streams.shape
    if fn.shape != ((2 + s) * s, s * dim) or base.shape != ((2 + s) * s,) or scale.shape != (3,):
        raise ValueError(f"mHC params fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale "
                         f"{tuple(scale.shape)} do not fit S={s}, D={dim}")
    if y is not None:
        if y.shape != (num_tokens, dim) or post is None or comb is None:
            raise ValueError("expand needs y [T, D], post [T, S] and comb [T, S, S]")
        if post.shape != (num_tokens, s) or comb.shape != (num_tokens, s, s):
            raise ValueError(f"post {tuple(post.shape)} / comb {tuple(comb.shape)} mismatch")
    if pre_in is not None and pre_in.shape != (num_tokens, s):
        raise ValueError(f"pre_in must be [T, S], got {tuple(pre_in.shape)}")
    triton_runtime.check_device(streams, fn)


# ============================================================================ ref surface
def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             sinkhorn_iters: int, hc_eps: float,
             norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, S, D] -> pre [T, S], post [T, S], comb [T, S, S], all FP32 (one launch)."""
    _, pre, post, comb, _ = expand_mix_collapse(None, streams, None, None, fn, base, scale,
                                                sinkhorn_iters, hc_eps, norm_eps)
    return pre, post, comb


@triton.jit
def _sinkhorn_kernel(l_ptr, c_ptr, T, eps, S: tl.constexpr, ITERS: tl.constexpr,
                     BLOCK_T: tl.constexpr):
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
            lg, comb, lg.shape[0], float(eps), S=_S, ITERS=iters, BLOCK_T=16)
    return comb


@triton.jit
def _collapse_kernel(x_ptr, pre_ptr, out_ptr, D, S: tl.constexpr, BF16: tl.constexpr,
                     BLOCK_D: tl.constexpr):
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
    tl.store(out_ptr + t * D + cols, _round(out, BF16).to(out_ptr.dtype.element_ty), mask=mask)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [T, S, D], pre [T, S] -> x [T, D] = round(sum_k pre_k X_k)."""
    triton_runtime.check_device(streams, pre)
    num_tokens, s, dim = streams.shape
    x = streams.contiguous()
    out = torch.empty(num_tokens, dim, dtype=streams.dtype, device=streams.device)
    if num_tokens:
        _collapse_kernel[(num_tokens, triton.cdiv(dim, 256))](
            x, pre.to(torch.float32).contiguous(), out, dim, S=s,
            BF16=streams.dtype == torch.bfloat16, BLOCK_D=256, **triton_runtime.launch_options())
    return out


@triton.jit
def _expand_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, D, S: tl.constexpr,
                   BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    y = tl.load(y_ptr + t * D + cols, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(S):
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in tl.static_range(S):
            xj = tl.load(x_ptr + (t * S + j) * D + cols, mask=mask, other=0.0).to(tl.float32)
            cjk = tl.load(comb_ptr + t * S * S + j * S + k)
            if j == 0:
                acc = cjk * xj
            else:
                acc = acc + cjk * xj
        acc = tl.load(post_ptr + t * S + k) * y + acc
        tl.store(out_ptr + (t * S + k) * D + cols, _round(acc, BF16).to(out_ptr.dtype.element_ty),
                 mask=mask)


def expand(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
           comb: torch.Tensor) -> torch.Tensor:
    """y [T, D], streams [T, S, D], post [T, S], comb [T, S, S] -> new streams [T, S, D]."""
    triton_runtime.check_device(y, streams, post, comb)
    num_tokens, s, dim = streams.shape
    x = streams.contiguous()
    out = torch.empty_like(x)
    if num_tokens:
        _expand_kernel[(num_tokens, triton.cdiv(dim, 256))](
            y.contiguous(), x, post.to(torch.float32).contiguous(),
            comb.to(torch.float32).contiguous(), out, dim, S=s,
            BF16=streams.dtype == torch.bfloat16, BLOCK_D=256, **triton_runtime.launch_options())
    return out
