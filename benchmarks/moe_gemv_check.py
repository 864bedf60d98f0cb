"""Routed MXFP4 experts at decode sizes: the CUDA-core GEMV path (kernels/moe/gemv.py) against
the tensor-core grouped GEMMs it replaces, at the bench preset's shapes (64 experts, top-6,
hidden 5120, I = 2304).

    python benchmarks/moe_gemv_check.py --out DIR [--variants ...] [--budget-s S] [--smoke]

1. check: `moe.triton.routed_experts` (GEMV on) at M = 1, 4, 8, 16 tokens against the torch
   reference (moe.ref.expert_ffn on the dequantised experts, summed in ascending expert id);
   err = max|out - ref| / max|ref|.
2. time: the full routed path as served (pair sort, expert GEMMs, combine), old (GEMV off) vs
   new, at M = 1, 8, 16: median per call over CUDA-graph replays (kernel_roofline.graph_ms),
   two random routings alternating so weights stream from HBM. Then gemv CONFIG variants
   (each checked too) until --budget-s is spent.
Bytes per call: weights + scales of the experts the routings touch (mean distinct count) plus
activations in and out; % is of 4.2 TB/s. Writes moe_gemv_check.md / .json under --out.
--smoke: tiny shapes on the CPU under the Triton interpreter (checks this driver).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from flashpd.bench import kernel_roofline as kr
from flashpd.kernels import configs

COPY_GBPS = 4200.0
LIMIT = 10.0
SHAPES = {
    "full": {"hidden": 5120, "inter": 2304, "experts": 64, "top_k": 6, "check_m": (1, 4, 8, 16), "time_m": (1, 8, 16)},
    "smoke": {"hidden": 64, "inter": 32, "experts": 4, "top_k": 2, "check_m": (1, 3), "time_m": (3,)},
}
_SMOKE_TILES = {"up": {"block_n": 64}, "down": {"block_n": 64}}  # few interpreted programs
_ALL_ROWS = 1 << 30
# name -> GemvConfig overrides ("up" / "down" merged into the defaults), the Ms it times
VARIANTS = {
    "rows4": ({"rows": ((1, 1), (_ALL_ROWS, 4))}, (16,)),
    "rows1": ({"rows": ((_ALL_ROWS, 1),)}, (8, 16)),
    "bn32": ({"up": {"block_n": 32}, "down": {"block_n": 32}}, (1, 16)),
    "no_prefetch": ({"up": {"prefetch": False}, "down": {"prefetch": False}}, (1,)),
    "g16": ({"up": {"groups": 16}, "down": {"groups": 16}}, (1,)),
    "select": ({"decode": "select"}, (1,)),
    "bn32_w8": ({"up": {"block_n": 32, "warps": 8}, "down": {"block_n": 32, "warps": 8}}, (1,)),
}


class Bench:
    """Random MXFP4 experts (kernel_roofline.rand_mxfp4) and routings at each M."""

    def __init__(self, shape: dict):
        from flashpd.kernels.moe import triton as mt

        self.e, self.k = shape["experts"], shape["top_k"]
        self.d, self.i = shape["hidden"], shape["inter"]
        self.routed = mt.ExpertSet(
            kr.rand_mxfp4(self.i, self.d, self.e, 11),
            kr.rand_mxfp4(self.i, self.d, self.e, 12),
            kr.rand_mxfp4(self.d, self.i, self.e, 13),
        )
        ws = (self.routed.w1, self.routed.w3, self.routed.w2)
        self.per_expert = sum(kr.wbytes(w) for w in ws) / self.e
        self.gen = torch.Generator().manual_seed(17)
        self.sets: dict[int, list] = {}
        self.refs: dict[int, torch.Tensor] = {}
        # the kernel configs of the rows: `base` (the run's defaults), `tuned` (the current row)
        self.base = self.tuned = configs.DEFAULT

    def routings(self, m: int) -> tuple[torch.Tensor, list]:
        if m not in self.sets:
            x = torch.randn(m, self.d, generator=self.gen).to(torch.bfloat16).to(kr.DEV)
            sets = []
            for _ in range(2):
                ids = torch.stack([torch.randperm(self.e, generator=self.gen)[: self.k] for _ in range(m)])
                gam = torch.rand(m, self.k, generator=self.gen) * 0.3
                sets.append((ids.to(kr.DEV), gam.to(kr.DEV)))
            self.sets[m] = [x, sets]
        return self.sets[m][0], self.sets[m][1]

    def nbytes(self, m: int) -> float:
        _, sets = self.routings(m)
        distinct = statistics.mean(len(torch.unique(ids)) for ids, _ in sets)
        return distinct * self.per_expert + m * self.d * (2 + 4) + m * self.k * (self.i * 2 * 2 + self.d * 2)

    def reference(self, m: int) -> torch.Tensor:
        """moe.ref's routed sum for routing 0, FP32 [m, D] (dequantises used experts only)."""
        from flashpd.kernels.moe import ref as mref

        if m not in self.refs:
            x, sets = self.routings(m)
            ids, gam = sets[0]
            want = torch.zeros(m, self.d, dtype=torch.float32, device=kr.DEV)
            for j in torch.unique(ids).tolist():
                tok, slot = torch.nonzero(ids == j, as_tuple=True)
                w1, w3, w2 = (kr.deq_one(w, j) for w in (self.routed.w1, self.routed.w3, self.routed.w2))
                y = mref.expert_ffn(x[tok], w1, w3, w2, LIMIT, gam[tok, slot][:, None])
                want.index_add_(0, tok, y.float())
            self.refs[m] = want
        return self.refs[m]

    def use(self, **moe) -> None:
        """The rows from now on run with the base configs' MoE fields `moe` replaced (mappings
        and the nested gemv_tiles / swapab configs merged)."""
        self.tuned = configs.merge(self.base, moe=moe)

    def kernels_row(self, m: int, path: str = "gemv") -> dict:
        """gemv / swapab `expert_rows` alone (prep + up + down; pairs sorted outside, no
        combine), timed only."""
        from flashpd.kernels.moe import gemv, swapab
        from flashpd.kernels.moe import triton as mt

        module, cfg = (gemv, self.tuned.moe.gemv_tiles) if path == "gemv" else (swapab, self.tuned.moe.swapab)
        x, sets = self.routings(m)
        rows = module.tile_rows(m, cfg)
        pairs = [mt.sort_pairs(ids, gam, self.e, rows) for ids, gam in sets]
        calls = [lambda p=p: module.expert_rows(x, p, self.routed, LIMIT, rows, cfg=cfg) for p in pairs]
        t0 = time.perf_counter()
        for fn in calls[:1]:
            fn()
        ms = (time.perf_counter() - t0) * 1e3 if kr.DEV != "cuda" else kr.graph_ms(calls)
        gbps = self.nbytes(m) / (ms * 1e-3) / 1e9
        out = {
            "path": f"{path} kernels only (prep+up+down)",
            "m": m,
            "err": float("nan"),
            "us": ms * 1e3,
            "GBps": gbps,
            "pct": 100.0 * gbps / COPY_GBPS,
        }
        print(json.dumps(out), flush=True)
        return out

    def call(self, m: int, r: int) -> torch.Tensor:
        from flashpd.kernels.moe import triton as mt

        x, sets = self.routings(m)
        return mt.routed_experts(x, sets[r][0], sets[r][1], self.routed, LIMIT, tuned=self.tuned)

    def row(self, path: str, m: int, timed: bool) -> dict:
        t0 = time.perf_counter()
        err = kr.rel_err(self.call(m, 0), self.reference(m))
        ms = (time.perf_counter() - t0) * 1e3  # --smoke: the checked call's wall clock
        out = {"path": path, "m": m, "err": err, "us": None, "GBps": None, "pct": None}
        if timed:
            if kr.DEV == "cuda":
                ms = kr.graph_ms([lambda r=r: self.call(m, r) for r in range(2)])
            gbps = self.nbytes(m) / (ms * 1e-3) / 1e9
            out.update(us=ms * 1e3, GBps=gbps, pct=100.0 * gbps / COPY_GBPS)
        print(json.dumps(out), flush=True)
        return out


def parse_common(
    ap: argparse.ArgumentParser, argv: list[str] | None, variants: dict, budget_s: float
) -> argparse.Namespace:
    """--variants (names of `variants`, checked), --budget-s and --smoke (the options both MoE
    decode checks take), then parse."""
    ap.add_argument("--variants", nargs="*", default=list(variants))
    ap.add_argument("--budget-s", type=float, default=budget_s, help="start no variant after this many seconds")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU under the interpreter (checks the driver)"
    )
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants if v not in variants]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(variants)}")
    return args


def rows_table(rows: list[dict]) -> list[str]:
    """The markdown table of timed / checked rows (both MoE decode checks print it)."""
    lines = ["| path | M | MB | us | GB/s | % of 4.2 TB/s | err |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = f"{r['us']:.1f} | {r['GBps']:.0f} | {r['pct']:.1f}%" if r["us"] is not None else "- | - | -"
        lines.append(f"| {r['path']} | {r['m']} | {r.get('MB', 0):.1f} | {t} | {r['err']:.1e} |")
    return lines


def write_results(out_dir: str, name: str, text: str, payload: dict) -> None:
    """name.md (the text, also printed) and name.json under out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(payload, f, indent=1, default=str)
    print(text)


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# Routed MXFP4 experts, decode: GEMV (CUDA cores) vs grouped GEMMs ({meta['device']})",
        "",
        f"Command: `{meta['command']}` (commit {meta['commit']}); shapes {meta['shape']};"
        f" % of {COPY_GBPS:.0f} GB/s; MB per call = experts touched + activations;"
        f" gemv config {meta['gemv_config']}; variants (overrides): "
        + "; ".join(f"{k} {v[0]}" for k, v in VARIANTS.items()),
        "",
    ]
    return "\n".join(lines + rows_table(rows)) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = parse_common(ap, argv, VARIANTS, budget_s=45.0)
    return kr.device_main(
        "moe_gemv_check", args.smoke, lambda: _run(args, argv, SHAPES["smoke" if args.smoke else "full"])
    )


def _run(args, argv, shape: dict) -> int:
    t0 = time.perf_counter()
    bench = Bench(shape)
    bench.base = configs.merge(
        configs.DEFAULT, moe={"gemv_max_rows": max(shape["check_m"]), "gemv_tiles": _SMOKE_TILES if args.smoke else {}}
    )
    meta = kr.run_meta("moe_gemv_check", argv, shape, gemv_config=bench.base.moe.gemv_tiles.as_dict())
    rows: list[dict] = []
    for m in shape["check_m"]:  # new path, checked (and timed at time_m)
        bench.use(gemv=True)
        rows.append(bench.row("gemv (new)", m, m in shape["time_m"]))
        if m in shape["time_m"]:
            rows.append(bench.kernels_row(m))
            bench.use(gemv=False)
            rows.append(bench.row("grouped GEMM (old)", m, True))
    worst = max(r["err"] for r in rows if r["path"] == "gemv (new)")
    if worst > 5e-3:  # e.g. subnormal weights flushed: try the decode without subnormals
        print(f"WARNING: gemv err {worst:.1e}; checking decode 'select'", flush=True)
        bench.use(gemv_tiles={"decode": "select"})
        rows += [bench.row("gemv select (err check)", m, False) for m in shape["check_m"]]
    for name in args.variants[:1] if args.smoke else args.variants:
        if time.perf_counter() - t0 > args.budget_s and not args.smoke:
            print(f"budget spent: {name} and later variants not run", flush=True)
            break
        overrides, ms = VARIANTS[name]
        bench.use(gemv_tiles=overrides)
        for m in ms if not args.smoke else shape["time_m"][-1:]:
            rows.append(bench.row(f"gemv {name}", m, True))
    for r in rows:
        r["MB"] = bench.nbytes(r["m"]) / 1e6
    meta["seconds"] = time.perf_counter() - t0
    write_results(args.out, "moe_gemv_check", markdown(meta, rows), {"meta": meta, "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
