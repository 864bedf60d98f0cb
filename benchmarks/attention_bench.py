"""Packed sparse attention at the bench shapes: correctness and time of launch variants (GPU).

    python benchmarks/attention_bench.py [--out FILE.json] [--quick] [--variants V ...]
        [--prefill-t T ...] [--jobs N] [--verify V ...] [--budget-s S] [--check-only]
        [--fused-combine] [--decode-only]

Shapes (preset "bench"): H = 64 heads x d = 512, window W = 128 FP8 records, top-k K = 512 NVFP4
compressed records, RoPE on the last 64 channels. Prefill: T = 4096 and 8192 queries, query t's
window = pool rows t..t+127 (a sliding window), its top-k = random rows of a 4,096-entry pool.
Decode: B = 1, 8, 64 queries, each with its own random window rows and top-k rows out of an 8K
context's 4,096 entries per sequence (B x 4,096 entries, past the L2 at B = 64).

Each variant is a set of `configs.AttentionConfig` overrides. For every (variant, shape)
it checks ||out - ref|| / ||ref|| against `attention/ref.py` (on 256 sampled queries for
prefill, all for decode; the output is poisoned with NaN first) and times the call: prefill
with CUDA events (median of 5 after a warm-up), decode as CUDA-graph replays of 20 calls.
Useful FLOPs = 4 * T * H * (W + K) * d; bytes = records read + q and out (bf16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flashpd.kernels import configs
from flashpd.kernels.configs import KernelConfigs

H, D, W, K, PAIRS, ENTRIES = 64, 512, 128, 512, 32, 4096
PREFILL_T, DECODE_B = (4096, 8192), (1, 8, 64)
DEV = "cuda"

PREFILL_VARIANTS = {
    "legacy": {"legacy_max_q": 1 << 30},  # the per-head-block kernel before this change
    "heads_bn64_tau8": {"heads_rescale_tau": 8.0},
    "heads_bn64": {"heads_block_n": 64, "heads_stages": 1},
    "heads_bn64_prefetch": {"heads_block_n": 64, "heads_prefetch": True},
    "heads_bn32_prefetch": {"heads_block_n": 32, "heads_prefetch": True},
    # launch configs (num_stages > 1: Triton's pipeliner copies the gathered record bytes of
    # later tiles into shared memory with cp.async while the current tile computes)
    "heads_bn64_s2": {"heads_block_n": 64, "heads_stages": 2},
    "heads_bn64_s3": {"heads_block_n": 64, "heads_stages": 3},
    "heads_bn32": {"heads_block_n": 32, "heads_stages": 1},
    "heads_bn32_s2": {"heads_block_n": 32, "heads_stages": 2},
    "heads_bn32_s3": {"heads_block_n": 32, "heads_stages": 3},
    "heads_bn128": {"heads_block_n": 128, "heads_stages": 1},
    "heads_bn128_trans": {"heads_block_n": 128, "heads_stages": 1, "heads_trans_s": True},
    # two programs per query, each owning half of the output channels (_heads_vsplit_kernel)
    "vsplit_bn32_w4": {"heads_vsplit": True, "heads_vsplit_block_n": 32, "heads_vsplit_warps": 4},
    "vsplit_bn16_w4": {"heads_vsplit": True, "heads_vsplit_block_n": 16, "heads_vsplit_warps": 4},
    "vsplit_bn64_w4": {"heads_vsplit": True, "heads_vsplit_block_n": 64, "heads_vsplit_warps": 4},
    "vsplit_bn32_w8": {"heads_vsplit": True, "heads_vsplit_block_n": 32, "heads_vsplit_warps": 8},
    "vsplit_bn16_w8": {"heads_vsplit": True, "heads_vsplit_block_n": 16, "heads_vsplit_warps": 8},
    "vsplit_bn64_w8": {"heads_vsplit": True, "heads_vsplit_block_n": 64, "heads_vsplit_warps": 8},
    "default": {},
}
DECODE_VARIANTS = {
    "legacy": {"legacy_max_q": 1 << 30},  # per-head-block kernel + its split-KV path
    "heads_t132_bn64": {"legacy_max_q": 0, "heads_split_target": 132},
    "heads_t132_bn32": {"legacy_max_q": 0, "heads_split_target": 132, "heads_split_block_n": 32},
    "heads_t132_bn64_s2": {"legacy_max_q": 0, "heads_split_target": 132, "heads_split_stages": 2},
    "heads_t132_bn128": {"legacy_max_q": 0, "heads_split_target": 132, "heads_split_block_n": 128},
    "heads_nosplit": {"legacy_max_q": 0, "heads_split_target": 0},
    "default": {},
    # fused_combine: the split programs' last arrival combines (one launch per call), against
    # the same kernels with _attn_combine_kernel (default / legacy / heads_t132_bn64)
    "fused_combine": {"fused_combine": True},
    "legacy_fused": {"legacy_max_q": 1 << 30, "fused_combine": True},
    "heads_t132_bn64_fused": {"legacy_max_q": 0, "heads_split_target": 132, "fused_combine": True},
    # the split-KV combine's width and the split count at small batches
    "c1": {"combine_heads": 1},
    "c2": {"combine_heads": 2},
    "c8": {"combine_heads": 8},
    "mt2": {"split_min_tiles": 2},
    "mt4": {"split_min_tiles": 4},
    "mt2_c1": {"split_min_tiles": 2, "combine_heads": 1},
    "mt2_c2": {"split_min_tiles": 2, "combine_heads": 2},
    "sh8": {"split_heads": 8},
    "sh8_mt2_c1": {"split_heads": 8, "split_min_tiles": 2, "combine_heads": 1},
    "bn32": {"split_block_n": 32},
    "bn32_c1": {"split_block_n": 32, "combine_heads": 1},
    "t132": {"split_target": 132},
    "t132_c1": {"split_target": 132, "combine_heads": 1},
}
# --fused-combine: these decode variants only (B = 1, 8, 64)
FUSED_COMPARE = ("default", "fused_combine", "legacy", "legacy_fused", "heads_t132_bn64", "heads_t132_bn64_fused")


def _inputs(num_q: int, decode: bool, g: torch.Generator):
    from flashpd.kernels.quant import ref as qref
    from flashpd.kernels.rope import ref as rope

    entries = ENTRIES * (num_q if decode else 1)
    comp = qref.pack_nvfp4(torch.randn(entries, D, generator=g).to(DEV))
    if decode:
        win = qref.pack_window_fp8(torch.randn(num_q * W * 2, D, generator=g).to(DEV))
        win_rows = torch.randperm(num_q * W * 2, generator=g)[: num_q * W].view(num_q, W)
        comp_rows = torch.randint(0, ENTRIES, (num_q, K), generator=g) + ENTRIES * torch.arange(num_q)[:, None]
    else:
        win = qref.pack_window_fp8(torch.randn(num_q + W, D, generator=g).to(DEV))
        win_rows = torch.arange(num_q)[:, None] + torch.arange(W)[None, :]
        comp_rows = torch.randint(0, ENTRIES, (num_q, K), generator=g)
    pos = torch.randint(0, 1 << 16, (num_q,), generator=g)
    freqs = rope.rope_frequencies(2 * PAIRS, 160000.0, rope.Yarn(16, 32, 1, 65536))
    cos, sin = rope.rope_cos_sin(pos, freqs)
    q = torch.randn(num_q, H, D, generator=g).to(torch.bfloat16).to(DEV)
    sink = torch.randn(H, generator=g).to(DEV)
    return dict(
        q=q,
        rope=(cos.to(DEV), sin.to(DEV)),
        win=win,
        win_rows=win_rows.int().to(DEV),
        comp=comp,
        comp_rows=comp_rows.int().to(DEV),
        sink=sink,
        pos=pos.to(DEV),
        freqs=freqs.to(DEV),
    )


def _call(x, tuned: KernelConfigs):
    from flashpd.kernels.attention import triton as at

    return at.sparse_attention_packed(
        x["q"], x["rope"], x["win"], x["win_rows"], x["comp"], x["comp_rows"], x["sink"], D**-0.5, tuned=tuned
    )


def _reference(x, idx: torch.Tensor) -> torch.Tensor:
    from flashpd.kernels.attention import ref as aref
    from flashpd.kernels.quant import ref as qref
    from flashpd.kernels.rope import ref as rope

    wr, cr = x["win_rows"][idx].long(), x["comp_rows"][idx].long()
    keys = torch.cat(
        (qref.unpack_window_fp8(x["win"], torch.bfloat16)[wr], qref.unpack_nvfp4(x["comp"], torch.bfloat16)[cr]), dim=1
    )
    valid = torch.ones(keys.shape[:2], dtype=torch.bool, device=keys.device)
    pos = x["pos"][idx]
    o = aref.sparse_attention(rope.apply_rope(x["q"][idx], pos, x["freqs"]), keys, valid, x["sink"], D**-0.5)
    return rope.apply_rope(o, pos, x["freqs"], inverse=True)


def _check(x, idx, ref, tuned: KernelConfigs) -> float:
    """Relative error on the sampled queries; 1e9 if any output is NaN (the block the output
    is allocated from was filled with NaN just before)."""
    from flashpd.kernels.verify import errors

    out = _call(x, tuned)
    return errors(out[idx].float(), ref.float())[1] if not out.isnan().any() else 1e9


def _fused_diff(x, tuned: KernelConfigs) -> float:
    """Max |fused - unfused| of one call (fused_combine on, then off; 0.0: bit-identical)."""
    fused = _call(x, tuned)
    unfused = _call(x, configs.override(tuned, attention={"fused_combine": False}))
    return float((fused.float() - unfused.float()).abs().max())


def _time_events(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b))
    return statistics.median(samples)


def _time_graph(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / calls)
    return statistics.median(samples)


def _compiled(at) -> dict:
    """The heads kernels' compiled variants in this process: id -> (CompiledKernel, arg names)."""
    out = {}
    for fn in (at.HEADS_KERNEL, at.HEADS_VSPLIT_KERNEL):
        for c in getattr(fn, "device_caches", {}).values():
            out.update({id(k): (k, fn.arg_names) for k in c[0].values()})
    return out


def _resources(kernels) -> list[dict]:
    """Registers, spilled 32-bit words and shared memory of (kernel, arg names) pairs."""
    keep = ("BLOCK_N", "PARTIAL", "COMP_FMT", "TRANS", "HB")
    out = []
    for k, arg_names in kernels:
        k = k.result() if hasattr(k, "result") else k  # launched: registers / spills known
        c = getattr(k.src, "constants", {})
        out.append(
            {
                "kernel": k.name,
                "n_regs": getattr(k, "n_regs", None),
                "n_spills": getattr(k, "n_spills", None),
                "shared": k.metadata.shared,
                "warps": k.metadata.num_warps,
                "stages": k.metadata.num_stages,
                "const": {arg_names[i[0]]: v for i, v in c.items() if isinstance(i, tuple) and arg_names[i[0]] in keep},
            }
        )
    return out


def run(quick: bool, only: list[str] | None = None, timing: bool = True, deadline: float | None = None) -> list[dict]:
    from flashpd.kernels.attention import triton as at

    g = torch.Generator().manual_seed(0)
    rows = []
    plans = [("prefill", t, PREFILL_VARIANTS) for t in (PREFILL_T[:1] if quick else PREFILL_T)]
    plans += [("decode", b, DECODE_VARIANTS) for b in DECODE_B]
    for phase, num_q, variants in plans:
        if only and not set(only) & set(variants):
            continue
        x = _inputs(num_q, phase == "decode", g)
        idx = (
            torch.randperm(num_q, generator=g)[:256].sort().values.to(DEV)
            if num_q > 256
            else torch.arange(num_q, device=DEV)
        )
        ref = _reference(x, idx)
        flops = 4.0 * num_q * H * (W + K) * D
        nbytes = num_q * (W * x["win"].shape[1] + K * x["comp"].shape[1] + 2 * H * D * 2)
        for name, over in variants.items():
            if only and name not in only:
                continue
            tuned = configs.override(configs.DEFAULT, attention=over)
            row = {"phase": phase, "rows": num_q, "variant": name}
            if deadline is not None and time.perf_counter() > deadline:
                row["error"] = "skipped: over the time budget"
                rows.append(row)
                continue
            t0 = time.perf_counter()
            try:
                torch.empty(num_q * H * D, dtype=torch.bfloat16, device=DEV).fill_(float("nan"))
                before = _compiled(at) if DEV == "cuda" else {}
                row["rel_err"] = _check(x, idx, ref, tuned)
                if over.get("fused_combine"):
                    row["max_diff_unfused"] = _fused_diff(x, tuned)
                if DEV == "cuda":
                    new = [k for i, k in _compiled(at).items() if i not in before]
                    row["kernels"] = _resources(new)
                if DEV != "cuda" or not timing:
                    row["wall_s"] = time.perf_counter() - t0
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                row["ms"] = (
                    _time_graph(lambda x=x, t=tuned: _call(x, t))
                    if phase == "decode"
                    else _time_events(lambda x=x, t=tuned: _call(x, t))
                )
                row["tflops"] = flops / row["ms"] / 1e9
                row["gbps"] = nbytes / row["ms"] / 1e6
                if phase == "decode":
                    row["plan"] = at.heads_plan(num_q, H, (W, K), tuned.attention)
            except Exception as exc:  # a variant that fails to compile or run is reported
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
        del x
    return rows


def verify_variants(names: list[str]) -> list[dict]:
    """`verify-kernels --ops attention` (bench scale, no timing; tiny on the CPU) under each
    prefill variant's AttentionConfig overrides: the packed NVFP4 / FP8 cases at T = 64 (split-KV) and
    1024 (one pass)."""
    from flashpd.kernels import verify

    rows = []
    for name in names:
        tuned = configs.override(configs.DEFAULT, attention=PREFILL_VARIANTS[name])
        try:
            checks = verify.run_checks("bench" if DEV == "cuda" else "tiny", ["attention"], timing=False, tuned=tuned)
            rows.append(
                {
                    "variant": name,
                    "checks": [
                        {"case": c.case, "max_rel": c.max_rel, "tol": c.tol, "passed": c.passed} for c in checks
                    ],
                }
            )
        except Exception as exc:
            rows.append({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def warm(variants: list[str], jobs: int, args, deadline: float) -> list[dict]:
    """Compile (and check) each variant in its own process, `jobs` at a time, so the timed run
    finds every kernel in Triton's cache; then `--verify` variants likewise. A job still
    running at `deadline` is stopped. Returns one record per job (rc, wall s, last line)."""
    import subprocess
    import sys

    cmds = []
    for v in variants:
        cmd = [sys.executable, __file__, "--check-only", "--variants", v]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--smoke"] if args.smoke else []
        cmd += ["--decode-only"] if not PREFILL_T else []
        cmds.append(cmd + (["--prefill-t", *map(str, args.prefill_t)] if args.prefill_t else []))
    for v in args.verify or []:
        cmds.append([sys.executable, __file__, "--verify", v, "--variants", *(["--smoke"] if args.smoke else [])])
    pending, running, done = list(cmds), [], []
    while pending or running:
        while pending and len(running) < jobs:
            cmd = pending.pop(0)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            running.append((cmd, proc, time.perf_counter()))
        time.sleep(0.2)
        for item in list(running):
            cmd, proc, t0 = item
            if proc.poll() is None and time.perf_counter() < deadline:
                continue
            if proc.poll() is None:
                proc.kill()
            out = proc.communicate()[0]
            running.remove(item)
            done.append(
                {
                    "cmd": " ".join(cmd[3:]),
                    "rc": proc.returncode,
                    "wall_s": round(time.perf_counter() - t0, 1),
                    "out": out[-3000:],
                }
            )
            print(f"warm: {done[-1]['cmd']}: rc {proc.returncode}, {done[-1]['wall_s']} s", flush=True)
        if time.perf_counter() > deadline:
            pending.clear()
    return done


def table(rows: list[dict]) -> str:
    lines = [
        "| phase | rows | variant | ms | TFLOP/s | GB/s | rel err | regs/spill/smem |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "max_diff_unfused" in r:  # fused_combine: max |fused - unfused| beside the name
            r = dict(r, variant=f"{r['variant']} (diff {r['max_diff_unfused']:.1e})")
        res = ",".join(
            f"{k['n_regs']}/{4 * (k['n_spills'] or 0)}B/{k['shared'] // 1024}K" for k in r.get("kernels", [])
        )
        if "error" in r:
            lines.append(f"| {r['phase']} | {r['rows']} | {r['variant']} | error: {r['error'][:80]} | | | | |")
            continue
        if "ms" not in r:
            lines.append(f"| {r['phase']} | {r['rows']} | {r['variant']} | | | | {r['rel_err']:.2e} | {res} |")
            continue
        lines.append(
            f"| {r['phase']} | {r['rows']} | {r['variant']} | {r['ms']:.4f} | "
            f"{r['tflops']:.1f} | {r['gbps']:.0f} | {r['rel_err']:.2e} | {res} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--quick", action="store_true", help="prefill T = 4096 only")
    ap.add_argument("--variants", nargs="*", help="run only these variants")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, checks only (runs under the CPU interpreter)")
    ap.add_argument("--prefill-t", type=int, nargs="*", help="prefill row counts (default 4096 8192)")
    ap.add_argument("--check-only", action="store_true", help="check, do not time")
    ap.add_argument(
        "--fused-combine",
        action="store_true",
        help="decode only: the fused split-KV combine against the two-launch "
        "form (variants " + " ".join(FUSED_COMPARE) + ")",
    )
    ap.add_argument("--decode-only", action="store_true", help="no prefill rows")
    ap.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="first compile and check every selected variant in this many "
        "processes at once (fills Triton's cache for the timed run)",
    )
    ap.add_argument(
        "--verify",
        nargs="*",
        metavar="VARIANT",
        help="run verify-kernels' attention checks (bench scale) under these prefill variants' AttentionConfig",
    )
    ap.add_argument(
        "--pick-out",
        help="write the decode variant to adopt here (its AttentionConfig "
        "overrides as JSON, {} = keep the defaults): the fastest at B = 1 among "
        "variants that check out and are at most 2%% slower than 'default' at "
        "every other batch",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall budget: warm-up jobs stop at 60%% of it, timing skips rows past it",
    )
    args = ap.parse_args(argv)
    global H, D, W, K, PAIRS, ENTRIES, PREFILL_T, DECODE_B, DEV
    start = time.perf_counter()
    if args.smoke:
        H, D, W, K, PAIRS, ENTRIES, PREFILL_T, DECODE_B = 4, 64, 16, 24, 8, 64, (40,), (1, 3)
    if args.prefill_t:
        PREFILL_T = tuple(args.prefill_t)
    if args.fused_combine or args.decode_only:
        PREFILL_T = ()
    if args.fused_combine:
        args.variants = list(FUSED_COMPARE)
    if not torch.cuda.is_available():
        if not args.smoke:
            raise SystemExit("attention_bench needs a CUDA GPU (or --smoke)")
        DEV = "cpu"
    budget = args.budget_s
    warm_rows = []
    if args.jobs:
        names = args.variants or sorted(set(PREFILL_VARIANTS) | set(DECODE_VARIANTS))
        warm_rows = warm(names, args.jobs, args, start + 0.6 * budget if budget else float("inf"))
    elif args.verify:
        warm_rows = verify_variants(args.verify)
        if not args.variants:
            return
    rows = run(args.quick, args.variants, timing=not args.check_only, deadline=start + budget if budget else None)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "rows": rows, "warm": warm_rows},
                f,
                indent=1,
            )
    print(table(rows) if DEV == "cuda" else json.dumps(rows))
    if args.pick_out:
        name = pick_decode(rows)
        print(f"picked decode variant: {name} {DECODE_VARIANTS[name]}")
        with open(args.pick_out, "w") as f:
            json.dump(DECODE_VARIANTS[name], f)


def pick_decode(rows: list[dict], slack: float = 1.02, tol: float = 0.02) -> str:
    """The decode variant with the lowest B = 1 time whose error is within tol and whose time
    at every other batch is within `slack` of 'default' ('default' when none beats it)."""
    ms = {}
    for r in rows:
        if r["phase"] == "decode" and "ms" in r and r.get("rel_err", 1e9) <= tol:
            ms.setdefault(r["variant"], {})[r["rows"]] = r["ms"]
    base = ms.get("default", {})
    best, best_ms = "default", base.get(1, float("inf"))
    for name, times in ms.items():
        if set(times) != set(base) or 1 not in times:
            continue
        if all(times[b] <= slack * base[b] for b in base if b != 1) and times[1] < best_ms:
            best, best_ms = name, times[1]
    return best


if __name__ == "__main__":
    main()
