"""Lightning indexer (model_spec §5): scores, layer-20 candidate blocks, sorted top-k.

Score of query t against compressed entry j (FP32, §13 "FP32 for quality"):

    I[t, j] = sum_h w[t, h] * ReLU(q[t, h] . k[j])     for j < n_visible[t], else -inf

Tie-break (the spec leaves it open, §5.5): a stable descending sort, so among equal scores the
lower (older) index wins. This makes the selection a function of the score row alone, identical
between prefill, chunked prefill and decode.
"""

from __future__ import annotations

import torch

from flashpd.kernels.dense.ref import fp32, matmul_nt

NEG_INF = float("-inf")


def index_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor,
                 n_visible: torch.Tensor) -> torch.Tensor:
    """q [T, h, dI], head_weights [T, h], keys [N, dI], n_visible [T] -> scores [T, N] FP32."""
    num_q, num_heads, head_dim = q.shape
    num_keys = keys.shape[0]
    dots = matmul_nt(q.reshape(num_q * num_heads, head_dim), keys)  # [T*h, N]
    dots = dots.reshape(num_q, num_heads, num_keys).clamp_min(0)  # ReLU
    w = fp32(head_weights)
    scores = torch.zeros(num_q, num_keys, dtype=torch.float32, device=q.device)
    for h in range(num_heads):  # fixed summation order over heads
        scores = scores + w[:, h, None] * dots[:, h, :]
    visible = torch.arange(num_keys, device=q.device)[None, :] < n_visible[:, None]
    return scores.masked_fill(~visible, NEG_INF)


def candidate_mask(scores: torch.Tensor, n_visible: torch.Tensor, block_size: int,
                   num_blocks: int) -> torch.Tensor:
    """Two-level candidates (§5.4): scores [T, N] -> bool [T, N], entries of the kept blocks.

    Block score = max over its entries; the newest (partly filled) block is forced in; the top
    `num_blocks` blocks are kept, except those whose score is -inf.
    """
    num_q, num_keys = scores.shape
    if num_keys == 0:
        return torch.zeros(num_q, 0, dtype=torch.bool, device=scores.device)
    n_blocks = -(-num_keys // block_size)
    padded = scores.new_full((num_q, n_blocks * block_size), NEG_INF)
    padded[:, :num_keys] = scores
    block_score = padded.reshape(num_q, n_blocks, block_size).amax(dim=-1)  # [T, nb]
    has_visible = n_visible >= 1
    newest = ((n_visible - 1).clamp_min(0) // block_size)[has_visible]  # [T']
    rows = torch.arange(num_q, device=scores.device)[has_visible]
    block_score[rows, newest] = float("inf")
    keep = min(num_blocks, n_blocks)
    order = torch.sort(block_score, dim=-1, descending=True, stable=True).indices[:, :keep]
    kept = torch.zeros(num_q, n_blocks, dtype=torch.bool, device=scores.device)
    kept.scatter_(1, order, torch.gather(block_score, 1, order) > NEG_INF)
    return kept.repeat_interleave(block_size, dim=1)[:, :num_keys]


def select_topk(scores: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """scores [T, N] (-inf = not selectable) -> entry ids [T, k], ascending, -1 padded (§5.5).

    `allowed` [T, N] (the candidate mask) sets every other entry to -inf first.
    """
    if allowed is not None:
        scores = scores.masked_fill(~allowed, NEG_INF)
    num_q, num_keys = scores.shape
    if num_keys < k:  # pad so that every row has k slots
        scores = torch.cat((scores, scores.new_full((num_q, k - num_keys), NEG_INF)), dim=1)
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    picked = order.indices[:, :k]  # [T, k]
    picked = torch.where(order.values[:, :k] > NEG_INF, picked, torch.full_like(picked, -1))
    # ascending by position, -1 last: sort with -1 mapped past every real index
    key = torch.where(picked < 0, torch.full_like(picked, scores.shape[1]), picked)
    return torch.gather(picked, 1, torch.sort(key, dim=-1).indices)
