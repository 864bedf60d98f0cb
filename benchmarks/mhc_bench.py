"""mHC kernel microbenchmark at the bench preset's shapes (bench/results/h200/mhc.md).

Checks `kernels/mhc/triton.py` against `kernels/mhc/ref.py` (norm-relative errors, the
tolerances of kernels/verify_cases.py), checks that a token's results are the same bits alone
and in a decode batch and for every prefill grid, then times, in us per call, with every call
of a site captured in one CUDA graph (replays timed with events, median):

    mixes   hc_mixes (the launch the model made per site before the fused steps)
    fused   expand_mix_collapse(y, ...) with collapse + RMSNorm (steps 4-6 of a layer)
    seam    expand_mix_collapse(None, ...) with collapse + RMSNorm (the attention site)
    layer   a layer's mHC work as model/model.py runs it: seam step, fused step, expand
            (before and after: the same launches through the previous / current kernels)

for T tokens per call; below 4096 tokens a graph cycles over 40 sites with their own fn and
streams (fn is 2 MB: the 80 of a forward do not stay in L2). `--before FILE` times a saved
copy of the previous kernels beside the current ones.

    python benchmarks/mhc_bench.py --before .mhc_before/mhc_before.py --out $OUT
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  (before any kernel import)
import triton
import triton.language as tl
# isort: on

from flashpd.bench import kernel_roofline as kr
from flashpd.kernels import configs, dispatch
from flashpd.kernels.dense import ref as dref
from flashpd.kernels.dense import triton as dt
from flashpd.kernels.mhc import ref as href
from flashpd.kernels.mhc import triton as mhc_triton
from flashpd.kernels.verify import errors

TOKENS = (1, 8, 64, 4096)
DEVICE = triton_runtime.kernel_device()  # CPU under the interpreter (a dry run of the script)
ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-20
# prefill launch variants timed at `--big` tokens (fused step): name -> MhcConfig overrides
VARIANTS = {
    "bt64 bd32 w8 s3 auto": {},
    "bt64 bd32 w8 s3 grid1": {"prefill_grid": 1},
    "bt64 bd32 w8 s3 grid2": {"prefill_grid": 2},
    "bt16 bd32 w4 s3 (decode tiles)": {"prefill_block_t": 16, "prefill_warps": 4},
    "bt32 bd32 w8 s3": {"prefill_block_t": 32},
}
# decode variants timed at 1, 8 and 64 tokens, each checked against the ref and for batch
# invariance (MhcConfig overrides of the defaults; bench/results/h200/mhc_decode.md): pin = the MMA
# operand X' converted once instead of recomputed in every warp, red = slice vectors loaded at
# once by the last program, spin = every program normalises its own slice, sk_tok = Sinkhorn on
# per-token vectors, split = slices of D, warps = per program
DECODE_VARIANTS = {
    "default": {},
    "before (no pin, red 40, no spin, tile Sinkhorn)": {
        "decode_pin": False,
        "red": 40,
        "decode_spin": False,
        "decode_sk_tok": False,
    },
    "Sinkhorn per token": {"decode_sk_tok": True},
    "no pin": {"decode_pin": False},
    "no spin": {"decode_spin": False},
    "no spin, 8 warps": {"decode_spin": False, "decode_warps": 8},
    "split 40": {"decode_split": 40},
}
DECODE_MODES = ("seam", "fused")


class Launch:
    """The mHC kernels with the configs of the variant being timed: `apply` / `restore` switch
    the configs, `ht` is the kernel module bound to them (the kernels hold no tuning state)."""

    def __init__(self) -> None:
        self.tuned = configs.DEFAULT

    @property
    def ht(self):
        return dispatch.bind(mhc_triton, self.tuned)

    def plan(self, num_tokens: int, dim: int) -> dict:
        return mhc_triton.launch_plan(num_tokens, dim, self.tuned.mhc)

    def set(self, **fields) -> None:
        self.tuned = configs.override(self.tuned, mhc=fields)


LAUNCH = Launch()


def apply(over: dict) -> configs.KernelConfigs:
    """Run with a variant's MhcConfig overrides (of the defaults); returns what restores the
    configs before."""
    saved = LAUNCH.tuned
    LAUNCH.tuned = configs.override(configs.DEFAULT, mhc=over)
    return saved


def restore(saved: configs.KernelConfigs) -> None:
    LAUNCH.tuned = saved


def load_before(path: str):
    spec = importlib.util.spec_from_file_location("mhc_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Site:
    """One mHC site's tensors: streams, y, fn/base/scale, incoming coefficients, norm weight."""

    def __init__(self, t: int, d: int, s: int, seed: int):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        rnd = lambda *shape: torch.randn(*shape, generator=g, device=DEVICE)  # noqa: E731
        self.x = rnd(t, s, d).bfloat16()
        self.y = rnd(t, d).bfloat16()
        self.fn = rnd((2 + s) * s, s * d) * (s * d) ** -0.5
        self.base = rnd((2 + s) * s) * 0.5
        self.scale = torch.tensor([1.0, 0.5, 2.0], device=DEVICE)
        self.nw = rnd(d).bfloat16()
        self.pre, self.post, self.comb = href.hc_mixes(self.x, self.fn, self.base, self.scale, ITERS, HC_EPS, NORM_EPS)

    def args(self, y: bool, collapse: bool) -> tuple:
        return (
            self.y if y else None,
            self.x,
            self.post if y else None,
            self.comb if y else None,
            self.fn,
            self.base,
            self.scale,
            ITERS,
            HC_EPS,
            NORM_EPS,
            self.pre if collapse else None,
            self.nw if collapse else None,
        )


def calls(mod, mode: str, site: Site) -> list:
    """Zero-argument launches of one site's `mode` through the module `mod` (new or before)."""
    if mode == "mixes":
        return [lambda: mod.hc_mixes(site.x, site.fn, site.base, site.scale, ITERS, HC_EPS, NORM_EPS)]
    if mode == "mixes_it1":  # one Sinkhorn iteration: mixes - mixes_it1 = the other 19
        return [lambda: mod.hc_mixes(site.x, site.fn, site.base, site.scale, 1, HC_EPS, NORM_EPS)]
    if mode == "fused":
        return [lambda: mod.expand_mix_collapse(*site.args(True, True))]
    if mode == "seam":
        return [lambda: mod.expand_mix_collapse(*site.args(False, True))]
    if mode == "layer_before":
        a = site.args(True, True)
        return [
            lambda: dt.rms_norm(mod.collapse(site.x, site.pre), site.nw, NORM_EPS),
            lambda: mod.hc_mixes(site.x, *a[4:10]),
            lambda: mod.expand(site.y, site.x, site.post, site.comb),
            lambda: mod.hc_mixes(site.x, *a[4:10]),
            lambda: dt.rms_norm(mod.collapse(site.x, site.pre), site.nw, NORM_EPS),
            lambda: mod.expand(site.y, site.x, site.post, site.comb),
        ]
    if mode == "layer_after":
        return [
            lambda: mod.expand_mix_collapse(*site.args(False, True)),
            lambda: mod.expand_mix_collapse(*site.args(True, True)),
            lambda: mod.expand(site.y, site.x, site.post, site.comb),
        ]
    raise ValueError(mode)


@triton.jit
def _touch_kernel(ptr):
    tl.store(ptr + tl.program_id(0), tl.program_id(0))


def launch_floor_us(programs: int = 80, n: int = 40) -> float:
    """us per launch of a kernel that only stores its program id, `programs` programs, n
    launches captured in one graph: the launch and drain part of every decode call."""
    buf = torch.zeros(programs, dtype=torch.int32, device=DEVICE)
    return time_us([lambda: _touch_kernel[(programs,)](buf) for _ in range(n)])


def time_us(fns: list, reps: int = 20) -> float:
    """us per entry of `fns`, all captured in one CUDA graph (NaN under the interpreter)."""
    return kr.graph_us(fns, DEVICE, reps)


def check(site: Site, t: int) -> list[dict]:
    """The fused step and the plain mixes against the ref sequence (verify_cases tolerances)."""
    rows = []
    xn_ref = href.expand(site.y, site.x, site.post, site.comb)
    ref = href.hc_mixes(xn_ref, site.fn, site.base, site.scale, ITERS, HC_EPS, NORM_EPS)
    xc_ref = dref.rms_norm(href.collapse(xn_ref, site.pre), site.nw, NORM_EPS)
    xn, pre, post, comb, xc = LAUNCH.ht.expand_mix_collapse(*site.args(True, True))
    for name, got, want, tol in (
        ("fused X'", xn, xn_ref, 8e-3),
        ("fused pre/post", torch.cat((pre, post), 1), torch.cat(ref[:2], 1), 1e-4),
        ("fused comb", comb, ref[2], 1e-4),
        ("fused collapse+norm", xc, xc_ref, 2e-2),
    ):
        rows.append({"T": t, "check": name, "rel_err": errors(got, want)[1], "tol": tol})
    mref = href.hc_mixes(site.x, site.fn, site.base, site.scale, ITERS, HC_EPS, NORM_EPS)
    mix = LAUNCH.ht.hc_mixes(site.x, site.fn, site.base, site.scale, ITERS, HC_EPS, NORM_EPS)
    rows.append(
        {
            "T": t,
            "check": "mixes pre/post/comb",
            "rel_err": max(errors(a, b)[1] for a, b in zip(mix, mref, strict=True)),
            "tol": 1e-4,
        }
    )
    seam = LAUNCH.ht.expand_mix_collapse(*site.args(False, True))
    sref = dref.rms_norm(href.collapse(site.x, site.pre), site.nw, NORM_EPS)
    rows.append({"T": t, "check": "seam collapse+norm", "rel_err": errors(seam[4], sref)[1], "tol": 2e-2})
    rows.append(
        {
            "T": t,
            "check": "expand",
            "rel_err": errors(LAUNCH.ht.expand(site.y, site.x, site.post, site.comb), xn_ref)[1],
            "tol": 8e-3,
        }
    )
    for r in rows:
        r["ok"] = r["rel_err"] <= r["tol"]
    return rows


def decode_invariance(d: int, s: int) -> bool:
    """A token's results (fused step, and the seam step) are the same bits alone, in a batch of
    8 and in a batch of 64 (decode tiles)."""
    site = Site(64, d, s, 7)
    same = True
    for y in (True, False):
        args = site.args(y, True)
        batch = LAUNCH.ht.expand_mix_collapse(*args)
        for i in (0, 5, 37, 63):
            for lo, hi in ((i, i + 1), (i - i % 8, i - i % 8 + 8)):
                part = [a[lo:hi] if j in (0, 1, 2, 3, 10) and a is not None else a for j, a in enumerate(args)]
                got = LAUNCH.ht.expand_mix_collapse(*part)
                same &= all(torch.equal(a[i : i + 1], b[i - lo : i - lo + 1]) for a, b in zip(batch, got, strict=True))
    return bool(same)


def invariance(d: int, s: int, big_t: int, prefill: bool = True) -> list[dict]:
    """Bits of a token alone vs in a batch (decode), and over prefill grids (--big tokens)."""
    out = [{"check": "decode: row alone == in a batch of 8 == in a batch of 64", "ok": decode_invariance(d, s)}]
    if not prefill:
        return out
    big = Site(big_t, d, s, 8)
    runs = []
    for grid in (1, 2, None):
        LAUNCH.set(prefill_grid=grid)
        runs.append(LAUNCH.ht.expand_mix_collapse(*big.args(True, True)))
    LAUNCH.set(prefill_grid=None)
    same = all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run, strict=True))
    out.append({"check": f"prefill {big_t}: grid 1 == grid 2 == auto (bits)", "ok": bool(same)})
    return out


def decode_variants(d: int, s: int, checks: list, rounds: int) -> list[dict]:
    """Each decode variant at 1, 8 and 64 tokens: seam and fused us per call (timed `rounds`
    times, the variants interleaved; median), checked against the ref at every T and for batch
    invariance (its rows appended to `checks`, tagged with the variant)."""
    rows = []
    for t in (1, 8, 64):
        sites = [Site(t, d, s, 300 + i) for i in range(40 if DEVICE.type == "cuda" else 1)]
        got: dict = {name: {m: [] for m in DECODE_MODES} for name in DECODE_VARIANTS}
        ok = dict.fromkeys(DECODE_VARIANTS, True)
        for r in range(rounds):
            for name, over in DECODE_VARIANTS.items():
                saved = apply(over)
                for mode in DECODE_MODES:
                    got[name][mode].append(time_us([f for st in sites for f in calls(LAUNCH.ht, mode, st)]))
                if r == 0:
                    new = [dict(c, variant=name) for c in check(sites[0], t)]
                    if t == 64:
                        new.append(
                            {"variant": name, "check": "decode invariance (bits)", "ok": decode_invariance(d, s)}
                        )
                    checks += new
                    ok[name] = all(c["ok"] for c in new)
                restore(saved)
        for name, over in DECODE_VARIANTS.items():
            saved = apply(over)
            row = {"variant": f"decode {name}", "T": t, "plan": LAUNCH.plan(t, d), "ok": ok[name]}
            restore(saved)
            for mode in DECODE_MODES:
                vals = sorted(got[name][mode])
                row[f"{mode}_us"] = vals[(len(vals) - 1) // 2]  # median (the lower of 2)
                row[f"{mode}_all"] = got[name][mode]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "plan"}), flush=True)
        del sites
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def warm(job: str, before: str | None, d: int, s: int) -> None:
    """Compile one variant (a subprocess each, in parallel; Triton's cache keeps them)."""
    kind, mode, variant = job.split(":")
    site = Site(80 if variant in VARIANTS else 2, d, s, 1)
    if kind == "before":
        mod = load_before(before)
    else:
        if variant in DECODE_VARIANTS or variant == "decode":
            apply(DECODE_VARIANTS.get(variant, {}))
            LAUNCH.set(decode_rows=1 << 30)
        else:
            apply(VARIANTS[variant])
            LAUNCH.set(decode_rows=0)
        mod = LAUNCH.ht
    for f in calls(mod, mode, site):
        f()
    torch.cuda.synchronize()


def warm_all(
    before: str | None, d: int, s: int, variants: bool = True, prefill_variants: bool = True, decode_only: bool = False
) -> float:
    first = next(iter(VARIANTS))
    jobs = [f"new:{m}:{v}" for m in ("mixes", "seam", "fused") for v in ("decode",) + (() if decode_only else (first,))]
    if variants and prefill_variants and not decode_only:
        jobs += [
            f"new:{m}:{v}"
            for m in ("mixes", "fused")
            for v in VARIANTS
            if "grid" not in v and "auto" not in v and "decode tiles" not in v
        ]
    if variants:
        jobs += [f"new:{m}:{v}" for m in DECODE_MODES for v in DECODE_VARIANTS if v != next(iter(DECODE_VARIANTS))]
    jobs += ["new:layer_after:decode", "new:mixes_it1:decode"]
    if before:
        jobs += [f"before:{m}:x" for m in ("mixes", "fused", "layer_after")]
    if DEVICE.type != "cuda":
        return 0.0
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen([sys.executable, __file__, "--warm", j, *(["--before", before] if before else [])])
        for j in jobs
    ]
    bad = [j for j, p in zip(jobs, procs, strict=True) if p.wait() != 0]
    if bad:
        print("warm-up failed:", bad, flush=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a saved copy of the previous kernels/mhc/triton.py")
    ap.add_argument("--out", default=".", help="folder for mhc.json / mhc_table.md")
    ap.add_argument("--warm", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    ap.add_argument("--dim", type=int, help="D other than the bench preset's (dry runs)")
    ap.add_argument("--big", type=int, default=8192, help="tokens of the prefill variants")
    ap.add_argument("--no-variants", action="store_true", help="the before/after table only")
    ap.add_argument(
        "--no-prefill-variants",
        action="store_true",
        help="decode variants only (the prefill ones at --big tokens are skipped)",
    )
    ap.add_argument(
        "--decode-only", action="store_true", help="no prefill-size compiles, rows, variants or grid checks"
    )
    ap.add_argument(
        "--rounds", type=int, default=2, help="times each decode variant is timed (interleaved; the median is kept)"
    )
    args = ap.parse_args()
    if args.decode_only:
        args.tokens = [t for t in args.tokens if t <= 64]
    try:
        from flashpd.model.presets import preset_config

        cfg = preset_config("bench")
        dim, s = cfg.hidden_size, cfg.hc_mult
    except Exception as exc:  # noqa: BLE001  (a tree mid-edit elsewhere: the preset's numbers)
        print(f"preset_config failed ({exc!r}): D=5120, S=4", flush=True)
        dim, s = 5120, 4
    d = args.dim or dim
    if args.warm:
        warm(args.warm, args.before, d, s)
        return
    warm_s = warm_all(args.before, d, s, not args.no_variants, not args.no_prefill_variants, args.decode_only)
    print(f"parallel compile {warm_s:.1f} s", flush=True)
    before = load_before(args.before) if args.before else None
    result = {
        "preset": "bench",
        "D": d,
        "S": s,
        "config": configs.DEFAULT.mhc.as_dict(),
        "checks": [],
        "times": [],
        "variants": [],
        "warm_s": warm_s,
    }
    for t in args.tokens:
        n_sites = 40 if t < 4096 and DEVICE.type == "cuda" else 2
        sites = [Site(t, d, s, 100 + i) for i in range(n_sites)]
        result["checks"] += check(sites[0], t)
        row = {"T": t, "plan": LAUNCH.plan(t, d)}
        for mode in ("mixes", "fused"):
            row[f"{mode}_after"] = time_us([f for st in sites for f in calls(LAUNCH.ht, mode, st)])
            if before:
                row[f"{mode}_before"] = time_us([f for st in sites for f in calls(before, mode, st)])
        if t <= 64:  # where a decode call's time goes: Sinkhorn, collapse + norm, expand
            for mode in ("seam", "mixes_it1"):
                row[f"{mode}_after"] = time_us([f for st in sites for f in calls(LAUNCH.ht, mode, st)])
        row["layer_after"] = time_us([f for st in sites for f in calls(LAUNCH.ht, "layer_after", st)]) * 3
        if before:  # the same three launches through the previous kernels
            row["layer_before"] = time_us([f for st in sites for f in calls(before, "layer_after", st)]) * 3
        result["times"].append(row)
        print(json.dumps(row), flush=True)
        del sites
        torch.cuda.empty_cache()
    skip = args.no_variants or args.no_prefill_variants or args.decode_only
    big = [] if skip else [Site(args.big, d, s, 200 + i) for i in range(2)]
    for name, over in ({} if skip else VARIANTS).items():
        if LAUNCH.plan(1, d)["nsl"] % (over.get("prefill_grid") or 1):
            continue
        saved = apply(over)
        us = time_us([f for st in big for f in calls(LAUNCH.ht, "fused", st)])
        mix_us = time_us([f for st in big for f in calls(LAUNCH.ht, "mixes", st)])
        result["variants"].append(
            {"variant": name, "fused_us_8192": us, "mixes_us_big": mix_us, "plan": LAUNCH.plan(args.big, d)}
        )
        restore(saved)
        print(name, f"fused {us:.1f} us, mixes {mix_us:.1f} us", flush=True)
    del big
    if not args.no_variants:
        result["variants"] += decode_variants(d, s, result["checks"], args.rounds)
    result["launch_floor_us"] = {str(p): launch_floor_us(p) for p in (80, 320)}
    print("launch floor (us per launch, graph):", result["launch_floor_us"], flush=True)
    result["checks"] += invariance(d, s, args.big, prefill=not args.decode_only)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mhc.json").write_text(json.dumps(result, indent=1))
    lines = [
        "| T | mixes before | mixes after | fused before | fused after | layer before | layer after |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["times"]:
        lines.append(
            f"| {r['T']} | "
            + " | ".join(
                f"{r.get(k, float('nan')):.1f}"
                for k in ("mixes_before", "mixes_after", "fused_before", "fused_after", "layer_before", "layer_after")
            )
            + " |"
        )
    lines += ["", "| check | variant | T | rel err | tol | ok |", "|---|---|---|---|---|---|"]
    for c in result["checks"]:
        lines.append(
            f"| {c['check']} | {c.get('variant', '')} | {c.get('T', '')} | "
            f"{c.get('rel_err', 0):.2e} | {c.get('tol', '')} | {c['ok']} |"
        )
    lines += ["", f"| prefill variant ({args.big} tokens) | fused us | mixes us |", "|---|---|---|"]
    lines += [
        f"| {v['variant']} | {v['fused_us_8192']:.1f} | {v['mixes_us_big']:.1f} |"
        for v in result["variants"]
        if "fused_us_8192" in v
    ]
    lines += [
        "",
        "| decode variant | T | seam us | fused us | all rounds (seam; fused) | checks ok |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {v['variant']} | {v['T']} | {v['seam_us']:.1f} | {v['fused_us']:.1f} | "
        f"{' '.join(f'{x:.1f}' for x in v['seam_all'])}; "
        f"{' '.join(f'{x:.1f}' for x in v['fused_all'])} | {v['ok']} |"
        for v in result["variants"]
        if "seam_us" in v
    ]
    lines += [
        "",
        "launch floor, us per launch of an 80 / 320-program kernel that stores one "
        "word per program (graph): " + " / ".join(f"{v:.1f}" for v in result["launch_floor_us"].values()),
    ]
    (out / "mhc_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("ALL CHECKS OK" if all(c["ok"] for c in result["checks"]) else "SOME CHECKS FAILED")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
