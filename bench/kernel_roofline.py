"""Per-kernel roofline on one GPU: the GEMMs and decode attention at the bench preset's shapes.

    python -m flashpd.bench.kernel_roofline --out bench/results/h200 [--sweep]

Measures the card's ceilings first (a 1 GiB device-to-device copy, counting bytes read plus
written; an 8192^3 bf16 GEMM), then for each kernel variant ("after": the current defaults;
with --sweep a few launch configurations; the previous kernels' "before" rows are in
bench/results/h200/roofline_b428135.md, their code in git history) and each case:

    decode  M = 1, 8, 64 tokens: FP8 32x32 dense layers (wq_a, wq_b, wkv, wo_a grouped, wo_b,
            indexer wq_b), the FP8 shared expert (SwiGLU GEMM + down GEMM), the MXFP4 routed
            experts (64 experts, top-6: SwiGLU GEMM + down GEMM on sorted pairs), and sparse
            attention over 128 window + 512 NVFP4 compressed records (64 heads x 512)
    prefill M = 4096: wq_a, wo_b (FP8) and the routed experts

Each time is the median over CUDA-graph replays of back-to-back calls (no host time; the calls
cycle over enough weight copies that weights come from HBM, not the 60 MB L2), one replay timed
with two CUDA events (kernels.verify.event_ms). Bytes are the fewest the call must move (weights
incl. scales once, activations in and out); decode kernels are rated by GB/s against the copy
bandwidth, prefill by TFLOP/s against the bf16 GEMM. Each result's error is against a torch
reference on the dequantised weights. Writes roofline.json (rewritten after every variant) and
roofline.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from flashpd.kernels import configs
from flashpd.kernels.configs import KernelConfigs

HIDDEN, HEADS, HEAD_DIM, Q_LORA, O_LORA, O_GROUPS = 5120, 64, 512, 1280, 1024, 8
INTER, EXPERTS, TOP_K, INDEX_HEADS, INDEX_DIM = 2304, 64, 6, 32, 128
WINDOW, TOPK_KEYS, ROPE_PAIRS = 128, 512, 32
DECODE_M, PREFILL_M = (1, 8, 64), 4096
L2_BYTES = 256 << 20  # rotate weight copies until a graph replay streams this much
DEV = "cuda"

# name -> (DenseConfig overrides, AttentionConfig overrides; mappings merged)
VARIANTS = {"after": ({}, {})}
_MX = {"block_n": 32, "block_k": 256, "warps": 4, "stages": 3, "target_ctas": 1024}
# mx_* sweeps run the MXFP4 expert cases at decode sizes; pf_* the prefill cases; others the
# M = 1 and 64 cases of wq_a, wo_b, the experts and attention
SWEEP = {
    "mx_ds_t264": ({"mx": {**_MX, "target_ctas": 264}}, {}),
    "mx_ds_k128": ({"mx": {**_MX, "block_k": 128}}, {}),
    "mx_ds_k64_t264": ({"mx": {**_MX, "block_k": 64, "target_ctas": 264, "stages": 4}}, {}),
    "mx_asm": ({"mxfp4_decode": "asm"}, {}),
    "mx_asm_k128_t264": ({"mxfp4_decode": "asm", "mx": {**_MX, "block_k": 128, "target_ctas": 264}}, {}),
    "mx_bits": ({"mxfp4_decode": "bits"}, {}),
}


# ============================================================================ timing
def measure_ceilings() -> dict:
    from flashpd.kernels.verify import time_ms

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), reps=10)
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    mm_ms = time_ms(lambda: a @ b, reps=10)
    return {"copy_GBps": 2 * n / (copy_ms * 1e-3) / 1e9, "bf16_TFLOPs": 2 * 8192**3 / (mm_ms * 1e-3) / 1e12}


def graph_ms(calls: list, reps: int = 7) -> float:
    """Median ms per call over CUDA-graph replays of every call in `calls`, back to back."""
    from flashpd.kernels.verify import event_ms

    for fn in calls:  # compile, allocate counters and workspaces outside the capture
        fn()
    if DEV != "cuda":  # --smoke under the interpreter: wall clock of one pass
        t0 = time.perf_counter()
        for fn in calls:
            fn()
        return (time.perf_counter() - t0) * 1e3 / len(calls)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = [event_ms(graph.replay) for _ in range(reps)]
    return statistics.median(samples) / len(calls)


def graph_us(calls: list, device: torch.device, reps: int = 20) -> float:
    """`graph_ms` in us for kernels on `device`; off a GPU (an interpreter dry run of a bench
    script) every call runs once and the time is NaN."""
    if torch.device(device).type != "cuda":
        for fn in calls:
            fn()
        return float("nan")
    return graph_ms(calls, reps) * 1e3


@dataclass
class Launch:
    """The kernel configs of the variant being timed: `run_variant` sets `tuned`, and the
    cases' calls pass it to every kernel at call time (the kernels hold no tuning state)."""

    tuned: KernelConfigs = configs.DEFAULT


LAUNCH = Launch()


def variant_configs(dense_over: dict, attn_over: dict) -> KernelConfigs:
    """The default configs with a variant's dense / attention overrides (mappings merged)."""
    return configs.merge(configs.DEFAULT, dense=dense_over, attention=attn_over)


def device_main(name: str, smoke: bool, run) -> int:
    """run() with kernel tensors on the GPU, or with --smoke on the CPU under the interpreter
    (a check of the script's logic); DEV restored after."""
    global DEV
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit(f"{name} needs a CUDA GPU (or --smoke)")
    saved, DEV = DEV, "cpu" if smoke else "cuda"
    try:
        return run()
    finally:
        DEV = saved


def run_meta(name: str, argv: list[str] | None, shape: dict, **extra) -> dict:
    """The results' header: command line, device, commit (FLASHPD_COMMIT), shapes."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    return {
        "command": f"python -m flashpd.bench.{name} " + " ".join(argv),
        "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)",
        "commit": os.environ.get("FLASHPD_COMMIT", "unknown"),
        "shape": shape,
        **extra,
    }


def copies_for(nbytes: float) -> int:
    return max(2, min(16, -(-L2_BYTES // max(1, int(nbytes)))))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# ============================================================================ inputs
def rand_fp8(n: int, k: int, experts: int = 1, seed: int = 0):
    from flashpd.kernels.dense.triton import Weights
    from flashpd.kernels.quant import ref as qref

    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(experts * n, k, device=DEV, generator=g) * 0.05
    q, s = qref.quantize_fp8_blockwise(w)
    if experts == 1:
        return Weights.fp8(q, s)
    return Weights.fp8(q.view(experts, n, k), s.view(experts, n // 32, -1))


def rand_mxfp4(n: int, k: int, experts: int, seed: int):
    from flashpd.kernels.dense.triton import Weights

    g = torch.Generator(device=DEV).manual_seed(seed)
    packed = torch.randint(0, 256, (experts, n, k // 2), device=DEV, generator=g, dtype=torch.uint8)
    scale = torch.randint(118, 123, (experts, n, k // 32), device=DEV, generator=g, dtype=torch.uint8)
    return Weights.mxfp4(packed, scale)


def deq(w) -> torch.Tensor:
    """[E, N, K] FP32 values of a Weights."""
    from flashpd.kernels.dense.triton import W_FP8, W_MXFP4
    from flashpd.kernels.quant import ref as qref

    if w.fmt == W_FP8:
        return torch.stack(
            [
                qref.dequantize_fp8_blockwise(w.data[e].view(torch.float8_e4m3fn), w.scale[e], torch.float32)
                for e in range(w.num_experts)
            ]
        )
    if w.fmt == W_MXFP4:
        return torch.stack([qref.dequantize_mxfp4_weight(w.data[e], w.scale[e]).float() for e in range(w.num_experts)])
    return w.data.float()


def wbytes(w) -> float:
    return w.data.numel() + (w.scale.numel() if w.scale is not None else 0)


# ============================================================================ cases
class Case:
    """One kernel call at one size: calls (one per weight copy), bytes, flops, error."""

    def __init__(self, kernel: str, shape: str, m: int, phase: str):
        self.kernel, self.shape, self.m, self.phase = kernel, shape, m, phase
        self.bytes = self.flops = 0.0
        self.calls: list = []
        self.check = None  # () -> relative error vs the reference


def dense_cases(ms, names) -> list[Case]:
    from flashpd.kernels.dense import triton as dt

    shapes = {
        "wq_a": (Q_LORA, HIDDEN, 1),
        "wq_b": (HEADS * HEAD_DIM, Q_LORA, 1),
        "wkv": (HEAD_DIM, HIDDEN, 1),
        "wo_a": (O_LORA, HEADS // O_GROUPS * HEAD_DIM, O_GROUPS),
        "wo_b": (HIDDEN, O_GROUPS * O_LORA, 1),
        "idx_wq_b": (INDEX_HEADS * INDEX_DIM, Q_LORA, 1),
    }
    out = []
    for name in names:
        n, k, e = shapes[name]
        base = rand_fp8(n, k, e, seed=hash(name) % 1000)
        copies = [base] + [
            dt.Weights(base.fmt, base.data.clone(), base.scale.clone()) for _ in range(copies_for(wbytes(base)) - 1)
        ]
        ref_w = deq(base)
        for m in ms:
            c = Case(
                "fp8_dense", f"{name} N={n} K={k}" + (f" G={e}" if e > 1 else ""), m, "prefill" if m > 64 else "decode"
            )
            rows = m * e
            x = torch.randn(rows, k, device=DEV).to(torch.bfloat16)
            c.bytes = wbytes(base) + rows * (k + n) * 2
            c.flops = 2.0 * rows * n * k
            if e == 1:
                c.calls = [lambda w=w, x=x: dt.linear_weights(x, w, torch.bfloat16, tuned=LAUNCH.tuned) for w in copies]
                c.check = lambda x=x, w=base, r=ref_w: rel_err(
                    dt.linear_weights(x, w, torch.bfloat16, tuned=LAUNCH.tuned), x.float() @ r[0].T
                )
            else:  # block-diagonal wo_a as the GPU forward runs it
                p = torch.arange(rows, device=DEV)
                a_rows = ((p % m) * e + p // m).to(torch.int32)
                counts = torch.full((e,), m, dtype=torch.int64, device=DEV)

                def call(w, x=x, a_rows=a_rows, counts=counts, m=m, e=e, n=n):
                    sched = dt.grouped_schedule(counts, m * e, dt.block_m_for(m, LAUNCH.tuned.dense))
                    out_ = torch.empty(m * e, n, dtype=torch.bfloat16, device=DEV)
                    return dt.grouped_gemm(x, w, sched, out_, a_rows=a_rows, cfg=LAUNCH.tuned.dense)

                c.calls = [lambda w=w, call=call: call(w) for w in copies]

                def check(call=call, w=base, r=ref_w, x=x, a_rows=a_rows, m=m, e=e):
                    a = x[a_rows.long()].float().view(e, m, -1)
                    want = torch.bmm(a, r.transpose(1, 2)).reshape(m * e, -1)
                    return rel_err(call(w), want)

                c.check = check
                bd = Case("fp8_dense", f"{name} N={n} K={k} G={e} block_diagonal", m, c.phase)
                bd.bytes, bd.flops = c.bytes, c.flops
                x3 = x.view(m, e, k)
                bd.calls = [lambda w=w, x3=x3: dt.block_diagonal(x3, w, tuned=LAUNCH.tuned) for w in copies]
                bd.check = lambda w=base, r=ref_w, x3=x3: rel_err(
                    dt.block_diagonal(x3, w, tuned=LAUNCH.tuned),
                    torch.bmm(x3.float().transpose(0, 1), r.transpose(1, 2)).transpose(0, 1),
                )
                out.append(bd)
            out.append(c)
    return out


def expert_cases(ms) -> list[Case]:
    """Routed MXFP4 experts (sorted pairs, two grouped GEMMs) and the FP8 shared expert."""
    from flashpd.kernels.dense import triton as dt
    from flashpd.kernels.moe import ref as mref
    from flashpd.kernels.moe import triton as mt

    routed = mt.ExpertSet(
        rand_mxfp4(INTER, HIDDEN, EXPERTS, 1),
        rand_mxfp4(INTER, HIDDEN, EXPERTS, 2),
        rand_mxfp4(HIDDEN, INTER, EXPERTS, 3),
    )
    shared = mt.ExpertSet(
        rand_fp8(INTER, HIDDEN, seed=4), rand_fp8(INTER, HIDDEN, seed=5), rand_fp8(HIDDEN, INTER, seed=6)
    )
    per_expert = sum(wbytes(w) for w in (routed.w1, routed.w3, routed.w2)) / EXPERTS
    out = []
    g = torch.Generator().manual_seed(7)
    for m in ms:
        sets = []
        for _ in range(2 if m <= 64 else 1):  # two routings alternate: fewer L2 hits
            ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(m)]).to(DEV)
            gam = (torch.rand(m, TOP_K, generator=g) * 0.3).to(DEV)
            sets.append((ids, gam))
        x = torch.randn(m, HIDDEN, device=DEV).to(torch.bfloat16)

        def prepared(ids, gam, x=x, m=m):
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            rows = (order // TOP_K).to(torch.int32)
            gamma = gam.reshape(-1)[order].float().contiguous()
            counts = torch.bincount(flat, minlength=EXPERTS)
            sched = dt.grouped_schedule(
                counts, m * TOP_K, dt.block_m_for(max(1, m * TOP_K // EXPERTS), LAUNCH.tuned.dense)
            )
            return rows, gamma, sched

        preps = [prepared(*s) for s in sets]

        def gemms(prep, x=x, m=m):
            rows, gamma, sched = prep
            h = torch.empty(m * TOP_K, INTER, dtype=torch.bfloat16, device=DEV)
            dt.grouped_gemm(x, routed.w1, sched, h, a_rows=rows, w3=routed.w3, gamma=gamma, limit=10.0)
            y = torch.empty(m * TOP_K, HIDDEN, dtype=torch.bfloat16, device=DEV)
            return dt.grouped_gemm(h, routed.w2, sched, y, cfg=LAUNCH.tuned.dense)

        c = Case("mxfp4_experts", f"routed E={EXPERTS} k={TOP_K} I={INTER}", m, "prefill" if m > 64 else "decode")
        distinct = statistics.mean(len(torch.unique(ids)) for ids, _ in sets)
        c.bytes = distinct * per_expert + m * HIDDEN * 2 * 2 + m * TOP_K * (INTER * 2 * 2 + HIDDEN * 2)
        c.flops = 6.0 * m * TOP_K * HIDDEN * INTER
        c.calls = [lambda p=p, gemms=gemms: gemms(p) for p in preps]

        def check(ids=sets[0][0], gam=sets[0][1], prep=preps[0], gemms=gemms, x=x, m=m):
            y = gemms(prep).float()
            rows = prep[0].long()
            order = torch.argsort(ids.reshape(-1), stable=True)
            want = torch.empty_like(y)
            sorted_ids = ids.reshape(-1)[order]
            for e in torch.unique(sorted_ids).tolist():
                sel = (sorted_ids == e).nonzero().flatten()
                w1, w3, w2 = (deq_one(w, e) for w in (routed.w1, routed.w3, routed.w2))
                gamma = gam.reshape(-1)[order][sel][:, None]
                want[sel] = mref.expert_ffn(x[rows[sel]], w1, w3, w2, 10.0, gamma).float()
            return rel_err(y, want)

        c.check = check
        out.append(c)
        if m <= 64:
            s = Case("fp8_shared_expert", f"shared I={INTER}", m, "decode")
            s.bytes = sum(wbytes(w) for w in (shared.w1, shared.w3, shared.w2)) + m * HIDDEN * 4
            s.flops = 6.0 * m * HIDDEN * INTER
            s.calls = [lambda x=x: mt.dense_experts(x, shared, 10.0, None, LAUNCH.tuned.dense)]
            d = [deq(w)[0].to(torch.bfloat16) for w in (shared.w1, shared.w3, shared.w2)]
            s.check = lambda x=x, d=d: rel_err(
                mt.dense_experts(x, shared, 10.0, None, LAUNCH.tuned.dense), mref.expert_ffn(x, *d, 10.0)
            )
            out.append(s)
    return out


def deq_one(w, e: int) -> torch.Tensor:
    from flashpd.kernels.quant import ref as qref

    return qref.dequantize_mxfp4_weight(w.data[e], w.scale[e]).to(torch.bfloat16)


def attention_cases(ms) -> list[Case]:
    from flashpd.kernels.attention import ref as aref
    from flashpd.kernels.attention import triton as at
    from flashpd.kernels.quant import ref as qref

    out = []
    entries = 65536
    g = torch.Generator().manual_seed(9)
    win_pool = qref.pack_window_fp8(torch.randn(64 * WINDOW * 4, HEAD_DIM, device=DEV))
    comp_pool = qref.pack_nvfp4(torch.randn(entries, HEAD_DIM, device=DEV))
    sink = torch.randn(HEADS, device=DEV)
    for m in ms:
        q = torch.randn(m, HEADS, HEAD_DIM, device=DEV).to(torch.bfloat16)
        win_rows = torch.randperm(win_pool.shape[0], generator=g)[: m * WINDOW].view(m, WINDOW).int().to(DEV)
        comp_rows = torch.randint(0, entries, (m, TOPK_KEYS), generator=g).int().to(DEV)
        c = Case("attention", f"packed NVFP4 H={HEADS} D={HEAD_DIM} W={WINDOW} K={TOPK_KEYS}", m, "decode")
        c.bytes = m * (
            WINDOW * win_pool.shape[1]
            + TOPK_KEYS * comp_pool.shape[1]
            + 2 * HEADS * HEAD_DIM * 2
            + (WINDOW + TOPK_KEYS) * 4
        )
        c.flops = 4.0 * m * HEADS * (WINDOW + TOPK_KEYS) * HEAD_DIM
        c.calls = [
            lambda q=q, wr=win_rows, cr=comp_rows: at.sparse_attention_packed(
                q, None, win_pool, wr, comp_pool, cr, sink, HEAD_DIM**-0.5, tuned=LAUNCH.tuned
            )
        ]

        def check(q=q, wr=win_rows, cr=comp_rows):
            got = c_call(q, wr, cr)
            keys = torch.cat(
                (
                    qref.unpack_window_fp8(win_pool, torch.bfloat16)[wr.long()],
                    qref.unpack_nvfp4(comp_pool, torch.bfloat16)[cr.long()],
                ),
                dim=1,
            )
            valid = torch.ones(keys.shape[:2], dtype=torch.bool, device=DEV)
            return rel_err(got, aref.sparse_attention(q, keys, valid, sink, HEAD_DIM**-0.5))

        def c_call(q, wr, cr):
            return at.sparse_attention_packed(
                q, None, win_pool, wr, comp_pool, cr, sink, HEAD_DIM**-0.5, tuned=LAUNCH.tuned
            )

        c.check = check
        out.append(c)
    return out


def all_cases(quick: bool) -> list[Case]:
    dense_names = ["wq_a", "wo_b", "wkv"] if quick else ["wq_a", "wq_b", "wkv", "wo_a", "wo_b", "idx_wq_b"]
    ms = (1, 64) if quick else DECODE_M
    cases = dense_cases(ms, dense_names) + expert_cases(ms) + attention_cases(ms)
    if not quick:
        cases += dense_cases((PREFILL_M,), ["wq_a", "wo_b"]) + expert_cases((PREFILL_M,))
    return cases


# ============================================================================ run
def apply(variant: str) -> None:
    """The cases' calls run with this variant's configs from now on."""
    LAUNCH.tuned = variant_configs(*{**VARIANTS, **SWEEP}[variant])


def run_variant(variant: str, cases: list[Case], ceilings: dict) -> list[dict]:
    apply(variant)
    rows = []
    for c in cases:
        t0 = time.perf_counter()
        row = {
            "variant": variant,
            "kernel": c.kernel,
            "shape": c.shape,
            "M": c.m,
            "phase": c.phase,
            "bytes": c.bytes,
            "flops": c.flops,
        }
        try:
            row["rel_err"] = c.check()
            row["ms"] = graph_ms(c.calls)
        except Exception as exc:  # report, keep going: one bad config must not lose the rest
            row["error"] = f"{type(exc).__name__}: {exc}"[-1500:]
            rows.append(row)
            print(f"{variant:>18} {c.kernel:<18} M={c.m:<5} FAILED {row['error']}", flush=True)
            continue
        row["GBps"] = c.bytes / (row["ms"] * 1e-3) / 1e9
        row["TFLOPs"] = c.flops / (row["ms"] * 1e-3) / 1e12
        row["pct_copy"] = 100 * row["GBps"] / ceilings["copy_GBps"]
        row["pct_bf16"] = 100 * row["TFLOPs"] / ceilings["bf16_TFLOPs"]
        rows.append(row)
        print(
            f"{variant:>18} {c.kernel:<18} {c.shape:<40} M={c.m:<5} {row['ms']:9.4f} ms "
            f"{row['GBps']:8.0f} GB/s {row['pct_copy']:5.1f}% copy {row['TFLOPs']:7.1f} TF "
            f"err {row['rel_err']:.2e}  ({time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
    apply("after")
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    ok = [r for r in rows if "ms" in r]
    key = lambda r: (r["kernel"], r["shape"], r["M"])  # noqa: E731
    by = {(r["variant"],) + key(r): r for r in ok}
    lines = [
        "# Kernel roofline on one H200 (bench-preset shapes)",
        "",
        f"Generated by `{meta['command']}` on {meta['device']} (torch {meta['torch']}, triton "
        f"{meta['triton']}), commit {meta['commit']}.",
        f"Measured ceilings: copy {meta['copy_GBps']:.0f} GB/s (read + write), bf16 GEMM "
        f"{meta['bf16_TFLOPs']:.0f} TFLOP/s.",
        "Times: median per call over CUDA-graph replays (calls back to back over enough weight "
        "copies to stream from HBM). Bytes: weights + scales once, activations in and out. "
        "`before` = the previous kernels (rows kept in roofline_b428135.md; '-' in a run of "
        "today's code); `after` = the current defaults. err = max |out - ref| / max |ref| against a torch "
        "reference on the dequantised weights.",
        "",
        "| kernel | shape | M | MB moved | GFLOP | before ms | after ms | speed-up | after GB/s "
        "| % copy | after TFLOP/s | % bf16 | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    seen = []
    for r in ok:
        if key(r) not in seen:
            seen.append(key(r))
    for k in seen:
        a = by.get(("after",) + k)
        b = by.get(("before",) + k)
        if a is None:
            continue
        before = f"{b['ms']:.4f}" if b else "-"
        speed = f"{b['ms'] / a['ms']:.2f}x" if b else "-"
        lines.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {a['bytes'] / 1e6:.1f} | {a['flops'] / 1e9:.1f} | "
            f"{before} | {a['ms']:.4f} | {speed} | {a['GBps']:.0f} | {a['pct_copy']:.1f}% | "
            f"{a['TFLOPs']:.1f} | {a['pct_bf16']:.1f}% | {a['rel_err']:.1e} |"
        )
    sweeps = sorted({r["variant"] for r in ok} - {"before", "after"})
    if sweeps:
        lines += [
            "",
            "## Launch-configuration sweep (ms per call)",
            "",
            "| kernel | shape | M | after | " + " | ".join(sweeps) + " |",
            "|---|---|---|---|" + "---|" * len(sweeps),
        ]
        for k in seen:
            cells = [by.get((v,) + k) for v in sweeps]
            if not any(cells) or ("after",) + k not in by:
                continue
            lines.append(
                f"| {k[0]} | {k[1]} | {k[2]} | {by[('after',) + k]['ms']:.4f} | "
                + " | ".join(f"{c['ms']:.4f}" if c else "-" for c in cells)
                + " |"
            )
    failed = [r for r in rows if "error" in r]
    if failed:
        lines += ["", "## Failed", ""] + [
            f"- {r['variant']} {r['kernel']} {r['shape']} M={r['M']}: {r['error']}" for r in failed
        ]
    return "\n".join(lines) + "\n"


def use_tiny_shapes() -> None:
    """Shrink every shape (and move to the CPU) so the driver runs under the interpreter."""
    global HIDDEN, HEADS, HEAD_DIM, Q_LORA, O_LORA, O_GROUPS, INTER, EXPERTS, TOP_K
    global INDEX_HEADS, INDEX_DIM, WINDOW, TOPK_KEYS, DECODE_M, PREFILL_M, L2_BYTES, DEV
    os.environ["TRITON_INTERPRET"] = "1"
    HIDDEN, HEADS, HEAD_DIM, Q_LORA, O_LORA, O_GROUPS = 128, 4, 64, 64, 32, 2
    INTER, EXPERTS, TOP_K, INDEX_HEADS, INDEX_DIM = 64, 8, 2, 2, 32
    WINDOW, TOPK_KEYS, DECODE_M, PREFILL_M, L2_BYTES, DEV = 16, 24, (1, 3), 80, 1, "cpu"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/h200")
    ap.add_argument("--variants", nargs="*", default=["after"])
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP configurations")
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--sweep-only", nargs="*", default=None, help="with --sweep: these SWEEP names only")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU under the interpreter (checks the driver)"
    )
    ap.add_argument(
        "--budget-s", type=float, default=1e9, help="start no variant after this many seconds (results so far are kept)"
    )
    args = ap.parse_args(argv)
    if args.smoke:
        use_tiny_shapes()
    elif not torch.cuda.is_available():
        raise SystemExit("kernel_roofline needs a CUDA GPU")
    import triton

    os.makedirs(args.out, exist_ok=True)
    ceilings = measure_ceilings() if DEV == "cuda" else {"copy_GBps": 1.0, "bf16_TFLOPs": 1.0}
    meta = {
        "command": "python -m flashpd.bench.kernel_roofline " + " ".join(argv or []),
        "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "host": platform.node(),
        "commit": os.environ.get("FLASHPD_COMMIT", "unknown"),
        **ceilings,
        "dense_config": configs.DEFAULT.dense.as_dict(),
        "attention_config": configs.DEFAULT.attention.as_dict(),
    }
    print(f"ceilings: copy {ceilings['copy_GBps']:.0f} GB/s, bf16 {ceilings['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    sweep = list(SWEEP) if args.sweep_only is None else args.sweep_only
    cases = all_cases(args.quick)
    quick = [c for c in cases if c.m in (1, 64) and (c.kernel != "fp8_dense" or c.shape.split()[0] in ("wq_a", "wo_b"))]
    plan = [(v, cases) for v in args.variants]
    mx = [c for c in cases if c.kernel == "mxfp4_experts" and c.phase == "decode"]
    plan += [
        (v, [c for c in cases if c.phase == "prefill"] if v.startswith("pf_") else mx if v.startswith("mx_") else quick)
        for v in (sweep if args.sweep else [])
    ]
    rows: list[dict] = []
    t_start = time.perf_counter()
    for v, subset in plan:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"budget spent: {v} and later variants not run", flush=True)
            break
        rows += run_variant(v, subset, ceilings)
        with open(os.path.join(args.out, "roofline.json"), "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        with open(os.path.join(args.out, "roofline.md"), "w") as f:
            f.write(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
