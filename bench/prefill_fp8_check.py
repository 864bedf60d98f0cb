"""Prefill FP8 GEMMs that take cuBLAS from cublas_min_rows rows: the shared expert's SwiGLU pair
and wo_a's block-diagonal groups, against the Triton kernel they ran on before (H200).

    python -m flashpd.bench.prefill_fp8_check [--rows 4096 8192]

Bench-preset shapes (D = 5120, shared I = 2304; wo_a G = 8 groups of N = 1024, K = 4096),
random FP8 32x32-tile weights; ms per call (CUDA events over 20 calls after one warm call),
TFLOP/s, and the largest difference between the two paths relative to max |Triton|.
"""

from __future__ import annotations

import argparse

import torch

from flashpd.kernels.dense import triton as dt
from flashpd.kernels.quant import ref as qref


def _ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _both(fn) -> tuple[float, float, float]:
    """(cuBLAS ms, Triton ms, relative difference) of one call."""
    new, y_new = _ms(fn), fn().clone()
    saved = dt.CONFIG["cublas_min_rows"]
    dt.CONFIG["cublas_min_rows"] = 1 << 30
    try:
        old, y_old = _ms(fn), fn().clone()
    finally:
        dt.CONFIG["cublas_min_rows"] = saved
    diff = ((y_new.float() - y_old.float()).abs().max() / y_old.float().abs().max()).item()
    return new, old, diff


def _fp8(n: int, k: int) -> dt.Weights:
    return dt.Weights.fp8(*qref.quantize_fp8_blockwise(torch.randn(n, k, device="cuda")))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 8192])
    args = ap.parse_args(argv)
    print("| GEMM | rows | cuBLAS ms | TFLOP/s | Triton ms | TFLOP/s | rel diff |")
    print("|---|---|---|---|---|---|---|")
    for t in args.rows:
        x = torch.randn(t, 5120, device="cuda").to(torch.bfloat16)
        w1, w3 = _fp8(2304, 5120), _fp8(2304, 5120)
        h = torch.empty(t, 2304, dtype=torch.bfloat16, device="cuda")
        new, old, diff = _both(lambda x=x, w1=w1, h=h, w3=w3: dt.grouped_gemm(
            x, w1, None, h, w3=w3, limit=7.0))
        flops = 2.0 * t * 2 * 2304 * 5120
        print(f"| shared SwiGLU up | {t} | {new:.3f} | {flops / new / 1e9:.0f} | {old:.3f} | "
              f"{flops / old / 1e9:.0f} | {diff:.1e} |")
        xs = torch.randn(t, 8, 4096, device="cuda").to(torch.bfloat16)
        ws = [qref.quantize_fp8_blockwise(torch.randn(1024, 4096, device="cuda"))
              for _ in range(8)]
        wb = dt.Weights.fp8(torch.stack([q for q, _ in ws]), torch.stack([s for _, s in ws]))
        new, old, diff = _both(lambda xs=xs, wb=wb: dt.block_diagonal(xs, wb))
        flops = 2.0 * t * 8 * 1024 * 4096
        print(f"| wo_a block-diagonal | {t} | {new:.3f} | {flops / new / 1e9:.0f} | {old:.3f} | "
              f"{flops / old / 1e9:.0f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
