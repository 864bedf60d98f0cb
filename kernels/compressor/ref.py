"""KV compressor (model_spec §4): one compressed entry per `ratio` tokens.

Ratio 2 (gated pooling, all FP32). Group j = tokens {2j, 2j+1}; per channel c:

    a_t = x_t . wkv^T,  g_t = x_t . wgate^T                       (FP32 GEMMs)
    w_r = softmax_r(g_{2j+r, c}),  P_{j, c} = w_0 a_{2j, c} + w_1 a_{2j+1, c}

A call that ends after the first token of a group keeps that token's FP32 (a, g) as the
open-group row; the next call closes the group with it (§4.5):

    tokens:     ... | 2j  2j+1 | 2j+2 ]  call ends      [ 2j+3 | 2j+4 ...
    groups:         |  entry j |  open row (a, g) ------> entry j+1

Ratio 1 is a per-token projection (`project`) with no pooling. The caller RMS-normalises the
pooled value (`latent`), which is the pre-RoPE latent shared by the main KV and the index keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashpd.kernels.dense.ref import linear, linear_fp32, rms_norm


@dataclass(frozen=True)
class OpenGroup:
    """FP32 projections of the lone first token of a ratio-2 group: a, g [c]."""

    kv: torch.Tensor
    gate: torch.Tensor


def gated_projection(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (a, g), each FP32 [T, c] (input and weights upcast, §4.1)."""
    return linear_fp32(x, wkv), linear_fp32(x, wgate)


def pool_pairs(
    kv: torch.Tensor, gate: torch.Tensor, open_group: OpenGroup | None
) -> tuple[torch.Tensor, OpenGroup | None]:
    """Close the groups of consecutive tokens (after the carried open row, if any).

    kv, gate FP32 [T, c] for consecutive tokens whose first token opens a group unless
    `open_group` is given. Returns pooled FP32 [G, c] and the new open row (or None).
    """
    if open_group is not None:
        kv = torch.cat((open_group.kv[None], kv), dim=0)
        gate = torch.cat((open_group.gate[None], gate), dim=0)
    num_rows = kv.shape[0]
    num_groups = num_rows // 2
    left = OpenGroup(kv[-1].clone(), gate[-1].clone()) if num_rows % 2 else None
    width = kv.shape[-1]
    a = kv[: 2 * num_groups].reshape(num_groups, 2, width)  # [G, 2, c]
    g = gate[: 2 * num_groups].reshape(num_groups, 2, width)
    return pool_two(a[:, 0], g[:, 0], a[:, 1], g[:, 1]), left


def pool_two(a0: torch.Tensor, g0: torch.Tensor, a1: torch.Tensor, g1: torch.Tensor) -> torch.Tensor:
    """Softmax-gated pooling of two rows, FP32 [N, c] each -> [N, c] (§4.1)."""
    g_max = torch.maximum(g0, g1)
    e0, e1 = torch.exp(g0 - g_max), torch.exp(g1 - g_max)
    total = e0 + e1
    return (e0 / total) * a0 + (e1 / total) * a1


def latent(pooled: torch.Tensor, norm_weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Pre-RoPE latent = RMSNorm(bf16(P)) [G, c] in `dtype` (§4.1)."""
    return rms_norm(pooled.to(dtype), norm_weight, eps)


def project(x: torch.Tensor, wkv: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Ratio 1 (§4.2): latent_t = RMSNorm(x_t . wkv^T) [T, c] in x.dtype."""
    return rms_norm(linear(x, wkv), norm_weight, eps)


def pool_open_pairs(
    ag: torch.Tensor,
    open_rows: torch.Tensor,
    from_stored: torch.Tensor,
    slots: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The paged forward's pooling of T consecutive seam rows: ag FP32 [T, 2, c] ((a, g) per
    row), open_rows FP32 [S, 2, c] (each slot's stored open row), from_stored bool [T], slots
    [T] -> pool_two(partner(t), row t) in `dtype` [T, c], where partner(t) is
    open_rows[slots[t]] if from_stored[t] else row t - 1 (row T - 1 for t = 0)."""
    stored = open_rows[slots.long()]  # [T, 2, c]
    prev = torch.where(from_stored[:, None, None], stored, ag.roll(1, 0))
    return pool_two(prev[:, 0], prev[:, 1], ag[:, 0], ag[:, 1]).to(dtype)
