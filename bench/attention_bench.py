"""Packed sparse attention at the bench shapes: correctness and time of launch variants (GPU).

    python -m flashpd.bench.attention_bench [--out FILE.json] [--quick]

Shapes (preset "bench"): H = 64 heads x d = 512, window W = 128 FP8 records, top-k K = 512 NVFP4
compressed records, RoPE on the last 64 channels. Prefill: T = 4096 and 8192 queries, query t's
window = pool rows t..t+127 (a sliding window), its top-k = random rows of a 4,096-entry pool.
Decode: B = 1, 8, 64 queries, each with its own random window rows and top-k rows out of an 8K
context's 4,096 entries per sequence (B x 4,096 entries, past the L2 at B = 64).

Each variant is a set of `kernels.attention.triton.CONFIG` overrides. For every (variant, shape)
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

H, D, W, K, PAIRS, ENTRIES = 64, 512, 128, 512, 32, 4096
PREFILL_T, DECODE_B = (4096, 8192), (1, 8, 64)
DEV = "cuda"

PREFILL_VARIANTS = {
    "legacy": {"legacy_max_q": 1 << 30},  # the per-head-block kernel before this change
    "heads_bn64_tau0": {"heads_rescale_tau": 0.0},
    "heads_bn64": {},
    "heads_bn64_prefetch": {"heads_prefetch": True},
    "heads_bn32_prefetch": {"heads_block_n": 32, "heads_prefetch": True},
}
DECODE_VARIANTS = {
    "legacy": {"legacy_max_q": 1 << 30},  # per-head-block kernel + its split-KV path
    "heads_t132_bn64": {"legacy_max_q": 0, "heads_split_target": 132},
    "heads_t132_bn32": {"legacy_max_q": 0, "heads_split_target": 132,
                        "heads_split_block_n": 32},
    "heads_nosplit": {"legacy_max_q": 0, "heads_split_target": 0},
    "default": {},
}


def _inputs(num_q: int, decode: bool, g: torch.Generator):
    from flashpd.kernels.quant import ref as qref
    from flashpd.kernels.rope import ref as rope

    entries = ENTRIES * (num_q if decode else 1)
    comp = qref.pack_nvfp4(torch.randn(entries, D, generator=g).to(DEV))
    if decode:
        win = qref.pack_window_fp8(torch.randn(num_q * W * 2, D, generator=g).to(DEV))
        win_rows = torch.randperm(num_q * W * 2, generator=g)[:num_q * W].view(num_q, W)
        comp_rows = (torch.randint(0, ENTRIES, (num_q, K), generator=g)
                     + ENTRIES * torch.arange(num_q)[:, None])
    else:
        win = qref.pack_window_fp8(torch.randn(num_q + W, D, generator=g).to(DEV))
        win_rows = torch.arange(num_q)[:, None] + torch.arange(W)[None, :]
        comp_rows = torch.randint(0, ENTRIES, (num_q, K), generator=g)
    pos = torch.randint(0, 1 << 16, (num_q,), generator=g)
    freqs = rope.rope_frequencies(2 * PAIRS, 160000.0, rope.Yarn(16, 32, 1, 65536))
    cos, sin = rope.rope_cos_sin(pos, freqs)
    q = torch.randn(num_q, H, D, generator=g).to(torch.bfloat16).to(DEV)
    sink = torch.randn(H, generator=g).to(DEV)
    return dict(q=q, rope=(cos.to(DEV), sin.to(DEV)), win=win, win_rows=win_rows.int().to(DEV),
                comp=comp, comp_rows=comp_rows.int().to(DEV), sink=sink, pos=pos.to(DEV),
                freqs=freqs.to(DEV))


def _call(x):
    from flashpd.kernels.attention import triton as at

    return at.sparse_attention_packed(x["q"], x["rope"], x["win"], x["win_rows"], x["comp"],
                                      x["comp_rows"], x["sink"], D ** -0.5)


def _reference(x, idx: torch.Tensor) -> torch.Tensor:
    from flashpd.kernels.attention import ref as aref
    from flashpd.kernels.quant import ref as qref
    from flashpd.kernels.rope import ref as rope

    wr, cr = x["win_rows"][idx].long(), x["comp_rows"][idx].long()
    keys = torch.cat((qref.unpack_window_fp8(x["win"], torch.bfloat16)[wr],
                      qref.unpack_nvfp4(x["comp"], torch.bfloat16)[cr]), dim=1)
    valid = torch.ones(keys.shape[:2], dtype=torch.bool, device=keys.device)
    pos = x["pos"][idx]
    o = aref.sparse_attention(rope.apply_rope(x["q"][idx], pos, x["freqs"]), keys, valid,
                              x["sink"], D ** -0.5)
    return rope.apply_rope(o, pos, x["freqs"], inverse=True)


def _check(x, idx, ref) -> float:
    """Relative error on the sampled queries; 1e9 if any output is NaN (the block the output
    is allocated from was filled with NaN just before)."""
    from flashpd.kernels.verify import errors

    out = _call(x)
    return errors(out[idx].float(), ref.float())[1] if not out.isnan().any() else 1e9


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


def run(quick: bool, only: list[str] | None = None) -> list[dict]:
    from flashpd.kernels.attention import triton as at

    default = dict(at.CONFIG)
    g = torch.Generator().manual_seed(0)
    rows = []
    plans = [("prefill", t, PREFILL_VARIANTS) for t in (PREFILL_T[:1] if quick else PREFILL_T)]
    plans += [("decode", b, DECODE_VARIANTS) for b in DECODE_B]
    for phase, num_q, variants in plans:
        x = _inputs(num_q, phase == "decode", g)
        idx = (torch.randperm(num_q, generator=g)[:256].sort().values.to(DEV)
               if num_q > 256 else torch.arange(num_q, device=DEV))
        ref = _reference(x, idx)
        flops = 4.0 * num_q * H * (W + K) * D
        nbytes = num_q * (W * x["win"].shape[1] + K * x["comp"].shape[1] + 2 * H * D * 2)
        for name, over in variants.items():
            if only and name not in only:
                continue
            at.CONFIG.clear()
            at.CONFIG.update(default, **over)
            row = {"phase": phase, "rows": num_q, "variant": name}
            t0 = time.perf_counter()
            try:
                torch.empty(num_q * H * D, dtype=torch.bfloat16, device=DEV).fill_(
                    float("nan"))
                row["rel_err"] = _check(x, idx, ref)
                if DEV != "cuda":
                    rows.append(row)
                    continue
                row["ms"] = (_time_graph(lambda x=x: _call(x)) if phase == "decode"
                             else _time_events(lambda x=x: _call(x)))
                row["tflops"] = flops / row["ms"] / 1e9
                row["gbps"] = nbytes / row["ms"] / 1e6
                if phase == "decode":
                    row["plan"] = at.heads_plan(num_q, H, (W, K))
            except Exception as exc:  # a variant that fails to compile or run is reported
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
        del x
    at.CONFIG.clear()
    at.CONFIG.update(default)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| phase | rows | variant | ms | TFLOP/s | GB/s | rel err |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['phase']} | {r['rows']} | {r['variant']} | error: "
                         f"{r['error'][:80]} | | | |")
            continue
        lines.append(f"| {r['phase']} | {r['rows']} | {r['variant']} | {r['ms']:.4f} | "
                     f"{r['tflops']:.1f} | {r['gbps']:.0f} | {r['rel_err']:.2e} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--quick", action="store_true", help="prefill T = 4096 only")
    ap.add_argument("--variants", nargs="*", help="run only these variants")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, checks only (runs under the CPU interpreter)")
    args = ap.parse_args(argv)
    global H, D, W, K, PAIRS, ENTRIES, PREFILL_T, DECODE_B, DEV
    if args.smoke:
        H, D, W, K, PAIRS, ENTRIES, PREFILL_T, DECODE_B = 4, 64, 16, 24, 8, 64, (40,), (1, 3)
    if not torch.cuda.is_available():
        if not args.smoke:
            raise SystemExit("attention_bench needs a CUDA GPU (or --smoke)")
        DEV = "cpu"
    rows = run(args.quick, args.variants)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(table(rows) if DEV == "cuda" else json.dumps(rows))


if __name__ == "__main__":
    main()
