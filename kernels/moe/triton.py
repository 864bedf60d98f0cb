"""MoE in Triton (model_spec §7): a fused router, and grouped expert GEMMs on checkpoint formats.

Same function names and signatures as `moe/ref.py` (route, swiglu, expert_ffn, moe), plus
`moe_quantized` whose routed experts are MXFP4 and shared expert FP8, read as stored.

Fused router (`route`), one launch:

    grid (token blocks of 16, SPLIT slices of D)
    each program: partial logits [16, E] = x[:, slice] . W_g[:, slice]^T   (FP32 accumulation)
    the last program of a token block to finish (atomic counter) sums the SPLIT partials in
    slice order, then: / gate_temp -> sqrt(softplus) -> + bias -> top-k (ties: lower id)
    -> gamma = s / (sum s + 1e-20) * routed_scale

SPLIT is a constant, so a token's arithmetic does not depend on the batch (dense/ref.py); it
spreads the router weight stream over more SMs at decode batch sizes.

Experts: token-slot pairs are sorted by expert; one grouped GEMM computes
h = bf16(gamma * silu(min(g, L)) * clamp(u, -L, L)) from W1/W3 (SwiGLU epilogue), a second
y = bf16(h . W2^T); each token then sums its pairs in ascending expert id, in FP32, as the ref.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.configs import DEFAULT, DenseConfig, KernelConfigs
from flashpd.kernels.dense import triton as dense
from flashpd.kernels.dense.triton import DOT_UPCAST, Weights, mma, softplus_f32, swiglu_limited
from flashpd.kernels.moe import gemv, grouped_large, swapab
from flashpd.kernels.moe.ref import ExpertSet, ExpertWeights  # noqa: F401 (re-exported)
from flashpd.kernels.quant.triton import round_bf16

ROUTER_SPLIT = 20  # slices of D per token block (constant: batch invariance)
# Routed MXFP4 experts of batches of <= MoeConfig.gemv_max_rows tokens run on CUDA cores
# (moe/gemv.py); FLASHPD_MOE_GEMV_MAX_ROWS overrides the bound at engine load (0: always the
# tensor-core GEMMs). The H200 default is 0: swap-AB (moe/swapab.py) is faster from 1 token
# (bench/results/h200/moe_decode.md); the GEMV stays for gemv_max_rows > 0 (it also takes fp32
# activations, which swap-AB does not).
_ROUTER_BLOCK_T = 16
ROUTER_BLOCK_K = 128  # one or two K steps per program at D = 5120 (at most: router_block_k)
_ROUTER_TILE_BYTES = 32 * 1024  # a pipeline stage's gate tile, at most


# ============================================================================ fused router
@triton.jit
def _select_top_k(scores, biased, experts, slot, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """(ids [BT, K_PAD], unbiased scores [BT, K_PAD], their sum [BT]) of the TOP_K experts by
    biased score, lower id on ties, in selection order."""
    sel_ids = tl.zeros((scores.shape[0], K_PAD), dtype=tl.int32)
    sel_scores = tl.zeros((scores.shape[0], K_PAD), dtype=tl.float32)
    total = tl.zeros_like(tl.max(scores, axis=1))
    for i in tl.static_range(TOP_K):  # selection by biased score, lower id on ties
        best = tl.max(biased, axis=1)
        pick = tl.min(tl.where(biased == best[:, None], experts[None, :], E_PAD), axis=1)
        hit = experts[None, :] == pick[:, None]
        chosen = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # unbiased score
        total = total + chosen
        sel_ids = tl.where(slot == i, pick[:, None], sel_ids)
        sel_scores = tl.where(slot == i, chosen[:, None], sel_scores)
        biased = tl.where(hit, float("-inf"), biased)
    return sel_ids, sel_scores, total


@triton.jit
def _route_epilogue(
    logits,
    rows,
    rmask,
    experts,
    emask,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    inv_temp,
    routed_scale,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    scores = tl.sqrt_rn(softplus_f32(logits * inv_temp))  # [BT, E_PAD]
    bias = tl.load(bias_ptr + experts, mask=emask, other=0.0)
    biased = tl.where(emask[None, :], scores + bias[None, :], float("-inf"))
    slot = tl.arange(0, K_PAD)[None, :]  # [1, K_PAD]
    sel_ids, sel_scores, total = _select_top_k(scores, biased, experts, slot, TOP_K, K_PAD, E_PAD)
    if NORMALIZE:  # norm_topk_prob
        gamma = sel_scores / (total[:, None] + 1e-20) * routed_scale
    else:
        gamma = sel_scores * routed_scale
    out = rows[:, None].to(tl.int64) * TOP_K + slot
    omask = rmask[:, None] & (slot < TOP_K)
    tl.store(ids_ptr + out, sel_ids.to(tl.int64), mask=omask)
    tl.store(weights_ptr + out, gamma, mask=omask)


@triton.jit
def _route_sort(
    ids_ptr,
    weights_ptr,
    counter_ptr,
    rows_ptr,
    gamma_ptr,
    pos_ptr,
    t_exp_ptr,
    t_start_ptr,
    t_end_ptr,
    T,
    E,
    max_tiles,
    sort_blocks,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    SORT_BLOCK_T: tl.constexpr,
    COUNT_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """After a router token block's epilogue: the last token block to finish (a second arrival
    counter, counter_ptr[token blocks]) runs every program of `_sort_pairs_kernel` in turn, so
    the gate launch also gives sort_pairs' outputs. Reads the ids / weights through L2 (.cg)."""
    arrivals = tl.num_programs(0)  # the router's token blocks
    tl.debug_barrier()  # this program's ids / weights stores, before its arrival (and its reads)
    arrived = arrivals - 1
    if arrivals > 1:
        arrived = tl.atomic_add(counter_ptr + arrivals, 1, sem="acq_rel")
    if arrived == arrivals - 1:
        if arrivals > 1:
            tl.store(counter_ptr + arrivals, 0)  # ready for the next launch
        experts = tl.arange(0, E_PAD)
        slot = tl.arange(0, K_PAD)
        smask = slot < TOP_K
        for blk in range(0, sort_blocks):
            _sort_token_block(
                ids_ptr,
                weights_ptr,
                rows_ptr,
                gamma_ptr,
                pos_ptr,
                T,
                blk,
                sort_blocks,
                experts,
                slot,
                smask,
                TOP_K,
                E_PAD,
                SORT_BLOCK_T,
                COUNT_T,
                ".cg",
            )
        for qb in range(0, (max_tiles + BLOCK_Q - 1) // BLOCK_Q):
            _sort_tile_block(
                ids_ptr,
                t_exp_ptr,
                t_start_ptr,
                t_end_ptr,
                T,
                E,
                max_tiles,
                qb,
                experts,
                slot,
                smask,
                TOP_K,
                E_PAD,
                SORT_BLOCK_T,
                COUNT_T,
                BLOCK_M,
                BLOCK_Q,
                ".cg",
            )


@triton.jit(do_not_specialize=["T", "max_tiles", "sort_blocks"])  # T == 1 stays a tensor scalar
def _route_kernel(
    x_ptr,
    stride_x,
    w_ptr,
    stride_w,
    bias_ptr,
    partial_ptr,
    counter_ptr,
    ids_ptr,
    weights_ptr,
    T,
    E,
    D,
    chunk,
    inv_temp,
    routed_scale,
    rows_ptr,
    gamma_ptr,
    pos_ptr,
    t_exp_ptr,
    t_start_ptr,
    t_end_ptr,
    max_tiles,
    sort_blocks,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    NORMALIZE: tl.constexpr,
    SORT: tl.constexpr,
    SORT_BLOCK_T: tl.constexpr,
    COUNT_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    tb = tl.program_id(0)
    sp = tl.program_id(1)
    rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    experts = tl.arange(0, E_PAD)
    emask = experts < E
    acc = tl.zeros((BLOCK_T, E_PAD), dtype=tl.float32)
    k_end = tl.minimum(sp * chunk + chunk, D)
    for k0 in range(sp * chunk, k_end, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        kmask = k_idx < k_end
        a = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_x + k_idx[None, :],
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + experts[:, None].to(tl.int64) * stride_w + k_idx[None, :],
            mask=emask[:, None] & kmask[None, :],
            other=0.0,
        )
        acc = mma(a, tl.trans(w), acc, IEEE, UPCAST)
    if SPLIT == 1:
        _route_epilogue(
            acc,
            rows,
            rmask,
            experts,
            emask,
            bias_ptr,
            ids_ptr,
            weights_ptr,
            inv_temp,
            routed_scale,
            TOP_K,
            K_PAD,
            E_PAD,
            NORMALIZE,
        )
        if SORT:
            _route_sort(
                ids_ptr,
                weights_ptr,
                counter_ptr,
                rows_ptr,
                gamma_ptr,
                pos_ptr,
                t_exp_ptr,
                t_start_ptr,
                t_end_ptr,
                T,
                E,
                max_tiles,
                sort_blocks,
                TOP_K,
                K_PAD,
                E_PAD,
                SORT_BLOCK_T,
                COUNT_T,
                BLOCK_M,
                BLOCK_Q,
            )
    else:
        tile = rows[:, None].to(tl.int64) * E_PAD + experts[None, :]
        tl.store(partial_ptr + sp * T.to(tl.int64) * E_PAD + tile, acc, mask=rmask[:, None])
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + tb, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # last slice of this token block: reduce in slice order
            logits = tl.zeros((BLOCK_T, E_PAD), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                logits += tl.load(
                    partial_ptr + s * T.to(tl.int64) * E_PAD + tile,
                    mask=rmask[:, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
            tl.store(counter_ptr + tb, 0)  # ready for the next launch
            _route_epilogue(
                logits,
                rows,
                rmask,
                experts,
                emask,
                bias_ptr,
                ids_ptr,
                weights_ptr,
                inv_temp,
                routed_scale,
                TOP_K,
                K_PAD,
                E_PAD,
                NORMALIZE,
            )
            if SORT:  # sort_pairs' outputs from the last token block to finish
                _route_sort(
                    ids_ptr,
                    weights_ptr,
                    counter_ptr,
                    rows_ptr,
                    gamma_ptr,
                    pos_ptr,
                    t_exp_ptr,
                    t_start_ptr,
                    t_end_ptr,
                    T,
                    E,
                    max_tiles,
                    sort_blocks,
                    TOP_K,
                    K_PAD,
                    E_PAD,
                    SORT_BLOCK_T,
                    COUNT_T,
                    BLOCK_M,
                    BLOCK_Q,
                )


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    routed_scale: float,
    gate_temp: float = 1.0,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (expert ids [T, k] int64, weights [T, k] FP32), one fused launch.

    Ties in s + bias go to the lower expert id. `normalize` is norm_topk_prob.
    """
    ids, weights, _ = _route_launch(x, gate_weight, bias, top_k, routed_scale, gate_temp, normalize, None)
    return ids, weights


# The gate in one launch at decode sizes (route_sorted): with MoeConfig.fused_gate on, calls of
# at most fused_gate_max_tokens tokens have the router's last token block to finish also
# produce sort_pairs' outputs (the same tensors and values), instead of a second launch. Off:
# slower on the H200 (benchmarks/moe_route_bench.py --fused: 20.1 us against route + sort 12.5
# at 1 token, 28.2 / 13.0 at 16; results/h200/moe_fused_gate.md): the last block's serial sort
# costs more than the launch it saves. FLASHPD_MOE_FUSED_GATE=1 turns it on at engine load
# (kernels/tuning.py). The bound: 16 tokens are one sort token block; past it the one program
# sorts block after block (4 at 64 tokens, plus the tile blocks).


def route_sorted(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    routed_scale: float,
    gate_temp: float,
    normalize: bool,
    block_m: int,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> tuple[torch.Tensor, torch.Tensor, SortedPairs]:
    """(ids, weights) as `route` and their SortedPairs as `sort_pairs(ids, weights, E, block_m)`:
    one launch when fused_gate is on and T <= fused_gate_max_tokens, else route + sort_pairs."""
    num_experts = gate_weight.shape[0]
    m = tuned.moe
    if not (m.fused_gate and 0 < x.shape[0] <= min(m.fused_gate_max_tokens, SORT_KERNEL_MAX_TOKENS)):
        ids, weights = route(x, gate_weight, bias, top_k, routed_scale, gate_temp, normalize)
        return ids, weights, sort_pairs(ids, weights, num_experts, block_m)
    return _route_launch(x, gate_weight, bias, top_k, routed_scale, gate_temp, normalize, block_m)


def _route_launch(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    routed_scale: float,
    gate_temp: float,
    normalize: bool,
    block_m: int | None,
) -> tuple[torch.Tensor, torch.Tensor, SortedPairs | None]:
    """The router launch; with `block_m`, its last token block also sorts the pairs."""
    _check_route(x, gate_weight, bias, top_k)
    num_tokens, num_experts = x.shape[0], gate_weight.shape[0]
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return ids, weights, None
    n_blocks = triton.cdiv(num_tokens, _ROUTER_BLOCK_T)
    pairs = None if block_m is None else _empty_pairs(num_tokens, top_k, num_experts, block_m, x.device)
    _route_kernel[(n_blocks, ROUTER_SPLIT)](
        *_route_args(x, gate_weight, bias, ids, weights, n_blocks, routed_scale, gate_temp),
        *_sorted_out(pairs, ids),
        triton.cdiv(num_tokens, _SORT_BLOCK_T),
        **_route_constexprs(x, num_experts, top_k, normalize, block_m),
        num_warps=8,
        num_stages=3,
        **triton_runtime.launch_options(),
    )
    return ids, weights, pairs


def _route_args(x, gate_weight, bias, ids, weights, n_blocks: int, routed_scale: float, gate_temp: float) -> tuple:
    """The router's positional arguments up to the sort's outputs, in its signature's order."""
    num_tokens, dim = x.shape
    num_experts = gate_weight.shape[0]
    chunk = triton.cdiv(triton.cdiv(dim, ROUTER_SPLIT), ROUTER_BLOCK_K) * ROUTER_BLOCK_K
    partial = torch.empty(
        ROUTER_SPLIT, num_tokens, triton.next_power_of_2(num_experts), dtype=torch.float32, device=x.device
    )
    w = gate_weight if gate_weight.dtype == x.dtype else gate_weight.to(x.dtype)
    return (
        x,
        x.stride(0),
        w,
        w.stride(0),
        bias.to(torch.float32).contiguous(),
        partial,
        triton_runtime.arrival_counters(x.device, n_blocks + 1),
        ids,
        weights,
        num_tokens,
        num_experts,
        dim,
        chunk,
        1.0 / gate_temp,
        float(routed_scale),
    )


def _sorted_out(pairs: SortedPairs | None, ids: torch.Tensor) -> tuple:
    """The sort's outputs and tile count; without the sort, unused pointers (ids) and 1."""
    if pairs is None:
        return (ids,) * 6 + (1,)
    sched = pairs.schedule
    return (pairs.rows, pairs.gamma, pairs.pos, sched.expert, sched.start, sched.end, sched.start.shape[0])


def _route_constexprs(x: torch.Tensor, num_experts: int, top_k: int, normalize: bool, block_m: int | None) -> dict:
    return dict(
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        BLOCK_T=_ROUTER_BLOCK_T,
        E_PAD=triton.next_power_of_2(num_experts),
        BLOCK_K=router_block_k(num_experts),
        SPLIT=ROUTER_SPLIT,
        IEEE=x.dtype == torch.float32,
        UPCAST=DOT_UPCAST,
        NORMALIZE=normalize,
        SORT=block_m is not None,
        SORT_BLOCK_T=_SORT_BLOCK_T,
        COUNT_T=SORT_COUNT_T,
        BLOCK_M=block_m or 16,
        BLOCK_Q=_SORT_BLOCK_Q,
    )


def router_block_k(num_experts: int) -> int:
    """The router's K step: ROUTER_BLOCK_K, smaller for many experts so that a pipeline stage's
    gate tile [E_PAD, BLOCK_K] BF16 stays within _ROUTER_TILE_BYTES (the released 384 experts
    pad to 512: K step 32; at 128 it asked 264 KB of shared memory, over the H200's 227 KB).
    A function of the gate's shape only (batch invariance); it divides ROUTER_BLOCK_K, so the
    K chunks of the slices stay the same."""
    e_pad = triton.next_power_of_2(num_experts)
    return max(16, min(ROUTER_BLOCK_K, _ROUTER_TILE_BYTES // (2 * e_pad)))


def _check_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int) -> None:
    if x.ndim != 2 or x.stride(1) != 1 or gate_weight.ndim != 2 or gate_weight.stride(1) != 1:
        raise ValueError("route needs row-major x [T, D] and gate_weight [E, D]")
    if x.shape[1] != gate_weight.shape[1] or bias.shape != (gate_weight.shape[0],):
        raise ValueError(f"route shapes x {tuple(x.shape)}, W {tuple(gate_weight.shape)}, bias {tuple(bias.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"route input must be bf16 or fp32, got {x.dtype}")
    if not 1 <= top_k <= gate_weight.shape[0]:
        raise ValueError(f"top_k {top_k} outside [1, {gate_weight.shape[0]}]")
    triton_runtime.check_device(x, gate_weight, bias)


# ============================================================================ SwiGLU
@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, h_ptr, n, limit, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs, swiglu_limited(g, u, limit), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """FP32 silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    triton_runtime.check_device(gate, up)
    g, u = gate.contiguous(), up.contiguous()
    h = torch.empty(gate.shape, dtype=torch.float32, device=gate.device)
    if h.numel():
        _swiglu_kernel[(triton.cdiv(h.numel(), 1024),)](g, u, h, h.numel(), float(limit), BLOCK=1024)
    return h


# ============================================================================ experts
def expert_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    weight: torch.Tensor | None = None,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> torch.Tensor:
    """x [n, D] -> [n, D] in x.dtype; `weight` [n, 1] FP32 multiplies h before w2."""
    experts = ExpertSet(Weights.plain(w1.to(x.dtype)), Weights.plain(w3.to(x.dtype)), Weights.plain(w2.to(x.dtype)))
    gamma = None if weight is None else weight.reshape(-1).to(torch.float32).contiguous()
    return dense_experts(x, experts, limit, gamma, tuned.dense)


def dense_experts(
    x: torch.Tensor, experts: ExpertSet, limit: float, gamma: torch.Tensor | None, cfg: DenseConfig
) -> torch.Tensor:
    """Every row of x through expert 0 of `experts` (shared expert / single expert)."""
    num_rows = x.shape[0]
    h = torch.empty(num_rows, experts.w1.out_dim, dtype=x.dtype, device=x.device)
    dense.grouped_gemm(x, experts.w1, None, h, w3=experts.w3, gamma=gamma, limit=limit, cfg=cfg)
    y = torch.empty(num_rows, experts.w2.out_dim, dtype=x.dtype, device=x.device)
    return dense.grouped_gemm(h, experts.w2, None, y, cfg=cfg)


# ============================================================================ pair sorting
# Decode batches (<= SORT_KERNEL_MAX_TOKENS tokens) sort their token-expert pairs in one launch
# instead of torch's argsort / scatter / cumsum / searchsorted / index chain; larger batches
# (prefill) keep the torch chain, which gives the same order.
#
#   counts  counts[e] = pairs routed to expert e;  row_off = exclusive cumsum (sorted layout)
#   rows    program b < token blocks: pair (t, s) of its block, expert e, goes to row
#           row_off[e] + (pairs of e in earlier tokens) + (earlier slots of t with expert e)
#           (a stable sort by expert id); rank(t, s) = the pair's place among t's pairs in
#           ascending expert id (ties by slot) -> pos[t, rank] = its sorted row
#   tiles   the other programs, BLOCK_Q tiles each: tile q of the grouped GEMM: expert =
#           #experts whose tiles end at or before q, rows [start, end) of that expert's rows in
#           block_m steps; surplus tiles are empty
# Every program counts the pairs of every token itself (the ids are a few KB, in L2), so the
# token blocks and tile blocks run side by side instead of one after another.
SORT_KERNEL_MAX_TOKENS = 256
_SORT_BLOCK_T = 16
SORT_COUNT_T = 16  # tokens per step of a program's count of every token's pairs
SORT_WARPS = 4
_SORT_BLOCK_Q = 64
_COMBINE_BLOCK_D = 1024


@triton.jit
def _sort_counts(
    ids_ptr,
    T,
    t_own,
    experts,
    slot,
    smask,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    COUNT_T: tl.constexpr,
    E_PAD: tl.constexpr,
    CACHE: tl.constexpr,
):
    """(pairs per expert in every token but the BLOCK_T from t_own, of those before t_own),
    COUNT_T tokens a step."""
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    before = tl.zeros((E_PAD,), dtype=tl.int32)
    for t0 in range(0, T, COUNT_T):
        tok = t0 + tl.arange(0, COUNT_T)
        own = (tok >= t_own) & (tok < t_own + BLOCK_T)
        m = ((tok < T) & ~own)[:, None] & smask[None, :]
        ids = tl.load(ids_ptr + tok[:, None] * TOP_K + slot[None, :], mask=m, other=-1, cache_modifier=CACHE)
        hit = (ids.to(tl.int32)[:, :, None] == experts[None, None, :]).to(tl.int32)
        per_tok = tl.sum(hit, axis=1)  # [COUNT_T, E]
        counts += tl.sum(per_tok, axis=0)
        before += tl.sum(tl.where((tok < t_own)[:, None], per_tok, 0), axis=0)
    return counts, before


@triton.jit
def _expert_rows_base(
    ids_ptr,
    T,
    blk,
    n_blocks,
    hit,
    experts,
    slot,
    smask,
    TOP_K: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    COUNT_T: tl.constexpr,
    CACHE: tl.constexpr,
):
    """[BT, E]: the sorted row of each token's first pair with expert e: the expert's first row
    (counts of every block), plus the earlier blocks' and this block's earlier tokens' pairs."""
    per_tok = tl.sum(hit, axis=1)  # [BT, E]
    counts = tl.sum(per_tok, axis=0)
    seen = tl.zeros((E_PAD,), dtype=tl.int32)
    if n_blocks > 1:
        c, seen = _sort_counts(ids_ptr, T, blk * BLOCK_T, experts, slot, smask, TOP_K, BLOCK_T, COUNT_T, E_PAD, CACHE)
        counts += c
    row_off = tl.cumsum(counts, 0) - counts
    return (row_off + seen)[None, :] + tl.cumsum(per_tok, 0) - per_tok


@triton.jit
def _slot_ranks(ids, slot, smask):
    """([BT, KP] earlier slots of the token with the same expert, [BT, KP] the slot's rank by
    expert id within its token)."""
    other = ids[:, None, :]  # [BT, 1, KP]: slot s' against slot s on axis 1
    valid = smask[None, None, :]
    earlier = slot[None, None, :] < slot[None, :, None]
    same = (other == ids[:, :, None]) & valid & earlier
    ties = tl.sum(same.to(tl.int32), axis=2)
    rank = tl.sum(((other < ids[:, :, None]) & valid).to(tl.int32), axis=2) + tl.sum(same.to(tl.int32), axis=2)
    return ties, rank


@triton.jit
def _sort_token_block(
    ids_ptr,
    w_ptr,
    rows_ptr,
    gamma_ptr,
    pos_ptr,
    T,
    blk,
    n_blocks,
    experts,
    slot,
    smask,
    TOP_K: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    COUNT_T: tl.constexpr,
    CACHE: tl.constexpr,
):
    """Token block `blk`: the sorted rows (rows, gamma) and per-token ranks (pos) of its pairs."""
    tok = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    m = (tok[:, None] < T) & smask[None, :]
    flat = tok[:, None] * TOP_K + slot[None, :]
    ids = tl.load(ids_ptr + flat, mask=m, other=-1, cache_modifier=CACHE).to(tl.int32)
    gam = tl.load(w_ptr + flat, mask=m, other=0.0, cache_modifier=CACHE)
    hit = (ids[:, :, None] == experts[None, None, :]).to(tl.int32)  # [BT, KP, E]
    base = _expert_rows_base(
        ids_ptr, T, blk, n_blocks, hit, experts, slot, smask, TOP_K, E_PAD, BLOCK_T, COUNT_T, CACHE
    )
    ties, rank = _slot_ranks(ids, slot, smask)
    dest = tl.sum(hit * base[:, None, :], axis=2) + ties  # [BT, KP]
    tl.store(rows_ptr + dest, tok[:, None] + slot[None, :] * 0, mask=m)
    tl.store(gamma_ptr + dest, gam, mask=m)
    tl.store(pos_ptr + tok[:, None] * TOP_K + rank, dest, mask=m)


@triton.jit
def _tile_bounds(counts, q, E, experts, BLOCK_M: tl.constexpr):
    """(expert, first row, end row) of schedule tiles q ([BQ]) from the per-expert pair counts:
    each expert's rows in BLOCK_M tiles, experts in order; tiles past the last are empty."""
    row_off = tl.cumsum(counts, 0) - counts
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)  # one past each expert's last tile
    total = tl.sum(tiles, axis=0)
    ex = tl.sum((tile_end[None, :] <= q[:, None]).to(tl.int32), axis=1)
    ex = tl.minimum(ex, E - 1)
    sel = experts[None, :] == ex[:, None]  # [BQ, E]
    first = tl.sum(tl.where(sel, (tile_end - tiles)[None, :], 0), axis=1)
    roff = tl.sum(tl.where(sel, row_off[None, :], 0), axis=1)
    cnt = tl.sum(tl.where(sel, counts[None, :], 0), axis=1)
    start = roff + (q - first) * BLOCK_M
    end = tl.where(q < total, tl.minimum(start + BLOCK_M, roff + cnt), start)
    return ex, start, end


@triton.jit
def _sort_tile_block(
    ids_ptr,
    t_exp_ptr,
    t_start_ptr,
    t_end_ptr,
    T,
    E,
    max_tiles,
    qb,
    experts,
    slot,
    smask,
    TOP_K: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    COUNT_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    CACHE: tl.constexpr,
):
    """Tiles qb * BLOCK_Q .. + BLOCK_Q - 1 of the grouped GEMM's schedule."""
    counts, _ = _sort_counts(ids_ptr, T, -BLOCK_T, experts, slot, smask, TOP_K, BLOCK_T, COUNT_T, E_PAD, CACHE)
    q = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    ex, start, end = _tile_bounds(counts, q, E, experts, BLOCK_M)
    qm = q < max_tiles
    tl.store(t_exp_ptr + q, ex, mask=qm)
    tl.store(t_start_ptr + q, start, mask=qm)
    tl.store(t_end_ptr + q, end, mask=qm)


@triton.jit(do_not_specialize=["T", "max_tiles", "n_blocks"])
def _sort_pairs_kernel(
    ids_ptr,
    w_ptr,
    rows_ptr,
    gamma_ptr,
    pos_ptr,
    t_exp_ptr,
    t_start_ptr,
    t_end_ptr,
    T,
    E,
    max_tiles,
    n_blocks,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    COUNT_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    slot = tl.arange(0, K_PAD)
    smask = slot < TOP_K
    if pid < n_blocks:  # token block pid: sorted rows and per-token ranks of its pairs
        _sort_token_block(
            ids_ptr,
            w_ptr,
            rows_ptr,
            gamma_ptr,
            pos_ptr,
            T,
            pid,
            n_blocks,
            experts,
            slot,
            smask,
            TOP_K,
            E_PAD,
            BLOCK_T,
            COUNT_T,
            "",
        )
    else:  # tiles of the grouped GEMM's schedule
        _sort_tile_block(
            ids_ptr,
            t_exp_ptr,
            t_start_ptr,
            t_end_ptr,
            T,
            E,
            max_tiles,
            pid - n_blocks,
            experts,
            slot,
            smask,
            TOP_K,
            E_PAD,
            BLOCK_T,
            COUNT_T,
            BLOCK_M,
            BLOCK_Q,
            "",
        )


@dataclass(frozen=True)
class SortedPairs:
    """Token-expert pairs sorted by expert (stable): rows [P] int32 token of each sorted pair,
    gamma [P] FP32 its routing weight, schedule the grouped GEMM's tiles, pos [T, k] int32 the
    sorted row of each token's pairs in ascending expert id (the combine's sum order)."""

    rows: torch.Tensor
    gamma: torch.Tensor
    schedule: dense.TileSchedule
    pos: torch.Tensor


def sort_pairs(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, block_m: int) -> SortedPairs:
    """Sort the (token, slot) pairs of ids [T, k] (distinct experts per token, as `route`
    gives) by expert; no host sync. One launch up to SORT_KERNEL_MAX_TOKENS tokens (a program
    per 16-token block and per 64 tiles)."""
    if ids.shape[0] > SORT_KERNEL_MAX_TOKENS:
        return _sort_pairs_torch(ids, weights, num_experts, block_m)
    return _sort_pairs_launch(ids, weights, num_experts, block_m)


def _sort_pairs_torch(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, block_m: int) -> SortedPairs:
    """`sort_pairs` past SORT_KERNEL_MAX_TOKENS: a stable argsort by expert (no host read-back)."""
    num_tokens, top_k = ids.shape
    num_pairs = num_tokens * top_k
    device = ids.device
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs sorted by expert
    rows = (order // top_k).to(torch.int32)
    gamma = weights.reshape(-1)[order].to(torch.float32).contiguous()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # no host read-back (CUDA graphs)
    schedule = dense.grouped_schedule(counts, num_pairs, block_m)
    position = torch.empty_like(order)
    position[order] = torch.arange(num_pairs, device=device)
    pos = position.reshape(num_tokens, top_k).sort(dim=-1).values.to(torch.int32)
    return SortedPairs(rows, gamma, schedule, pos.contiguous())


def _sort_pairs_launch(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, block_m: int) -> SortedPairs:
    """`sort_pairs` in one launch: a program per 16-token block and per 64 tiles."""
    num_tokens, top_k = ids.shape
    max_tiles = _max_tiles(num_tokens * top_k, num_experts, block_m)
    out = _empty_pairs(num_tokens, top_k, num_experts, block_m, ids.device)
    sched = out.schedule
    n_blocks = triton.cdiv(num_tokens, _SORT_BLOCK_T)
    _sort_pairs_kernel[(n_blocks + triton.cdiv(max_tiles, _SORT_BLOCK_Q),)](
        ids.contiguous(),
        weights.to(torch.float32).contiguous(),
        out.rows,
        out.gamma,
        out.pos,
        sched.expert,
        sched.start,
        sched.end,
        num_tokens,
        num_experts,
        max_tiles,
        n_blocks,
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(num_experts),
        BLOCK_T=_SORT_BLOCK_T,
        COUNT_T=SORT_COUNT_T,
        BLOCK_M=block_m,
        BLOCK_Q=_SORT_BLOCK_Q,
        num_warps=SORT_WARPS,
    )
    return out


def _max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Tiles of the grouped GEMM's schedule: enough for any routing, at least one."""
    return max(1, min(num_pairs, -(-num_pairs // block_m) + num_experts))


def _empty_pairs(num_tokens: int, top_k: int, num_experts: int, block_m: int, device: torch.device) -> SortedPairs:
    """SortedPairs' buffers for the sort kernels to fill (sort_pairs, route_sorted)."""
    num_pairs = num_tokens * top_k
    rows = torch.empty(num_pairs, dtype=torch.int32, device=device)
    gamma = torch.empty(num_pairs, dtype=torch.float32, device=device)
    pos = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    tile = torch.empty(3, _max_tiles(num_pairs, num_experts, block_m), dtype=torch.int32, device=device)
    return SortedPairs(rows, gamma, dense.TileSchedule(tile[0], tile[1], tile[2], block_m), pos)


@triton.jit
def _combine_kernel(
    y_ptr,
    stride_y,
    pos_ptr,
    shared_ptr,
    stride_s,
    out_ptr,
    stride_o,
    D,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[t] = sum of y[pos[t, 0..k-1]] in that order (ascending expert id) + shared[t], FP32,
    rounded once to out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for r in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + t * TOP_K + r).to(tl.int64)
        acc += tl.load(y_ptr + p * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t * stride_s + cols, mask=cmask, other=0.0).to(tl.float32)
    if OUT_BF16:
        acc = round_bf16(acc)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def combine(y: torch.Tensor, pos: torch.Tensor, shared: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """[T, D] in out_dtype: each token's expert rows y[pos[t]] summed in FP32 in pos order,
    plus shared[t] (the shared expert's output) when given, one rounding. One launch."""
    num_tokens, top_k = pos.shape
    dim = y.shape[1]
    out = torch.empty(num_tokens, dim, dtype=out_dtype, device=y.device)
    if num_tokens:
        _combine_kernel[(num_tokens, triton.cdiv(dim, _COMBINE_BLOCK_D))](
            y,
            y.stride(0),
            pos,
            shared if shared is not None else y,
            shared.stride(0) if shared is not None else 0,
            out,
            out.stride(0),
            dim,
            TOP_K=top_k,
            HAS_SHARED=shared is not None,
            OUT_BF16=out_dtype == torch.bfloat16,
            BLOCK_D=_COMBINE_BLOCK_D,
            num_warps=4,
        )
    return out


# ============================================================================ routed experts
def expert_path(
    num_tokens: int, num_pairs: int, experts: ExpertSet, dtype: torch.dtype, tuned: KernelConfigs
) -> tuple[str, int]:
    """(path, tile rows) the routed experts of a num_tokens-token call take: "gemv" (CUDA
    cores), "swapab" (decode sizes), "large" (prefill sizes, GPU) or "grouped" (the generic
    grouped GEMMs); tile rows: the pair sort's block_m for that path."""
    m = tuned.moe
    if m.gemv and num_tokens <= m.gemv_max_rows and gemv.eligible(experts, dtype):
        return "gemv", gemv.tile_rows(num_tokens, m.gemv_tiles)
    if num_tokens <= m.swapab_max_tokens and swapab.eligible(experts, dtype):
        return "swapab", swapab.tile_rows(num_tokens, m.swapab)
    if grouped_large.eligible(experts.w1, num_pairs, dtype, experts.w2, cfg=m.large):
        return "large", grouped_large.block_m(m.large)
    return "grouped", dense.block_m_for(max(1, num_pairs // max(1, experts.num_experts)), tuned.dense)


def _expert_rows(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: ExpertSet,
    limit: float,
    presorted: SortedPairs | None,
    tuned: KernelConfigs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [T*k, D] in x.dtype, one row per sorted pair; pos [T, k]): the two grouped GEMMs.
    `presorted`: the pairs already sorted (route_sorted), used when its tiles fit the path."""
    num_tokens, top_k = ids.shape
    num_pairs = num_tokens * top_k
    path, block_m = expert_path(num_tokens, num_pairs, experts, x.dtype, tuned)
    pairs = presorted
    if pairs is None or pairs.schedule.block_m != block_m:
        pairs = sort_pairs(ids, weights, experts.num_experts, block_m)
    m = tuned.moe
    if path == "gemv":
        return gemv.expert_rows(x, pairs, experts, limit, block_m, cfg=m.gemv_tiles), pairs.pos
    if path == "swapab":
        return swapab.expert_rows(x, pairs, experts, limit, block_m, cfg=m.swapab), pairs.pos
    if path == "large":
        return grouped_large.expert_gemms(
            x, pairs.rows, pairs.gamma, pairs.schedule, experts.w1, experts.w3, experts.w2, limit, cfg=m.large
        ), pairs.pos
    return _grouped_expert_rows(x, pairs, experts, limit, tuned), pairs.pos


def _grouped_expert_rows(x: torch.Tensor, pairs: SortedPairs, experts: ExpertSet, limit: float, tuned) -> torch.Tensor:
    """The two split-K grouped GEMMs (dense.grouped_gemm) over the sorted pairs' schedule."""
    num_pairs = pairs.rows.shape[0]
    h = torch.empty(num_pairs, experts.w1.out_dim, dtype=x.dtype, device=x.device)
    dense.grouped_gemm(
        x,
        experts.w1,
        pairs.schedule,
        h,
        a_rows=pairs.rows,
        w3=experts.w3,
        gamma=pairs.gamma,
        limit=limit,
        cfg=tuned.dense,
    )
    y = torch.empty(num_pairs, experts.w2.out_dim, dtype=x.dtype, device=x.device)
    dense.grouped_gemm(h, experts.w2, pairs.schedule, y, cfg=tuned.dense)
    return y


def routed_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: ExpertSet,
    limit: float,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> torch.Tensor:
    """Sum over each token's k experts, ascending expert id, FP32 [T, D] (no shared expert)."""
    y, pos = _expert_rows(x, ids, weights, experts, limit, None, tuned)
    return combine(y, pos, None, torch.float32)


def moe(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    experts: ExpertWeights,
    shared: ExpertWeights | None,
    top_k: int,
    routed_scale: float,
    limit: float,
    gate_temp: float = 1.0,
    normalize: bool = True,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> torch.Tensor:
    """x [T, D] -> y [T, D] in x.dtype (dequantised expert weights, as the ref)."""
    return moe_quantized(
        x,
        gate_weight,
        bias,
        ExpertSet.plain(experts),
        None if shared is None else ExpertSet.plain(shared),
        top_k,
        routed_scale,
        limit,
        gate_temp,
        normalize,
        tuned=tuned,
    )


def moe_quantized(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    experts: ExpertSet,
    shared: ExpertSet | None,
    top_k: int,
    routed_scale: float,
    limit: float,
    gate_temp: float = 1.0,
    normalize: bool = True,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> torch.Tensor:
    """As `moe`, with expert weights in checkpoint formats (MXFP4 routed, FP8 shared)."""
    triton_runtime.check_device(x)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    gate = (gate_weight, bias, top_k, routed_scale, gate_temp, normalize)
    ids, weights, presorted = _route_for(x, gate, experts, tuned)
    y, pos = _expert_rows(x, ids, weights, experts, limit, presorted, tuned)
    return _add_shared(x, y, pos, shared, limit, tuned)


def _route_for(x: torch.Tensor, gate: tuple, experts: ExpertSet, tuned: KernelConfigs):
    """(ids, weights, presorted pairs or None): with fused_gate, one launch that also sorts the
    pairs for the expert path's tiles; else `route`."""
    gate_weight, bias, top_k, routed_scale, gate_temp, normalize = gate
    if tuned.moe.fused_gate and x.shape[0] <= tuned.moe.fused_gate_max_tokens:  # one launch
        _, block_m = expert_path(x.shape[0], x.shape[0] * top_k, experts, x.dtype, tuned)
        return route_sorted(x, gate_weight, bias, top_k, routed_scale, gate_temp, normalize, block_m, tuned=tuned)
    ids, weights = route(x, gate_weight, bias, top_k, routed_scale, gate_temp, normalize)
    return ids, weights, None


def _add_shared(x: torch.Tensor, y, pos, shared: ExpertSet | None, limit: float, tuned: KernelConfigs) -> torch.Tensor:
    """The routed sum plus the shared expert(s), rounded to x.dtype once."""
    shared_y = [
        dense_experts(x, _one_expert(shared, e), limit, None, tuned.dense)
        for e in range(shared.num_experts if shared is not None else 0)
    ]
    if len(shared_y) <= 1:  # routed sum + shared expert + rounding in one launch
        return combine(y, pos, shared_y[0] if shared_y else None, x.dtype)
    out = combine(y, pos, None, torch.float32)
    for s_y in shared_y:
        out = out + s_y.to(torch.float32)
    return out.to(x.dtype)


def _one_expert(experts: ExpertSet, e: int) -> ExpertSet:
    return ExpertSet(
        *(
            Weights(w.fmt, w.data[e : e + 1], None if w.scale is None else w.scale[e : e + 1])
            for w in (experts.w1, experts.w3, experts.w2)
        )
    )


def warmup(
    experts: ExpertSet,
    shared: ExpertSet | None,
    num_gate_experts: int,
    top_k: int,
    rows=(1, 8, 64),
    limit: float = 10.0,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> int:
    """Compile (and run once) the router and expert GEMM variants of `rows`-token MoE calls.

    experts / shared: one layer's routed (MXFP4) and shared (FP8) experts; num_gate_experts:
    the router's expert count. Every MoE layer of a model shares these variants. Returns the
    number of MoE calls made.
    """
    device = experts.w1.data.device
    dim = experts.w1.in_dim
    gate = torch.randn(num_gate_experts, dim, device=device).to(torch.bfloat16) * dim**-0.5
    bias = torch.zeros(num_gate_experts, device=device)
    for r in rows:
        x = torch.randn(r, dim, device=device).to(torch.bfloat16)
        moe_quantized(x, gate, bias, experts, shared, top_k, 1.0, limit, tuned=tuned)
    return len(rows)
