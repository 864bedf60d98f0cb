"""Routed MXFP4 experts at 2-32 pairs per expert: the swap-AB tensor-core path
(kernels/moe/swapab.py) against the grouped GEMMs (dense.grouped_gemm) and the CUDA-core GEMV,
at the bench preset's shapes (64 experts, top-6, hidden 5120, I = 2304).

    python benchmarks/moe_swapab_check.py --out DIR [--variants ...] [--budget-s S] [--smoke]

1. each M of `ms`: `moe.triton.routed_experts` as served (pair sort, both expert GEMMs,
   combine) with the swap-AB path forced (new), the grouped GEMMs (old: swap-AB bound 0, GEMV
   bound 0) and, at M <= 16, the GEMV (the default there today); err = max|out - ref| / max|ref|
   against moe.ref.expert_ffn on the dequantised experts (routing 0), median per call over
   CUDA-graph replays of two random routings alternating (kernel_roofline.graph_ms).
2. swapab CONFIG variants (each checked too) at their Ms until --budget-s is spent.
3. the compiled swap-AB kernels: MMA instructions in the PTX (wgmma / mma.sync), registers,
   spills, shared memory.
Bytes per call: weights + scales of the experts the routings touch (mean distinct count) plus
activations in and out; % is of 4.2 TB/s. Writes moe_swapab.md / .json under --out.
--smoke: tiny shapes on the CPU under the Triton interpreter (checks this driver).
"""

from __future__ import annotations

import argparse
import re
import time

from moe_gemv_check import COPY_GBPS, Bench, parse_common, rows_table, write_results

from flashpd.bench import kernel_roofline as kr
from flashpd.kernels import configs

SHAPES = {
    "full": {"hidden": 5120, "inter": 2304, "experts": 64, "top_k": 6, "ms": (8, 16, 32, 64, 128, 192)},
    "smoke": {"hidden": 64, "inter": 64, "experts": 4, "top_k": 2, "ms": (3, 9)},
}
_SMOKE_TILES = {"up": {"block_k": 64}, "down": {"block_k": 64}}
_ALL = 1 << 30
# name -> (SwapabConfig overrides, the Ms it times), on top of the default (run 1 at 280db55
# compared the "pair" decode, now the default, and others; run 2 at ae9dc55 these, before the
# config's "sizes" existed: moe_decode.md). Variants setting up / down run without "sizes"
# (variant_fields).
_W2 = {"block_n": 32, "warps": 2}
VARIANTS = {
    "split_decode": ({"decode": "split"}, (1, 64)),
    "bn32w2": ({"up": _W2, "down": _W2}, (1, 2, 4, 8, 16, 64, 128)),
    "bn16w1": ({"up": {"block_n": 16, "warps": 1}, "down": {"block_n": 16, "warps": 1}}, (1, 8, 64)),
    "up_s2": ({"up": {"split": 2}}, (1, 2, 4, 8)),
    "up_s4": ({"up": {"split": 4}}, (1, 4)),
    "up_s2_dn2": ({"up": {"split": 2}, "down": {"split": 2}}, (1, 8)),
    "bn32w2_s2": ({"up": {**_W2, "split": 2}, "down": _W2}, (1, 4, 8)),
    "bn32w2_s4d2": ({"up": {**_W2, "split": 4}, "down": {**_W2, "split": 2}}, (1, 4)),
    "nr96": ({"up": {"maxnreg": 96}}, (8, 64)),
    "nr96_d64": ({"up": {"maxnreg": 96}, "down": {"maxnreg": 64}}, (64,)),
    "bk256": ({"up": {"block_k": 256}, "down": {"block_k": 256}}, (16, 64)),
    "st4": ({"up": {"stages": 4}, "down": {"stages": 4}}, (64,)),
    "bn32w2_bk256": ({"up": {**_W2, "block_k": 256}, "down": {**_W2, "block_k": 256}}, (64,)),
    "bn32w2_st4": ({"up": {**_W2, "stages": 4}, "down": {**_W2, "stages": 4}}, (64,)),
    "pair_fold": ({"fold_prep": True}, (1,)),
    "pair_spf": ({"up": {"scale_prefetch": True}, "down": {"scale_prefetch": True}}, (64,)),
    "pair_wpf": ({"up": {"w_prefetch": True}, "down": {"w_prefetch": True}}, (64,)),
}


def variant_fields(overrides: dict) -> dict:
    """A variant's SwapabConfig fields: one that sets "up" or "down" (and no "sizes") runs
    without the per-size entries, so that it is measured as given, not shadowed by them."""
    if ("up" in overrides or "down" in overrides) and "sizes" not in overrides:
        return {**overrides, "sizes": ()}
    return overrides


def compiled_kernels() -> list[dict]:
    """MMA form, registers, spills and shared memory of every compiled swap-AB kernel."""
    from flashpd.kernels.moe import swapab

    out = []
    for k in swapab.compiled_variants():
        ptx = k.asm.get("ptx", "")
        ttgir = k.asm.get("ttgir", "")
        dot = next((ln.strip()[:240] for ln in ttgir.splitlines() if "warp_group_dot " in ln or "tt.dot " in ln), "")
        out.append(
            {
                "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                "mma_sync": len(re.findall(r"mma\.sync", ptx)),
                "regs": getattr(k, "n_regs", None),
                "spills": getattr(k, "n_spills", None),
                "shared": getattr(k.metadata, "shared", None),
                "dot": dot,
            }
        )
    return out


# MoE fields per path of the rows: which routed-expert path `routed_experts` takes
PATHS = {
    "swapab": {"gemv": False, "gemv_max_rows": 0, "swapab_max_tokens": _ALL},
    "grouped": {"gemv": False, "gemv_max_rows": 0, "swapab_max_tokens": 0},
    "gemv": {"gemv": True, "gemv_max_rows": 16, "swapab_max_tokens": 0},
}


def _variant_row(bench: Bench, name: str, m: int, smoke: bool) -> dict:
    """One variant's row; its failure is a row (one variant must not hide the others)."""
    try:
        return bench.row(f"swapab {name}", m, True)
    except Exception as exc:
        if smoke:
            raise
        print(f"variant {name} M={m} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return {"path": f"swapab {name} FAILED", "m": m, "err": float("nan"), "us": None, "GBps": None, "pct": None}


def markdown(meta: dict, rows: list[dict], kernels: list[dict]) -> str:
    lines = [
        f"# Routed MXFP4 experts, 1-192 tokens: swap-AB vs grouped GEMMs ({meta['device']})",
        "",
        f"Command: `{meta['command']}` (commit {meta['commit']}); shapes {meta['shape']};"
        f" % of {COPY_GBPS:.0f} GB/s; MB per call = experts touched + activations;"
        f" full path = pair sort + both expert GEMMs + combine; swapab config "
        f"{meta['swapab_config']}; variants (overrides): " + "; ".join(f"{k} {v[0]}" for k, v in VARIANTS.items()),
        "",
    ]
    lines += rows_table(rows)
    lines += [
        "",
        "Compiled swap-AB kernels (MMA instructions in the PTX):",
        "",
        "| wgmma | mma.sync | regs | spills | shared B | dot |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {k['wgmma']} | {k['mma_sync']} | {k['regs']} | {k['spills']} | {k['shared']} | `{k['dot'][:120]}` |"
        for k in kernels
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", nargs="*", type=int, default=None)
    ap.add_argument(
        "--paths",
        nargs="*",
        default=["swapab", "grouped", "gemv"],
        help="which paths the per-M rows time (gemv at M <= 16 only)",
    )
    args = parse_common(ap, argv, VARIANTS, budget_s=60.0)
    shape = dict(SHAPES["smoke" if args.smoke else "full"])
    if args.ms:
        shape["ms"] = tuple(args.ms)
    return kr.device_main("moe_swapab_check", args.smoke, lambda: _run(args, argv, shape))


def _run(args, argv, shape: dict) -> int:
    t0 = time.perf_counter()
    bench = Bench(shape)
    bench.base = configs.merge(configs.DEFAULT, moe={"swapab": _SMOKE_TILES if args.smoke else {}})
    meta = kr.run_meta("moe_swapab_check", argv, shape, swapab_config=bench.base.moe.swapab.as_dict())
    rows: list[dict] = []
    for m in shape["ms"]:
        for path, label in (
            ("swapab", "swapab (new)"),
            ("grouped", "grouped GEMM (old)"),
            ("gemv", "gemv (default <= 16)"),
        ):
            if path in args.paths and (path != "gemv" or m <= 16):
                bench.use(**PATHS[path])
                rows.append(bench.row(label, m, True))
        if "kernels" in args.paths and not args.smoke:
            bench.use(**PATHS["swapab"])
            rows.append(bench.kernels_row(m, "swapab"))
    for name in args.variants[:1] if args.smoke else args.variants:
        if time.perf_counter() - t0 > args.budget_s and not args.smoke:
            print(f"budget spent: {name} and later variants not run", flush=True)
            break
        overrides, ms = VARIANTS[name]
        bench.use(**PATHS["swapab"], swapab=variant_fields(overrides))
        for m in ms if not args.smoke else shape["ms"][-1:]:
            if args.ms and not args.smoke and m not in args.ms:
                continue
            rows.append(_variant_row(bench, name, m, args.smoke))
    kernels = compiled_kernels()
    for r in rows:
        r["MB"] = bench.nbytes(r["m"]) / 1e6
    meta["seconds"] = time.perf_counter() - t0
    write_results(
        args.out, "moe_swapab", markdown(meta, rows, kernels), {"meta": meta, "results": rows, "kernels": kernels}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
