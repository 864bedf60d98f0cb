"""Manifold-constrained hyper-connections (model_spec §2.2-§2.3), all arithmetic FP32.

Mixes of one site from the streams X [T, S, D]:

    z = flatten(X) [S*D] (stream-major),  rho = 1/sqrt(mean(z^2) + eps)
    m = rho * (fn . z)  -> [pre(S) | post(S) | comb(S*S)]
    pre  = sigmoid(scale0 * m_pre  + base_pre) + hc_eps
    post = 2 sigmoid(scale1 * m_post + base_post)
    comb = Sinkhorn(scale2 * m_comb + base_comb as S x S, row-major A[j][k]: j source, k dest)

Collapse x = sum_k pre_k X_k; expand X'_k = post_k y + sum_j comb[j][k] X_j. Both round once to
the stream dtype. The stream sums are per-token batched GEMMs of fixed shape ([1|S, S] x [S, D]),
so every token sees the same arithmetic whatever the batch.
"""

from __future__ import annotations

import torch

from flashpd.kernels.dense.ref import fp32, linear_fp32, rms_norm, sigmoid


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits [T, S, S] -> comb [T, S, S] (§2.2 step 5).

    Row softmax (+eps), one column normalisation, then (iters - 1) x (rows, columns). Rows are
    the last axis (destinations k), columns the middle axis (sources j).
    """
    if iters < 1:
        raise ValueError(f"sinkhorn needs at least one iteration, got {iters}")
    logits = fp32(logits)
    e = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    c = e / e.sum(dim=-1, keepdim=True) + eps
    eps_t = c.new_full((), eps)  # in-place ops: no rewrap; a fill, not a host copy (graph capture)
    c.div_(c.sum(dim=-2, keepdim=True).add_(eps_t))
    for _ in range(iters - 1):
        c.div_(c.sum(dim=-1, keepdim=True).add_(eps_t))  # rows
        c.div_(c.sum(dim=-2, keepdim=True).add_(eps_t))  # columns
    return c


def hc_mixes(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, S, D] -> pre [T, S], post [T, S], comb [T, S, S], all FP32."""
    num_tokens, num_streams, _ = streams.shape
    z = fp32(streams).reshape(num_tokens, -1)  # [T, S*D]
    rho = torch.rsqrt(z.square().mean(dim=-1, keepdim=True) + norm_eps)  # [T, 1]
    m = linear_fp32(z, fn) * rho  # [T, (2+S)*S]
    base, scale = fp32(base), fp32(scale)
    s = num_streams
    pre = sigmoid(scale[0] * m[:, :s] + base[:s]) + hc_eps
    post = 2.0 * sigmoid(scale[1] * m[:, s : 2 * s] + base[s : 2 * s])
    comb_logits = (scale[2] * m[:, 2 * s :] + base[2 * s :]).reshape(num_tokens, s, s)
    return pre, post, sinkhorn(comb_logits, sinkhorn_iters, hc_eps)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [T, S, D], pre [T, S] -> x [T, D] = bf16(sum_k pre_k X_k)."""
    mixed = torch.bmm(fp32(pre)[:, None, :], fp32(streams))  # [T, 1, D]
    return mixed[:, 0].to(streams.dtype)


def expand(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y [T, D], streams [T, S, D], post [T, S], comb [T, S, S] -> new streams [T, S, D].

    X'_k = post_k y + sum_j comb[j][k] X_j: the residual mix is comb^T (per token) times X.
    """
    mixed = torch.bmm(fp32(comb).transpose(1, 2), fp32(streams))
    out = fp32(post)[..., None] * fp32(y)[:, None, :] + mixed
    return out.to(streams.dtype)  # [T, S, D]


def expand_mix_collapse(
    y: torch.Tensor | None,
    streams: torch.Tensor,
    post: torch.Tensor | None,
    comb: torch.Tensor | None,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    pre_in: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One mHC step of the shifted schedule (§2.4), as the sequence of the ops above:

    X' = expand(y; post, comb, X) (X' = X when y is None), the mixes of X', and, with pre_in,
    x = rms_norm(collapse(X', pre_in), norm_weight, norm_eps) (dense/ref.py).
    -> (X' [T, S, D], pre [T, S], post' [T, S], comb' [T, S, S], x [T, D] | None).
    """
    new = streams if y is None else expand(y, streams, post, comb)
    pre, post_o, comb_o = hc_mixes(new, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    x = None
    if pre_in is not None:
        x = rms_norm(collapse(new, pre_in), norm_weight, norm_eps)
    return new, pre, post_o, comb_o, x
