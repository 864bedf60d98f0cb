"""Offline (no GPU) sm_90 compile report of the MoE router kernel, with and without the fused
pair sort (kernels/moe/triton.py `ROUTE_KERNEL`, SORT), at the bench preset's router (64
experts, top-6, BF16): registers, stack (spills), shared memory, the arrival atomics' PTX and
the number of L2 (.cg) loads. No timing.

    python -m flashpd.bench.moe_route_sass
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (set before the kernels load)

_PTRS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*fp32", "partial_ptr": "*fp32",
         "counter_ptr": "*i32", "ids_ptr": "*i64", "weights_ptr": "*fp32", "rows_ptr": "*i32",
         "gamma_ptr": "*fp32", "pos_ptr": "*i32", "t_exp_ptr": "*i32", "t_start_ptr": "*i32",
         "t_end_ptr": "*i32"}
_SORT_PTRS = ("rows_ptr", "gamma_ptr", "pos_ptr", "t_exp_ptr", "t_start_ptr", "t_end_ptr")


def compile_route(sort: bool, split: int, block_m: int = 8):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashpd.kernels.dense.triton import DOT_UPCAST
    from flashpd.kernels.moe import triton as mt

    fn = mt.ROUTE_KERNEL
    const = {"TOP_K": 6, "K_PAD": 8, "BLOCK_T": 16, "E_PAD": 64, "BLOCK_K": mt.ROUTER_BLOCK_K,
             "SPLIT": split, "IEEE": False, "UPCAST": DOT_UPCAST, "NORMALIZE": True,
             "SORT": sort, "SORT_BLOCK_T": 16, "COUNT_T": mt.SORT_COUNT_T, "BLOCK_M": block_m,
             "BLOCK_Q": 64}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in _PTRS:  # without the sort, route passes the ids (int64) for these
            sig[name] = "*i64" if name in _SORT_PTRS and not sort else _PTRS[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in ("inv_temp", "routed_scale") else "i32"
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 8, "num_stages": 3})


def main() -> int:
    from flashpd.bench.dense_fp8_sass import analyse

    print("| router | regs | stack B | smem KiB | arrival atomics | .cg loads |")
    print("|---|---|---|---|---|---|")
    for sort in (False, True):
        for split in (20, 1):
            k = compile_route(sort, split)
            r = analyse(k, 1)
            ptx = k.asm["ptx"]
            atoms = sorted({line.split()[1] for line in ptx.splitlines() if "atom." in line})
            print(f"| SPLIT {split}{' + sort' if sort else ''} | {r['regs']} | {r['stack']} | "
                  f"{r['smem_kib']:.1f} | {ptx.count('atom.')} {' '.join(atoms)} | "
                  f"{ptx.count('ld.global.cg')} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
