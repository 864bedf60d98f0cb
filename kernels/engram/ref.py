"""Engram injection (model_spec §8.5), given the looked-up table rows of each token.

    E = concat of the C hashed rows [C * row_dim]       (BF16, exact FP8 dequant)
    kv = E . wkv^T -> key_k = kv[k*D:(k+1)*D] (k < S), value = kv[S*D:]
    per stream k, FP32, h = X_k:
        rho_k = rsqrt(mean(h^2) + eps) * rsqrt(mean(key_k^2) + eps)
        dot_k = rho_k * sum_c h_c * qk[k, c] * key_k,c / sqrt(D)      qk = q_weight * k_weight
        gate_k = sigmoid(sign(dot_k) * sqrt(max(|dot_k|, 1e-6)))       sign(0) = +
    X_k <- bf16(h + gate_k * value)

Statistics are per token and per stream (not joint over streams, §12.13).
"""

from __future__ import annotations

import math

import torch

from flashpd.kernels.dense.ref import fp32, linear, sigmoid

SIGNED_SQRT_CLAMP = 1e-6


def engram_gates(streams: torch.Tensor, keys: torch.Tensor, qk: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """streams, keys [T, S, D]; qk [S, D] -> gates FP32 [T, S]."""
    h = fp32(streams)
    key = fp32(keys)
    d_model = h.shape[-1]
    rho = torch.rsqrt(h.square().mean(dim=-1) + norm_eps) * torch.rsqrt(key.square().mean(dim=-1) + norm_eps)  # [T, S]
    dot = rho * (h * fp32(qk)[None] * key).sum(dim=-1) / math.sqrt(d_model)
    sign = torch.where(dot < 0, -1.0, 1.0)
    return sigmoid(sign * torch.sqrt(dot.abs().clamp_min(SIGNED_SQRT_CLAMP)))


def engram_inject(
    streams: torch.Tensor, rows: torch.Tensor, wkv: torch.Tensor, qk: torch.Tensor, norm_eps: float
) -> torch.Tensor:
    """streams [T, S, D], rows [T, C*row_dim] (compute dtype), wkv [(S+1)*D, C*row_dim],
    qk [S, D] FP32 -> new streams [T, S, D] in streams.dtype."""
    kv = linear(rows.to(streams.dtype), wkv)  # [T, (S+1)*D]
    return run_engram(streams, kv, qk, norm_eps, inject=True)[0]


def run_engram(
    streams: torch.Tensor, kv: torch.Tensor, qk: torch.Tensor, norm_eps: float, inject: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """streams [T, S, D], kv [T, (S+1)*D] (the projected rows: S keys, one value) -> (new
    streams if `inject` else streams, gates FP32 [T, S])."""
    num_tokens, num_streams, d_model = streams.shape
    keys = kv[:, : num_streams * d_model].reshape(num_tokens, num_streams, d_model)
    value = fp32(kv[:, num_streams * d_model :])  # [T, D]
    gates = engram_gates(streams, keys, qk, norm_eps)  # [T, S]
    if not inject:
        return streams, gates
    out = fp32(streams) + gates[..., None] * value[:, None, :]
    return out.to(streams.dtype), gates


def gather_rows(table, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """ids [T, C] (global rows of the layer's table: E4M3 `weight` [rows, row_dim] and UE8M0
    `scale` [rows, row_dim/32], e.g. on the host) -> BF16 rows [T, C * row_dim] on ids' device
    (exact: an E4M3 value times a power of two)."""
    from flashpd.kernels.quant.ref import unpack_window_fp8

    idx = ids.reshape(-1).long().to(table.weight.device)
    records = torch.cat((table.weight[idx], table.scale[idx]), dim=1)  # window-record layout
    rows = unpack_window_fp8(records, torch.bfloat16).to(ids.device)
    rows = rows.reshape(ids.shape[0], ids.shape[1] * table.weight.shape[1])
    return rows if out is None else out.copy_(rows)
