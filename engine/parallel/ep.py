"""Expert-parallel MoE: route locally, all-to-all the (token, expert) pairs to their owners.

One layer on one rank, with the EP group of every rank (each holding its own DP tokens):

    route      same gate and bias everywhere -> ids, weights [T, k]           (kernels/moe/ref)
    dispatch   pairs sorted by expert id; owner = expert // experts_per_rank
               counts, then x rows, expert ids, weights -> owners           (4 all-to-alls)
    compute    each owner runs its experts over the rows it received
    combine    y rows back to their source rank (1 all-to-all), summed per token in FP32 in
               ascending expert order, + the replicated shared expert, one rounding

The per-token sum order equals the single-process reference (kernels/moe/ref.py `moe`) and every
GEMM row is batch-invariant, so EP output equals the reference bit for bit. A rank with no tokens
still takes part in every all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashpd.engine.parallel.launch import Comm
from flashpd.engine.parallel.sharding import RankShard
from flashpd.kernels.dense.ref import fp32
from flashpd.kernels.moe.ref import ExpertWeights, expert_ffn, route
from flashpd.model.config import ModelConfig


@dataclass(frozen=True)
class LocalMoE:
    """One layer's MoE weights as a rank holds them (dequantised)."""

    gate: torch.Tensor  # [E, D] replicated
    bias: torch.Tensor  # [E] FP32 replicated
    experts: ExpertWeights  # the rank's routed experts: owned (EP) or all, TP-split
    first_expert: int  # global id of experts[0]
    shared: ExpertWeights | None  # [1, I(/tp), D]

    @classmethod
    def load(cls, shard: RankShard, layer: int, dtype: torch.dtype) -> LocalMoE:
        cfg, p = shard.cfg, f"layers.{layer}.ffn."
        owned = shard.plan.owned_experts(cfg, shard.rank)
        experts = ExpertWeights(
            *(torch.stack([shard.mxfp4(f"{p}experts.{e}.{w}", dtype) for e in owned]) for w in ("w1", "w3", "w2"))
        )
        shared = None
        if cfg.n_shared_experts:
            shared = ExpertWeights(*(shard.fp8(f"{p}shared_experts.{w}", dtype)[None] for w in ("w1", "w3", "w2")))
        return cls(
            gate=shard.get(p + "gate.weight").to(dtype),
            bias=shard.get(p + "gate.bias"),
            experts=experts,
            first_expert=owned.start,
            shared=shared,
        )


@dataclass(frozen=True)
class Dispatch:
    """This rank's (token, expert) pairs, ordered by expert id (hence by owner rank)."""

    token_idx: torch.Tensor  # [P] source row
    expert_ids: torch.Tensor  # [P] global expert id
    weights: torch.Tensor  # [P] FP32 routing weight
    order: torch.Tensor  # [P] rank of the expert among its token's k, ascending id
    send_counts: list[int]  # pairs per owner rank


def plan_dispatch(ids: torch.Tensor, weights: torch.Tensor, experts_per_rank: int, ep_size: int) -> Dispatch:
    """ids, weights [T, k] -> the pairs to send, grouped by owner rank."""
    num_tokens, top_k = ids.shape
    sorted_ids, perm = ids.sort(dim=1)  # [T, k] ascending expert per token
    sorted_w = weights.gather(1, perm)
    flat_ids = sorted_ids.reshape(-1)  # [T*k] token-major
    by_expert = torch.sort(flat_ids, stable=True).indices  # ties keep token order
    token_idx = torch.arange(num_tokens, device=ids.device).repeat_interleave(top_k)
    order = torch.arange(top_k, device=ids.device).repeat(num_tokens)
    expert_ids = flat_ids[by_expert]
    owners = torch.div(expert_ids, experts_per_rank, rounding_mode="floor")
    send_counts = torch.bincount(owners, minlength=ep_size)
    if send_counts.numel() > ep_size:
        raise ValueError(f"expert id {int(expert_ids.max())} has no owner among {ep_size} ranks")
    return Dispatch(
        token_idx[by_expert], expert_ids, sorted_w.reshape(-1)[by_expert], order[by_expert], send_counts.tolist()
    )


def run_local_experts(
    x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights, limit: float
) -> torch.Tensor:
    """Received rows x [R, D] with local expert ids [R] and weights [R] -> y [R, D] in x.dtype."""
    y = torch.empty_like(x)
    if local_ids.numel() and (local_ids.min() < 0 or local_ids.max() >= experts.num_experts):
        raise ValueError(
            f"received a pair for an expert this rank does not own "
            f"(local ids {int(local_ids.min())}..{int(local_ids.max())})"
        )
    for e in torch.unique(local_ids).tolist():
        rows = torch.nonzero(local_ids == e).squeeze(1)
        y[rows] = expert_ffn(x[rows], experts.w1[e], experts.w3[e], experts.w2[e], limit, weights[rows][:, None])
    return y


def combine(y: torch.Tensor, d: Dispatch, num_tokens: int, top_k: int) -> torch.Tensor:
    """Returned rows y [P, D] (dispatch order) -> FP32 [T, D], each token's experts summed in
    ascending id order: pass j adds every token's j-th expert (no token twice in one pass)."""
    out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(top_k):
        pick = d.order == j
        out.index_add_(0, d.token_idx[pick], fp32(y[pick]))
    return out


def ep_moe(x: torch.Tensor, moe: LocalMoE, cfg: ModelConfig, comm: Comm) -> torch.Tensor:
    """x [T, D] (this rank's tokens) -> y [T, D] in x.dtype; collective over `comm`."""
    if moe.experts.w1.shape[1] != cfg.moe_intermediate_size:
        raise ValueError(
            f"experts hold {moe.experts.w1.shape[1]} of "
            f"{cfg.moe_intermediate_size} intermediate rows (TP-split): use tp_moe"
        )
    ids, weights = route(
        x, moe.gate, moe.bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.gate_temp, cfg.norm_topk_prob
    )
    d = plan_dispatch(ids, weights, moe.experts.num_experts, comm.size)
    recv_counts = comm.exchange_counts(d.send_counts, x.device)
    x_in = comm.all_to_all(x[d.token_idx], d.send_counts, recv_counts)  # [R, D]
    ids_in = comm.all_to_all(d.expert_ids, d.send_counts, recv_counts)  # [R]
    w_in = comm.all_to_all(d.weights, d.send_counts, recv_counts)  # [R]
    y_in = run_local_experts(x_in, ids_in - moe.first_expert, w_in, moe.experts, cfg.swiglu_limit)
    y = comm.all_to_all(y_in, recv_counts, d.send_counts)  # [P, D] back in dispatch order
    out = combine(y, d, x.shape[0], cfg.num_experts_per_tok)
    if moe.shared is not None:
        s = moe.shared
        out += fp32(expert_ffn(x, s.w1[0], s.w3[0], s.w2[0], cfg.swiglu_limit))
    return out.to(x.dtype)
