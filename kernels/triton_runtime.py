"""Where flashpd's Triton kernels run: the GPU when CUDA is present, Triton's interpreter otherwise.

Triton decides at *decoration* time whether a `@triton.jit` function is compiled or interpreted
(it reads TRITON_INTERPRET then), so every `kernels/<op>/triton.py` imports this module before it
defines a kernel. On a host without CUDA (CI, laptops) the interpreter is the only way a Triton
kernel can run, so it is selected unless the caller set TRITON_INTERPRET explicitly.

The interpreter executes kernels with NumPy, which differs from the GPU in two ways the kernels
guard against (see kernels/quant/triton.py): float casts to BF16 and FP8 truncate instead of
rounding to nearest even, and libdevice functions are missing. Kernels therefore round with
explicit bit arithmetic, which is exact on both.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_scalar_index() -> None:
    """Let `range(0, K, BLOCK)` take a runtime scalar K under the interpreter with NumPy >= 2.

    Triton 3.6's interpreter holds scalar arguments as 1-element arrays and converts them with
    `int(array)`, which NumPy 2.x refuses for arrays of one dimension. This converts the single
    element instead; it changes nothing on the GPU path.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_flashpd_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._flashpd_patched = True
    interpreter._patch_lang_tensor = patched


def interpreting() -> bool:
    """True when Triton kernels defined after this import run in the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_device() -> torch.device:
    """The device kernel inputs must live on: CUDA, or CPU under the interpreter."""
    return torch.device("cpu") if interpreting() else torch.device("cuda")


def check_device(*tensors: torch.Tensor) -> None:
    """Raise unless every tensor is on the device the kernels run on (strict, no copies)."""
    want = kernel_device().type
    for t in tensors:
        if t.device.type != want:
            raise ValueError(
                f"Triton kernels here run on {want} (TRITON_INTERPRET="
                f"{os.environ.get('TRITON_INTERPRET', '')!r}); got a tensor on {t.device}"
            )


def launch_options() -> dict:
    """Compile options for launches: no FMA contraction, so a*b - c*d rounds as torch does.

    The interpreter accepts no compile options, hence the empty dict there.
    """
    return {} if interpreting() else {"enable_fp_fusion": False}


if interpreting():
    _patch_interpreter_scalar_index()


COUNTER_SLOTS = 1 << 16  # arrival counters held per device before the buffer would grow
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int = 0) -> torch.Tensor:
    """Zeroed int32 arrival counters of the kernels' cross-program reductions (split-K, the mHC
    and router partials): one buffer per device, shared, since every launch leaves the counters
    it used zeroed and launches on one stream take turns. A new (larger) buffer only past
    COUNTER_SLOTS, which no launch at the served shapes needs (a captured graph keeps the one
    it saw)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, COUNTER_SLOTS), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def check_counter_slots(blocks: int) -> None:
    """A split-K grid's output blocks take one arrival counter each: at most COUNTER_SLOTS."""
    if blocks > COUNTER_SLOTS:
        raise ValueError(f"{blocks} split-K output blocks, at most {COUNTER_SLOTS}")


def split_partials(split: int, swiglu: bool, rows: int, n_dim: int, out: torch.Tensor, device) -> torch.Tensor:
    """The split-K partial sums: fp32 [(2 if SwiGLU else 1) * split * rows * N]; `out` itself
    when one K segment writes C directly (split <= 1)."""
    if split <= 1:
        return out
    return torch.empty((2 if swiglu else 1) * split * rows * n_dim, dtype=torch.float32, device=device)
