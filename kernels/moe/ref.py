"""Mixture of experts (model_spec §7).

    logits = x . W_g^T / gate_temp                    (FP32)
    s      = sqrt(softplus(logits))                   "sqrtsoftplus"
    ids    = top-k of (s + bias)                      bias steers selection only
    gamma  = scale * s[ids] / (sum s[ids] + 1e-20)    unbiased scores, then * routed scale
    expert(x) = w2( bf16( gamma * silu(min(gate, L)) * clamp(up, -L, L) ) )
    y = bf16( sum_i expert_i(x) + shared(x) )         summed in FP32, expert-id order

gate = w1(x), up = w3(x) are GEMM outputs in the activation dtype, upcast to FP32 (§7.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashpd.kernels.dense.ref import Weights, dequantize, fp32, linear, linear_fp32, silu, softplus

ROUTER_NORM_EPS = 1e-20


@dataclass(frozen=True)
class ExpertWeights:
    """Stacked SwiGLU expert weights: w1, w3 [E, I, D]; w2 [E, D, I] (dequantised)."""

    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    routed_scale: float,
    gate_temp: float = 1.0,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (expert ids [T, k] int64, weights [T, k] FP32).

    Ties in s + bias go to the lower expert id (stable sort). `normalize` is norm_topk_prob.
    """
    logits = linear_fp32(x, gate_weight) / gate_temp  # [T, E]
    scores = torch.sqrt(softplus(logits))
    biased = scores + fp32(bias)[None, :]
    ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [T, k]
    chosen = torch.gather(scores, 1, ids)  # unbiased
    if normalize:
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + ROUTER_NORM_EPS)
    return ids, chosen * routed_scale


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """FP32 silu(min(gate, limit)) * clamp(up, -limit, limit) (§7.5, §12.14)."""
    gate = fp32(gate).clamp_max(limit)
    up = fp32(up).clamp(-limit, limit)
    return silu(gate) * up


def expert_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [n, D] -> [n, D] in x.dtype; `weight` [n, 1] FP32 multiplies h before w2 (§12.14)."""
    h = swiglu(linear(x, w1), linear(x, w3), limit)  # [n, I] FP32
    if weight is not None:
        h = weight * h
    return linear(h.to(x.dtype), w2)


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
) -> torch.Tensor:
    """x [T, D] -> y [T, D] in x.dtype."""
    ids, weights = route(x, gate_weight, bias, top_k, routed_scale, gate_temp, normalize)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, D]
    for e in torch.unique(ids).tolist():  # ascending expert id: fixed per-token sum order
        token_idx, slot = torch.nonzero(ids == e, as_tuple=True)
        y = expert_ffn(
            x[token_idx], experts.w1[e], experts.w3[e], experts.w2[e], limit, weights[token_idx, slot][:, None]
        )
        out.index_add_(0, token_idx, fp32(y))
    if shared is not None:
        for e in range(shared.num_experts):
            out += fp32(expert_ffn(x, shared.w1[e], shared.w3[e], shared.w2[e], limit))
    return out.to(x.dtype)


# ---------------------------------------------------------------- checkpoint-format experts
@dataclass(frozen=True)
class ExpertSet:
    """SwiGLU experts in any checkpoint format: w1, w3 [E, I, D], w2 [E, D, I] (as `Weights`)."""

    w1: Weights
    w3: Weights
    w2: Weights

    @property
    def num_experts(self) -> int:
        return self.w1.num_experts

    @staticmethod
    def plain(weights: ExpertWeights) -> ExpertSet:
        return ExpertSet(Weights.plain(weights.w1), Weights.plain(weights.w3), Weights.plain(weights.w2))


def _dequantized(experts: ExpertSet, dtype: torch.dtype) -> ExpertWeights:
    return ExpertWeights(*(dequantize(w).to(dtype) for w in (experts.w1, experts.w3, experts.w2)))


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
) -> torch.Tensor:
    """As `moe`, with expert weights in checkpoint formats (MXFP4 routed, FP8 shared): the
    weights dequantised (exact) to x.dtype, as the GPU kernels do in registers."""
    return moe(
        x,
        gate_weight,
        bias,
        _dequantized(experts, x.dtype),
        None if shared is None else _dequantized(shared, x.dtype),
        top_k,
        routed_scale,
        limit,
        gate_temp,
        normalize,
    )


def warmup(
    experts: ExpertSet,
    shared: ExpertSet | None,
    num_gate_experts: int,
    top_k: int,
    rows=(1, 8, 64),
    limit: float = 10.0,
) -> int:
    """Kernel variants compiled ahead of the first request: the reference compiles none."""
    return 0
