"""KV compressor in Triton: the ratio-2 gated pooling of the GPU forward in one launch.

`pool_open_pairs` is what the paged forward needs per seam row t of a ratio-2 source: its
partner row (the slot's stored open row when t opens the segment's seam, else the row before
it), the softmax-gated pooling of the two (FP32, `ref.pool_two`) and the BF16 rounding of the
pooled latent, without the gather / roll / where / eleven elementwise launches of the torch
expression. The rest of the op family is the reference's (re-exported below).

exp: libdevice's expf on the GPU (the function torch's CUDA exp calls: the same bits); the
interpreter has no libdevice and uses tl.exp (NumPy's, an ulp away at most).
"""

from __future__ import annotations

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.compressor import ref
from flashpd.kernels.quant.triton import round_bf16

_LIBDEVICE = not triton_runtime.interpreting()
if _LIBDEVICE:
    from triton.language.extra import libdevice
else:  # never traced: the EXP_LIBDEVICE=False branch is the one compiled
    libdevice = None

OpenGroup = ref.OpenGroup
gated_projection = ref.gated_projection
pool_pairs = ref.pool_pairs
pool_two = ref.pool_two
latent = ref.latent
project = ref.project


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _partner(ag_ptr, open_ptr, stride_open, stored_ptr, slots_ptr, t, cols, mask, num_rows, C: tl.constexpr):
    """(a, g) of row t's partner: its slot's stored open row, else the row before (roll by one)."""
    stored = tl.load(stored_ptr + t) != 0
    from_prev = tl.load(stored_ptr + t) == 0
    slot = tl.load(slots_ptr + t).to(tl.int64)
    prev = ag_ptr + ((t + num_rows - 1) % num_rows) * (2 * C)  # the row before (roll by one)
    kept = open_ptr + slot * stride_open
    a0 = tl.where(
        stored,
        tl.load(kept + cols, mask=mask & stored, other=0.0),
        tl.load(prev + cols, mask=mask & from_prev, other=0.0),
    )
    g0 = tl.where(
        stored,
        tl.load(kept + C + cols, mask=mask & stored, other=0.0),
        tl.load(prev + C + cols, mask=mask & from_prev, other=0.0),
    )
    return a0, g0


@triton.jit
def _pool_two(a0, g0, a1, g1, LIBDEVICE: tl.constexpr):
    """softmax(g0, g1)-weighted a0, a1 in FP32 (ref.pool_two)."""
    g_max = tl.maximum(g0, g1)
    e0 = _exp(g0 - g_max, LIBDEVICE)
    e1 = _exp(g1 - g_max, LIBDEVICE)
    total = e0 + e1
    return tl.math.div_rn(e0, total) * a0 + tl.math.div_rn(e1, total) * a1


@triton.jit
def _pool_open_pairs_kernel(
    ag_ptr,
    open_ptr,
    stride_open,
    stored_ptr,
    slots_ptr,
    out_ptr,
    num_rows,
    C: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OUT_BF16: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    row = ag_ptr + t * (2 * C)
    a1 = tl.load(row + cols, mask=mask, other=0.0)
    g1 = tl.load(row + C + cols, mask=mask, other=0.0)
    a0, g0 = _partner(ag_ptr, open_ptr, stride_open, stored_ptr, slots_ptr, t, cols, mask, num_rows, C)
    pooled = _pool_two(a0, g0, a1, g1, LIBDEVICE)
    if OUT_BF16:
        pooled = round_bf16(pooled)
    tl.store(out_ptr + t * C + cols, pooled.to(out_ptr.dtype.element_ty), mask=mask)


def pool_open_pairs(
    ag: torch.Tensor,
    open_rows: torch.Tensor,
    from_stored: torch.Tensor,
    slots: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """ag FP32 [T, 2, c] ((a, g) of T consecutive seam rows), open_rows FP32 [S, 2, c] (each
    slot's stored open row of this source; a view of the pools is fine), from_stored bool [T],
    slots int [T] -> pooled [T, c] in `dtype` (BF16: rounded to nearest even):

        partner(t) = open_rows[slots[t]] if from_stored[t] else ag[t - 1]   (ag[T - 1] for t = 0)
        pooled[t]  = ref.pool_two(partner a, partner g, ag[t, 0], ag[t, 1])

    One launch, nothing read on the host (CUDA-graph safe)."""
    _check_pool_args(ag, open_rows, from_stored, slots, dtype)
    num_rows, _, width = ag.shape
    out = torch.empty(num_rows, width, dtype=dtype, device=ag.device)
    if num_rows == 0:
        return out
    _launch_pool(ag.contiguous(), open_rows, from_stored, slots, out)
    return out


def _launch_pool(ag: torch.Tensor, open_rows, from_stored, slots, out: torch.Tensor) -> None:
    """One program per (row, BLOCK_C columns), BLOCK_C up to 1024."""
    num_rows, width = out.shape
    block = min(1024, triton.next_power_of_2(width))
    _pool_open_pairs_kernel[(num_rows, triton.cdiv(width, block))](
        ag,
        open_rows,
        open_rows.stride(0),
        from_stored.view(torch.uint8),
        slots,
        out,
        num_rows,
        C=width,
        BLOCK_C=block,
        OUT_BF16=out.dtype == torch.bfloat16,
        LIBDEVICE=_LIBDEVICE,
        **triton_runtime.launch_options(),
    )


def _check_pool_args(ag, open_rows, from_stored, slots, dtype: torch.dtype) -> None:
    if ag.ndim != 3 or ag.shape[1] != 2 or ag.dtype != torch.float32:
        raise ValueError(f"ag must be FP32 [T, 2, c], got {ag.dtype} {tuple(ag.shape)}")
    num_rows, _, width = ag.shape
    if open_rows.ndim != 3 or open_rows.shape[1:] != (2, width) or (open_rows.dtype != torch.float32):
        raise ValueError(f"open_rows must be FP32 [S, 2, {width}], got {open_rows.dtype} {tuple(open_rows.shape)}")
    if open_rows.stride(1) != width or open_rows.stride(2) != 1:
        raise ValueError("open_rows must be contiguous within a slot's row")
    if from_stored.shape != (num_rows,) or slots.shape != (num_rows,):
        raise ValueError(
            f"from_stored and slots must be [{num_rows}], got {tuple(from_stored.shape)}, {tuple(slots.shape)}"
        )
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be bf16 or fp32, got {dtype}")
    triton_runtime.check_device(ag, open_rows, from_stored, slots)
