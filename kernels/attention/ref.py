"""Sparse MQA attention over window ∪ selected compressed entries, one softmax, per-head sink.

Each query t gathers its own key set (model_spec §3.4), laid out the same way in every path so
that prefill, chunked prefill and decode do identical arithmetic per query:

    slot:   0 ........................ W-1 | W ............. W+K-1
    key:    window positions p-W+1 .. p    | compressed entries topk[t, 0..K-1]
    valid:  position >= window start       | index >= 0

(W = sliding window, K = index top-k.) K = V: the gathered latent is both key and value.
Scores (q . k) * scale are FP32; the sink logit enters only the denominator (§3.5):

    m = max(sink_h, max_u s_hu);  P_hu = exp(s_hu - m) / (exp(sink_h - m) + sum_v exp(s_hv - m))

A query with no valid key outputs 0.
"""

from __future__ import annotations

import torch

from flashpd.kernels.dense.ref import fp32


def window_keys(
    window_kv: torch.Tensor, window_start: int, q_positions: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each query's window slots.

    window_kv [Nw, d] holds positions [window_start, window_start + Nw); q_positions [T].
    Returns keys [T, W, d] and valid [T, W] (slot i of query p is position p - W + 1 + i).
    """
    num_kv = window_kv.shape[0]
    if q_positions.numel() and int(q_positions.max()) >= window_start + num_kv:
        raise ValueError("a query position lies past the window buffer")
    offsets = torch.arange(window, device=q_positions.device) - (window - 1)  # [W]
    slot_pos = q_positions[:, None] + offsets[None, :]  # [T, W]
    valid = slot_pos >= window_start
    index = (slot_pos - window_start).clamp_min(0)  # [T, W]
    return window_kv[index], valid  # [T, W, d], [T, W]


def compressed_keys(entries: torch.Tensor, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """entries [N, d], topk [T, K] (-1 = empty slot) -> keys [T, K, d], valid [T, K]."""
    valid = topk >= 0
    if entries.shape[0] == 0:
        shape = (*topk.shape, entries.shape[1])
        return entries.new_zeros(shape), valid
    return entries[topk.clamp_min(0)], valid


def sparse_attention(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """q [T, H, d], keys [T, N, d] (K = V), valid [T, N], sink [H] FP32 -> [T, H, d] in q.dtype."""
    k32 = fp32(keys)
    scores = torch.bmm(fp32(q), k32.transpose(1, 2)) * softmax_scale  # [T, H, N]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = fp32(sink)[None, :]  # [1, H]
    row_max = torch.maximum(scores.amax(dim=-1), sink)  # [T, H]
    weights = torch.exp(scores - row_max[..., None])  # [T, H, N]; masked -> 0
    denom = torch.exp(sink - row_max) + weights.sum(dim=-1)  # [T, H]
    probs = weights / denom[..., None]
    return torch.bmm(probs, k32).to(q.dtype)  # [T, H, d]


# ---------------------------------------------------------------- packed records (GPU forward)
FMT_FP8 = 0  # compressed records in the window's E4M3 + UE8M0 per 32 form
FMT_NVFP4 = 1  # compressed records in E2M1 + E4M3 per 16 (the default compressed KV)


def sparse_attention_packed(
    q: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    window_pool: torch.Tensor,
    window_rows: torch.Tensor,
    comp_pool: torch.Tensor | None,
    comp_rows: torch.Tensor | None,
    sink: torch.Tensor,
    softmax_scale: float,
    comp_format: int = FMT_NVFP4,
) -> torch.Tensor:
    """RoPE(q) -> attention over the records of window_rows ∪ comp_rows -> inverse RoPE.

    q [T, H, d] pre-RoPE; rope = (cos, sin) [T, R/2] (None: no RoPE); window_pool uint8 window
    FP8 records, window_rows [T, W] pool rows (-1 empty); comp_pool records in comp_format,
    comp_rows [T, K] (-1 empty), or None for window-only layers. The keys are the records
    unpacked to q.dtype (exact), K = V as in `sparse_attention`."""
    from flashpd.kernels.quant import ref as qref
    from flashpd.kernels.rope.ref import rotate

    keys = [qref.unpack_window_fp8(window_pool, q.dtype)[window_rows.long().clamp_min(0)]]
    valid = [window_rows >= 0]
    if comp_pool is not None:
        unpack = qref.unpack_nvfp4 if comp_format == FMT_NVFP4 else qref.unpack_window_fp8
        keys.append(unpack(comp_pool, q.dtype)[comp_rows.long().clamp_min(0)])
        valid.append(comp_rows >= 0)
    x = q if rope is None else rotate(q, *rope)
    o = sparse_attention(x, torch.cat(keys, dim=1), torch.cat(valid, dim=1), sink, softmax_scale)
    return o if rope is None else rotate(o, *rope, inverse=True)


def warmup(
    num_heads: int,
    head_dim: int,
    rope_pairs: int,
    window: int,
    topk: tuple[int, ...],
    comp_format: int = FMT_NVFP4,
    rows=(1, 8, 64),
) -> int:
    """Kernel variants compiled ahead of the first request: the reference compiles none."""
    return 0
