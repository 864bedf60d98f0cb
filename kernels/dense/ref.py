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

from dataclasses import dataclass

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


# ---------------------------------------------------------------- checkpoint-format weights
W_PLAIN, W_MXFP4, W_FP8 = 0, 1, 2  # Weights.fmt codes (the Triton GEMM's W_FMT)


@dataclass(frozen=True)
class Weights:
    """One or more [N, K] weight matrices in a checkpoint format (leading expert axis E).

    fmt PLAIN: data [E, N, K] bf16/fp32, scale None. MXFP4: data uint8 [E, N, K/2], scale uint8
    [E, N, K/32]. FP8: data float8_e4m3fn [E, N, K], scale uint8 [E, ceil(N/32), ceil(K/32)].
    """

    fmt: int
    data: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.data.shape[0]

    @property
    def out_dim(self) -> int:
        return self.data.shape[1]

    @property
    def in_dim(self) -> int:
        return self.data.shape[2] * (2 if self.fmt == W_MXFP4 else 1)

    @staticmethod
    def plain(w: torch.Tensor) -> Weights:
        return Weights(W_PLAIN, w if w.ndim == 3 else w[None])

    @staticmethod
    def mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> Weights:
        if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
            raise TypeError("MXFP4 weights are uint8 packed nibbles + uint8 UE8M0 scales")
        return Weights(W_MXFP4, packed if packed.ndim == 3 else packed[None], scale if scale.ndim == 3 else scale[None])

    @staticmethod
    def fp8(w_f8: torch.Tensor, scale: torch.Tensor) -> Weights:
        if w_f8.dtype != torch.float8_e4m3fn or scale.dtype != torch.uint8:
            raise TypeError("FP8 weights are float8_e4m3fn + uint8 UE8M0 32x32 tile scales")
        return Weights(
            W_FP8, (w_f8 if w_f8.ndim == 3 else w_f8[None]).view(torch.uint8), scale if scale.ndim == 3 else scale[None]
        )

    @staticmethod
    def stack_out(parts: list[Weights]) -> Weights:
        """One weight whose output rows are `parts`' rows in order (same input, one GEMM instead
        of several: x . W^T = [x . W_0^T, x . W_1^T, ...] along N). Single FP8 or plain matrices
        of one K; FP8 parts need N % 32 == 0 so their 32x32 scale tiles stay whole."""
        if not parts:
            raise ValueError("stack_out: no weights")
        first = parts[0]
        for i, w in enumerate(parts):
            if w.num_experts != 1 or w.fmt != first.fmt or w.in_dim != first.in_dim or w.data.dtype != first.data.dtype:
                raise ValueError(
                    f"stack_out: part {i} is not a single matrix of the first part's format and K ({first.in_dim})"
                )
            if w.fmt == W_MXFP4:
                raise ValueError("stack_out: FP8 or plain weights only")
            if w.fmt == W_FP8 and w.out_dim % 32:
                raise ValueError(f"stack_out: FP8 part {i} has N={w.out_dim}, not a multiple of the 32-row scale tile")
        data = torch.cat([w.data for w in parts], dim=1)
        scale = torch.cat([w.scale for w in parts], dim=1) if first.fmt == W_FP8 else None
        return Weights(first.fmt, data, scale)


def dequantize(w: Weights) -> torch.Tensor:
    """FP32 [E, N, K] of w's values (exact: E2M1 / E4M3 times a power-of-two scale)."""
    from flashpd.kernels.quant import ref as qref

    if w.fmt == W_PLAIN:
        return fp32(w.data)
    if w.fmt == W_MXFP4:
        pairs = zip(w.data, w.scale, strict=True)
        return torch.stack([qref.dequantize_mxfp4_weight(d, s, torch.float32) for d, s in pairs])
    pairs = zip(w.data.view(torch.float8_e4m3fn), w.scale, strict=True)
    return torch.stack([qref.dequantize_fp8_blockwise(d, s, torch.float32) for d, s in pairs])


def linear_weights(x: torch.Tensor, w: Weights, out_dtype: torch.dtype) -> torch.Tensor:
    """x [T, K] . W^T for a single weight in any format -> [T, N] in out_dtype (FP32 sums)."""
    if w.num_experts != 1:
        raise ValueError("linear_weights takes one weight matrix")
    return matmul_nt(x, dequantize(w)[0].to(x.dtype)).to(out_dtype)


def block_diagonal(x: torch.Tensor, w: Weights, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, G, K] -> [T, G, N]: out[t, g] = x[t, g] . W[g]^T (FP32 sums, out_dtype or x's)."""
    if x.ndim != 3 or x.shape[1] != w.num_experts:
        raise ValueError(f"block_diagonal: x {tuple(x.shape)} for {w.num_experts} weights")
    deq = dequantize(w).to(x.dtype)
    out = torch.stack([matmul_nt(x[:, g], deq[g]) for g in range(w.num_experts)], dim=1)
    return out.to(out_dtype or x.dtype)


def warmup(weights, rows=(1, 8, 64), dtype: torch.dtype = torch.bfloat16) -> int:
    """GEMM variants compiled ahead of the first request: the reference compiles none."""
    return 0
