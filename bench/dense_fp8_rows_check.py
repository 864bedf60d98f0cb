"""Batch invariance of the FP8 swap kernel's row classes on the GPU (dense/fp8_swap.py).

    python -m flashpd.bench.dense_fp8_rows_check [--variants r_w4 r_w2 ...]

For each gemm_decode row-class variant (fp8_swap.CONFIG["classes"]) and class 16 / 32 / 64:
a bench-preset weight (wq_a + wkv stacked [1792, 5120]; the shared expert's SwiGLU pair) times
the class's widest batch, then every row again in calls of other sizes of the class and at
other positions (the batch rolled). Prints, per variant and class, whether every row was bit
for bit the same (the interpreter tests cover the same positions only).
"""

from __future__ import annotations

import argparse

import torch


def check(classes: dict, cls: int, swiglu: bool) -> bool:
    from flashpd.bench import kernel_roofline as kr
    from flashpd.kernels.dense import fp8_swap as fs

    fs.CONFIG["classes"] = classes
    n, k = (kr.INTER, kr.HIDDEN) if swiglu else (kr.Q_LORA + kr.HEAD_DIM, kr.HIDDEN)
    w = kr.rand_fp8(n, k, seed=41)
    w3 = kr.rand_fp8(n, k, seed=42) if swiglu else None
    x = torch.randn(cls, k, device="cuda").to(torch.bfloat16)

    def call(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16, device="cuda")
        if swiglu:
            return fs.gemm(x[rows], w, out, w3, None, 10.0)
        return fs.gemm(x[rows], w, out)

    full = call(torch.arange(cls, device="cuda"))
    ok = True
    lo = max(cls // 2 + 1, 9) if cls > 8 else 1
    for size in sorted({lo, (lo + cls) // 2, cls}):
        for shift in (0, 3, cls - 1):
            rows = (torch.arange(size, device="cuda") + shift) % cls
            ok &= torch.equal(call(rows), full[rows])
    return ok


def main(argv: list[str] | None = None) -> int:
    from flashpd.bench.gemm_decode import VARIANTS
    from flashpd.kernels.dense import fp8_swap as fs

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="*", default=["default"])
    args = ap.parse_args(argv)
    default = fs.CONFIG["classes"]
    for v in args.variants:
        classes = default if v == "default" else VARIANTS[v][0]["fp8_swap"]["classes"]
        res = {f"{c}{' swiglu' if s else ''}": check(classes, c, s) for c in sorted(classes)
               for s in (False, True)}
        print(f"invariance {v}: " + ", ".join(f"{c} {'same' if ok else 'DIFFERS'}"
                                              for c, ok in res.items()), flush=True)
    fs.CONFIG["classes"] = default
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
