"""Check every Triton kernel against its torch reference, and time both.

`run_checks(scale)` builds inputs at `tiny` shapes (CPU, TRITON_INTERPRET=1; seconds) or `bench`
shapes (the bench preset's per-layer geometry, GPU), runs the kernel and `ref.py` on the same
inputs, and returns one `Check` per case: max abs error, max error relative to max|ref|, pass or
fail against the case's tolerance (0 = bit-exact), and on the GPU the kernel's median time with
achieved GB/s or TFLOP/s. The tests, `flashpd verify-kernels` and bench/gpu_kernels.py all use it.

Errors are measured on the kernel's own output; where the output is a selection (top-k ids,
routed experts) a mismatch is accepted only if the two selections have the same scores to
within the tolerance (ties and 1-ulp score differences may pick different entries).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from flashpd.kernels import triton_runtime

SCALES = ("tiny", "bench")


@dataclass
class Check:
    op: str
    case: str
    max_abs: float
    max_rel: float
    tol: float  # on max_rel; 0 = bit-exact
    passed: bool
    kernel_ms: float | None = None
    ref_ms: float | None = None
    bytes_moved: float | None = None
    flops: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float | None:
        if self.kernel_ms and self.bytes_moved:
            return self.bytes_moved / (self.kernel_ms * 1e-3) / 1e9
        return None

    @property
    def tflops(self) -> float | None:
        if self.kernel_ms and self.flops:
            return self.flops / (self.kernel_ms * 1e-3) / 1e12
        return None

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(gbps=self.gbps, tflops=self.tflops)
        return d


# ============================================================================ helpers
def device() -> torch.device:
    return triton_runtime.kernel_device()


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref|, that / max |ref|) over finite reference entries; NaN never passes."""
    out, ref = out.float(), ref.float()
    if out.shape != ref.shape:
        raise ValueError(f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    if torch.isnan(out).any():
        return math.inf, math.inf
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(out)) or not torch.equal(out[~finite], ref[~finite]):
        return math.inf, math.inf
    if not finite.any():
        return 0.0, 0.0
    diff = (out[finite] - ref[finite]).abs().max().item()
    scale = ref[finite].abs().max().item()
    return diff, diff / scale if scale > 0 else diff


def exact_check(op: str, case: str, out: torch.Tensor, ref: torch.Tensor, **kw) -> Check:
    same = torch.equal(out, ref)
    mism = 0.0 if same else (out != ref).float().mean().item()
    return Check(op, case, mism, mism, 0.0, same, note="bit-exact" if same else f"{mism:.2%} bytes differ", **kw)


def close_check(op: str, case: str, out: torch.Tensor, ref: torch.Tensor, tol: float, **kw) -> Check:
    abs_err, rel_err = errors(out, ref)
    return Check(op, case, abs_err, rel_err, tol, rel_err <= tol, **kw)


def selection_check(
    op: str, case: str, ids: torch.Tensor, ref_ids: torch.Tensor, scores: torch.Tensor, tol: float, **kw
) -> Check:
    """ids [T, k] (-1 padded) vs ref_ids: equal, or equal score multisets within tol."""
    if torch.equal(ids, ref_ids):
        return Check(op, case, 0.0, 0.0, tol, True, note="identical selection", **kw)
    pick = (
        lambda i: torch.where(
            i >= 0,
            torch.gather(scores, 1, i.clamp_min(0)),  # noqa: E731
            torch.full_like(scores[:, :1], -math.inf).expand_as(i),
        )
    )
    a = pick(ids).sort(dim=-1).values
    b = pick(ref_ids).sort(dim=-1).values
    abs_err, rel_err = errors(a, b)
    frac = (ids != ref_ids).float().mean().item()
    return Check(op, case, abs_err, rel_err, tol, rel_err <= tol, note=f"{frac:.3%} ids differ (near-ties)", **kw)


_L2_FLUSH: list[torch.Tensor] = []


def _flush_l2() -> None:
    """Overwrite 256 MB (> the 60 MB L2) so a timed call starts from a cold cache."""
    if not _L2_FLUSH:
        _L2_FLUSH.append(torch.empty(64 << 20, dtype=torch.float32, device="cuda"))
    _L2_FLUSH[0].zero_()


def event_ms(fn: Callable[[], object]) -> float:
    """Milliseconds of one call of `fn` between two CUDA events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds: CUDA events on the GPU (L2 flushed before each call, outside the
    timed region), wall clock under the interpreter."""
    for _ in range(warmup):
        fn()
    samples = []
    if device().type == "cuda":
        for _ in range(reps):
            _flush_l2()
            samples.append(event_ms(fn))
    else:
        for _ in range(max(1, reps // 10)):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(*shape: int, seed: int, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    """Fresh random data, drawn on the CPU (same values on every device), moved to device()."""
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(device())


def _timed(
    check: Check, timing: bool, kernel: Callable[[], object], ref: Callable[[], object] | None = None, reps: int = 20
) -> Check:
    if timing:
        check.kernel_ms = time_ms(kernel, reps)
        if ref is not None:
            check.ref_ms = time_ms(ref, max(3, reps // 4))
    return check


# ============================================================================ registry
CHECKS: dict[str, Callable[..., list[Check]]] = {}  # op -> fn(scale, timing, tuned=)


def register_check(op: str):
    def wrap(fn):
        CHECKS[op] = fn
        return fn

    return wrap


def run_checks(
    scale: str = "tiny", ops: list[str] | None = None, timing: bool | None = None, tuned=None
) -> list[Check]:
    """All registered checks (import side effect: kernels/verify_cases.py) at `scale`, each
    kernel run with `tuned` (a configs.KernelConfigs; None: the table's default)."""
    from flashpd.kernels import (
        configs,
        verify_cases,  # noqa: F401  (registers the cases)
    )

    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; scales are {', '.join(SCALES)}")
    timing = (device().type == "cuda") if timing is None else timing
    unknown = set(ops or ()) - set(CHECKS)
    if unknown:
        raise KeyError(f"unknown ops {sorted(unknown)}; ops are {', '.join(CHECKS)}")
    results = []
    for op, fn in CHECKS.items():
        if ops and op not in ops:
            continue
        results.extend(fn(scale, timing, tuned=tuned or configs.DEFAULT))
    return results


def format_table(results: list[Check]) -> str:
    head = (
        f"{'op':<10} {'case':<34} {'max_abs':>10} {'max_rel':>10} {'tol':>8} {'ok':>4} "
        f"{'ms':>9} {'ref_ms':>9} {'GB/s':>8} {'TFLOP/s':>8}  note"
    )
    lines = [head, "-" * len(head)]

    def fmt(v: float | None, spec: str) -> str:
        return "-".rjust(int(spec.split(".")[0])) if v is None else format(v, spec)

    for c in results:
        lines.append(
            f"{c.op:<10} {c.case:<34} {c.max_abs:>10.3g} {c.max_rel:>10.3g} {c.tol:>8.1g} "
            f"{'yes' if c.passed else 'NO':>4} {fmt(c.kernel_ms, '9.4f')} "
            f"{fmt(c.ref_ms, '9.4f')} {fmt(c.gbps, '8.1f')} {fmt(c.tflops, '8.1f')}  {c.note}"
        )
    return "\n".join(lines)


def surface_mismatches(op: str) -> list[str]:
    """Public callables of kernels/<op>/ref.py missing from kernels/<op>/triton.py."""
    import importlib
    import inspect

    ref = importlib.import_module(f"flashpd.kernels.{op}.ref")
    fast = importlib.import_module(f"flashpd.kernels.{op}.triton")
    missing = []
    for name, obj in vars(ref).items():
        if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != ref.__name__:
            continue
        other = getattr(fast, name, None)
        if other is None:
            missing.append(name)
        elif _params(other) != _params(obj):
            missing.append(f"{name} (signature)")
    return missing


def _params(fn) -> list[str]:
    """Parameter names of fn, less the keyword-only `tuned` (the launch configs a Triton
    implementation takes beside the reference's parameters; `dispatch.bind` fills it)."""
    import inspect

    return [p for p in inspect.signature(fn).parameters if p != "tuned"]
