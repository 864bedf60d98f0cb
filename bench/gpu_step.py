"""Whole decode / prefill steps of a preset on one GPU, composed from the Triton kernels.

    python -m flashpd.bench.gpu_step --out bench/results/h200        (GPU, `bench` preset)
    TRITON_INTERPRET=1 python -m flashpd.bench.gpu_step --smoke      (CPU, `tiny` preset)

Weights (engine/gpu/weights.py `make_model`) are generated on the device directly in checkpoint
formats (model_spec §10): dense projections FP8 E4M3 + UE8M0 32x32 tiles, routed experts MXFP4
(packed E2M1 + UE8M0 per 32), BF16 router / compressor / small indexer weights, FP32 mHC
parameters, a BF16 head computed with FP32 accumulation (BF16 x BF16 products are exact in FP32,
so this is the FP32 head's math), and Engram tables in pinned host memory. KV pools are packed
uint8 records filled with random valid values through the kernels' own write paths (window FP8
528 B, compressed NVFP4 288 B, index MXFP4 68 B).

One layer forward (model_spec §2.4, §3.7), for T query rows:

    [Engram]  gather 24 rows (host, zero copy) -> wkv FP8 GEMM -> fused gate + inject
    mHC       fused write-back of the previous sublayer + this site's mixes + collapse + norm
    attention wq_a -> q_norm -> wq_b | wkv -> kv_norm -> window FP8 write (+RoPE)
              [KV source] compressor -> NVFP4 entry write + index key MXFP4 write
              [index source] index q (RoPE + MXFP4) -> scores over the packed keys -> top-512
              (layer 20 also publishes candidate blocks; reindex layers score inside them)
              sparse attention over window ∪ top-k records -> wo_a (8 groups) -> wo_b
    mHC       fused write-back + FFN mixes + collapse + norm
    MoE       fused router -> MXFP4 grouped experts (SwiGLU) -> FP8 shared expert

Index scoring and the candidate-masked top-k run once per sequence: their kernels take one key
pool for all queries of a call (no per-query key base), so a decode batch of B sequences makes B
scoring launches per index layer. KV writes inside a CUDA-graph capture go through the write
kernel without `_check_write_args` (it reads max(rows) back to the host); rows are checked once
outside the capture. Numerics of every kernel are the business of tests/kernels; this file times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before any kernel import: GPU or interpreter
# isort: on

from flashpd.engine.gpu.weights import (
    EngramWeights,
    GpuWeights,
    LayerWeights,
    make_model,
    rand_bf16,
)
from flashpd.kernels.attention import triton as attn_t
from flashpd.kernels.dense import triton as dense
from flashpd.kernels.dense.triton import Weights
from flashpd.kernels.engram import triton as engram_t
from flashpd.kernels.indexer import triton as index_t
from flashpd.kernels.mhc import triton as mhc_t
from flashpd.kernels.moe import triton as moe_t
from flashpd.kernels.quant import ref as qref
from flashpd.kernels.quant import triton as quant_t
from flashpd.kernels.rope.ref import Yarn, rope_cos_sin, rope_frequencies
from flashpd.kernels.verify import event_ms
from flashpd.model.config import LayerRole, LayerSpec, ModelConfig
from flashpd.model.presets import preset_config

PEAK_BF16_TFLOPS = 790.0  # H200 dense bf16 (device notes); MFU is against this
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
                -6.0)


@dataclass(frozen=True)
class RunPlan:
    """Sizes of one benchmark run."""

    preset: str
    batches: tuple[int, ...]  # decode batch sizes
    context_tokens: int  # tokens already in each decode sequence
    prefill_tokens: int  # encoder-path prompt length
    replay_rows: int  # bounded replay rows (model_spec §11.4)
    replay_prefixes: tuple[int, ...]  # prefix-hit lengths H at which replay is measured
    reps: int
    warmup: int
    graphs: bool  # CUDA graphs (GPU only)
    measure_step: bool = True  # also time the whole decode step (smoke: replay covers it)


BENCH_PLAN = RunPlan("bench", (1, 8, 64), 8192, 8192, 128, (8192, 32768, 131072), 5, 1, True)
SMOKE_PLAN = RunPlan("smoke", (1,), 16, 16, 4, (16,), 1, 0, False, measure_step=False)


def plan_config(plan: RunPlan) -> ModelConfig:
    """The preset's config; `smoke` is `tiny` cut to one layer per role (6 layers), an 8-token
    window and 1 Sinkhorn iteration, so the interpreter runs every section in seconds."""
    if plan.preset != "smoke":
        return preset_config(plan.preset)
    tiny = preset_config("tiny")
    return tiny.replace(
        name="smoke", num_layers=6, compress_ratios=(0, 0, 2, 2, 1, 1),
        kv_source_layer_ids=(2, 4), index_source_layer_ids=(2, 4, 5),
        candidate_source_layer_id=4, candidate_topk_blocks=2, index_topk=8,
        sliding_window=8, hc_sinkhorn_iters=1, moe_intermediate_size=32, engram_layer_ids=(1,),
        engram_num_embeddings=tiny.engram_num_embeddings[:1])


# ============================================================================ device weights
def _device() -> torch.device:
    return triton_runtime.kernel_device()


# ============================================================================ KV pools
@dataclass
class Pools:
    """Packed records: window FP8 per layer; compressed NVFP4 + index MXFP4 per KV source.

    Compressed rows of sequence b live at [b * entries_per_seq[src], ...): one region each.
    """

    window: list[torch.Tensor]
    comp: dict[int, torch.Tensor]
    index: dict[int, torch.Tensor]
    entries_per_seq: dict[int, int]


def _fill(pool: torch.Tensor, dim: int, pack) -> None:
    """Random valid records through the reference packers (bit-identical to the write kernels,
    and fast under the interpreter)."""
    chunk = 1 << 16
    for r0 in range(0, pool.shape[0], chunk):
        n = min(chunk, pool.shape[0] - r0)
        pool[r0:r0 + n] = pack(rand_bf16(n, dim))


def make_pools(cfg: ModelConfig, plan: RunPlan) -> Pools:
    dev, d, di = _device(), cfg.head_dim, cfg.index_head_dim
    window_rows = max(max(plan.batches) * cfg.sliding_window, plan.prefill_tokens)
    window = []
    for _ in cfg.layers:
        pool = torch.empty(window_rows, qref.window_fp8_record_bytes(d), dtype=torch.uint8,
                           device=dev)
        _fill(pool, d, qref.pack_window_fp8)
        window.append(pool)
    comp, index, per_seq = {}, {}, {}
    for src in cfg.kv_source_layer_ids:
        ratio = cfg.compress_ratios[src]
        per_seq[src] = plan.context_tokens // ratio + 1
        num = max(max(plan.batches) * per_seq[src], max(plan.replay_prefixes) // ratio + 1,
                  plan.prefill_tokens // ratio + 1)
        comp[src] = torch.empty(num, qref.nvfp4_record_bytes(d), dtype=torch.uint8, device=dev)
        index[src] = torch.empty(num, qref.mxfp4_record_bytes(di), dtype=torch.uint8, device=dev)
        _fill(comp[src], d, qref.pack_nvfp4)
        _fill(index[src], di, qref.pack_mxfp4)
    return Pools(window, comp, index, per_seq)


# ============================================================================ forward context
@dataclass
class Segment:
    """Query rows [start, stop) of one sequence, whose compressed entries start at `key_base`."""

    start: int
    stop: int
    key_base: dict[int, int]  # per ratio
    num_keys: dict[int, int]  # per ratio: entries the segment's last query can see


@dataclass
class StepCtx:
    """Static inputs of one forward over T query rows (addresses fixed: graph-capturable)."""

    positions: torch.Tensor  # [T] int64
    rope_main: tuple[torch.Tensor, torch.Tensor]  # [T, R/2] each (ratio-0 layers)
    rope_comp: tuple[torch.Tensor, torch.Tensor]  # [T, R/2] (ratio > 0 layers)
    rope_index_q: tuple[torch.Tensor, torch.Tensor]  # [T * nh, R/2]
    window_rows: torch.Tensor  # [T, W] int32 pool rows, -1 empty
    window_write: torch.Tensor  # [T] int32
    n_visible: dict[int, torch.Tensor]  # ratio -> [T] int32
    key_base: dict[int, torch.Tensor]  # ratio -> [T] int64 first pool row of the query's seq
    segments: list[Segment]
    entry_rows: dict[int, torch.Tensor]  # ratio -> [entries] int32 rows written this call
    entry_rope: dict[int, tuple[torch.Tensor, torch.Tensor]]
    open_kv: tuple[torch.Tensor, torch.Tensor] | None  # decode ratio-2 open rows (a, g) FP32
    engram_ids: torch.Tensor  # [T, C]
    write_global: bool  # False in a bounded replay: cached global state is not rewritten
    graph_safe: bool = False  # KV writes skip the host-side row check (inside a capture)
    published: dict = field(default_factory=dict)  # idx_src -> comp rows; "blocks" -> blocks
    e2m1: torch.Tensor | None = None  # decode table for the index query fake quant

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


class RopeTables:
    def __init__(self, cfg: ModelConfig):
        r = cfg.rope
        yarn = Yarn(r.yarn_factor, r.yarn_beta_fast, r.yarn_beta_slow, r.yarn_original_max_position)
        self.main = rope_frequencies(cfg.rope_head_dim, r.theta)
        self.comp = rope_frequencies(cfg.rope_head_dim, r.compress_theta, yarn)

    def at(self, positions: torch.Tensor, compress: bool) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(positions.cpu(), self.comp if compress else self.main)
        return cos.to(_device()).contiguous(), sin.to(_device()).contiguous()


def _ratios(cfg: ModelConfig) -> tuple[int, ...]:
    return tuple(sorted({cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids}))


def _window_rows(positions: torch.Tensor, lo: torch.Tensor, row_of, window: int) -> torch.Tensor:
    """[T, W]: positions t-W+1..t clipped at lo[t] (-1 below), mapped through row_of(pos)."""
    pos = positions[:, None] + torch.arange(window)[None, :] - (window - 1)  # [T, W]
    return torch.where(pos >= lo[:, None], row_of(pos), -1).to(torch.int32)


def _base_ctx(cfg: ModelConfig, rope: RopeTables, positions: torch.Tensor,
              window_rows: torch.Tensor, window_write: torch.Tensor, key_base: dict,
              segments: list[Segment], entry_pos: dict, entry_rows: dict, open_kv,
              write_global: bool) -> StepCtx:
    dev = _device()
    nh = cfg.index_n_heads
    comp_rope = rope.at(positions, True)
    ids = torch.randint(0, min(cfg.engram_num_embeddings), (positions.shape[0],
                        cfg.engram_hash_columns), device=dev)
    return StepCtx(
        positions=positions.to(dev), rope_main=rope.at(positions, False), rope_comp=comp_rope,
        rope_index_q=tuple(t.repeat_interleave(nh, dim=0).contiguous() for t in comp_rope),
        window_rows=window_rows.to(dev), window_write=window_write.to(torch.int32).to(dev),
        n_visible={r: ((positions + 1) // r).to(torch.int32).to(dev) for r in _ratios(cfg)},
        key_base={r: b.to(dev) for r, b in key_base.items()}, segments=segments,
        entry_rows={r: v.to(torch.int32).to(dev) for r, v in entry_rows.items()},
        entry_rope={r: rope.at(p, True) for r, p in entry_pos.items()}, open_kv=open_kv,
        engram_ids=ids, write_global=write_global,
        e2m1=torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=dev))


def decode_ctx(cfg: ModelConfig, pools: Pools, rope: RopeTables, batch: int,
               context_tokens: int) -> StepCtx:
    """B sequences, each adding the token at position `context_tokens`."""
    window = cfg.sliding_window
    positions = torch.full((batch,), context_tokens, dtype=torch.int64)
    seq = torch.arange(batch)
    lo = torch.zeros(batch, dtype=torch.int64)
    rows = _window_rows(positions, lo, lambda p: seq[:, None] * window + p % window, window)
    per_seq = {cfg.compress_ratios[s]: n for s, n in pools.entries_per_seq.items()}
    key_base = {r: seq * n for r, n in per_seq.items()}
    newest = {r: (context_tokens + 1) // r - 1 for r in per_seq}  # entry each token closes
    segments = [Segment(b, b + 1, {r: b * n for r, n in per_seq.items()},
                        {r: newest[r] + 1 for r in per_seq}) for b in range(batch)]
    entry_rows = {r: key_base[r] + newest[r] for r in per_seq}
    entry_pos = {r: torch.full((batch,), r * newest[r], dtype=torch.int64) for r in per_seq}
    dev, d = _device(), cfg.head_dim
    open_kv = (torch.randn(batch, d, device=dev), torch.randn(batch, d, device=dev))
    return _base_ctx(cfg, rope, positions, rows, seq * window + context_tokens % window,
                     key_base, segments, entry_pos, entry_rows, open_kv, write_global=True)


def prefill_ctx(cfg: ModelConfig, rope: RopeTables, num_tokens: int) -> StepCtx:
    """One prompt of `num_tokens` (even) from position 0; window pool rows = positions."""
    positions = torch.arange(num_tokens, dtype=torch.int64)
    rows = _window_rows(positions, torch.zeros_like(positions), lambda p: p, cfg.sliding_window)
    ratios = _ratios(cfg)
    zero = {r: torch.zeros(num_tokens, dtype=torch.int64) for r in ratios}
    segments = [Segment(0, num_tokens, {r: 0 for r in ratios},
                        {r: num_tokens // r for r in ratios})]
    entries = {r: torch.arange(num_tokens // r, dtype=torch.int64) for r in ratios}
    return _base_ctx(cfg, rope, positions, rows, positions, zero, segments,
                     {r: r * e for r, e in entries.items()}, entries, None, write_global=True)


def replay_ctx(cfg: ModelConfig, rope: RopeTables, prefix_tokens: int, rows: int) -> StepCtx:
    """Bounded replay after a prefix hit of H tokens: rows at [H-R, H), windows clipped at H-R,
    compressed state read from the cache and not rewritten (model_spec §11.4)."""
    start = prefix_tokens - rows
    positions = torch.arange(start, prefix_tokens, dtype=torch.int64)
    win = _window_rows(positions, torch.full_like(positions, start), lambda p: p - start,
                       cfg.sliding_window)
    ratios = _ratios(cfg)
    zero = {r: torch.zeros(rows, dtype=torch.int64) for r in ratios}
    segments = [Segment(0, rows, {r: 0 for r in ratios},
                        {r: prefix_tokens // r for r in ratios})]
    return _base_ctx(cfg, rope, positions, win, positions - start, zero, segments, {}, {}, None,
                     write_global=False)


# ============================================================================ layer pieces
def _lin(x: torch.Tensor, w: Weights) -> torch.Tensor:
    return dense.linear_weights(x, w, torch.bfloat16)


def _norm(x: torch.Tensor, w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return dense.rms_norm(x, w, cfg.rms_norm_eps)


def _write(ctx: StepCtx, fmt: int, values: torch.Tensor, rows: torch.Tensor,
           pool: torch.Tensor, rope) -> None:
    """KV write; inside a graph capture, the same kernel without the host-side row check."""
    if not ctx.graph_safe:
        quant_t._write(fmt, values, rows, pool, rope)
        return
    cos, sin, pairs = quant_t._rope_tables(rope, values)
    quant_t._kv_write_kernel[(values.shape[0],)](
        values, values.stride(0), rows, pool, pool.stride(0), cos, sin, cos.stride(0),
        D=values.shape[1], BLOCK=quant_t._BLOCK[fmt], FMT=fmt,
        AMAX_FLOOR=quant_t._AMAX_FLOOR[fmt], ROPE_PAIRS=pairs,
        ROUND_BF16=values.dtype == torch.bfloat16, num_warps=1 if values.shape[1] <= 128 else 4,
        **triton_runtime.launch_options())


def compress(lw: LayerWeights, cfg: ModelConfig, ctx: StepCtx, pools: Pools,
             x: torch.Tensor) -> None:
    """KV-source layers (§4, §5.2): new compressed entries -> NVFP4 records + index keys."""
    ratio = lw.spec.ratio
    if ratio == 2:
        kv = dense.linear_fp32(x, lw.comp_wkv)  # [T, d] FP32
        score = dense.linear_fp32(x, lw.comp_wgate)
        if ctx.open_kv is not None:  # decode: the token closes its group with the open row
            kv = torch.stack((ctx.open_kv[0], kv), dim=1)  # [G, 2, d]
            score = torch.stack((ctx.open_kv[1], score), dim=1)
        else:
            kv, score = kv.view(-1, 2, kv.shape[1]), score.view(-1, 2, score.shape[1])
        pooled = (torch.softmax(score, dim=1) * kv).sum(dim=1).to(torch.bfloat16)  # [G, d]
        latent = _norm(pooled, lw.comp_norm, cfg)
    else:
        latent = _norm(dense.linear(x, lw.comp_wkv), lw.comp_norm, cfg)  # [T, d]
    rows, rope = ctx.entry_rows[ratio], ctx.entry_rope[ratio]
    keys = _norm(dense.linear(latent, lw.idx_wk), lw.idx_k_norm, cfg)  # [G, dI] pre-RoPE
    _write(ctx, quant_t.FMT_NVFP4, latent, rows, pools.comp[lw.spec.layer_id], rope)
    _write(ctx, quant_t.FMT_MXFP4, keys, rows, pools.index[lw.spec.layer_id], rope)


def _index_query(lw: LayerWeights, cfg: ModelConfig, ctx: StepCtx, cq: torch.Tensor,
                 x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q^I = MXFP4(RoPE(c_q . wq_b)) [T, nh, dI] and head weights [T, nh] (§5.1)."""
    nh, di = cfg.index_n_heads, cfg.index_head_dim
    num = cq.shape[0] * nh
    q = _lin(cq, lw.idx_wq_b).view(num, di)
    rec = torch.empty(num, qref.mxfp4_record_bytes(di), dtype=torch.uint8, device=q.device)
    rows = torch.arange(num, dtype=torch.int32, device=q.device)
    _write(ctx, quant_t.FMT_MXFP4, q, rows, rec, ctx.rope_index_q)
    codes = torch.stack((rec[:, :di // 2] & 0xF, rec[:, :di // 2] >> 4), dim=-1).long()
    scale = torch.exp2(rec[:, di // 2:].float() - 127.0)  # [N, dI/32]
    vals = ctx.e2m1[codes.view(num, di // 32, 32)] * scale[:, :, None]
    q_fq = vals.view(-1, nh, di).to(torch.bfloat16)
    weights = dense.linear_fp32(x, lw.idx_proj) * (1.0 / math.sqrt(nh * di))  # [T, nh]
    return q_fq, weights


def index_select(lw: LayerWeights, cfg: ModelConfig, ctx: StepCtx, pools: Pools,
                 cq: torch.Tensor, x: torch.Tensor) -> None:
    """Scores + top-k per sequence; publishes compressed pool rows [T, k] for this idx_src."""
    spec = lw.spec
    q, w = _index_query(lw, cfg, ctx, cq, x)
    keys = pools.index[spec.kv_src]
    nvis = ctx.n_visible[spec.ratio]
    k, bs = cfg.index_topk, cfg.candidate_block_size
    picked, scores, blocks = [], [], []
    for seg in ctx.segments:
        sl = slice(seg.start, seg.stop)
        base, n = seg.key_base[spec.ratio], seg.num_keys[spec.ratio]
        seg_keys = keys[base:base + n]
        if spec.uses_candidates:
            picked.append(index_t.index_topk_sparse(q[sl], w[sl], seg_keys, nvis[sl],
                                                    ctx.published["blocks"][sl], bs, k))
        else:
            s = index_t.index_scores_packed(q[sl], w[sl], seg_keys, nvis[sl])  # [t, n]
            if spec.is_candidate_source:
                blocks.append(index_t.candidate_blocks(s, nvis[sl], bs, cfg.candidate_topk_blocks))
            scores.append(s)
    if scores:
        same = len({s.shape[1] for s in scores}) == 1
        picked = [index_t.select_topk(torch.cat(scores), k)] if same else \
            [index_t.select_topk(s, k) for s in scores]
    if blocks:
        ctx.published["blocks"] = torch.cat(blocks)
    ids = torch.cat(picked)  # [T, k] entry ids, -1 padded
    base = ctx.key_base[spec.ratio][:, None]
    ctx.published[spec.layer_id] = torch.where(ids >= 0, ids + base, -1).to(torch.int32)


def _wo_a(o: torch.Tensor, w: Weights) -> torch.Tensor:
    """Block-diagonal wo_a: o [T, G, H/G*d] -> z [T, G*o_lora] (group g through W_a[g])."""
    num_tokens, groups, width = o.shape
    a = o.reshape(num_tokens * groups, width)
    # C row p = g*T + t (group-major, one expert per group) reads A row t*G + g
    p = torch.arange(num_tokens * groups, device=o.device)
    a_rows = ((p % num_tokens) * groups + p // num_tokens).to(torch.int32)
    counts = torch.full((groups,), num_tokens, dtype=torch.int64, device=o.device)
    block_m = dense.block_m_for(num_tokens)
    schedule = dense.grouped_schedule(counts, num_tokens * groups, block_m)
    z = torch.empty(num_tokens * groups, w.out_dim, dtype=o.dtype, device=o.device)
    dense.grouped_gemm(a, w, schedule, z, a_rows=a_rows)
    return z.view(groups, num_tokens, -1).transpose(0, 1).reshape(num_tokens, -1)


def attention(lw: LayerWeights, cfg: ModelConfig, ctx: StepCtx, pools: Pools,
              x: torch.Tensor) -> torch.Tensor:
    spec = lw.spec
    num_tokens = x.shape[0]
    cq = _norm(_lin(x, lw.wq_a), lw.q_norm, cfg)  # [T, q_lora]
    q = _lin(cq, lw.wq_b).view(num_tokens, cfg.num_heads, cfg.head_dim)  # [T, H, d]
    kv = _norm(_lin(x, lw.wkv), lw.kv_norm, cfg)  # [T, d]
    rope = ctx.rope_comp if spec.ratio else ctx.rope_main
    window_pool = pools.window[spec.layer_id]
    _write(ctx, quant_t.FMT_WINDOW_FP8, kv, ctx.window_write, window_pool, rope)
    comp_pool = comp_rows = None
    if spec.ratio:
        if spec.owns_compressor and ctx.write_global:
            compress(lw, cfg, ctx, pools, x)
        if spec.owns_index_query:
            index_select(lw, cfg, ctx, pools, cq, x)
        comp_pool, comp_rows = pools.comp[spec.kv_src], ctx.published[spec.idx_src]
    o = attn_t.sparse_attention_packed(q, rope, window_pool, ctx.window_rows, comp_pool,
                                       comp_rows, lw.sink, cfg.head_dim ** -0.5)  # [T, H, d]
    z = _wo_a(o.view(num_tokens, cfg.o_groups, -1), lw.wo_a)  # [T, G*o_lora]
    return _lin(z, lw.wo_b)  # [T, D]


def moe(lw: LayerWeights, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    # moe.triton.route fails to compile for exactly one token on the GPU (Triton specialises
    # the scalar T == 1 to a constant, and the kernel calls T.to()); the router is batch
    # invariant, so a lone token is routed as row 0 of two copies
    rows = x if x.shape[0] != 1 else x.expand(2, -1).contiguous()
    ids, gamma = moe_t.route(rows, lw.gate, lw.gate_bias, cfg.num_experts_per_tok,
                             cfg.routed_scaling_factor, cfg.gate_temp, cfg.norm_topk_prob)
    ids, gamma = ids[:x.shape[0]], gamma[:x.shape[0]]
    out = moe_t.routed_experts(x, ids, gamma, lw.experts, cfg.swiglu_limit)  # [T, D] FP32
    shared = moe_t._dense_experts(x, lw.shared, cfg.swiglu_limit, None)
    return (out + shared.to(torch.float32)).to(x.dtype)


def engram(ew: EngramWeights, cfg: ModelConfig, ctx: StepCtx, streams: torch.Tensor
           ) -> torch.Tensor:
    rows = engram_t.gather_rows(ew.table, ctx.engram_ids)  # [T, C*row_dim] BF16
    kv = _lin(rows, ew.wkv)  # [T, (S+1)*D]
    return engram_t._run_engram(streams, kv, ew.qk, cfg.rms_norm_eps, inject=True)[0]


# ============================================================================ layers / steps
@dataclass
class Carry:
    """Residual state between sublayers (§2.4): streams, pending sublayer output, coefficients."""

    streams: torch.Tensor  # [T, S, D]
    y: torch.Tensor | None  # [T, D] output not yet written back
    post: torch.Tensor | None  # [T, S]
    comb: torch.Tensor | None  # [T, S, S]
    pre: torch.Tensor  # [T, S] carried pre vector


def initial_carry(cfg: ModelConfig, num_tokens: int) -> Carry:
    """Embedding rows expanded to S streams, one-hot pre (layer 0)."""
    emb = rand_bf16(num_tokens, cfg.hidden_size)
    streams = emb[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
    pre = torch.zeros(num_tokens, cfg.hc_mult, device=emb.device)
    pre[:, 0] = 1.0
    return Carry(streams, None, None, None, pre)


def mid_carry(cfg: ModelConfig, num_tokens: int) -> Carry:
    """A carry as it enters a middle layer (pending FFN output and coefficients)."""
    dev, s = _device(), cfg.hc_mult
    return Carry(rand_bf16(num_tokens, s, cfg.hidden_size), rand_bf16(num_tokens, cfg.hidden_size),
                 torch.rand(num_tokens, s, device=dev),
                 torch.softmax(torch.randn(num_tokens, s, s, device=dev), -1),
                 torch.softmax(torch.randn(num_tokens, s, device=dev), -1))


def _mhc(cfg: ModelConfig, carry: Carry, params, norm_w: torch.Tensor):
    fn, base, scale = params
    return mhc_t.expand_mix_collapse(carry.y, carry.streams, carry.post, carry.comb, fn, base,
                                     scale, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps,
                                     pre_in=carry.pre, norm_weight=norm_w)


def layer_forward(model: GpuWeights, lw: LayerWeights, ctx: StepCtx, pools: Pools,
                  carry: Carry) -> Carry:
    cfg = model.cfg
    if lw.engram is not None:  # write back the previous FFN output, then inject (§2.4 step 1)
        streams = carry.streams
        if carry.y is not None:
            streams = mhc_t.expand(carry.y, streams, carry.post, carry.comb)
        carry = Carry(engram(lw.engram, cfg, ctx, streams), None, None, None, carry.pre)
    streams, pre_a, post_a, comb_a, x = _mhc(cfg, carry, lw.hc_attn, lw.attn_norm)
    y = attention(lw, cfg, ctx, pools, x)
    carry = Carry(streams, y, post_a, comb_a, pre_a)
    streams, pre_f, post_f, comb_f, x = _mhc(cfg, carry, lw.hc_ffn, lw.ffn_norm)
    return Carry(streams, moe(lw, cfg, x), post_f, comb_f, pre_f)


def head(model: GpuWeights, carry: Carry) -> torch.Tensor:
    """Final write-back, collapse with layer 39's FFN pre, norm, logits FP32 [T, vocab]."""
    streams = mhc_t.expand(carry.y, carry.streams, carry.post, carry.comb)
    h = _norm(mhc_t.collapse(streams, carry.pre), model.norm, model.cfg)
    return dense.linear_fp32(h, model.head)


def full_step(model: GpuWeights, ctx: StepCtx, pools: Pools, carry: Carry) -> torch.Tensor:
    for lw in model.layers:
        carry = layer_forward(model, lw, ctx, pools, carry)
    return head(model, carry)


def encoder_prefill(model: GpuWeights, ctx: StepCtx, pools: Pools, carry: Carry) -> None:
    """Layers before the candidate source on every token, then that layer's KV-source work
    (seam mixes + collapse + norm, compressor, NVFP4 entries, index keys) (§11.2)."""
    seam = model.cfg.candidate_source_layer_id
    for lw in model.layers[:seam]:
        carry = layer_forward(model, lw, ctx, pools, carry)
    lw = model.layers[seam]
    _, _, _, _, x = _mhc(model.cfg, carry, lw.hc_attn, lw.attn_norm)
    compress(lw, model.cfg, ctx, pools, x)


# ============================================================================ timing
def _sync() -> None:
    if torch.cuda.is_available() and not triton_runtime.interpreting():
        torch.cuda.synchronize()


def time_ms(fn, reps: int, warmup: int = 1) -> float:
    """Median milliseconds of `fn` after `warmup` calls: CUDA events or wall clock."""
    for _ in range(warmup):
        fn()
    _sync()
    samples = []
    for _ in range(reps):
        if triton_runtime.interpreting():
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
            continue
        samples.append(event_ms(fn))
    return statistics.median(samples)


def graph_time_ms(fn, ctx: StepCtx, reps: int) -> float:
    """Capture `fn` in one torch.cuda.CUDAGraph (after eager warm-up) and time its replay."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    ctx.graph_safe = True
    try:
        with torch.cuda.graph(graph):
            fn()
    finally:
        ctx.graph_safe = False
    return time_ms(graph.replay, reps)


def measure_copy_gbps() -> float:
    """Device copy bandwidth, read + write bytes over time (GB/s)."""
    num = (1 << 30) if not triton_runtime.interpreting() else (1 << 22)
    src = torch.empty(num, dtype=torch.uint8, device=_device()).random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 10)
    return 2 * num / (ms * 1e-3) / 1e9


# ============================================================================ byte / FLOP laws
def _fp8_bytes(params: int) -> float:
    return params * (1 + 1 / 1024)  # E4M3 + one UE8M0 per 32x32 tile


def _attn_params(cfg: ModelConfig) -> int:
    d, dim = cfg.head_dim, cfg.hidden_size
    return (dim * cfg.q_lora_rank + cfg.q_lora_rank * cfg.num_heads * d + dim * d
            + cfg.num_heads * d * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * dim)


def _expert_params(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def expected_experts(cfg: ModelConfig, batch: int) -> float:
    """Distinct experts a batch touches under uniform routing: E (1 - (1 - k/E)^B)."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def _role_extra_params(cfg: ModelConfig, spec: LayerSpec) -> dict[str, int]:
    """(params, bytes/param) of the compressor / indexer weights a role owns."""
    d, dim, di, nh = cfg.head_dim, cfg.hidden_size, cfg.index_head_dim, cfg.index_n_heads
    out = {}
    if spec.owns_compressor:
        out["compressor_bf16"] = d * dim * (2 if spec.ratio == 2 else 1) + di * d
    if spec.owns_index_query:
        out["index_q_fp8"] = nh * di * cfg.q_lora_rank
        out["index_proj_bf16"] = nh * dim
    return out


def decode_layer_bytes(cfg: ModelConfig, spec: LayerSpec, batch: int,
                       context_tokens: int) -> dict[str, float]:
    """HBM bytes one decode step reads in one layer: weights + KV (activations left out)."""
    s, dim = cfg.hc_mult, cfg.hidden_size
    extra = _role_extra_params(cfg, spec)
    weights = (_fp8_bytes(_attn_params(cfg)) + cfg.n_routed_experts * dim * 2
               + expected_experts(cfg, batch) * _expert_params(cfg) * (0.5 + 1 / 32)
               + _fp8_bytes(_expert_params(cfg)) + 2 * (2 + s) * s * s * dim * 4
               + 2 * extra.get("compressor_bf16", 0) + _fp8_bytes(extra.get("index_q_fp8", 0))
               + 2 * extra.get("index_proj_bf16", 0))
    if spec.has_engram:
        weights += _fp8_bytes((s + 1) * dim * cfg.engram_hash_columns * cfg.engram_head_dim)
    kv = cfg.sliding_window * qref.window_fp8_record_bytes(cfg.head_dim)
    if spec.ratio:
        visible = (context_tokens + 1) // spec.ratio
        kv += min(cfg.index_topk, visible) * qref.nvfp4_record_bytes(cfg.head_dim)
        if spec.owns_index_query:
            pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
            scanned = min(visible, pool) if spec.uses_candidates else visible
            kv += scanned * qref.mxfp4_record_bytes(cfg.index_head_dim)
    return {"weights": weights, "kv": kv * batch}


def decode_step_bytes(cfg: ModelConfig, batch: int, context_tokens: int) -> dict[str, float]:
    total = {"weights": 2.0 * cfg.vocab_size * cfg.hidden_size, "kv": 0.0}  # BF16 head
    for spec in cfg.layers:
        part = decode_layer_bytes(cfg, spec, batch, context_tokens)
        total["weights"] += part["weights"]
        total["kv"] += part["kv"]
    return total


def encoder_prefill_flops(cfg: ModelConfig, num_tokens: int) -> dict[str, float]:
    """2 FLOP per active param per token (+ per compressed entry) plus attention and index
    scoring FLOPs, for layers before the candidate source and that layer's KV-source work."""
    s, dim, d = cfg.hc_mult, cfg.hidden_size, cfg.head_dim
    seam = cfg.candidate_source_layer_id
    mhc_params = 2 * (2 + s) * s * s * dim
    dense_per_token = 0.0
    attn_flops = 0.0
    index_flops = 0.0
    for spec in cfg.layers[:seam]:
        per_token = (_attn_params(cfg) + cfg.n_routed_experts * dim + mhc_params
                     + (cfg.num_experts_per_tok + 1) * _expert_params(cfg))
        extra = _role_extra_params(cfg, spec)
        if spec.owns_compressor:  # projections per token; index keys per entry
            per_token += d * dim * (2 if spec.ratio == 2 else 1)
            per_token += cfg.index_head_dim * d / spec.ratio
        per_token += extra.get("index_q_fp8", 0) + extra.get("index_proj_bf16", 0)
        if spec.has_engram:
            per_token += (s + 1) * dim * cfg.engram_hash_columns * cfg.engram_head_dim
        dense_per_token += per_token
        for p in range(num_tokens):
            keys = min(p + 1, cfg.sliding_window)
            if spec.ratio:
                visible = (p + 1) // spec.ratio
                keys += min(cfg.index_topk, visible)
                if spec.owns_index_query:
                    index_flops += 2 * cfg.index_n_heads * cfg.index_head_dim * visible
            attn_flops += 4 * cfg.num_heads * d * keys
    dense_per_token += mhc_params / 2 + d * dim + cfg.index_head_dim * d  # layer-20 seam
    return {"dense": 2 * dense_per_token * num_tokens, "attention": attn_flops,
            "index": index_flops, "active_params_per_token": dense_per_token}


# ============================================================================ sections
ROLE_LAYERS = {  # representative layer per role, in an order where publishers come first
    "swa_only": lambda s: s.role is LayerRole.SWA_ONLY and not s.has_engram,
    "engram_swa": lambda s: s.role is LayerRole.SWA_ONLY and s.has_engram,
    "full_ratio2": lambda s: s.role is LayerRole.FULL and s.ratio == 2 and not s.has_engram,
    "reuse": lambda s: s.role is LayerRole.REUSE,
    "full_ratio1_candidate": lambda s: s.is_candidate_source,
    "reindex": lambda s: s.role is LayerRole.REINDEX,
}


def role_layer_ids(cfg: ModelConfig) -> dict[str, int]:
    return {role: next(s.layer_id for s in cfg.layers if pick(s))
            for role, pick in ROLE_LAYERS.items()}


def compose_layers(cfg: ModelConfig, role_ms: dict[str, float]) -> float:
    """Derived: sum over layers of its role's time; an Engram layer of another role adds
    (engram_swa - swa_only)."""
    engram_extra = role_ms["engram_swa"] - role_ms["swa_only"]
    total = 0.0
    for spec in cfg.layers:
        if spec.role is LayerRole.SWA_ONLY:
            base = role_ms["swa_only"]
        elif spec.is_candidate_source:
            base = role_ms["full_ratio1_candidate"]
        elif spec.role is LayerRole.FULL:
            base = role_ms["full_ratio2"]
        else:
            base = role_ms[spec.role.value]
        total += base + (engram_extra if spec.has_engram else 0.0)
    return total


class Attempts:
    """Runs measurements; with keep_going, a failure is recorded (label -> error) and the run
    continues with the next measurement instead of losing the rest of a device lease."""

    def __init__(self, keep_going: bool, log):
        self.keep_going = keep_going
        self.log = log
        self.errors: dict[str, str] = {}

    def __call__(self, label: str, fn):
        if not self.keep_going:
            return fn()
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - recorded in the results, see class doc
            self.errors[label] = f"{type(exc).__name__}: {str(exc)[:400]}"
            self.log(f"FAILED {label}: {self.errors[label]}")
            return None


def _decode_one(model, pools, rope, plan, batch, log, attempt: Attempts) -> dict:
    cfg = model.cfg
    ctx = decode_ctx(cfg, pools, rope, batch, plan.context_tokens)
    row = {"batch": batch, "context_tokens": plan.context_tokens, "roles": {}}
    for role, layer_id in role_layer_ids(cfg).items():
        lw, carry = model.layers[layer_id], mid_carry(cfg, batch)
        fn = lambda lw=lw, carry=carry: layer_forward(model, lw, ctx, pools, carry)  # noqa: E731
        entry = {"layer": layer_id,
                 "eager_ms": attempt(f"B{batch} {role} eager",
                                     lambda fn=fn: time_ms(fn, plan.reps, plan.warmup))}
        if plan.graphs:
            entry["graph_ms"] = attempt(f"B{batch} {role} graph",
                                        lambda fn=fn: graph_time_ms(fn, ctx, plan.reps))
        part = decode_layer_bytes(cfg, cfg.layers[layer_id], batch, plan.context_tokens)
        entry["floor_bytes"] = part["weights"] + part["kv"]
        row["roles"][role] = entry
        log(f"decode B={batch} {role} (layer {layer_id}): {entry}")
    head_carry = mid_carry(cfg, batch)
    row["head_eager_ms"] = attempt(f"B{batch} head", lambda: time_ms(
        lambda: head(model, head_carry), plan.reps, plan.warmup))
    modes = ["eager_ms"] + (["graph_ms"] if plan.graphs else [])
    for mode in modes:
        role_ms = {r: e[mode] for r, e in row["roles"].items()}
        if None not in role_ms.values() and row["head_eager_ms"] is not None:
            row[f"composed_{mode}"] = compose_layers(cfg, role_ms) + row["head_eager_ms"]
    row["floor_bytes"] = decode_step_bytes(cfg, batch, plan.context_tokens)
    if not plan.measure_step:
        return row
    carry = initial_carry(cfg, batch)
    step = lambda: full_step(model, ctx, pools, carry)  # noqa: E731
    row["step_eager_ms"] = attempt(f"B{batch} step eager", lambda: time_ms(
        step, max(1, plan.reps // 2), plan.warmup))
    if plan.graphs:
        row["step_graph_ms"] = attempt(f"B{batch} step graph",
                                       lambda: graph_time_ms(step, ctx, plan.reps))
    log(f"decode B={batch}: step eager {row['step_eager_ms']} ms, "
        f"graph {row.get('step_graph_ms')} ms")
    return row


def run_prefill(model, pools, rope, plan, log) -> dict:
    cfg = model.cfg
    ctx = prefill_ctx(cfg, rope, plan.prefill_tokens)
    carry = initial_carry(cfg, plan.prefill_tokens)
    prefill = lambda: encoder_prefill(model, ctx, pools, carry)  # noqa: E731
    ms = time_ms(prefill, max(1, plan.reps // 4), plan.warmup)
    flops = encoder_prefill_flops(cfg, plan.prefill_tokens)
    total = flops["dense"] + flops["attention"] + flops["index"]
    out = {"tokens": plan.prefill_tokens, "ms": ms, "tokens_per_s": plan.prefill_tokens / ms * 1e3,
           "flops": flops, "tflops": total / (ms * 1e-3) / 1e12,
           "mfu": total / (ms * 1e-3) / (PEAK_BF16_TFLOPS * 1e12)}
    log(f"prefill {plan.prefill_tokens} tokens: {ms:.1f} ms, {out['tokens_per_s']:.0f} tok/s, "
        f"MFU {out['mfu']:.1%}")
    return out


def run_replay(model, pools, rope, plan, log) -> list[dict]:
    cfg = model.cfg
    rows = []
    for prefix in plan.replay_prefixes:
        ctx = replay_ctx(cfg, rope, prefix, plan.replay_rows)
        carry = initial_carry(cfg, plan.replay_rows)
        step = lambda ctx=ctx, carry=carry: full_step(model, ctx, pools, carry)  # noqa: E731
        ms = time_ms(step, max(1, plan.reps // 2), plan.warmup)
        rows.append({"prefix_tokens": prefix, "rows": plan.replay_rows, "ms": ms})
        log(f"replay {plan.replay_rows} rows after a {prefix}-token hit: {ms:.2f} ms")
    return rows


def ttft_rows(prefill: dict, replay: list[dict]) -> list[dict]:
    """Derived recompute time = H / measured encoder tokens/s (a lower bound beyond the measured
    length: attention and index cost per token grow with H)."""
    out = []
    for r in replay:
        recompute_ms = r["prefix_tokens"] / prefill["tokens_per_s"] * 1e3
        out.append({"prefix_tokens": r["prefix_tokens"], "replay_ms": r["ms"],
                    "recompute_ms_derived": recompute_ms, "speedup": recompute_ms / r["ms"]})
    return out


# ============================================================================ report
def _fmt(x, nd=3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def render_markdown(payload: dict) -> str:
    gbps = payload["copy_gbps"]
    lines = [f"# Decode / prefill steps on one GPU ({payload['preset']} preset)", "",
             f"Generated by `python -m flashpd.bench.gpu_step` on {payload['device']} "
             f"(torch {payload['torch']}). Measured copy bandwidth {gbps:.0f} GB/s (read+write).",
             "Times: median of CUDA-event timings. `floor` = bytes read / copy bandwidth "
             "(weights incl. expected distinct experts E(1-(1-k/E)^B), KV records).", "",
             "## Decode, per layer role", "",
             "| B | role | layer | eager ms | graph ms | floor ms | graph / floor |",
             "|---|---|---|---|---|---|---|"]
    for row in payload.get("decode", []):
        for role, e in row["roles"].items():
            floor = e["floor_bytes"] / (gbps * 1e9) * 1e3
            g = e.get("graph_ms")
            lines.append(f"| {row['batch']} | {role} | {e['layer']} | {_fmt(e['eager_ms'])} | "
                         f"{_fmt(g)} | {_fmt(floor)} | {_fmt(g / floor if g else None, 1)} |")
    lines += ["", "## Decode, whole step (all layers + FP32 head)", "",
              "| B | composed eager ms (derived) | composed graph ms (derived) | measured eager ms "
              "| measured graph ms | floor ms | weights GB | KV GB | tok/s (graph) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in payload.get("decode", []):
        fb = row["floor_bytes"]
        floor = (fb["weights"] + fb["kv"]) / (gbps * 1e9) * 1e3
        g = row.get("step_graph_ms")
        best = g or row.get("step_eager_ms")
        tok = row["batch"] / best * 1e3 if best else None
        lines.append(f"| {row['batch']} | {_fmt(row.get('composed_eager_ms'))} | "
                     f"{_fmt(row.get('composed_graph_ms'))} | {_fmt(row.get('step_eager_ms'))} | "
                     f"{_fmt(g)} | {_fmt(floor)} | {fb['weights'] / 1e9:.2f} | "
                     f"{fb['kv'] / 1e9:.3f} | {_fmt(tok, 0)} |")
    lines += ["", "composed (derived) = sum over layers of the role's per-layer time "
              "(Engram layers add engram_swa - swa_only) + head (eager).", ""]
    pre = payload.get("prefill")
    if pre:
        f = pre["flops"]
        lines += ["## Encoder-path prefill", "",
                  "| tokens | ms | tokens/s | TFLOP | TFLOP/s | MFU vs 790 |",
                  "|---|---|---|---|---|---|",
                  f"| {pre['tokens']} | {pre['ms']:.1f} | {pre['tokens_per_s']:.0f} | "
                  f"{(f['dense'] + f['attention'] + f['index']) / 1e12:.1f} | {pre['tflops']:.1f} | "
                  f"{pre['mfu']:.1%} |", "",
                  f"FLOPs: 2 x {f['active_params_per_token'] / 1e9:.2f} B active params/token "
                  f"({f['dense'] / 1e12:.1f} TFLOP) + attention {f['attention'] / 1e12:.2f} + index "
                  f"scoring {f['index'] / 1e12:.2f} TFLOP.", ""]
    if payload.get("ttft"):
        lines += ["## TTFT proxy after a prefix hit", "",
                  f"| prefix H | replay {payload['replay'][0]['rows']} rows, all layers ms "
                  "(measured) | recompute H through encoder ms (derived = H / tok/s) | ratio |",
                  "|---|---|---|---|"]
        for r in payload["ttft"]:
            lines.append(f"| {r['prefix_tokens']} | {r['replay_ms']:.2f} | "
                         f"{r['recompute_ms_derived']:.1f} | {r['speedup']:.1f}x |")
    if payload.get("errors"):
        lines += ["", "## Failed measurements", ""]
        lines += [f"- {label}: {err}" for label, err in payload["errors"].items()]
    return "\n".join(lines) + "\n"


def _save(out_dir: str | None, payload: dict) -> None:
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "step.json"), "w") as f:
        json.dump(payload, f, indent=1)
    with open(os.path.join(out_dir, "step.md"), "w") as f:
        f.write(render_markdown(payload))


def run(plan: RunPlan, out_dir: str | None, log=print, keep_going: bool = False) -> dict:
    cfg = plan_config(plan)
    t0 = time.time()
    torch.manual_seed(0)
    model = make_model(cfg)
    pools = make_pools(cfg, plan)
    rope = RopeTables(cfg)
    _sync()
    dev = torch.cuda.get_device_name() if not triton_runtime.interpreting() else "CPU interpreter"
    payload = {"preset": plan.preset, "device": dev, "torch": torch.__version__,
               "platform": platform.platform(), "setup_s": time.time() - t0,
               "copy_gbps": measure_copy_gbps(), "decode": []}
    log(f"setup {payload['setup_s']:.1f} s, copy {payload['copy_gbps']:.0f} GB/s")
    # smallest batch first, then prefill and replay, then the larger batches: a run cut short
    # by its time limit still leaves one row of every section (the JSON is saved after each)
    attempt = Attempts(keep_going, log)
    payload["errors"] = attempt.errors
    batches = sorted(plan.batches)
    decode = lambda b: _decode_one(model, pools, rope, plan, b, log, attempt)  # noqa: E731
    payload["decode"].append(decode(batches[0]))
    _save(out_dir, payload)
    payload["prefill"] = attempt("prefill", lambda: run_prefill(model, pools, rope, plan, log))
    _save(out_dir, payload)
    payload["replay"] = attempt("replay", lambda: run_replay(model, pools, rope, plan, log))
    if payload["prefill"] and payload["replay"]:
        payload["ttft"] = ttft_rows(payload["prefill"], payload["replay"])
    _save(out_dir, payload)
    for batch in batches[1:]:
        payload["decode"].append(decode(batch))
        _save(out_dir, payload)
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for step.md / step.json")
    parser.add_argument("--smoke", action="store_true", help="tiny preset, tiny sizes (CPU)")
    parser.add_argument("--batches", default=None, help="comma list overriding the plan's")
    parser.add_argument("--keep-going", action="store_true",
                        help="record a failed measurement in the results and carry on")
    args = parser.parse_args(argv)
    plan = SMOKE_PLAN if args.smoke else BENCH_PLAN
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
        plan = RunPlan(**{**plan.__dict__, "batches": batches})
    if not args.smoke and triton_runtime.interpreting():
        raise SystemExit("the bench preset needs a GPU; use --smoke under the interpreter")
    payload = run(plan, args.out, log=lambda m: print(m, flush=True), keep_going=args.keep_going)
    print(render_markdown(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
