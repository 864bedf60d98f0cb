"""Offline (no GPU) compile report of the fused mHC kernel's decode tiles for Hopper (sm_90).

    python -m flashpd.bench.mhc_sass [--variants NAME ...] [--modes seam fused]

Compiles `mhc.triton.FUSED_KERNEL` with Triton's bundled ptxas at the bench preset's D = 5120 for
each decode variant of bench/mhc_bench.py (CONFIG overrides, through `launch_plan`) and reads the
binary back (dense_fp8_sass.analyse): registers, stack (spills), shared memory, MMA form. No
timing: a variant that spills here is not worth device time.
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (set before the kernels load)

_FP32 = ("post_ptr", "comb_ptr", "fn_ptr", "base_ptr", "scale_ptr", "pre_in_ptr", "pre_ptr",
         "post_out_ptr", "comb_out_ptr", "partial_ptr")


def compile_variant(overrides: dict, mode: str, tokens: int = 1, dim: int = 5120):
    """The compiled decode kernel of one CONFIG variant; mode seam (no y) or fused (y)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashpd.kernels.mhc import triton as ht

    saved = dict(ht.CONFIG)
    ht.CONFIG.update(overrides)
    try:
        plan = ht.launch_plan(tokens, dim)
    finally:
        ht.CONFIG.clear()
        ht.CONFIG.update(saved)
    fn = ht.FUSED_KERNEL
    const = {"D": dim, "S": 4, "ITERS": 20, "HAS_Y": mode == "fused", "COLLAPSE": True,
             "HAS_NORM_W": True, "BF16": True, "UPCAST": False, "SPIN": plan["spin"],
             **ht.kernel_constants(plan)}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ("*fp32" if name in _FP32 else
                         "*i32" if name == "counter_ptr" else "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.endswith("eps"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    opts = {"num_warps": plan["warps"], "num_stages": plan["stages"], "enable_fp_fusion": False}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=opts)


def main(argv: list[str] | None = None) -> int:
    from flashpd.bench.dense_fp8_sass import analyse
    from flashpd.bench.mhc_bench import DECODE_VARIANTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="*", default=list(DECODE_VARIANTS))
    ap.add_argument("--modes", nargs="*", default=["seam", "fused"])
    args = ap.parse_args(argv)
    print("| variant | mode | regs | stack B | smem KiB | mma |")
    print("|---|---|---|---|---|---|")
    for name in args.variants:
        for mode in args.modes:
            try:
                r = analyse(compile_variant(DECODE_VARIANTS[name], mode), 1)
                print(f"| {name} | {mode} | {r['regs']} | {r['stack']} | {r['smem_kib']:.1f} | "
                      f"{r['mma']} |", flush=True)
            except Exception as exc:  # one variant's failure must not hide the others
                print(f"| {name} | {mode} | FAILED {type(exc).__name__}: {str(exc)[:160]} | | |"
                      " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
