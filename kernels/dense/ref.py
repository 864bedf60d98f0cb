"""Dense reference ops: GEMM, RMSNorm and activations whose per-row results do not depend on batch.

Why "batch-invariant": the serving engine batches sequences and chunks a prompt arbitrarily, and
the model must give one sequence the same numbers whether it runs alone, batched, in one chunk or
token by token. The fake quants (FP8/FP4 rounding) and top-k selections downstream turn a 1-ulp
difference into a visible one, so every row must see identical arithmetic:

- MKL's SGEMM picks different kernels for thin operands (fewer than ~12 rows or columns), so
  `matmul_nt` zero-pads both operands to a multiple of 16 rows; a row's result then no longer
  depends on how many other rows share the call.
- torch's vectorised sigmoid / silu / softplus differ in the last bit from their scalar tails;
  `exp`, `log1p` and division do not, so the activations below are written with those.

Dtype convention: `linear` accumulates in FP32 and rounds once to the input dtype (BF16 GEMM with
FP32 accumulation); in FP32 mode that rounding is the identity.
"""

from __future__ import annotations

import torch

GEMM_PAD_ROWS = 16


def fp32(x: torch.Tensor) -> torch.Tensor:
    """x as FP32, without a dispatch when it already is (these ops are overhead-bound on CPU)."""
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """[M, K] -> [max(multiple, ceil(M/multiple)*multiple), K], zero rows appended."""
    rows = x.shape[0]
    padded = max(multiple, -(-rows // multiple) * multiple)
    if padded == rows:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, padded - rows))


def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b[N, K]^T -> [M, N] in FP32, each element independent of M and N."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"matmul_nt shapes {tuple(a.shape)} x {tuple(b.shape)}^T")
    rows, cols = a.shape[0], b.shape[0]
    if rows == 0 or cols == 0:
        return a.new_zeros(rows, cols, dtype=torch.float32)
    a32 = _pad_rows(fp32(a), GEMM_PAD_ROWS)
    b32 = _pad_rows(fp32(b), GEMM_PAD_ROWS)
    return (a32 @ b32.T)[:rows, :cols]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] . weight[out, in]^T -> [T, out]: FP32 accumulation, one rounding to x.dtype."""
    return round_to(matmul_nt(x, weight), x.dtype)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] . weight[out, in]^T -> [T, out] in FP32 (both operands upcast, §4.1, §7, §9)."""
    return matmul_nt(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """[..., D] -> [..., D] in x.dtype: FP32 statistic, FP32 weight multiply, one rounding (§12.3)."""
    x32 = fp32(x)
    y = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * fp32(weight)
    return round_to(y, x.dtype)


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bf16(.) of the spec in BF16 mode; the identity in FP32 mode."""
    return x if x.dtype == dtype else x.to(dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Logistic sigmoid in FP32, batch-invariant (see module docstring)."""
    x = fp32(x)
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) in FP32."""
    x = fp32(x)
    return x * sigmoid(x)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """log(1 + e^x) in FP32, passing x through above `threshold` as PyTorch does (§12.15)."""
    x = fp32(x)
    return torch.where(x > threshold, x, torch.log1p(torch.exp(x.clamp_max(threshold))))
