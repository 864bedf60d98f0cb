"""Partial RoPE, interleaved pairs on the last `rope_dim` channels (model_spec §3.3).

Pair i (i = 0 .. rope_dim/2 - 1) is channels (off + 2i, off + 2i + 1) with off = dim - rope_dim,
read as a + ib and multiplied by e^{i p theta_i} (inverse: e^{-i p theta_i}):

    a' = a cos - b sin,   b' = a sin + b cos          (FP32, rounded once to x.dtype)

The phase is float32(p) * float32(theta_i), formed in FP32 as the trained model did (at p ~ 1e6
an FP64 phase would differ visibly).

Frequencies theta_i = base^(-2i/rope_dim); with YaRN (DeepSeek form, no mscale):

    corr(beta) = rope_dim * ln(L_orig / (2 pi beta)) / (2 ln base)
    lo = max(floor(corr(beta_fast)), 0),  hi = min(ceil(corr(beta_slow)), rope_dim - 1)
    ramp_i = clamp((i - lo) / (hi - lo), 0, 1)
    theta'_i = theta_i (1 - ramp_i) + (theta_i / factor) ramp_i
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashpd.kernels.dense.ref import fp32


@dataclass(frozen=True)
class Yarn:
    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position: int


def yarn_correction_range(rope_dim: int, base: float, yarn: Yarn) -> tuple[int, int]:
    """(lo, hi) pair indices of the YaRN ramp; (15, 25) for the released compress table."""

    def corr(beta: float) -> float:
        return rope_dim * math.log(yarn.original_max_position / (2 * math.pi * beta)) / (2 * math.log(base))

    lo = max(math.floor(corr(yarn.beta_fast)), 0)
    hi = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
    return lo, hi


def rope_frequencies(rope_dim: int, base: float, yarn: Yarn | None = None) -> torch.Tensor:
    """theta'_i, FP32 [rope_dim / 2]."""
    if rope_dim % 2:
        raise ValueError(f"rope_dim must be even, got {rope_dim}")
    theta = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn is None:
        return theta
    lo, hi = yarn_correction_range(rope_dim, base, yarn)
    span = (hi - lo) if hi != lo else 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - lo) / span).clamp(0, 1)
    return theta * (1 - ramp) + (theta / yarn.factor) * ramp


def rope_cos_sin(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int -> (cos, sin), each FP32 [T, rope_dim / 2]."""
    phase = fp32(positions)[:, None] * fp32(freqs)[None, :]  # [T, n]
    return torch.cos(phase), torch.sin(phase)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, ..., dim] rotated on its last 2n channels by cos, sin [T, n]; x.dtype out."""
    n = cos.shape[-1]
    rope_dim = 2 * n
    if x.shape[0] != cos.shape[0] or x.shape[-1] < rope_dim:
        raise ValueError(f"rotate: x {tuple(x.shape)}, cos {tuple(cos.shape)}")
    if inverse:
        sin = -sin
    extra = (1,) * (x.ndim - 2)  # broadcast over head axes
    cos = cos.reshape(cos.shape[0], *extra, n)  # [T, 1.., n]
    sin = sin.reshape(sin.shape[0], *extra, n)
    pairs = fp32(x[..., -rope_dim:]).unflatten(-1, (n, 2))  # [T, .., n, 2]
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rotated.to(x.dtype)), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, ..., dim] rotated on its last 2*len(freqs) channels at positions [T]; x.dtype out."""
    if x.shape[0] != positions.shape[0]:
        raise ValueError(f"apply_rope: x {tuple(x.shape)}, positions {tuple(positions.shape)}")
    cos, sin = rope_cos_sin(positions, freqs)
    return rotate(x, cos, sin, inverse)
