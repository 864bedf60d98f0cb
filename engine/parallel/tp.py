"""Tensor-parallel blocks: column/row-parallel linears and the TP pieces of one layer.

    column parallel   y_r = x . W_r^T            W split by output rows; no communication
    row parallel      y = sum_r x_r . W_r^T      W split by input columns; FP32 partials, one
                                                 all-reduce, one rounding to x.dtype

Attention under TP (the shared KV latent is replicated, so it needs no communication):

    c_q [T, q_lora] (replicated wq_a) --wq_b column--> q [T, H/tp, d]      local heads
    attention over the replicated window/compressed KV, sink [H/tp]        per head, local
    o [T, H/tp, d] --grouped wo_a column (G/tp groups)--> z [T, G/tp*o_lora]
    z --wo_b row + all-reduce--> [T, D]

The MLP (shared expert, and routed experts when ep_size == 1) splits the intermediate dim:
w1, w3 column, w2 row; the routed and shared partials share one all-reduce.

At tp_size 1 every block is the single-process reference computation, rounding included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashpd.engine.parallel.ep import LocalMoE
from flashpd.engine.parallel.launch import Comm
from flashpd.engine.parallel.sharding import RankShard
from flashpd.kernels.dense.ref import fp32, linear, linear_fp32, matmul_nt, round_to
from flashpd.kernels.moe.ref import ExpertWeights, route, swiglu
from flashpd.model.config import ModelConfig


# ============================================================================ linears
def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] . W_r[out/tp, in]^T -> this rank's output columns [T, out/tp]."""
    return linear(x, weight)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, comm: Comm) -> torch.Tensor:
    """x_r [T, in/tp] . W_r[out, in/tp]^T, summed over the group -> [T, out] in x.dtype."""
    return round_to(comm.all_reduce_sum(matmul_nt(x, weight)), x.dtype)


def gather_columns(y: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Column-parallel outputs [T, out/tp] of every rank -> [T, out]."""
    return comm.all_gather_cat(y, dim=-1)


# ============================================================================ attention
@dataclass(frozen=True)
class AttentionOutShard:
    wo_a: torch.Tensor  # [G/tp * o_lora, (H/G)*d]: this rank's output groups
    wo_b: torch.Tensor  # [D, G/tp * o_lora]: the matching input columns

    @classmethod
    def load(cls, shard: RankShard, layer: int, dtype: torch.dtype) -> AttentionOutShard:
        p = f"layers.{layer}.attn."
        return cls(wo_a=shard.fp8(p + "wo_a", dtype), wo_b=shard.fp8(p + "wo_b", dtype))


def local_heads(cfg: ModelConfig, comm: Comm) -> range:
    """Global ids of the attention heads (and sink logits) this TP rank computes."""
    per_rank = cfg.num_heads // comm.size
    return range(comm.rank * per_rank, (comm.rank + 1) * per_rank)


def tp_query(c_q: torch.Tensor, wq_b: torch.Tensor, cfg: ModelConfig, comm: Comm) -> torch.Tensor:
    """c_q [T, q_lora] -> this rank's query heads [T, H/tp, d] (wq_b split by heads)."""
    q = column_parallel_linear(c_q, wq_b)  # [T, H/tp * d]
    return q.reshape(c_q.shape[0], len(local_heads(cfg, comm)), cfg.head_dim)


def tp_output_projection(o: torch.Tensor, w: AttentionOutShard, cfg: ModelConfig, comm: Comm) -> torch.Tensor:
    """Local heads o [T, H/tp, d] (inverse-RoPE'd) -> grouped wo_a -> wo_b -> [T, D] (§3.6)."""
    num_groups = cfg.o_groups // comm.size
    groups = o.reshape(o.shape[0], num_groups, -1)  # [T, G/tp, (H/G)*d]
    wo_a = w.wo_a.reshape(num_groups, cfg.o_lora_rank, -1)  # [G/tp, o_lora, (H/G)*d]
    z = torch.cat([linear(groups[:, g], wo_a[g]) for g in range(num_groups)], dim=-1)
    return row_parallel_linear(z, w.wo_b, comm)  # [T, D]


# ============================================================================ MLP
def _expert_partial(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    comm: Comm,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert over this rank's intermediate slice -> FP32 partial [n, D] of y_e.

    The reference rounds y_e to x.dtype once it is complete; under TP it completes only after
    the all-reduce, so the rounding happens there (at tp_size 1 it happens here, as in the
    reference)."""
    h = swiglu(linear(x, w1), linear(x, w3), limit)  # [n, I/tp] FP32
    if weight is not None:
        h = weight * h
    partial = matmul_nt(h.to(x.dtype), w2)  # [n, D] FP32
    return fp32(round_to(partial, x.dtype)) if comm.size == 1 else partial


def tp_shared_expert(x: torch.Tensor, shared: ExpertWeights, limit: float, comm: Comm) -> torch.Tensor:
    """x [T, D] -> shared expert output [T, D] in x.dtype (w1, w3 by rows, w2 by columns)."""
    partial = _expert_partial(x, shared.w1[0], shared.w3[0], shared.w2[0], limit, comm)
    return round_to(comm.all_reduce_sum(partial), x.dtype)


def tp_moe(x: torch.Tensor, moe: LocalMoE, cfg: ModelConfig, comm: Comm) -> torch.Tensor:
    """x [T, D] (same tokens on every TP rank) -> MoE output [T, D]; one all-reduce.

    Routed experts are all present, split by intermediate rows; the per-token FP32 sum runs in
    ascending expert order, as in kernels/moe/ref.py."""
    if moe.experts.num_experts != cfg.n_routed_experts:
        raise ValueError(
            f"tp_moe needs all {cfg.n_routed_experts} routed experts, the rank "
            f"holds {moe.experts.num_experts} (EP-owned): use ep_moe"
        )
    ids, weights = route(
        x, moe.gate, moe.bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.gate_temp, cfg.norm_topk_prob
    )
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, D]
    ex, limit = moe.experts, cfg.swiglu_limit
    for e in torch.unique(ids).tolist():
        token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
        out.index_add_(
            0,
            token_idx,
            _expert_partial(x[token_idx], ex.w1[e], ex.w3[e], ex.w2[e], limit, comm, weights[token_idx, slot][:, None]),
        )
    if moe.shared is not None:
        s = moe.shared
        out += _expert_partial(x, s.w1[0], s.w3[0], s.w2[0], limit, comm)
    return comm.all_reduce_sum(out).to(x.dtype)


# ============================================================================ head
def vocab_parallel_logits(h: torch.Tensor, head: torch.Tensor, comm: Comm) -> torch.Tensor:
    """h [T, D] . head_r[V/tp, D]^T on every rank, gathered -> FP32 logits [T, V] (§9)."""
    return gather_columns(linear_fp32(h, head), comm)
