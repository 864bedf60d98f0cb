"""Prefill-size GEMMs on one GPU: the routed MXFP4 experts (kernels/moe/grouped_large.py
variants against the current grouped GEMM), the FP8 shared expert and FP8 dense layers.

    python benchmarks/gemm_prefill.py --out $OUT [--tokens 4096 8192]

Routed experts at the bench preset's shapes (64 experts, top-6, hidden 5120, I=2304): tokens T,
pairs P = 6T sorted by expert, random routing and gamma, MXFP4 weights of random codes and
scales (bench/kernel_roofline.py's inputs). Each GEMM configuration is timed alone (median of
CUDA-event timings, L2 flushed before each call), checked against a torch FP32 reference on the
dequantised weights (max|out-ref| / max|ref|); the best of each GEMM is then run end to end.
Writes gemm_prefill.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from flashpd.kernels import configs

HIDDEN, INTER, EXPERTS, TOP_K, Q_LORA, O_IN = 5120, 2304, 64, 6, 1280, 8192
LIMIT = 10.0
DEV = "cuda"
BASE = configs.DEFAULT  # the kernel configs of the run (--smoke: no tl.dot_scaled)
PEAK_NOTE = "bf16 8192^3 torch.matmul"

_T1 = {
    "path": "mx",
    "block_m": 128,
    "block_n": 128,
    "block_k": 64,
    "warps": 8,
    "stages": 4,
    "dot_scaled": True,
    "swap": False,
}
_B = {**_T1, "path": "bf16", "dot_scaled": False}
# name -> tiles, for the SwiGLU GEMM (gemm1) and the down GEMM (gemm2); bf16 / cublas times
# include the decode of that GEMM's weights into the scratch buffer
GEMM1 = {
    "mx_ds_128x128_s4": _T1,
    "mx_ds_f13_256x128_s3": {**_T1, "block_m": 256, "fused13": True, "stages": 3},
    "mx_ds_f13_128x256_s3": {**_T1, "block_n": 256, "fused13": True, "stages": 3},
    "mx_ds_f13_128x128_s4": {**_T1, "fused13": True},
    "bf16_f13_128x256_s3": {**_B, "block_n": 256, "fused13": True, "stages": 3},
    "bf16_f13_256x128_s3": {**_B, "block_m": 256, "fused13": True, "stages": 3},
    "bf16_f13_128x128_s4": {**_B, "fused13": True},
    "bf16_128x128_s3": {**_B, "stages": 3},
    "cublas": {**_T1, "path": "cublas"},
}
GEMM2 = {
    "mx_ds_128x128_s4": _T1,
    "bf16_128x256_s3": {**_B, "block_n": 256, "stages": 3},
    "bf16_256x128_s3": {**_B, "block_m": 256, "stages": 3},
    "bf16_128x128_s4": _B,
    "cublas": {**_T1, "path": "cublas"},
}
DEQUANT = {
    "32x256_w4": {"block_r": 32, "block_k": 256, "warps": 4},
    "64x256_w8": {"block_r": 64, "block_k": 256, "warps": 8},
    "16x512_w4": {"block_r": 16, "block_k": 512, "warps": 4},
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def routed(tokens: int, weights, results: list, log) -> None:
    from flashpd.bench.kernel_roofline import deq_one
    from flashpd.kernels.dense import triton as dt
    from flashpd.kernels.moe import grouped_large as gl
    from flashpd.kernels.moe import ref as mref
    from flashpd.kernels.verify import time_ms

    w1, w3, w2 = weights
    dev = DEV
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    gam = torch.rand(tokens, TOP_K, generator=g) * 0.3
    ids, gam = ids.to(dev), gam.to(dev)
    x = torch.randn(tokens, HIDDEN, device=dev).to(torch.bfloat16)
    pairs = tokens * TOP_K
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = (order // TOP_K).to(torch.int32)
    gamma = gam.reshape(-1)[order].float().contiguous()
    counts = torch.bincount(flat, minlength=EXPERTS)
    sorted_ids = flat[order]
    # reference: per expert, FP32 GEMMs on the dequantised weights (moe.ref.expert_ffn)
    t0 = time.perf_counter()
    h_ref = torch.empty(pairs, INTER, dtype=torch.bfloat16, device=dev)
    y_ref = torch.empty(pairs, HIDDEN, dtype=torch.bfloat16, device=dev)
    ends = torch.cumsum(counts, 0).tolist()
    for e in range(EXPERTS):
        lo, hi = (ends[e - 1] if e else 0), ends[e]
        if lo == hi:
            continue
        a = x[rows[lo:hi].long()]
        d1, d3, d2 = (deq_one(w, e) for w in (w1, w3, w2))
        h = mref.swiglu(mref.linear(a, d1), mref.linear(a, d3), LIMIT)
        h_ref[lo:hi] = (gamma[lo:hi, None] * h).to(torch.bfloat16)
        y_ref[lo:hi] = mref.linear(h_ref[lo:hi], d2)
    assert torch.equal(sorted_ids, torch.repeat_interleave(torch.arange(EXPERTS, device=dev), counts))
    log(f"T={tokens}: reference {time.perf_counter() - t0:.1f}s")
    flops1 = 2.0 * pairs * HIDDEN * 2 * INTER
    flops2 = 2.0 * pairs * INTER * HIDDEN

    def rec(name, ms, err, flops, **kw):
        r = {
            "case": "routed",
            "tokens": tokens,
            "variant": name,
            "ms": ms,
            "err": err,
            "TFLOPs": flops / (ms * 1e-3) / 1e12 if ms else None,
            **kw,
        }
        results.append(r)
        log(f"  {name}: {ms:.3f} ms  {r['TFLOPs'] or 0:.0f} TFLOP/s  err {err:.2e}")

    # before: the current grouped GEMM of dense/triton.py (as moe/triton.py calls it)
    sched = dt.grouped_schedule(counts, pairs, dt.block_m_for(max(1, pairs // EXPERTS), BASE.dense))
    h0 = torch.empty(pairs, INTER, dtype=torch.bfloat16, device=dev)
    y0 = torch.empty(pairs, HIDDEN, dtype=torch.bfloat16, device=dev)

    def before1():
        return dt.grouped_gemm(x, w1, sched, h0, a_rows=rows, w3=w3, gamma=gamma, limit=LIMIT, cfg=BASE.dense)

    def before2():
        return dt.grouped_gemm(h_ref, w2, sched, y0, cfg=BASE.dense)

    ms1, ms2 = time_ms(before1, reps=5, warmup=1), time_ms(before2, reps=5, warmup=1)
    rec("before gemm1", ms1, rel_err(before1(), h_ref), flops1)
    rec("before gemm2", ms2, rel_err(before2(), y_ref), flops2)
    rec("before total", ms1 + ms2, 0.0, flops1 + flops2)
    best = {}
    s128 = dt.grouped_schedule(counts, pairs, 128)
    prs = gl.pairs_of(rows, gamma, s128, EXPERTS)
    for gemm, table, flops in (("gemm1", GEMM1, flops1), ("gemm2", GEMM2, flops2)):
        for name, t in table.items():
            try:

                def fn(t=t, gemm=gemm):
                    if gemm == "gemm1":
                        return gl.swiglu_gemm(x, prs, w1, w3, LIMIT, t)
                    return gl.down_gemm(h_ref, prs, w2, t)

                err = rel_err(fn(), h_ref if gemm == "gemm1" else y_ref)
                ms = time_ms(fn, reps=7, warmup=1)
                rec(f"{gemm} {name}", ms, err, flops, tiles=t)
                if err < 5e-3 and (gemm not in best or ms < best[gemm][1]):
                    best[gemm] = (name, ms, t)
            except Exception as exc:  # a configuration that does not compile or run
                log(f"  {gemm} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
    large = BASE.moe.large
    try:
        for name, cfg in DEQUANT.items():  # decode of W1 | W3 into the scratch (3 GB BF16)
            fn = lambda cfg=cfg: gl.decoded_scratch(w1, w3, cfg)  # noqa: E731
            ms = time_ms(fn, reps=5, warmup=1)
            nbytes = 2 * (w1.data.numel() + w1.scale.numel()) + 2 * 2 * w1.data.numel() * 2
            rec(f"dequant W1|W3 {name}", ms, 0.0, 0.0, GBps=nbytes / (ms * 1e-3) / 1e9)
        if "gemm1" in best and "gemm2" in best:  # end to end: the best of each GEMM
            top = configs.override(large, gemm1=best["gemm1"][2], gemm2=best["gemm2"][2], scratch_min_pairs=1 << 40)
            fn = lambda: gl.expert_gemms(
                x,
                rows,
                gamma,
                s128,
                w1,
                w3,
                w2,
                LIMIT,  # noqa: E731
                cfg=top,
            )
            rec(
                f"after best ({best['gemm1'][0]} + {best['gemm2'][0]})",
                time_ms(fn, reps=7, warmup=1),
                rel_err(fn(), y_ref),
                flops1 + flops2,
                gemm1=best["gemm1"][2],
                gemm2=best["gemm2"][2],
            )
        # the defaults (GroupedLargeConfig), then the MoE entry point: dispatched here vs the
        # previous grouped GEMM (min_pairs out of reach); both include sorting and the sum
        fn = lambda: gl.expert_gemms(
            x,
            rows,
            gamma,
            s128,
            w1,
            w3,
            w2,
            LIMIT,  # noqa: E731
            cfg=large,
        )
        out = torch.full_like(y_ref, float("nan"))
        out.copy_(fn())
        rec("after (defaults)", time_ms(fn, reps=7, warmup=1), rel_err(out, y_ref), flops1 + flops2)
        from flashpd.kernels.moe import triton as mt

        experts = mt.ExpertSet(w1, w3, w2)
        new = lambda: mt.routed_experts(x, ids, gam, experts, LIMIT, tuned=BASE)  # noqa: E731
        y_new = new()
        ms_new = time_ms(new, reps=5, warmup=1)
        previous = configs.override(BASE, moe={"large": {"min_pairs": 1 << 40}})
        old = lambda: mt.routed_experts(
            x,
            ids,
            gam,
            experts,
            LIMIT,  # noqa: E731
            tuned=previous,
        )
        y_old = old()
        ms_old = time_ms(old, reps=5, warmup=1)
        rec("moe.routed_experts previous path", ms_old, 0.0, flops1 + flops2)
        rec("moe.routed_experts dispatched (err vs previous)", ms_new, rel_err(y_new, y_old), flops1 + flops2)
    except Exception as exc:
        log(f"  end to end FAILED {type(exc).__name__}: {str(exc)[:300]}")


def fp8_cases(tokens: int, results: list, log) -> None:
    from flashpd.bench.kernel_roofline import deq, rand_fp8
    from flashpd.kernels.dense import triton as dt
    from flashpd.kernels.moe import grouped_large as gl
    from flashpd.kernels.moe import ref as mref
    from flashpd.kernels.moe import triton as mt
    from flashpd.kernels.verify import time_ms

    x = torch.randn(tokens, HIDDEN, device=DEV).to(torch.bfloat16)
    shared = mt.ExpertSet(
        rand_fp8(INTER, HIDDEN, seed=4), rand_fp8(INTER, HIDDEN, seed=5), rand_fp8(HIDDEN, INTER, seed=6)
    )
    d = [deq(w)[0].to(torch.bfloat16) for w in (shared.w1, shared.w3, shared.w2)]
    want = mref.expert_ffn(x, *d, LIMIT)
    flops = 6.0 * tokens * HIDDEN * INTER

    def cublas_shared():  # W1|W3 dequantised to BF16, cuBLAS, SwiGLU kernel, cuBLAS
        w13 = torch.cat([dt.dequantize_fp8(shared.w1), dt.dequantize_fp8(shared.w3)])
        h = gl.swiglu_halves(x @ w13.T, None, LIMIT)
        return h @ dt.dequantize_fp8(shared.w2).T

    for name, fn in (
        ("shared expert (current)", lambda: mt.dense_experts(x, shared, LIMIT, None, BASE.dense)),
        ("shared expert cuBLAS w13", cublas_shared),
    ):
        ms = time_ms(fn, reps=7, warmup=1)
        results.append(
            {
                "case": "fp8",
                "tokens": tokens,
                "variant": name,
                "ms": ms,
                "err": rel_err(fn(), want),
                "TFLOPs": flops / (ms * 1e-3) / 1e12,
            }
        )
        log(f"  {name}: {ms:.3f} ms {results[-1]['TFLOPs']:.0f} TFLOP/s err {results[-1]['err']:.2e}")
    for name, n, k in (("wq_a", Q_LORA, HIDDEN), ("wo_b", HIDDEN, O_IN)):
        w = rand_fp8(n, k, seed=hash(name) % 1000)
        xa = torch.randn(tokens, k, device=DEV).to(torch.bfloat16)
        fn = lambda w=w, xa=xa: dt.linear_weights(
            xa,
            w,
            torch.bfloat16,  # noqa: E731
            tuned=BASE,
        )
        ms = time_ms(fn, reps=7, warmup=1)
        results.append(
            {
                "case": "fp8",
                "tokens": tokens,
                "variant": f"{name} N={n} K={k}",
                "ms": ms,
                "err": rel_err(fn(), xa.float() @ deq(w)[0].T),
                "TFLOPs": 2.0 * tokens * n * k / (ms * 1e-3) / 1e12,
            }
        )
        log(f"  {name}: {ms:.3f} ms {results[-1]['TFLOPs']:.0f} TFLOP/s")


def _smoke() -> None:
    from flashpd.bench import kernel_roofline

    global DEV, HIDDEN, INTER, EXPERTS, Q_LORA, O_IN, BASE

    DEV = kernel_roofline.DEV = "cpu"
    # the interpreter cannot run tl.dot_scaled
    BASE = configs.merge(BASE, moe={"large": {"gemm1": {"dot_scaled": False}, "gemm2": {"dot_scaled": False}}})
    HIDDEN, INTER, EXPERTS, Q_LORA, O_IN = 128, 128, 8, 64, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--skip-fp8", action="store_true")
    ap.add_argument("--quick", action="store_true", help="no per-GEMM sweep: before, the defaults, the MoE entry point")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU under the interpreter (checks the script runs)"
    )
    args = ap.parse_args()
    if args.smoke:
        _smoke()
    if args.quick:
        GEMM1.clear()
        GEMM2.clear()
        for name in list(DEQUANT)[1:]:
            del DEQUANT[name]
    from flashpd.bench.kernel_roofline import rand_mxfp4
    from flashpd.kernels.verify import time_ms

    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    results: list = []
    sq = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    mm = time_ms(lambda: sq @ sq, reps=5)
    results.append({"case": "ceiling", "variant": PEAK_NOTE, "ms": mm, "TFLOPs": 2 * 8192**3 / (mm * 1e-3) / 1e12})
    log(f"bf16 GEMM ceiling {results[-1]['TFLOPs']:.0f} TFLOP/s ({DEV})")
    weights = (
        rand_mxfp4(INTER, HIDDEN, EXPERTS, 1),
        rand_mxfp4(INTER, HIDDEN, EXPERTS, 2),
        rand_mxfp4(HIDDEN, INTER, EXPERTS, 3),
    )
    for i, tokens in enumerate(args.tokens):
        routed(tokens, weights, results, log)
        if i == 0 and not args.skip_fp8:
            fp8_cases(tokens, results, log)
        with open(os.path.join(args.out, "gemm_prefill.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    with open(os.path.join(args.out, "gemm_prefill.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print("\n| case | T | variant | ms | TFLOP/s | err |\n|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['case']} | {r.get('tokens', '')} | {r['variant']} | {r['ms']:.3f} | "
            f"{r['TFLOPs'] or 0:.0f} | {r.get('err', 0):.1e} |"
        )


if __name__ == "__main__":
    main()
