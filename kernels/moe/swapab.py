"""Routed MXFP4 experts at a few pairs per expert on tensor cores, operands swapped ("swap AB").

At 1-32 pairs per expert the grouped GEMM of dense/triton.py computes A[BM, K] . W^T with
BM = 16 rows of which a handful are valid, the dequantised weight as the MMA's B operand. Here
the weight tile is the MMA's A operand (M = 64 weight rows) and the few activation rows of one
expert tile are its N (ROWS = 8, 16 or 32; SwapabConfig.rows says which MMA instruction each becomes):

    acc[BN, ROWS] += W[e, n0:n0+BN, k-step] . X[rows of the tile, k-step]^T     FP32

moe/ref.py's math, as `moe.triton`'s grouped GEMMs:

    h[p] = bf16(gamma[p] * silu(min(bf16(x[t] . W1[e]^T), L)) * clamp(bf16(x[t] . W3[e]^T), L))
    y[p] = bf16(h[p] . W2[e]^T)          p: a sorted (token t, expert e) pair

Launches (no host sync; CUDA-graph capturable: every grid is a function of the token count):

    sort_pairs  (moe.triton) pairs sorted by expert; tiles of <= ROWS pairs of one expert
    prep        xp = x with each 32-column group split: its 16 even columns, then its 16 odd
    up          grid (tile, N block of I): W1 and W3 share the X tile, SwiGLU epilogue -> h
                (bf16, stored with the same even/odd split: the down launch's input as is)
    down        grid (tile, N block of D): y = bf16(h . W2^T) per pair
    combine     (moe.triton) each token's pairs summed in ascending expert id, FP32

Empty tiles (grid slots past the active ones) exit at once; tile is grid axis 0, so the N
blocks of one expert's tiles run side by side and a second tile reads the weights from L2.

MXFP4 nibbles: byte j of a 32-value group holds k = 2j (low nibble) and 2j + 1 (high). A K step
of G groups loads the bytes as [BN, G, 16], decodes the low nibbles into [BN, 16 G] (the even
k of the step) and the high ones into [BN, 16 G] (the odd k), each times its group's scale
(exact), and makes two dots against the matching halves of xp: no interleave in registers.
On the GPU the decode is PTX (kernels/e2m1.py: `e2m1_pair_asm`, SwapabConfig.decode "pair";
or `e2m1_lo_asm` / `e2m1_hi_asm`, "split"); under the interpreter `fp32_e2m1` (same values: all
exact).

Split-K (up / down "split", per batch size through SwapabConfig.sizes): grid axis 2 splits the K
steps; FP32 partials go to a workspace and the last program of a (tile, N block) to arrive
sums them in split order, then runs the epilogue (deterministic, no extra launch).

Batch invariance: K is summed in steps of BLOCK_K, even half then odd half, so a pair's sums
do not depend on how many pairs share its tile or the call within a batch-size class (the
tensor-core instruction the compiler picks for the class's ROWS, and the K step and split-K
ways of its sizes entry, are constants of the class): across those bounds (2/3, 4/5,
8/9, 16/17, 32/33, 64/65 tokens) the last bits may differ. The path is chosen by size
(moe/triton.py: (gemv_max_rows, swapab_max_tokens] tokens) and sums in another order than the GEMV and
the grouped GEMMs, so a token may differ in the last bits across those bounds too, as between
the GEMV and the grouped GEMM paths.
"""

from __future__ import annotations

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.configs import SwapabConfig
from flashpd.kernels.dense.triton import DOT_UPCAST, W_MXFP4, mma, swiglu_limited
from flashpd.kernels.e2m1 import e2m1_hi_asm, e2m1_lo_asm, e2m1_pair_asm, fp32_e2m1
from flashpd.kernels.moe.gemv import check_rows_call, rows_for
from flashpd.kernels.quant.triton import e8m0_decode, round_bf16

# Routed MXFP4 experts of batches of <= MoeConfig.swapab_max_tokens tokens (and more than
# gemv_max_rows) take this path; FLASHPD_MOE_SWAPAB_MAX_TOKENS overrides it at engine load (0: off).
# Measured on the H200 (bench/results/h200/moe_swapab.md, moe_decode.md): faster than the
# grouped GEMMs from 8 to 128 tokens, than the GEMV from 1 token; a tie at 192.
# rows: pairs per tile (the MMA's N) by token count, the first entry whose bound covers the
# batch; up / down: N block (weight rows per program: the MMA's M), K step, warps, stages.
# Triton 3.6 on sm_90 compiles ROWS = 8 to mma.sync m16n8k16 (the weight bytes reach registers
# 4 per thread: fast) and ROWS >= 16 with 4 warps to wgmma with the weight tile in registers
# (A) and X^T in shared memory (B), whose register layout reads the bytes 2 per thread.
# decode: "pair" (one PTX block per byte word for both nibbles, e2m1_pair_asm; H200: 4-10%
# faster than "split" at 1-128 tokens, bench/results/h200/moe_decode.md) or "split"
# (dense/triton.py's two); fold_prep: the up launch reads x as given (no prep launch);
# scale_prefetch / w_prefetch: next K step's scale / weight bytes loaded a step ahead into
# registers (w_prefetch: with stages 1, no shared-memory stage for the weights); up / down may
# also name split (split-K ways, deterministic: see the kernel) and maxnreg (register cap).
# sizes: ((max tokens, {"up": {...}, "down": {...}}), ...) overrides of up / down by batch
# size, the first entry covering the batch (launch_config); none: up / down as they are.
# Each entry measured on the H200 against up / down alone (moe_decode.md, run 2, full routed
# path): 3-4 tokens up split-K 2 (185.8 vs 201.2 us at 4); 9-16 K step 256 (428.4 vs 454.7);
# 33-64 N block 32 with 2 warps and K step 256 (511.6 vs 574.5 at 64); 65-128 (tiles of 16)
# N block 32 with 2 warps (mma.sync instead of wgmma: 717.5 vs 750.9 at 128). 1-2, 5-8 and
# 17-32 tokens: no variant measured faster (17-32 not measured).
# (configs.SwapabConfig: KernelConfigs.moe.swapab, passed in as `cfg`)
_PREP_BLOCK = 1024
_BF16_2P126 = tl.constexpr(8.507059173023462e37)  # 2^126: the asm decode's scale offset (exact in BF16)


def tile_rows(num_tokens: int, cfg: SwapabConfig) -> int:
    """Pairs per tile for a batch of num_tokens tokens (cfg.rows)."""
    return rows_for(cfg.rows, num_tokens, "swapab")


def eligible(experts, dtype: torch.dtype) -> bool:
    """True when these kernels take the call: MXFP4 routed experts (all three weights) with
    K % 32 == 0, bf16 activations."""
    ws = (experts.w1, experts.w3, experts.w2)
    return dtype == torch.bfloat16 and all(w.fmt == W_MXFP4 and w.in_dim % 32 == 0 for w in ws)


# ============================================================================ kernels
@triton.jit
def _split_col(n):
    """Column n's place in a 32-group split into its 16 even then its 16 odd columns."""
    r = n % 32
    return n - r + (r % 2) * 16 + r // 2


@triton.jit
def _prep_kernel(x_ptr, stride_x, xp_ptr, K, BLOCK: tl.constexpr):
    """xp[t, _split_col(k)] = x[t, k] (bf16, row-major [T, K])."""
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = k < K
    v = tl.load(x_ptr + t * stride_x + k, mask=mask, other=0.0)
    tl.store(xp_ptr + t * K + _split_col(k), v, mask=mask)


@triton.jit
def _load_bytes(w_ptr, w_row, g0, K, nmask, G: tl.constexpr, EVEN_K: tl.constexpr):
    """Packed bytes of groups g0 .. g0+G-1 of W rows w_row: [BN, 16 G] (byte c: group c // 16)."""
    c = tl.arange(0, G * 16)
    if EVEN_K:  # no K mask: 16-byte vector loads
        return tl.load(w_ptr + w_row + g0 * 16 + c[None, :], mask=nmask[:, None], other=0)
    else:  # whole groups in or out (K % 32 == 0)
        cmask = (g0 + c // 16) * 32 < K
        return tl.load(w_ptr + w_row + g0 * 16 + c[None, :], mask=nmask[:, None] & cmask[None, :], other=0)


@triton.jit
def _load_scales(s_ptr, s_row, g0, K, nmask, G: tl.constexpr):
    """UE8M0 bytes of groups g0 .. g0+G-1 of W rows s_row: [BN, G] (127 past K)."""
    kmask = (g0 + tl.arange(0, G)) * 32 < K
    return tl.load(s_ptr + s_row + g0 + tl.arange(0, G)[None, :], mask=nmask[:, None] & kmask[None, :], other=127)


@triton.jit
def _decode(raw, sb, G: tl.constexpr, MX_ASM: tl.constexpr, PAIR: tl.constexpr, BLOCK_N: tl.constexpr):
    """(even k, odd k) each [BN, 16 G] bf16 of bytes raw [BN, 16 G] and scales sb [BN, G]:
    exact. Only elementwise ops lie between the bytes and the dot (the tile can go to the MMA
    from registers); each group's scale is broadcast over its 16 bytes."""
    if MX_ASM and PAIR:  # BF16 bits of 2^126 * 2^(b - 127) = 2^(b - 1): exponent b + 126
        s16 = ((sb.to(tl.int32) + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        s16 = tl.reshape(tl.broadcast_to(s16[:, :, None], (BLOCK_N, G, 16)), (BLOCK_N, G * 16))
        return e2m1_pair_asm(raw, s16)
    sf = tl.reshape(tl.broadcast_to(e8m0_decode(sb)[:, :, None], (BLOCK_N, G, 16)), (BLOCK_N, G * 16))
    if MX_ASM:  # 2^126 * scale is exact in BF16 for UE8M0 bytes <= 128
        s16 = (sf * _BF16_2P126).to(tl.bfloat16)
        lo, hi = e2m1_lo_asm(raw, s16), e2m1_hi_asm(raw, s16)
    else:
        bi = raw.to(tl.int32)
        lo = fp32_e2m1(bi, sf).to(tl.bfloat16)
        hi = fp32_e2m1(bi >> 4, sf).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _swapab_kernel(
    xp_ptr,
    K,
    stride_x,
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
    ws_ptr,
    count_ptr,
    steps_per_split,
    SWIGLU: tl.constexpr,
    MX_ASM: tl.constexpr,
    UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PAIR: tl.constexpr,
    SCALE_PF: tl.constexpr,
    W_PF: tl.constexpr,
    X_SPLIT: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """One tile (<= ROWS pairs of one expert) x one N block of BLOCK_N weight rows.

    SWIGLU (up): x rows gathered by token, W1 and W3, epilogue -> h[p] (split columns).
    Else (down): row p of xp (= h), W1 only -> out[p, n]. X_SPLIT: the rows hold split
    32-groups (xp, h; row stride K); else natural columns (x as given, row stride stride_x:
    the even / odd halves are gathered with stride 2, no prep launch). SCALE_PF / W_PF: the
    next K step's scale bytes / weight bytes are loaded one step ahead into registers (the
    last step reloads itself); else the compiler's pipeline (num_stages) stages them.

    SPLIT > 1 (split-K, grid axis 2 = s): program s sums K steps [s, s + 1) * steps_per_split
    into FP32 partials ws[tile, N block, s]; the last of the SPLIT programs of a (tile, N block)
    to arrive (atomic counter, reset by it) sums the partials in s order and runs the
    epilogue: the same order whichever program arrives last (deterministic)."""
    q = tl.program_id(0)
    start = tl.load(t_start_ptr + q)
    end = tl.load(t_end_ptr + q)
    if start < end:
        e = tl.load(t_exp_ptr + q).to(tl.int64)
        p = start + tl.arange(0, ROWS)
        pmask = p < end
        if SWIGLU:  # past the tile's end: its first pair's row (read, never stored)
            src = tl.load(rows_ptr + tl.where(pmask, p, start)).to(tl.int64)
        else:
            src = tl.where(pmask, p, start).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        w_row = e * stride_we + n.to(tl.int64)[:, None] * stride_wn  # [BN, 1] bytes
        s_row = e * stride_se + n.to(tl.int64)[:, None] * stride_sn  # [BN, 1]
        G: tl.constexpr = BLOCK_K // 32
        c = tl.arange(0, G * 16)  # column of a step's even (or odd) half
        if X_SPLIT:
            x_col = (c // 16) * 32 + c % 16  # its place in xp (split 32-groups)
            x_odd = 16
            x_row = src[None, :] * K  # [1, ROWS]
        else:
            x_col = (c // 16) * 32 + 2 * (c % 16)  # its even column in x
            x_odd = 1
            x_row = src[None, :] * stride_x
        acc1 = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        k_begin = 0
        k_end = K
        if SPLIT > 1:
            k_begin = tl.program_id(2) * steps_per_split * BLOCK_K
            k_end = tl.minimum(K, k_begin + steps_per_split * BLOCK_K)
        last = (k_end // 32 - 1) // G * G  # the last K step's first group
        if W_PF:
            raw1n = _load_bytes(w1_ptr, w_row, k_begin // 32, K, nmask, G, EVEN_K)
            raw3n = raw1n
            if SWIGLU:
                raw3n = _load_bytes(w3_ptr, w_row, k_begin // 32, K, nmask, G, EVEN_K)
        if W_PF or SCALE_PF:
            sb1n = _load_scales(s1_ptr, s_row, k_begin // 32, K, nmask, G)
            sb3n = sb1n
            if SWIGLU:
                sb3n = _load_scales(s3_ptr, s_row, k_begin // 32, K, nmask, G)
        for k0 in range(k_begin, k_end, BLOCK_K):
            g0 = k0 // 32
            nxt = tl.minimum(g0 + G, last)
            if EVEN_K:
                xe = tl.load(xp_ptr + x_row + (k0 + x_col)[:, None])
                xo = tl.load(xp_ptr + x_row + (k0 + x_odd + x_col)[:, None])
            else:
                xm = (k0 + x_col < K)[:, None]
                xe = tl.load(xp_ptr + x_row + (k0 + x_col)[:, None], mask=xm, other=0.0)
                xo = tl.load(xp_ptr + x_row + (k0 + x_odd + x_col)[:, None], mask=xm, other=0.0)
            if W_PF:
                raw1, raw3 = raw1n, raw3n
                raw1n = _load_bytes(w1_ptr, w_row, nxt, K, nmask, G, EVEN_K)
                if SWIGLU:
                    raw3n = _load_bytes(w3_ptr, w_row, nxt, K, nmask, G, EVEN_K)
            else:
                raw1 = _load_bytes(w1_ptr, w_row, g0, K, nmask, G, EVEN_K)
                raw3 = raw1
                if SWIGLU:
                    raw3 = _load_bytes(w3_ptr, w_row, g0, K, nmask, G, EVEN_K)
            if W_PF or SCALE_PF:
                sb1, sb3 = sb1n, sb3n
                sb1n = _load_scales(s1_ptr, s_row, nxt, K, nmask, G)
                if SWIGLU:
                    sb3n = _load_scales(s3_ptr, s_row, nxt, K, nmask, G)
            else:
                sb1 = _load_scales(s1_ptr, s_row, g0, K, nmask, G)
                sb3 = sb1
                if SWIGLU:
                    sb3 = _load_scales(s3_ptr, s_row, g0, K, nmask, G)
            lo1, hi1 = _decode(raw1, sb1, G, MX_ASM, PAIR, BLOCK_N)
            acc1 = mma(lo1, xe, acc1, False, UPCAST)
            acc1 = mma(hi1, xo, acc1, False, UPCAST)
            if SWIGLU:
                lo3, hi3 = _decode(raw3, sb3, G, MX_ASM, PAIR, BLOCK_N)
                acc3 = mma(lo3, xe, acc3, False, UPCAST)
                acc3 = mma(hi3, xo, acc3, False, UPCAST)
        done = True
        if SPLIT > 1:  # partials out; the last program of the SPLIT sums them in s order
            pid_nb = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            tile = tl.arange(0, BLOCK_N)[:, None] * ROWS + tl.arange(0, ROWS)[None, :]
            base = pid_nb.to(tl.int64) * SPLIT * 2 * BLOCK_N * ROWS
            part = base + tl.program_id(2) * 2 * BLOCK_N * ROWS + tile
            tl.store(ws_ptr + part, acc1)
            if SWIGLU:
                tl.store(ws_ptr + part + BLOCK_N * ROWS, acc3)
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_nb, 1, sem="acq_rel")
            done = arrived == SPLIT - 1
            if done:
                acc1 = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
                acc3 = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
                for si in tl.static_range(SPLIT):
                    off = base + si * 2 * BLOCK_N * ROWS + tile
                    acc1 += tl.load(ws_ptr + off, cache_modifier=".cg")
                    if SWIGLU:
                        acc3 += tl.load(ws_ptr + off + BLOCK_N * ROWS, cache_modifier=".cg")
                tl.store(count_ptr + pid_nb, 0)  # ready for the next launch
        mask = nmask[:, None] & pmask[None, :] & done
        if SWIGLU:  # moe.ref.expert_ffn: g, u rounded to bf16, h = bf16(gamma * swiglu(g, u))
            gamma = tl.load(gamma_ptr + p, mask=pmask, other=0.0)
            h = gamma[None, :] * swiglu_limited(round_bf16(acc1), round_bf16(acc3), limit)
            out = out_ptr + p[None, :].to(tl.int64) * N + _split_col(n)[:, None]
            tl.store(out, round_bf16(h).to(tl.bfloat16), mask=mask)
        else:
            out = out_ptr + p[None, :].to(tl.int64) * N + n[:, None]
            tl.store(out, round_bf16(acc1).to(tl.bfloat16), mask=mask)


# ============================================================================ host side
def compiled_variants() -> list:
    """The GEMM kernel's variants compiled so far (Triton CompiledKernel: asm, n_regs, ...)."""
    caches = getattr(_swapab_kernel, "device_caches", {})  # empty under the interpreter
    return [k for cache, *_ in caches.values() for k in cache.values()]


def launch_config(part: str, num_tokens: int, config: SwapabConfig) -> dict:
    """config.up / .down (part) with the overrides of the first config.sizes entry whose max
    tokens covers the batch (none past the last entry)."""
    cfg = dict(getattr(config, part))
    for max_tokens, over in config.sizes:
        if num_tokens <= max_tokens:
            cfg.update(over.get(part, {}))
            break
    return cfg


def _launch(
    xp, pairs, w1, w3, out, limit: float, rows_per_tile: int, swiglu: bool, cfg: dict, pair: bool, x_split: bool = True
) -> None:
    """One GEMM of the pair over `pairs`' tiles: up (W1 | W3, SwiGLU) or down (W2)."""
    _check_launch(w1, w3, cfg)
    w3 = w3 if w3 is not None else w1
    grid = (pairs.schedule.start.shape[0], triton.cdiv(w1.out_dim, cfg["block_n"]), cfg.get("split", 1))
    ws, count = _split_scratch(grid, rows_per_tile, cfg, xp, out)
    _swapab_kernel[grid](
        *_args(xp, pairs, w1, w3, out, limit, ws, count, cfg),
        **_constexprs(w1.in_dim, rows_per_tile, swiglu, cfg, pair, x_split),
        num_warps=cfg["warps"],
        num_stages=cfg["stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and not triton_runtime.interpreting() else {}),
        **triton_runtime.launch_options(),
    )


def _check_launch(w1, w3, cfg: dict) -> None:
    block_k, split = cfg["block_k"], cfg.get("split", 1)
    if block_k not in (32, 64, 128, 256, 512):
        raise ValueError(f"swapab config block_k must be a power of two in [32, 512], got {block_k}")
    if not 1 <= split <= 16:
        raise ValueError(f"swapab config split must be in [1, 16], got {split}")
    for w in (w1, w3 if w3 is not None else w1):
        if w.data.stride(-1) != 1 or w.scale.stride(-1) != 1:
            raise ValueError("swapab reads MXFP4 weights and scales with contiguous rows")


def _split_scratch(grid: tuple[int, int, int], rows_per_tile: int, cfg: dict, xp, out):
    """(partials, counters) of a split-K grid: fp32 [tiles * split * 2 * BLOCK_N * ROWS] and one
    arrival counter per output tile; without a split both unused (out stands in)."""
    split = grid[2]
    if split <= 1:
        return out, out  # unused
    n_tiles = grid[0] * grid[1]
    ws = torch.empty(n_tiles * split * 2 * cfg["block_n"] * rows_per_tile, dtype=torch.float32, device=xp.device)
    return ws, triton_runtime.arrival_counters(xp.device, n_tiles)


def _args(xp, pairs, w1, w3, out, limit: float, ws, count, cfg: dict) -> tuple:
    """The kernel's positional arguments, in its signature's order."""
    k_dim, split = w1.in_dim, cfg.get("split", 1)
    steps = triton.cdiv(k_dim, cfg["block_k"])
    return (
        xp,
        k_dim,
        xp.stride(0),
        pairs.rows,
        pairs.gamma,
        pairs.schedule.expert,
        pairs.schedule.start,
        pairs.schedule.end,
        w1.data,
        w1.scale,
        w3.data,
        w3.scale,
        w1.data.stride(0),
        w1.data.stride(1),
        w1.scale.stride(0),
        w1.scale.stride(1),
        out,
        w1.out_dim,
        float(limit),
        ws,
        count,
        triton.cdiv(steps, split),
    )


def _constexprs(k_dim: int, rows_per_tile: int, swiglu: bool, cfg: dict, pair: bool, x_split: bool) -> dict:
    return dict(
        SWIGLU=swiglu,
        MX_ASM=not triton_runtime.interpreting(),
        UPCAST=DOT_UPCAST,
        EVEN_K=k_dim % cfg["block_k"] == 0,
        ROWS=rows_per_tile,
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        PAIR=pair,
        SCALE_PF=cfg.get("scale_prefetch", False),
        W_PF=cfg.get("w_prefetch", False),
        X_SPLIT=x_split,
        SPLIT=cfg.get("split", 1),
    )


def expert_rows(
    x: torch.Tensor, pairs, experts, limit: float, rows_per_tile: int, *, cfg: SwapabConfig
) -> torch.Tensor:
    """y [P, D] bf16, one row per sorted pair of `pairs` (moe.triton.SortedPairs whose schedule
    has tiles of <= rows_per_tile pairs: sort_pairs(..., block_m=rows_per_tile)).

    x: [T, D] bf16 tokens; experts: moe.triton.ExpertSet with MXFP4 w1, w3 [E, I, D] and
    w2 [E, D, I]."""
    if not eligible(experts, x.dtype):
        raise ValueError(f"swapab expert_rows reads MXFP4 experts (K % 32 == 0) and bf16 activations (got {x.dtype})")
    x = check_rows_call(x, pairs, experts, rows_per_tile, (8, 16, 32))
    num_pairs = pairs.rows.shape[0]
    h = torch.empty(num_pairs, experts.w1.out_dim, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, experts.w2.out_dim, dtype=x.dtype, device=x.device)
    if num_pairs == 0:
        return y
    if cfg.decode not in ("pair", "split"):
        raise ValueError(f"swapab config decode must be 'pair' or 'split', got {cfg.decode!r}")
    pair = cfg.decode == "pair"
    xp = _prepared(x, cfg)
    up, down = launch_config("up", x.shape[0], cfg), launch_config("down", x.shape[0], cfg)
    _launch(xp, pairs, experts.w1, experts.w3, h, limit, rows_per_tile, True, up, pair, x_split=not cfg.fold_prep)
    _launch(h, pairs, experts.w2, None, y, 0.0, rows_per_tile, False, down, pair)
    return y


def _prepared(x: torch.Tensor, cfg: SwapabConfig) -> torch.Tensor:
    """x as the up launch reads it: x itself with fold_prep (the launch gathers the even / odd
    halves), else the even / odd halves split by one prep launch."""
    if cfg.fold_prep:
        return x
    num_tokens, dim = x.shape
    xp = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device)
    _prep_kernel[(num_tokens, triton.cdiv(dim, _PREP_BLOCK))](x, x.stride(0), xp, dim, BLOCK=_PREP_BLOCK, num_warps=4)
    return xp
