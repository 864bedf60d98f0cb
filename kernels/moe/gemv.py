"""Routed MXFP4 experts for decode batches on CUDA cores (FMA, no tl.dot): moe/ref.py's math.

At one or two rows per expert the tensor-core GEMM (dense/triton.py) spends its time moving
dequantised values into the MMA layout; here each weight value is decoded to FP32 by bit moves
and multiplied into the few rows that use it. Same result as `moe.triton`'s grouped GEMMs:

    h[p] = bf16(gamma[p] * silu(min(bf16(x[t] . W1[e]^T), L)) * clamp(bf16(x[t] . W3[e]^T), L))
    y[p] = bf16(h[p] . W2[e]^T)          p: a sorted (token t, expert e) pair

Launches (no host sync; CUDA-graph capturable):

    sort_pairs  (moe.triton) pairs sorted by expert; tiles of <= ROWS pairs of one expert
    prep        xp = x with each 32-column group permuted into nibble order (FP32, x XSCALE)
    up          grid (tile, N block of I): both W1 and W3 tiles, SwiGLU epilogue, h -> hp
                (FP32 values of bf16(h), nibble order, x XSCALE: the down launch's input)
    down        grid (tile, N block of D): y = bf16(hp . W2^T) per pair
    combine     (moe.triton) each token's pairs summed in ascending expert id, FP32

Empty tiles (grid slots past the active ones) exit at once. Tile is grid axis 0, so the N blocks
of two tiles of one expert run side by side and the second reads the weights from L2.

Weight words: the uint8 [E, N, K/2] nibbles are read as int32 words, 4 words (16 bytes, one
vector load) per 32-value scale group; nibble i of word j is column 8j + i (low nibble = even
column). Nibble i of every word is decoded at once:

    t = w << (28 - 4i)                  sign at bit 31, magnitude bits (e1 e0 m) at 28..30
    f = (t >> 6) & 0x81C00000           (arithmetic shift) sign | magnitude at bits 22..24
    float(f) = E2M1 value * 2^-126      (exact; 0.5 is the subnormal 2^-127)

and multiplied by x' = x * 2^64 (XSCALE) so products are normal FP32 numbers: v * x * 2^-62.
Within a scale group the 32 products are summed in FP32 (per word lane: nibbles 0..7, then
the 4 lanes), then scaled once by 2^(s-127) (exact), the groups summed in K order, and the
total multiplied by 2^62 (exact). DECODE "select" builds normal floats instead (no subnormal
operand; a few more integer ops): the fallback if a compiler ever flushed subnormals.

Batch invariance: a pair's sums depend on the K step (a constant) only, not on how many rows
share the call or its tile (tests/kernels/test_triton_moe_gemv.py). The path is chosen by size
(moe/triton.py: batches of <= GEMV_MAX_ROWS tokens), and its sums run in another order than the
tensor-core GEMMs', so a token may differ in the last bits between a batch of <= 16 tokens and a
larger one, as between dense/triton.py's decode and cuBLAS prefill paths (grouped_large.py too).
"""

from __future__ import annotations

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.configs import GemvConfig
from flashpd.kernels.dense.triton import W_MXFP4, Weights, swiglu_limited
from flashpd.kernels.quant.triton import e8m0_decode, round_bf16_if

# rows: pairs per tile by token count (the smallest entry >= the batch; 2 rows keep ~100
# registers per thread, 4 rows ~175: fewer programs resident); up / down: N block
# (weight rows per program), K step in 32-value groups, warps, prefetch (the next K step's
# weights loaded before this step's math); decode: "bits" or "select".
# (configs.GemvConfig: KernelConfigs.moe.gemv_tiles, passed in as `cfg`)
_XSCALE_BITS, _POST_BITS = 2.0**64, 2.0**62  # x' = x * 2^64; sums * 2^62 (see above)
_PREP_BLOCK = 1024
_SIGN_MAG = tl.constexpr(0x81C00000 - (1 << 32))  # as int32


def rows_for(table, num_tokens: int, name: str) -> int:
    """Pairs per tile from a ((max tokens, rows), ...) table: the first entry covering the
    batch (name: whose table, for the error)."""
    for max_tokens, rows in table:
        if num_tokens <= max_tokens:
            return rows
    raise ValueError(f"{name} config rows has no entry for {num_tokens} tokens")


def tile_rows(num_tokens: int, cfg: GemvConfig) -> int:
    """Pairs per tile for a batch of num_tokens tokens (cfg.rows)."""
    return rows_for(cfg.rows, num_tokens, "gemv")


def eligible(experts, dtype: torch.dtype) -> bool:
    """True when these kernels take the call: MXFP4 routed experts (all three weights), bf16 or
    fp32 activations."""
    return dtype in (torch.bfloat16, torch.float32) and all(
        w.fmt == W_MXFP4 for w in (experts.w1, experts.w3, experts.w2)
    )


# ============================================================================ kernels
@triton.jit
def _decode(words, i: tl.constexpr, SELECT: tl.constexpr):
    """FP32 of nibble i of each int32 word: E2M1 value * 2^-126 (bits) or the value (select)."""
    if SELECT:
        code = (words >> (4 * i)) & 15
        mag = code & 7
        normal = (mag << 22) + (126 << 23)  # exponent e >= 1: 2^(e-1) * (1 + m/2)
        bits = tl.where(mag >= 2, normal, tl.where(mag == 1, 0x3F000000, 0))
        bits = bits | ((code & 8) << 28)
    else:
        if i == 7:
            t = words
        else:
            t = words << (28 - 4 * i)
        bits = (t >> 6) & _SIGN_MAG
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _x_nibble(xp_ptr, row_off, col0, i: tl.constexpr, gmask, G: tl.constexpr, EVEN_K: tl.constexpr):
    """xp[row, col0 + 32 g + 4 i + j] as [G, 4]: the x values of nibble i of each word."""
    g = tl.arange(0, G)
    j = tl.arange(0, 4)
    offs = row_off + col0 + g[:, None] * 32 + 4 * i + j[None, :]
    if EVEN_K:
        return tl.load(xp_ptr + offs)
    else:
        return tl.load(xp_ptr + offs, mask=gmask[:, None], other=0.0)


@triton.jit
def _prep_kernel(x_ptr, stride_x, xp_ptr, K, xscale, BLOCK: tl.constexpr):
    """xp[t, 32g + 4i + j] = x[t, 32g + 8j + i] * xscale in FP32 (nibble order)."""
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    r = o % 32
    src = o - r + 8 * (r % 4) + r // 4
    mask = o < K
    v = tl.load(x_ptr + t * stride_x + src, mask=mask, other=0.0).to(tl.float32)
    tl.store(xp_ptr + t * K + o, v * xscale, mask=mask)


@triton.jit
def _load_w(w_ptr, s_ptr, w_row, s_row, gk, g, j, nmask, n_groups, EVEN_K: tl.constexpr):
    """Words [BN, G, 4] int32 and scale bytes [BN, G, 1] (int32) of groups gk .. gk+G-1.

    No K mask when EVEN_K (16-byte vector loads). The scales are read as each group's aligned
    quad of bytes, 4 lanes like the words (so both share one register layout), and the group's
    own byte is picked in registers."""
    gg = gk + g
    woff = w_row + gg[None, :, None] * 4 + j[None, None, :]
    quad = (gg // 4 * 4)[None, :, None] + j[None, None, :]  # [1, G, 4]
    if EVEN_K:
        words = tl.load(w_ptr + woff, mask=nmask[:, None, None], other=0)
        sb4 = tl.load(s_ptr + s_row + quad, mask=nmask[:, None, None], other=127)
    else:
        gmask = (gg < n_groups)[None, :, None]
        words = tl.load(w_ptr + woff, mask=nmask[:, None, None] & gmask, other=0)
        sb4 = tl.load(s_ptr + s_row + quad, mask=nmask[:, None, None] & (quad < n_groups), other=127)
    own = j[None, None, :] == (g % 4)[None, :, None]  # gk is a multiple of 4: loop-invariant
    sb = tl.sum(tl.where(own, sb4.to(tl.int32), 0), axis=2)[:, :, None]
    return words, sb


@triton.jit
def _row(tile_rows_ptr, start, end, r: tl.constexpr, GATHER: tl.constexpr):
    """(row of the activations, valid) of the tile's r-th pair; past the tile's end: its first
    row (read, never stored), so no activation load needs a row mask."""
    p = start + r
    valid = p < end
    if GATHER:
        src = tl.load(tile_rows_ptr + tl.where(valid, p, start))
    else:
        src = tl.where(valid, p, start)
    return src.to(tl.int64), valid


@triton.jit
def _gemv_kernel(
    xp_ptr,
    K,
    rows_ptr,
    gamma_ptr,
    t_exp_ptr,
    t_start_ptr,
    t_end_ptr,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    out_ptr,
    N,
    limit,
    post,
    out_scale,
    SWIGLU: tl.constexpr,
    ROWS: tl.constexpr,
    SELECT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    G: tl.constexpr,
):
    """One tile (<= ROWS pairs of one expert) x one N block. SWIGLU (up): rows of xp gathered by
    token, W1 and W3, epilogue -> FP32 nibble-order h * out_scale. Else (down): row p of xp,
    W1 only -> out[p, n] in out's dtype."""
    q = tl.program_id(0)
    start = tl.load(t_start_ptr + q)
    end = tl.load(t_end_ptr + q)
    if start < end:
        e = tl.load(t_exp_ptr + q).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        g = tl.arange(0, G)
        j = tl.arange(0, 4)
        src0, ok0 = _row(rows_ptr, start, end, 0, SWIGLU)
        src1, ok1 = _row(rows_ptr, start, end, 1, SWIGLU)
        src2, ok2 = _row(rows_ptr, start, end, 2, SWIGLU)
        src3, ok3 = _row(rows_ptr, start, end, 3, SWIGLU)
        w_row = e * stride_we + n.to(tl.int64)[:, None, None] * stride_wn  # [BN, 1, 1] words
        s_row = e * stride_se + n.to(tl.int64)[:, None, None] * stride_sn  # [BN, 1, 1]
        zero = tl.zeros((BLOCK_N, G, 4), dtype=tl.float32)
        a10, a11, a12, a13 = zero, zero, zero, zero  # W1 sums per (n, group, word lane), rows 0..3
        a30, a31, a32, a33 = zero, zero, zero, zero  # W3 (SwiGLU)
        n_groups = K // 32
        last = (n_groups - 1) // G * G  # the last K step's first group
        if PREFETCH:
            w1n, s1n = _load_w(w1_ptr, s1_ptr, w_row, s_row, 0, g, j, nmask, n_groups, EVEN_K)
            w3n, s3n = w1n, s1n
            if SWIGLU:
                w3n, s3n = _load_w(w3_ptr, s3_ptr, w_row, s_row, 0, g, j, nmask, n_groups, EVEN_K)
        for gk in range(0, n_groups, G):
            gmask = gk + g < n_groups
            if PREFETCH:  # next step's weights in flight while this step computes
                w1, sb1, w3, sb3 = w1n, s1n, w3n, s3n
                nxt = tl.minimum(gk + G, last)  # the last step reloads itself (cache hit)
            else:
                nxt = gk
            w1n, s1n = _load_w(w1_ptr, s1_ptr, w_row, s_row, nxt, g, j, nmask, n_groups, EVEN_K)
            if SWIGLU:
                w3n, s3n = _load_w(w3_ptr, s3_ptr, w_row, s_row, nxt, g, j, nmask, n_groups, EVEN_K)
            else:
                w3n, s3n = w1n, s1n
            if not PREFETCH:
                w1, sb1, w3, sb3 = w1n, s1n, w3n, s3n
            sc1 = e8m0_decode(sb1)
            sc3 = e8m0_decode(sb3)
            p10 = tl.zeros((BLOCK_N, G, 4), dtype=tl.float32)
            p11, p12, p13 = p10, p10, p10
            p30, p31, p32, p33 = p10, p10, p10, p10
            col0 = gk * 32
            for i in tl.static_range(8):
                f1 = _decode(w1, i, SELECT)
                if SWIGLU:
                    f3 = _decode(w3, i, SELECT)
                x0 = _x_nibble(xp_ptr, src0 * K, col0, i, gmask, G, EVEN_K)[None, :, :]
                p10 += f1 * x0
                if SWIGLU:
                    p30 += f3 * x0
                if ROWS > 1:
                    x1 = _x_nibble(xp_ptr, src1 * K, col0, i, gmask, G, EVEN_K)[None, :, :]
                    p11 += f1 * x1
                    if SWIGLU:
                        p31 += f3 * x1
                if ROWS > 2:
                    x2 = _x_nibble(xp_ptr, src2 * K, col0, i, gmask, G, EVEN_K)[None, :, :]
                    x3 = _x_nibble(xp_ptr, src3 * K, col0, i, gmask, G, EVEN_K)[None, :, :]
                    p12 += f1 * x2
                    p13 += f1 * x3
                    if SWIGLU:
                        p32 += f3 * x2
                        p33 += f3 * x3
            a10 += p10 * sc1
            if SWIGLU:
                a30 += p30 * sc3
            if ROWS > 1:
                a11 += p11 * sc1
                if SWIGLU:
                    a31 += p31 * sc3
            if ROWS > 2:
                a12 += p12 * sc1
                a13 += p13 * sc1
                if SWIGLU:
                    a32 += p32 * sc3
                    a33 += p33 * sc3
        _epilogue(a10, a30, start, ok0, n, nmask, gamma_ptr, out_ptr, N, limit, post, out_scale, SWIGLU, ROUND_BF16)
        if ROWS > 1:
            _epilogue(
                a11, a31, start + 1, ok1, n, nmask, gamma_ptr, out_ptr, N, limit, post, out_scale, SWIGLU, ROUND_BF16
            )
        if ROWS > 2:
            _epilogue(
                a12, a32, start + 2, ok2, n, nmask, gamma_ptr, out_ptr, N, limit, post, out_scale, SWIGLU, ROUND_BF16
            )
            _epilogue(
                a13, a33, start + 3, ok3, n, nmask, gamma_ptr, out_ptr, N, limit, post, out_scale, SWIGLU, ROUND_BF16
            )


@triton.jit
def _epilogue(
    a1,
    a3,
    p,
    ok,
    n,
    nmask,
    gamma_ptr,
    out_ptr,
    N,
    limit,
    post,
    out_scale,
    SWIGLU: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Pair p's outputs for columns n from its sums per (n, group, word lane) [BN, G, 4]."""
    g = round_bf16_if(tl.sum(tl.sum(a1, axis=2), axis=1) * post, ROUND_BF16)  # GEMM output, act dtype
    mask = nmask & ok
    if SWIGLU:  # moe.ref.expert_ffn: h = bf16(gamma * silu(min(g, L)) * clamp(u, -L, L))
        u = round_bf16_if(tl.sum(tl.sum(a3, axis=2), axis=1) * post, ROUND_BF16)
        gamma = tl.load(gamma_ptr + p, mask=ok, other=0.0)
        h = round_bf16_if(gamma * swiglu_limited(g, u, limit), ROUND_BF16)
        r = n % 32
        col = n - r + 4 * (r % 8) + r // 8  # nibble order for the down launch
        tl.store(out_ptr + p.to(tl.int64) * N + col, h * out_scale, mask=mask)
    else:
        tl.store(out_ptr + p.to(tl.int64) * N + n, g.to(out_ptr.dtype.element_ty), mask=mask)


# ============================================================================ host side
def _words(w: Weights) -> torch.Tensor:
    """uint8 [E, N, K/2] nibbles as int32 [E, N, K/8] words (same bytes, no copy)."""
    if w.data.stride(-1) != 1 or w.scale.stride(-1) != 1:
        raise ValueError("gemv reads MXFP4 weights and scales with contiguous rows")
    return w.data.view(torch.int32)


def _launch(
    xp,
    pairs,
    w1: Weights,
    w3: Weights | None,
    out,
    limit: float,
    rows_per_tile: int,
    swiglu: bool,
    round_bf16: bool,
    out_scale: float,
    config: GemvConfig,
) -> None:
    """One GEMV of the pair over `pairs`' tiles: up (W1 | W3, SwiGLU) or down (W2)."""
    cfg = config.up if swiglu else config.down
    if config.decode not in ("bits", "select"):
        raise ValueError(f"gemv config decode must be 'bits' or 'select', got {config.decode!r}")
    words1 = _words(w1)
    words3 = _words(w3) if w3 is not None else words1
    if cfg["groups"] not in (4, 8, 16):
        raise ValueError(f"gemv config groups must be 4, 8 or 16, got {cfg['groups']}")
    post = 1.0 if config.decode == "select" else _POST_BITS
    grid = (pairs.schedule.start.shape[0], triton.cdiv(w1.out_dim, cfg["block_n"]))
    _gemv_kernel[grid](
        *_args(xp, pairs, w1, w3, (words1, words3), out, limit, post, out_scale),
        **_constexprs(w1.in_dim, rows_per_tile, swiglu, round_bf16, cfg, config.decode == "select"),
        num_warps=cfg["warps"],
    )


def _args(xp, pairs, w1: Weights, w3: Weights | None, words: tuple, out, limit: float, post: float, out_scale: float):
    """The kernel's positional arguments, in its signature's order (weights as int32 words)."""
    words1, words3 = words
    return (
        xp,
        w1.in_dim,
        pairs.rows,
        pairs.gamma,
        pairs.schedule.expert,
        pairs.schedule.start,
        pairs.schedule.end,
        words1,
        w1.scale,
        words3,
        w3.scale if w3 is not None else w1.scale,
        words1.stride(0),
        words1.stride(1),
        w1.scale.stride(0),
        w1.scale.stride(1),
        out,
        w1.out_dim,
        float(limit),
        post,
        out_scale,
    )


def _constexprs(k_dim: int, rows_per_tile: int, swiglu: bool, round_bf16: bool, cfg: dict, select: bool) -> dict:
    return dict(
        SWIGLU=swiglu,
        ROWS=rows_per_tile,
        SELECT=select,
        ROUND_BF16=round_bf16,
        EVEN_K=(k_dim // 32) % cfg["groups"] == 0,
        PREFETCH=cfg["prefetch"],
        BLOCK_N=cfg["block_n"],
        G=cfg["groups"],
    )


def check_rows_call(x: torch.Tensor, pairs, experts, rows_per_tile: int, allowed: tuple[int, ...]) -> torch.Tensor:
    """The checks every routed-expert `expert_rows` makes (tile rows one of `allowed` and the
    schedule's, x [T, D] on the kernels' device); returns x with unit column stride."""
    if rows_per_tile not in allowed or pairs.schedule.block_m != rows_per_tile:
        raise ValueError(
            f"rows_per_tile {rows_per_tile} must be one of {allowed} and match "
            f"the schedule's block_m {pairs.schedule.block_m}"
        )
    if x.ndim != 2 or x.shape[1] != experts.w1.in_dim:
        raise ValueError(f"x {tuple(x.shape)} must be [T, {experts.w1.in_dim}]")
    x = x if x.stride(1) == 1 else x.contiguous()
    triton_runtime.check_device(x, experts.w1.data)
    return x


def expert_rows(x: torch.Tensor, pairs, experts, limit: float, rows_per_tile: int, *, cfg: GemvConfig) -> torch.Tensor:
    """y [P, D] in x.dtype, one row per sorted pair of `pairs` (moe.triton.SortedPairs whose
    schedule has tiles of <= rows_per_tile pairs: sort_pairs(..., block_m=rows_per_tile)).

    x: [T, D] bf16 or fp32 tokens; experts: moe.triton.ExpertSet with MXFP4 w1, w3 [E, I, D]
    and w2 [E, D, I]."""
    if not eligible(experts, x.dtype):
        raise ValueError(f"gemv expert_rows reads MXFP4 experts and bf16/fp32 activations (got {x.dtype})")
    x = check_rows_call(x, pairs, experts, rows_per_tile, (1, 2, 4))
    num_tokens, dim = x.shape
    num_pairs = pairs.rows.shape[0]
    inter = experts.w1.out_dim
    select = cfg.decode == "select"
    xscale = 1.0 if select else _XSCALE_BITS
    round_bf16 = x.dtype == torch.bfloat16
    xp = torch.empty(num_tokens, dim, dtype=torch.float32, device=x.device)
    hp = torch.empty(num_pairs, inter, dtype=torch.float32, device=x.device)
    y = torch.empty(num_pairs, dim, dtype=x.dtype, device=x.device)
    if num_pairs == 0:
        return y
    _prep_kernel[(num_tokens, triton.cdiv(dim, _PREP_BLOCK))](
        x, x.stride(0), xp, dim, xscale, BLOCK=_PREP_BLOCK, num_warps=4
    )
    w1, w3, w2 = experts.w1, experts.w3, experts.w2
    _launch(xp, pairs, w1, w3, hp, limit, rows_per_tile, True, round_bf16, xscale, cfg)
    _launch(hp, pairs, w2, None, y, 0.0, rows_per_tile, False, round_bf16, 1.0, cfg)
    return y
