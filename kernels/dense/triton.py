"""Dense ops in Triton: one grouped GEMM that reads the checkpoint's weight formats, RMSNorm,
activations. Same function names and signatures as `dense/ref.py`, plus the format GEMMs.

The GEMM computes, for a list of row tiles each bound to one weight matrix ("expert"):

    C[p, :] = A[a_rows[p], :] . W[expert(p)]^T          FP32 accumulation

with the weight dequantised in registers right before `tl.dot` (model_spec §10):

    W_FMT  layout                                           value
    PLAIN  W [E, N, K] (bf16 or fp32)                       as stored
    MXFP4  W [E, N, K/2] uint8 + S [E, N, K/32] UE8M0       E2M1(nibble) * 2^(S-127), low nibble = even k
    FP8    W [E, N, K] E4M3 + S [E, ceil(N/32), ceil(K/32)] E4M3 * 2^(S-127) per 32x32 tile

Epilogues: STORE (round once to the output dtype) or SWIGLU (two weights W1/W3 share the A
tile; h = gamma * silu(min(g, L)) * clamp(u, -L, L) with g, u rounded to the activation dtype
first, as moe.ref.expert_ffn does, then rounded to the output dtype).

Batch invariance (dense/ref.py): block sizes along K never depend on the number of rows, so a
row's result does not depend on how many rows share the call. BF16 x BF16 products are exact in
FP32, so `tl.dot` with FP32 accumulation is the ref's FP32 GEMM up to summation order; FP32
operands use `input_precision="ieee"` (no TF32). `tl.dot_scaled` (hardware MXFP4) is behind the
constexpr DOT_SCALED: it does not run under the Triton 3.6 interpreter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.quant.triton import e2m1_decode, e4m3_decode, e8m0_decode, round_bf16

GEMM_PAD_ROWS = 16  # kept for signature parity with dense/ref.py

W_PLAIN, W_MXFP4, W_FP8 = 0, 1, 2
EPI_STORE, EPI_SWIGLU = 0, 1
_BLOCK_K = 64  # fixed: part of the per-row arithmetic (batch invariance)
# Launch configuration of the grouped GEMM (block N, warps, stages); tuned on an H200 by
# bench/gpu_kernels.py. Block M follows the rows per expert (block_m_for); block K is fixed above.
# GEMMs of at most SMALL_ROWS rows in all (decode at small batch) get narrower N tiles: a
# [1, 4096] x [4096, 1024] GEMM then runs on 64 CTAs instead of 16, so more SMs stream weights
# (H200, bench preset, B=1 decode: 94.5 -> 72.1 ms/step). With more rows the grid is already
# wide and narrow tiles re-read A (B=64: 367 -> 406 ms when applied to every block-M-16 tile).
# The K order, hence each row's arithmetic, is unchanged.
CONFIG = {"block_n": 64, "block_n_small": int(os.environ.get("FLASHPD_GEMM_BLOCK_N_SMALL", 16)),
          "small_rows": 16, "warps": 4, "stages": 3}


# ============================================================================ activations
@triton.jit
def sigmoid_f32(x):
    """1 / (1 + exp(-x)) in FP32 (dense.ref.sigmoid)."""
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def log1p_f32(u):
    """log(1 + u) accurate for small u (Goldberg's trick; libdevice is absent in the interpreter)."""
    w = 1.0 + u
    exact = w == 1.0
    return tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))


@triton.jit
def softplus_f32(x):
    """log(1 + e^x), passing x through above 20 (dense.ref.softplus)."""
    return tl.where(x > 20.0, x, log1p_f32(tl.exp(tl.minimum(x, 20.0))))


# ============================================================================ dot
# Triton 3.6's interpreter mis-reads BF16 operands of tl.dot (NumPy >= 2); there the operands
# are upcast to FP32 first, which is exact (BF16 x BF16 products are exact in FP32 anyway).
DOT_UPCAST = triton_runtime.interpreting()


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a . b with FP32 accumulation; IEEE for FP32 operands (no TF32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def mma_tf32x3(a, b, acc, UPCAST: tl.constexpr):
    """acc + a . b for FP32 operands as three TF32 products (FP32-level accuracy, tensor cores)."""
    if UPCAST:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision="tf32x3")


# ============================================================================ weight tiles
@triton.jit
def _weight_tile(w_ptr, s_ptr, e, n_idx, k0, N, K, stride_we, stride_wn, stride_se, stride_sn,
                 W_FMT: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr,
                 HW_FP8: tl.constexpr):
    """Dequantised W[e, n_idx, k0:k0+BLOCK_K] as [BLOCK_N, BLOCK_K] in OUT_DTYPE (exact)."""
    k_idx = k0 + tl.arange(0, BLOCK_K)
    mask = (n_idx[:, None] < N) & (k_idx[None, :] < K)
    base = w_ptr + e.to(tl.int64) * stride_we + n_idx[:, None].to(tl.int64) * stride_wn
    if W_FMT == 0:
        w = tl.load(base + k_idx[None, :], mask=mask, other=0.0).to(OUT_DTYPE)
    elif W_FMT == 1:
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        hmask = (n_idx[:, None] < N) & (half[None, :] < K // 2)
        packed = tl.load(base + half[None, :], mask=hmask, other=0).to(tl.int32)
        vals = tl.interleave(e2m1_decode(packed & 0xF), e2m1_decode(packed >> 4))
        sbase = s_ptr + e.to(tl.int64) * stride_se + n_idx[:, None].to(tl.int64) * stride_sn
        sb = tl.load(sbase + k_idx[None, :] // 32, mask=mask, other=127)
        w = (vals * e8m0_decode(sb)).to(OUT_DTYPE)
    else:
        q = tl.load(base + k_idx[None, :], mask=mask, other=0)
        if HW_FP8:  # the conversion hardware (GPU); same values as the bit arithmetic
            val = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            val = e4m3_decode(q)
        sbase = s_ptr + e.to(tl.int64) * stride_se + (n_idx[:, None] // 32).to(tl.int64) * stride_sn
        sb = tl.load(sbase + k_idx[None, :] // 32, mask=mask, other=127)
        w = (val * e8m0_decode(sb)).to(OUT_DTYPE)
    return w


@triton.jit
def _dot_scaled_mxfp4(a, w_ptr, s_ptr, e, n_idx, k0, N, K, stride_we, stride_wn, stride_se,
                      stride_sn, acc, BLOCK_K: tl.constexpr):
    """acc + a . W^T with the MXFP4 tile handed to tl.dot_scaled as stored (no dequant here)."""
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    nmask = n_idx[:, None] < N
    base = w_ptr + e.to(tl.int64) * stride_we + n_idx[:, None].to(tl.int64) * stride_wn
    packed = tl.load(base + half[None, :], mask=nmask & (half[None, :] < K // 2), other=0)
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    sbase = s_ptr + e.to(tl.int64) * stride_se + n_idx[:, None].to(tl.int64) * stride_sn
    scale = tl.load(sbase + groups[None, :], mask=nmask & (groups[None, :] < K // 32), other=127)
    return tl.dot_scaled(a, None, "bf16", tl.trans(packed), scale, "e2m1", acc)


@triton.jit
def _round_out(x, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        x = round_bf16(x)
    return x


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, stride_am, a_rows_ptr, c_ptr, stride_cm, gamma_ptr,
    w1_ptr, s1_ptr, w3_ptr, s3_ptr, stride_we, stride_wn, stride_se, stride_sn,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, K, limit,
    W_FMT: tl.constexpr, EPILOGUE: tl.constexpr, HAS_GAMMA: tl.constexpr,
    GATHER_A: tl.constexpr, ROUND_ACT_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, DOT_SCALED: tl.constexpr, HW_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start < end:
        e = tl.load(tile_expert_ptr + tile)
        p = start + tl.arange(0, BLOCK_M)  # rows of C
        p_mask = p < end
        if GATHER_A:
            a_row = tl.load(a_rows_ptr + p, mask=p_mask, other=0).to(tl.int64)
        else:
            a_row = p.to(tl.int64)
        n_idx = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        dot_dtype = a_ptr.dtype.element_ty
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_idx = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + a_row[:, None] * stride_am + k_idx[None, :],
                        mask=p_mask[:, None] & (k_idx[None, :] < K), other=0.0)
            if DOT_SCALED:  # hardware / Triton MXFP4 path (GPU only, see module doc)
                acc1 = _dot_scaled_mxfp4(a, w1_ptr, s1_ptr, e, n_idx, k0, N, K, stride_we,
                                         stride_wn, stride_se, stride_sn, acc1, BLOCK_K)
                if EPILOGUE == 1:
                    acc3 = _dot_scaled_mxfp4(a, w3_ptr, s3_ptr, e, n_idx, k0, N, K, stride_we,
                                             stride_wn, stride_se, stride_sn, acc3, BLOCK_K)
            else:
                w1 = _weight_tile(w1_ptr, s1_ptr, e, n_idx, k0, N, K, stride_we, stride_wn,
                                  stride_se, stride_sn, W_FMT, BLOCK_K, dot_dtype, HW_FP8)
                acc1 = mma(a, tl.trans(w1), acc1, IEEE, UPCAST)
                if EPILOGUE == 1:
                    w3 = _weight_tile(w3_ptr, s3_ptr, e, n_idx, k0, N, K, stride_we, stride_wn,
                                      stride_se, stride_sn, W_FMT, BLOCK_K, dot_dtype, HW_FP8)
                    acc3 = mma(a, tl.trans(w3), acc3, IEEE, UPCAST)
        if EPILOGUE == 1:  # SwiGLU (moe.ref.expert_ffn): g, u rounded to the activation dtype
            g = tl.minimum(_round_out(acc1, ROUND_ACT_BF16), limit)
            u = tl.minimum(tl.maximum(_round_out(acc3, ROUND_ACT_BF16), -limit), limit)
            out = g * sigmoid_f32(g) * u
            if HAS_GAMMA:
                out = tl.load(gamma_ptr + p, mask=p_mask, other=0.0)[:, None] * out
        else:
            out = acc1
        c = c_ptr + p[:, None].to(tl.int64) * stride_cm + n_idx[None, :]
        tl.store(c, _round_out(out, OUT_BF16).to(c_ptr.dtype.element_ty),
                 mask=p_mask[:, None] & (n_idx[None, :] < N))


# ============================================================================ weights
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
        return Weights(W_MXFP4, packed if packed.ndim == 3 else packed[None],
                       scale if scale.ndim == 3 else scale[None])

    @staticmethod
    def fp8(w_f8: torch.Tensor, scale: torch.Tensor) -> Weights:
        if w_f8.dtype != torch.float8_e4m3fn or scale.dtype != torch.uint8:
            raise TypeError("FP8 weights are float8_e4m3fn + uint8 UE8M0 32x32 tile scales")
        return Weights(W_FP8, (w_f8 if w_f8.ndim == 3 else w_f8[None]).view(torch.uint8),
                       scale if scale.ndim == 3 else scale[None])


@dataclass(frozen=True)
class TileSchedule:
    """Row tiles of C: tile t covers rows [start[t], end[t]) of weight expert[t] (empty: start=end)."""

    expert: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    block_m: int


def single_schedule(num_rows: int, block_m: int, device: torch.device) -> TileSchedule:
    """All rows against weight 0."""
    n_tiles = max(1, -(-num_rows // block_m))
    start = torch.arange(n_tiles, dtype=torch.int32, device=device) * block_m
    end = torch.clamp(start + block_m, max=num_rows)
    return TileSchedule(torch.zeros_like(start), start, end, block_m)


def grouped_schedule(counts: torch.Tensor, total_rows: int, block_m: int) -> TileSchedule:
    """counts [E] rows per expert (rows sorted by expert, summing to total_rows) -> tiles.

    Computed on the device without a host sync: the tile count is bounded by
    ceil(total_rows / block_m) + E, and surplus tiles are empty.
    """
    device = counts.device
    counts = counts.to(torch.int64)
    num_experts = counts.shape[0]
    row_off = torch.cumsum(counts, 0) - counts  # [E] first row of each expert
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_off = torch.cumsum(tiles, 0)  # [E] one past the last tile of each expert
    max_tiles = -(-total_rows // block_m) + num_experts
    t = torch.arange(max_tiles, device=device)
    expert = torch.searchsorted(tile_off, t, right=True).clamp(max=num_experts - 1)  # [tiles]
    first_tile = tile_off[expert] - tiles[expert]
    start = row_off[expert] + (t - first_tile) * block_m
    end = torch.minimum(start + block_m, row_off[expert] + counts[expert])
    end = torch.where(t < tile_off[-1], end, start)
    return TileSchedule(expert.to(torch.int32), start.to(torch.int32), end.to(torch.int32),
                        block_m)


def grouped_gemm(a: torch.Tensor, w: Weights, schedule: TileSchedule, out: torch.Tensor,
                 a_rows: torch.Tensor | None = None, w3: Weights | None = None,
                 gamma: torch.Tensor | None = None, limit: float = 0.0,
                 dot_scaled: bool = False) -> torch.Tensor:
    """out[p] = epilogue(A[a_rows[p]] . W[expert(p)]^T); SwiGLU epilogue when w3 is given.

    dot_scaled=True (MXFP4 weights, GPU only) feeds the packed tile to tl.dot_scaled instead of
    dequantising it in registers; it is rejected under the interpreter, which cannot run it.
    """
    _check_gemm(a, w, out, w3)
    if dot_scaled and (w.fmt != W_MXFP4 or triton_runtime.interpreting()):
        raise ValueError("dot_scaled needs MXFP4 weights and a GPU (not the interpreter)")
    n_dim, k_dim = w.out_dim, w.in_dim
    n_tiles = schedule.start.shape[0]
    if n_tiles == 0 or out.shape[0] == 0:
        return out
    scale1 = w.scale if w.scale is not None else w.data
    w3_ = w3 if w3 is not None else w
    scale3 = w3_.scale if w3_.scale is not None else w3_.data
    sse, ssn = (scale1.stride(0), scale1.stride(1)) if w.scale is not None else (0, 0)
    cfg = CONFIG
    small = out.shape[0] <= cfg.get("small_rows", 0)
    block_n = cfg.get("block_n_small", cfg["block_n"]) if small else cfg["block_n"]
    grid = (n_tiles, triton.cdiv(n_dim, block_n))
    _grouped_gemm_kernel[grid](
        a, a.stride(0), a_rows if a_rows is not None else schedule.start, out, out.stride(0),
        gamma if gamma is not None else a, w.data, scale1, w3_.data, scale3,
        w.data.stride(0), w.data.stride(1), sse, ssn,
        schedule.expert, schedule.start, schedule.end, n_dim, k_dim, float(limit),
        W_FMT=w.fmt, EPILOGUE=EPI_SWIGLU if w3 is not None else EPI_STORE,
        HAS_GAMMA=gamma is not None, GATHER_A=a_rows is not None,
        ROUND_ACT_BF16=a.dtype == torch.bfloat16, OUT_BF16=out.dtype == torch.bfloat16,
        IEEE=a.dtype == torch.float32, UPCAST=DOT_UPCAST,
        DOT_SCALED=dot_scaled, HW_FP8=not DOT_UPCAST, BLOCK_M=schedule.block_m,
        BLOCK_N=block_n, BLOCK_K=_BLOCK_K, num_warps=cfg["warps"],
        num_stages=cfg["stages"], **triton_runtime.launch_options())
    return out


def _check_gemm(a: torch.Tensor, w: Weights, out: torch.Tensor, w3: Weights | None) -> None:
    if a.ndim != 2 or a.stride(1) != 1 or out.ndim != 2 or out.stride(1) != 1:
        raise ValueError("grouped_gemm needs row-major 2-D a and out")
    if a.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"activations must be bf16 or fp32, got {a.dtype}")
    if a.shape[1] != w.in_dim or out.shape[1] != w.out_dim:
        raise ValueError(f"shapes a {tuple(a.shape)}, W [{w.out_dim}, {w.in_dim}], "
                         f"out {tuple(out.shape)} do not chain")
    if w.fmt == W_PLAIN and w.data.dtype != a.dtype:
        raise TypeError(f"plain weights must match the activation dtype {a.dtype}")
    if w.fmt != W_PLAIN and a.dtype != torch.bfloat16:
        raise TypeError("quantised weights are dequantised to bf16; activations must be bf16")
    if w.fmt == W_MXFP4 and w.in_dim % 32:
        raise ValueError("MXFP4 weights need K % 32 == 0")
    if w3 is not None and (w3.fmt, w3.data.shape) != (w.fmt, w.data.shape):
        raise ValueError("SwiGLU W1 and W3 must share format and shape")
    triton_runtime.check_device(a, out, w.data)


def block_m_for(num_rows: int) -> int:
    return 16 if num_rows <= 16 else 32 if num_rows <= 64 else 64


def linear_weights(x: torch.Tensor, w: Weights, out_dtype: torch.dtype) -> torch.Tensor:
    """x [T, K] . W^T for a single weight in any format -> [T, N] in out_dtype."""
    if w.num_experts != 1:
        raise ValueError("linear_weights takes one weight matrix")
    out = torch.empty(x.shape[0], w.out_dim, dtype=out_dtype, device=x.device)
    schedule = single_schedule(x.shape[0], block_m_for(x.shape[0]), x.device)
    return grouped_gemm(x.contiguous(), w, schedule, out)


# ============================================================================ ref surface
def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b[N, K]^T -> [M, N] in FP32 (both operands in a's dtype)."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"matmul_nt shapes {tuple(a.shape)} x {tuple(b.shape)}^T")
    dtype = torch.float32 if torch.float32 in (a.dtype, b.dtype) else a.dtype
    return linear_weights(a.to(dtype), Weights.plain(b.to(dtype)), torch.float32)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] . weight[out, in]^T -> [T, out] in x.dtype, FP32 accumulation."""
    return linear_weights(x, Weights.plain(weight.to(x.dtype)), x.dtype)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x . weight^T in FP32 (bf16 operands: exact products, FP32 sums)."""
    return matmul_nt(x, weight)


def linear_fp8(x: torch.Tensor, w_f8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """x [T, in] bf16 . dequant(W_fp8 [out, in], 32x32 UE8M0 tiles)^T -> [T, out] bf16."""
    return linear_weights(x, Weights.fp8(w_f8, scale_u8), x.dtype)


def linear_mxfp4(x: torch.Tensor, packed: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """x [T, in] bf16 . dequant(MXFP4 [out, in/2], UE8M0 per 1x32)^T -> [T, out] bf16."""
    return linear_weights(x, Weights.mxfp4(packed, scale_u8), x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, D, eps,
                     HAS_W: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * (1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps))
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, _round_out(y, OUT_BF16).to(y_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """[..., D] -> [..., D] in x.dtype: FP32 statistic and weight multiply, one rounding."""
    triton_runtime.check_device(x)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight if weight is not None else x2, y, x2.stride(0), y.stride(0),
            x2.shape[1], float(eps), HAS_W=weight is not None,
            OUT_BF16=x.dtype == torch.bfloat16, BLOCK_D=triton.next_power_of_2(x2.shape[1]),
            **triton_runtime.launch_options())
    return y.reshape(x.shape)


def fp32(x: torch.Tensor) -> torch.Tensor:
    """x as FP32 (no copy when it already is)."""
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bf16(.) in BF16 mode; torch's cast is RNE on both CPU and GPU."""
    return x.to(dtype)


@triton.jit
def _act_kernel(x_ptr, y_ptr, n, threshold, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        y = sigmoid_f32(x)
    elif ACT == 1:
        y = x * sigmoid_f32(x)
    else:
        y = tl.where(x > threshold, x, log1p_f32(tl.exp(tl.minimum(x, threshold))))
    tl.store(y_ptr + offs, y, mask=mask)


def _activation(x: torch.Tensor, act: int, threshold: float = 20.0) -> torch.Tensor:
    triton_runtime.check_device(x)
    flat = x.reshape(-1).contiguous()
    y = torch.empty(flat.shape, dtype=torch.float32, device=x.device)
    if flat.numel():
        block = 1024
        _act_kernel[(triton.cdiv(flat.numel(), block),)](flat, y, flat.numel(), float(threshold),
                                                        ACT=act, BLOCK=block)
    return y.reshape(x.shape)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _activation(x, 0)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _activation(x, 1)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    return _activation(x, 2, threshold)
