"""Offline (no GPU) compile report of the FP8 decode GEMM launches for Hopper (sm_90).

    python -m flashpd.bench.dense_fp8_sass [--variants new f8_deq ...] [--try JSON ...]
                                           [--layers wq_b ...] [--m 1 64] [--out F]

For each gemm_decode variant (its dense CONFIG overrides) and each bench-preset FP8 layer (wq_a,
wq_b, wkv, wo_a block-diagonal G=8, wo_b, idx_wq_b, the shared expert's SwiGLU and down GEMMs)
at M rows, `grouped_gemm` runs its real launch logic on empty CPU tensors with the kernel
replaced by a recorder; the recorded launch (grid, arguments, constexprs, warps, stages) is then
compiled by Triton for sm_90 with its bundled ptxas, and the binary is read back with its
bundled cuobjdump:

    regs / stack   registers per thread and stack bytes (spills; > 0 is local-memory traffic)
    smem           shared memory per program (KiB)
    mma            the MMA the PTX uses: wgmma mMnNkK (Hopper, async, operand A in registers or
                   shared memory) or mma.sync m16n8k16 (Ampere form)
    loop i/B       instructions of the K loop (the longest loop with MMAs) per weight byte it
                   streams, summed over the program's warps (the SM issues at most 4 warp-instructions per clock, and a
                   decode GEMM at the copy bandwidth must stream ~16 B per clock per SM)
    programs       grid size (programs per launch)

No timing: these are the cheap facts that decide which variants earn H200 time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections import Counter

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (set before the kernels load)

import torch  # noqa: E402

LAYERS = {  # name: (N, K, groups, swiglu) at the bench preset (bench/kernel_roofline.py)
    "wq_a": (1280, 5120, 1, False), "wq_b": (32768, 1280, 1, False),
    "wkv": (512, 5120, 1, False), "wo_a": (1024, 4096, 8, False),
    "wo_b": (5120, 8192, 1, False), "idx_wq_b": (4096, 1280, 1, False),
    "shared_up": (2304, 5120, 1, True), "shared_down": (5120, 2304, 1, False),
}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl")
_TYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
          torch.uint8: "*u8", torch.int64: "*i64"}


class _Recorder:
    """Stands in for `SPLITK_KERNEL` at its launch site: keeps the grid, arguments, keywords."""

    def __init__(self):
        self.calls: list = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def record(layer: str, rows: int, overrides: dict) -> tuple:
    """(grid, args, kwargs) of the split-K launch `grouped_gemm` makes for `layer` at `rows`."""
    from flashpd.bench import gemm_decode
    from flashpd.kernels import triton_runtime
    from flashpd.kernels.dense import triton as dt

    n, k, groups, swiglu = LAYERS[layer]
    default = {key: (dict(v) if isinstance(v, dict) else v) for key, v in dt.CONFIG.items()}
    rec, kernel, check = _Recorder(), dt.SPLITK_KERNEL, triton_runtime.check_device
    try:
        gemm_decode.apply(overrides, default)
        dt.SPLITK_KERNEL, triton_runtime.check_device = rec, (lambda *t: None)

        def weights():
            return dt.Weights.fp8(torch.empty(groups, n, k, dtype=torch.float8_e4m3fn),
                                  torch.empty(groups, -(-n // 32), -(-k // 32),
                                              dtype=torch.uint8))

        a = torch.empty(rows * groups, k, dtype=torch.bfloat16)
        out = torch.empty(rows * groups, n, dtype=torch.bfloat16)
        dt.grouped_gemm(a, weights(), None, out, w3=weights() if swiglu else None,
                        limit=10.0 if swiglu else 0.0)
    finally:
        dt.SPLITK_KERNEL, triton_runtime.check_device = kernel, check
        gemm_decode.apply({}, default)
    if len(rec.calls) != 1:
        raise RuntimeError(f"{layer} M={rows}: {len(rec.calls)} launches recorded, expected 1")
    return rec.calls[0]


def compile_launch(args: tuple, kwargs: dict):
    """Triton-compile the recorded launch for sm_90 (types and 16-divisibility as the runtime
    specialises them: every tensor is 16-byte aligned; ints divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashpd.kernels.dense import triton as dt

    fn = dt.SPLITK_KERNEL
    names = fn.arg_names
    consts = {name: v for name, v in kwargs.items() if name not in _OPTIONS}
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        if i >= len(args):  # a constexpr left at its default
            consts[name] = fn.params[i].default
            sig[name] = "constexpr"
            continue
        v = args[i]
        if isinstance(v, torch.Tensor):
            sig[name] = _TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            dns = fn.do_not_specialize
            if name not in dns and i not in dns and int(v) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {key: kwargs[key] for key in _OPTIONS if key in kwargs}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def analyse(kernel, bytes_per_loop_iter: int) -> dict:
    """Registers, stack, shared memory, MMA form and loop instructions per weight byte."""
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    forms = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
    mma = ("wgmma " + ",".join(forms)) if forms else (
        "mma.sync " + ",".join(sorted(set(re.findall(r"mma\.sync\.aligned\.(m\d+n\d+k\d+)",
                                                     ptx))))) or "none"
    if forms:
        mma += " A:" + ("regs" if re.search(r"wgmma\.mma_async[^;]*\}, \{%r", ptx) else "smem")
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    body: list = []  # the longest backward-branch loop holding MMA instructions: the K loop
    for addr, text in ins:
        tgt = re.search(r"0x([0-9a-f]+)", text) if "BRA" in text else None
        if tgt and int(tgt.group(1), 16) < addr:
            cand = [t for a, t in ins if int(tgt.group(1), 16) <= a <= addr]
            if len(cand) > len(body) and any("MMA" in t for t in cand):
                body = cand
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body)
    warps = kernel.metadata.num_warps
    return {"regs": int(use.group(1)), "stack": int(use.group(2)),
            "smem_kib": kernel.metadata.shared / 1024, "mma": mma, "loop_instr": len(body),
            "loop_i_per_B": len(body) * warps / bytes_per_loop_iter if body else None,
            "top_ops": dict(ops.most_common(8))}


def main(argv: list[str] | None = None) -> int:
    from flashpd.bench import gemm_decode

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="*",
                    default=[v for v, (_o, kinds, _m) in gemm_decode.VARIANTS.items()
                             if "fp8" in kinds and (v == "new" or v.startswith("f8_deq"))])
    ap.add_argument("--layers", nargs="*", default=list(LAYERS))
    ap.add_argument("--m", nargs="*", type=int, default=[1, 64])
    ap.add_argument("--try", dest="tries", nargs="*", default=[], metavar="JSON",
                    help='ad-hoc CONFIG["skinny"] overrides, e.g. \'{"block_n": 256}\'')
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)
    variants = {v: gemm_decode.VARIANTS[v][0] for v in args.variants}
    variants.update({t: {"skinny": json.loads(t)} for t in args.tries})
    lines = ["| variant | layer | M | programs | warps/stages | regs | stack B | smem KiB | mma "
             "| loop i/B |", "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for v, overrides in variants.items():
        for layer in args.layers:
            for m in args.m:
                try:
                    grid, a, kw = record(layer, m, overrides)
                    k = compile_launch(a, kw)
                    per_iter = kw["BLOCK_N"] * kw["BLOCK_K"] * (2 if kw["EPILOGUE"] == 1 else 1)
                    r = analyse(k, per_iter)
                    ipb = f"{r['loop_i_per_B']:.3f}" if r["loop_i_per_B"] else "-"
                    line = (f"| {v} | {layer} | {m} | {grid[0] * grid[1] * grid[2]} | "
                            f"{kw['num_warps']}/{kw['num_stages']} | {r['regs']} | "
                            f"{r['stack']} | {r['smem_kib']:.0f} | {r['mma']} | {ipb} |")
                except Exception as exc:  # one variant's failure must not hide the others
                    line = f"| {v} | {layer} | {m} | FAILED {type(exc).__name__}: " \
                           f"{str(exc)[:120]} | | | | | | |"
                lines.append(line)
                print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
