"""Offline (no GPU) compile report of the FP8 swapped-operand decode kernel for Hopper (sm_90).

    python -m flashpd.bench.dense_fp8_swap_sass [--try JSON ...]

Compiles `dense.fp8_swap._fp8_swap_kernel` for sm_90 with Triton's bundled ptxas for each row
class tile below (ROWS = the X^T tile's width, BLOCK_N, warps; plain and SwiGLU pair, split-K
on) or the ad-hoc --try sets ({"ROWS": 32, "BLOCK_N": 32, "num_warps": 2, "SWIGLU": true}),
and reads the binary back (dense_fp8_sass.analyse): registers, stack (spills), shared memory,
MMA form (mma.sync or wgmma) and the K loop's warp-instructions per weight byte. No timing.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (set before the kernels load)

TILES = [(rows, bn, warps) for rows in (8, 16, 32, 64) for bn, warps in
         ((32, 2), (64, 2), (64, 4), (128, 4), (128, 8))]
_OPTS = ("num_warps", "num_stages")


def compile_variant(consts: dict):
    """(compiled kernel, weight bytes per K-loop iteration) for one constexpr / option set."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashpd.kernels.dense import fp8_swap

    fn = fp8_swap.FP8_SWAP_KERNEL
    opts = {"num_warps": 4, "num_stages": 3, **{k: v for k, v in consts.items() if k in _OPTS}}
    const = {"SWIGLU": False, "HAS_GAMMA": False, "OUT_BF16": True, "DEQ": 1, "HW_FP8": True,
             "UPCAST": False, "EVEN_K": True, "SPLIT_K": True, "RED_UNROLL": 4,
             "BLOCK_N": 64, "BLOCK_K": 128, "ROWS": 8,
             **{k: v for k, v in consts.items() if k not in _OPTS}}
    const["HAS_GAMMA"] = const["SWIGLU"]
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = {"x_ptr": "*bf16", "out_ptr": "*bf16", "gamma_ptr": "*fp32",
                         "part_ptr": "*fp32", "count_ptr": "*i32"}.get(name, "*u8")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "limit":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name not in ("rows", "split", "groups"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options=opts)
    return kernel, const["BLOCK_N"] * const["BLOCK_K"] * (2 if const["SWIGLU"] else 1)


def main(argv: list[str] | None = None) -> int:
    from flashpd.bench.dense_fp8_sass import analyse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--try", dest="tries", nargs="*", default=None)
    ap.add_argument("--swiglu", action="store_true", help="also the SwiGLU pair of each tile")
    args = ap.parse_args(argv)
    sets = [json.loads(t) for t in args.tries] if args.tries is not None else [
        {"ROWS": r, "BLOCK_N": bn, "num_warps": w, "SWIGLU": sw} for r, bn, w in TILES
        for sw in ((False, True) if args.swiglu else (False,))]
    print("| constexprs / options | regs | stack | smem KiB | MMA | loop instr / weight byte |")
    print("|---|---|---|---|---|---|")
    for consts in sets:
        try:
            facts = analyse(*compile_variant(consts))
        except Exception as exc:  # one bad set must not lose the rest
            print(f"| {json.dumps(consts)} | failed: {type(exc).__name__}: {exc} |||||")
            continue
        per_b = facts["loop_i_per_B"]
        print(f"| {json.dumps(consts)} | {facts['regs']} | {facts['stack']} | "
              f"{facts['smem_kib']:.1f} | {facts['mma']} | "
              + (f"{per_b:.3f}" if per_b else "-") + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
