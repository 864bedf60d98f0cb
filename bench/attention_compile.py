"""Offline sm_90 compile report of the packed-attention kernels (no GPU needed).

    python -m flashpd.bench.attention_compile [--variants V ...] [--fmt 0|1] [--partial]

Compiles the heads-as-M kernel (or, for heads_vsplit variants, _heads_vsplit_kernel) of each
`attention_bench.PREFILL_VARIANTS` entry for an H100/H200 (Triton's bundled ptxas, target
sm_90) at the bench shapes (d = 512, 64 heads, RoPE on 64 channels; arguments specialised as
the bench's are, strides and row counts divisible by 16) and prints, per variant, what
`cuobjdump` reads from the cubin: registers, stack (spill) bytes, shared memory, and for each
key loop (window, compressed) the SASS instructions per thread per tile with the local-memory
(LDL/STL) and HGMMA counts. Two resident programs per SM need <= 65,536 registers
(warps x 32 x registers, rounded up to 8) and <= 228 KB of shared memory (+1 KB each).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # before flashpd.kernels: compile, do not interpret

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

PTRS = {"q_ptr": "*bf16", "out_ptr": "*bf16", "stage_ptr": "*bf16", "sink_ptr": "*fp32",
        "cos_ptr": "*fp32", "sin_ptr": "*fp32", "win_ptr": "*u8", "win16_ptr": "*i16",
        "win_rows_ptr": "*i32", "comp_ptr": "*u8", "comp16_ptr": "*i16",
        "comp_rows_ptr": "*i32", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
        "count_ptr": "*i32"}
INTS = {"stride_cs": "i32", "stride_win": "i32", "W": "i32", "stride_comp": "i32",
        "KC": "i32", "H": "i32", "tiles_per_split": "i32", "scale": "fp32"}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")


def compile_variant(over: dict, fmt: int = 1, partial: bool = False):
    """The compiled kernel a bench-shape launch with CONFIG updated by `over` would run."""
    from flashpd.kernels.attention import triton as at

    cfg = dict(at.CONFIG, **over)
    vsplit = cfg["heads_vsplit"] and not partial
    kernel = at.HEADS_VSPLIT_KERNEL if vsplit else at.HEADS_KERNEL
    const = dict(D=512, ROPE_PAIRS=32, COMP_FMT=fmt, HB=64, ASM=True, UPCAST=False, HW=True,
                 BLOCK_N=cfg["heads_vsplit_block_n"] if vsplit else
                 cfg["heads_split_block_n"] if partial else cfg["heads_block_n"],
                 PARTIAL=partial, PREFETCH=bool(cfg["heads_prefetch"]),
                 TAU=float(cfg["heads_rescale_tau"]), TRANS=bool(cfg["heads_trans_s"]),
                 FUSED=partial and bool(cfg["fused_combine"]),
                 CH=min(cfg["combine_heads"], 64), OUT_BF16=True)
    sig, attrs, constexprs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in PTRS or name in INTS:
            sig[name] = PTRS.get(name) or INTS[name]
            if name != "scale" and not (partial and name == "tiles_per_split"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "constexpr"
            constexprs[name] = const[name]
    warps = cfg["heads_vsplit_warps"] if vsplit else cfg["heads_warps"]
    stages = cfg["heads_split_stages"] if partial else cfg["heads_stages"]
    return triton.compile(ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages,
                                       enable_fp_fusion=False))


def report(compiled) -> dict:
    """cuobjdump's resource line and per-loop SASS counts of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    out = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", res)}
    out["smem"] = compiled.metadata.shared
    ins = [(int(a, 16), t.strip()) for a, t in
           re.findall(r"/\*([0-9a-f]{4,6})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in ins:  # a backward branch closes a loop
        m = re.search(r"BRA\s+.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                                      for t in body)
            loops.append({"instr": len(body), "LDL": ops["LDL"], "STL": ops["STL"],
                          "HGMMA": ops["HGMMA"], "BAR": ops["BAR"]})
    out["loops"] = loops
    return out


def main(argv=None) -> None:
    from flashpd.bench.attention_bench import PREFILL_VARIANTS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="*", help="attention_bench prefill variants "
                    "(default: all heads and vsplit ones)")
    ap.add_argument("--fmt", type=int, default=1, help="compressed records: 1 NVFP4, 0 FP8")
    ap.add_argument("--partial", action="store_true", help="the split-KV (decode) variant")
    args = ap.parse_args(argv)
    names = args.variants or [n for n in PREFILL_VARIANTS if n.startswith(("heads", "vsplit"))]
    print("| variant | regs | stack B | smem KB | loop instr/thread/tile (LDL, HGMMA) |")
    print("|---|---|---|---|---|")
    for name in names:
        r = report(compile_variant(PREFILL_VARIANTS[name], args.fmt, args.partial))
        loops = "; ".join(f"{lp['instr']} ({lp['LDL']}, {lp['HGMMA']})" for lp in r["loops"])
        print(f"| {name} | {r['REG']} | {r['STACK']} | {r['smem'] / 1024:.0f} | {loops} |",
              flush=True)


if __name__ == "__main__":
    main()
