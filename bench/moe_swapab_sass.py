"""Offline (no GPU) compile report of the swap-AB routed-expert kernels for Hopper (sm_90).

    python -m flashpd.bench.moe_swapab_sass [--try JSON ...]

Compiles `moe.swapab.GEMM_KERNEL` for sm_90 with Triton's bundled ptxas at the bench
preset's shapes (up: K = 5120 with W1 and W3; down: K = 2304) for each variant below (or the
ad-hoc --try constexpr/option sets) and reads the binary back (dense_fp8_sass.analyse):
registers, stack (spills), shared memory, MMA form, and the K loop's warp-instructions per
weight byte it streams (the SM issues at most 4 warp-instructions per clock). No timing.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (set before the kernels load)

# name: (part, constexpr overrides, options overrides)
VARIANTS = {
    "up split-decode": ("up", {"PAIR": False}, {}),
    "up pair": ("up", {}, {}),
    "up pair rows 16": ("up", {"ROWS": 16}, {}),
    "up pair rows 16 N 32 2 warps": ("up", {"ROWS": 16, "BLOCK_N": 32}, {"num_warps": 2}),
    "up pair scale prefetch": ("up", {"SCALE_PF": True}, {}),
    "up pair w prefetch": ("up", {"W_PF": True}, {}),
    "up pair N 32 2 warps": ("up", {"BLOCK_N": 32}, {"num_warps": 2}),
    "up pair N 32 2 warps K 256": ("up", {"BLOCK_N": 32, "BLOCK_K": 256}, {"num_warps": 2}),
    "up pair split 2": ("up", {"SPLIT": 2}, {}),
    "down split-decode": ("down", {"PAIR": False}, {}),
    "down pair": ("down", {}, {}),
}
_INTS = ("K", "stride_x", "N", "stride_we", "stride_wn", "stride_se", "stride_sn",
         "steps_per_split")


def compile_variant(part: str, consts: dict, options: dict):
    """(compiled kernel, weight bytes per K-loop iteration) for one variant."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashpd.kernels.moe import swapab

    fn = swapab.GEMM_KERNEL
    up = part == "up"
    const = {"SWIGLU": up, "MX_ASM": True, "UPCAST": False, "EVEN_K": True, "ROWS": 8,
             "BLOCK_N": 64, "BLOCK_K": 128, "PAIR": True, "SCALE_PF": False, "W_PF": False,
             "X_SPLIT": True, "SPLIT": 1, **consts}
    opts = {"num_warps": 4, "num_stages": 3, **options}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            sig[name] = {"xp_ptr": "*bf16", "out_ptr": "*bf16", "gamma_ptr": "*fp32",
                         "ws_ptr": "*fp32"}.get(name, "*u8" if name[:2] in (
                             "w1", "w3", "s1", "s3") else "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "limit":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in _INTS and name != "steps_per_split":
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options=opts)
    per_iter = const["BLOCK_N"] * const["BLOCK_K"] // 2 * (2 if up else 1)
    return kernel, per_iter


def main(argv: list[str] | None = None) -> int:
    from flashpd.bench.dense_fp8_sass import analyse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--try", dest="tries", nargs="*", default=[], metavar="JSON",
                    help='["up", {"BLOCK_N": 32}, {"num_warps": 2}]')
    args = ap.parse_args(argv)
    variants = dict(VARIANTS)
    variants.update({t: tuple(json.loads(t)) for t in args.tries})
    print("| variant | regs | stack B | smem KiB | mma | loop instr | loop i/B |")
    print("|---|---|---|---|---|---|---|")
    for name, (part, consts, options) in variants.items():
        try:
            r = analyse(*compile_variant(part, consts, options))
            print(f"| {name} | {r['regs']} | {r['stack']} | {r['smem_kib']:.1f} | {r['mma']} | "
                  f"{r['loop_instr']} | {r['loop_i_per_B']:.3f} |", flush=True)
        except Exception as exc:  # one variant's failure must not hide the others
            print(f"| {name} | FAILED {type(exc).__name__}: {str(exc)[:120]} | | | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
