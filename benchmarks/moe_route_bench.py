"""MoE router and pair-sort microbenchmark at the bench preset's shapes (results/h200/latency.md).

Checks `kernels/moe/triton.py`'s `route` against `moe/ref.py` (expert ids equal, weights within
1e-5) and the one-launch `sort_pairs` against its torch chain (prefill path: the same rows,
gamma, pos and tiles), then times, in us per call, every call of a size captured in one CUDA
graph (median of 20 replays): a graph cycles over `--sites` gate weights (more than L2 holds,
as in a decode step, where each layer's gate comes from memory).

    route    x [T, D] -> ids, weights   (router variants: ROUTER_SPLIT x BLOCK_K)
    sort     ids [T, 6] -> SortedPairs  (block_m of the expert path that T takes)

`--before FILE` times a saved copy of the previous kernels/moe/triton.py beside the current one.
`--fused` times only the gate as the decode MoE runs it, route + sort_pairs (two launches) against
route_sorted with MoeConfig.fused_gate on (one launch: the router's last token block sorts the pairs), at
the swap-AB path's block_m, after checking the fused outputs identical and the counters zero.

    python benchmarks/moe_route_bench.py --before .mhc_before/moe_head.py --out $OUT
    python benchmarks/moe_route_bench.py --fused --tokens 1 8 64 --out $OUT
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  (before any kernel import)
# isort: on

from flashpd.bench import kernel_roofline as kr
from flashpd.kernels import configs
from flashpd.kernels.configs import DEFAULT, KernelConfigs
from flashpd.kernels.dense import triton as dt
from flashpd.kernels.moe import gemv, swapab
from flashpd.kernels.moe import ref as mref
from flashpd.kernels.moe import triton as mt

DEVICE = triton_runtime.kernel_device()
TOKENS = (1, 8, 64)
# router variants: name -> (ROUTER_SPLIT, BLOCK_K); the first is the module's default
ROUTER_VARIANTS = {
    f"split{s} bk{k}": (s, k) for s, k in ((mt.ROUTER_SPLIT, mt.ROUTER_BLOCK_K), (20, 128), (40, 128), (80, 64))
}
# sort variants: name -> (tokens per counting step, warps); the first is the module's default
SORT_VARIANTS = {
    f"count{c} w{w}": (c, w) for c, w in ((mt.SORT_COUNT_T, mt.SORT_WARPS), (16, 4), (32, 4), (64, 4), (64, 8))
}


def load(path: str):
    spec = importlib.util.spec_from_file_location("moe_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def time_us(fns: list, reps: int = 20) -> float:
    """us per entry of `fns`, all captured in one CUDA graph (NaN under the interpreter)."""
    return kr.graph_us(fns, DEVICE, reps)


def block_m(t: int, experts: int, top_k: int, tuned: KernelConfigs = DEFAULT) -> int:
    """The sort's tile rows on the expert path T tokens of plain (non-MXFP4) experts take
    (moe/triton.py expert_path: the GEMV bound, else the grouped GEMMs)."""
    m = tuned.moe
    if m.gemv and t <= m.gemv_max_rows:
        return gemv.tile_rows(t, m.gemv_tiles)
    return dt.block_m_for(max(1, t * top_k // experts), tuned.dense)


def gate_block_m(t: int, experts: int, top_k: int, tuned: KernelConfigs = DEFAULT) -> int:
    """The sort's tile rows of the bench preset's decode path (MXFP4 experts: swap-AB up to
    swapab_max_tokens tokens; moe/triton.py expert_path)."""
    if t <= tuned.moe.swapab_max_tokens:
        return swapab.tile_rows(t, tuned.moe.swapab)
    return block_m(t, experts, top_k, tuned)


def same_pairs(a: mt.SortedPairs, b: mt.SortedPairs) -> bool:
    sa, sb = a.schedule, b.schedule
    return (
        torch.equal(a.rows, b.rows)
        and torch.equal(a.gamma, b.gamma)
        and torch.equal(a.pos, b.pos)
        and sa.block_m == sb.block_m
        and torch.equal(sa.expert, sb.expert)
        and torch.equal(sa.start, sb.start)
        and torch.equal(sa.end, sb.end)
    )


def gate_rows(x, gates, bias, experts: int, top_k: int, t: int, result: dict) -> dict:
    """us per gate call, route + sort_pairs against the fused route_sorted (checked first)."""
    bm = gate_block_m(t, experts, top_k)
    # every T fused (the bound's data)
    fused = configs.override(
        DEFAULT, moe={"fused_gate": True, "fused_gate_max_tokens": max(t, DEFAULT.moe.fused_gate_max_tokens)}
    )
    ok = True
    for w in gates[:4]:
        ids, gam, pairs = mt.route_sorted(x, w, bias, top_k, 1.5, 1.0, True, bm, tuned=fused)
        zero = not bool(triton_runtime.arrival_counters(x.device).any())
        rids, rgam = mt.route(x, w, bias, top_k, 1.5)
        ok &= (
            zero
            and bool(torch.equal(ids, rids))
            and bool(torch.equal(gam, rgam))
            and same_pairs(pairs, mt.sort_pairs(rids, rgam, experts, bm))
        )
    result["checks"].append(
        {"T": t, "check": f"fused gate (block_m {bm}) == route + sort_pairs, counters zero", "ok": bool(ok)}
    )

    def two(w):
        ids, gam = mt.route(x, w, bias, top_k, 1.5)
        return mt.sort_pairs(ids, gam, experts, bm)

    row = {"T": t, "gate route+sort": time_us([lambda w=w: two(w) for w in gates])}
    row["gate fused"] = time_us(
        [lambda w=w: mt.route_sorted(x, w, bias, top_k, 1.5, 1.0, True, bm, tuned=fused) for w in gates]
    )
    return row


def set_router(split: int, bk: int) -> tuple[int, int]:
    saved = (mt.ROUTER_SPLIT, mt.ROUTER_BLOCK_K)
    mt.ROUTER_SPLIT, mt.ROUTER_BLOCK_K = split, bk
    return saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a saved copy of the previous kernels/moe/triton.py")
    ap.add_argument("--out", default=".", help="folder for moe_route.json")
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    ap.add_argument("--dim", type=int, help="D other than the bench preset's (dry runs)")
    ap.add_argument("--sites", type=int, default=128, help="gate weights a graph cycles over")
    ap.add_argument("--sort-only", action="store_true", help="time the default router only")
    ap.add_argument(
        "--fused", action="store_true", help="time only the gate: route + sort_pairs against the fused route_sorted"
    )
    args = ap.parse_args()
    try:
        from flashpd.model.presets import preset_config

        cfg = preset_config("bench")
        dim, experts, top_k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    except Exception as exc:  # noqa: BLE001  (a tree mid-edit elsewhere: the preset's numbers)
        print(f"preset_config failed ({exc!r}): D=5120, E=64, k=6", flush=True)
        dim, experts, top_k = 5120, 64, 6
    d = args.dim or dim
    sites = args.sites if DEVICE.type == "cuda" else 2
    before = load(args.before) if args.before else None
    g = torch.Generator(device=DEVICE).manual_seed(0)
    gates = [(torch.randn(experts, d, generator=g, device=DEVICE) * d**-0.5).bfloat16() for _ in range(sites)]
    bias = torch.randn(experts, generator=g, device=DEVICE) * 0.1
    result = {"D": d, "E": experts, "top_k": top_k, "sites": sites, "checks": [], "times": []}
    t_start = time.perf_counter()
    for t in args.tokens:
        x = torch.randn(t, d, generator=g, device=DEVICE).bfloat16()
        if args.fused:
            result["times"].append(gate_rows(x, gates, bias, experts, top_k, t, result))
            print(json.dumps(result["times"][-1]), flush=True)
            continue
        row = {"T": t}
        for name, (split, bk) in list(ROUTER_VARIANTS.items())[: 1 if args.sort_only else None]:
            saved = set_router(split, bk)
            ok = True
            for w in gates[:4]:
                ids, gam = mt.route(x, w, bias, top_k, 1.5)
                rids, rgam = mref.route(x, w, bias, top_k, 1.5)
                ok &= bool(torch.equal(ids, rids)) and bool(torch.allclose(gam, rgam, rtol=1e-5, atol=1e-6))
            result["checks"].append({"T": t, "check": f"route {name} == ref", "ok": ok})
            row[f"route {name}"] = time_us([lambda w=w, x=x: mt.route(x, w, bias, top_k, 1.5) for w in gates])
            set_router(*saved)
        if before is not None:
            row["route before"] = time_us([lambda w=w, x=x: before.route(x, w, bias, top_k, 1.5) for w in gates])
        # sort: ids of 40 layers' gates
        bm = block_m(t, experts, top_k)
        routed = [mt.route(x, w, bias, top_k, 1.5) for w in gates[:40]]
        for name, (count_t, warps) in SORT_VARIANTS.items():
            saved = (mt.SORT_COUNT_T, mt.SORT_WARPS)
            mt.SORT_COUNT_T, mt.SORT_WARPS = count_t, warps
            ok = True
            for ids, gam in routed[:4]:
                got = mt.sort_pairs(ids, gam, experts, bm)
                limit, mt.SORT_KERNEL_MAX_TOKENS = mt.SORT_KERNEL_MAX_TOKENS, 0
                want = mt.sort_pairs(ids, gam, experts, bm)
                mt.SORT_KERNEL_MAX_TOKENS = limit
                tiles = lambda s: [
                    (int(a), int(b), int(c))
                    for a, b, c in zip(s.expert, s.start, s.end, strict=True)  # noqa: E731
                    if b < c
                ]
                ok &= (
                    torch.equal(got.rows, want.rows)
                    and torch.equal(got.gamma, want.gamma)
                    and torch.equal(got.pos, want.pos)
                    and tiles(got.schedule) == tiles(want.schedule)
                )
            result["checks"].append({"T": t, "check": f"sort {name} (block_m {bm}) == torch chain", "ok": bool(ok)})
            row[f"sort {name}"] = time_us([lambda r=r, bm=bm: mt.sort_pairs(r[0], r[1], experts, bm) for r in routed])
            mt.SORT_COUNT_T, mt.SORT_WARPS = saved
        if before is not None:
            row["sort before"] = time_us(
                [lambda r=r, bm=bm: before.sort_pairs(r[0], r[1], experts, bm) for r in routed]
            )
        result["times"].append(row)
        print(json.dumps(row), flush=True)
    result["wall_s"] = time.perf_counter() - t_start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_route.json").write_text(json.dumps(result, indent=1))
    keys = [k for k in result["times"][0] if k != "T"]
    lines = [
        "| us per call | " + " | ".join(f"T={r['T']}" for r in result["times"]) + " |",
        "|---|" + "---|" * len(result["times"]),
    ]
    lines += [f"| {k} | " + " | ".join(f"{r[k]:.1f}" for r in result["times"]) + " |" for k in keys]
    lines += ["", "| check | T | ok |", "|---|---|---|"]
    lines += [f"| {c['check']} | {c['T']} | {c['ok']} |" for c in result["checks"]]
    (out / "moe_route_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("ALL CHECKS OK" if all(c["ok"] for c in result["checks"]) else "SOME CHECKS FAILED")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
