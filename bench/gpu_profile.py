"""Where a bench-preset decode step spends its GPU time, by kernel (torch.profiler).

    python -m flashpd.bench.gpu_profile --out bench/results/h200

One sequence with an 8K-token prompt goes through the engine on the GPU; then a few decode steps
run eagerly (graphs off, so that every kernel shows under its own name) under the profiler. The
table sums device time per kernel name over those steps and divides by the step count; the
captured graph replays the same kernels, so the split carries over (launch gaps aside).
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  (before any kernel import)
# isort: on

from flashpd.engine.gpu.loading import random_gpu_model
from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams
from flashpd.model.presets import preset_config

GROUPS = (  # kernel-name fragment -> what it is (first match wins)
    ("grouped_gemm", "GEMM (FP8 dense / MXFP4 experts, dequantised in registers)"),
    ("_gemm", "GEMM (FP8 dense / MXFP4 experts, dequantised in registers)"),
    ("attn", "sparse attention"),
    ("score", "indexer scoring"),
    ("topk", "top-k / candidate blocks"),
    ("block_max", "top-k / candidate blocks"),
    ("route", "MoE gate"),
    ("mhc", "mHC"),
    ("sinkhorn", "mHC"),
    ("mix", "mHC"),
    ("collapse", "mHC"),
    ("expand", "mHC"),
    ("rms", "RMSNorm"),
    ("kv_write", "KV writes / quantisation"),
    ("engram", "Engram"),
    ("gather", "Engram"),
)


def group_of(name: str) -> str:
    low = name.lower()
    for frag, group in GROUPS:
        if frag in low:
            return group
    return "torch ops (index/copy/elementwise/sort)"


def _engine(cfg, model, context: int, batch: int) -> LLMEngine:
    return LLMEngine(model, EngineConfig(
        dtype="bfloat16", device="cuda", num_blocks=context // 64 + 16 + 2 * batch,
        num_slots=batch + 4, max_num_batched_tokens=8192, max_num_seqs=batch,
        model_id="flashpd-profile"))


def _start(engine: LLMEngine, cfg, context: int, batch: int, tag: str) -> list[str]:
    """`batch` sequences decoding over one shared `context`-token prefix (prefix hits)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, cfg.vocab_size - 10, (context,), generator=g).tolist()
    engine.add_request(f"{tag}p", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    rids = [f"{tag}{b}" for b in range(batch)]
    for rid in rids:
        tail = torch.randint(10, cfg.vocab_size - 10, (16,), generator=g).tolist()
        engine.add_request(rid, prompt + tail, SamplingParams(max_tokens=10_000, ignore_eos=True))
    while any(engine.stats[r].first_token_s is None for r in rids):
        engine.step()
    for _ in range(2):  # compile the decode shapes
        engine.step()
    torch.cuda.synchronize()
    return rids


def kernel_table(engine: LLMEngine, steps: int) -> tuple[float, dict, dict]:
    return kernel_table_of(engine.step, steps)


def host_split(engine: LLMEngine, steps: int) -> dict:
    """Graphed steps: wall ms, GPU ms of the step's device work (CUDA events around it) and the
    host ms spent outside the device wait (cProfile's top functions printed)."""
    import cProfile
    import pstats
    import time

    walls, gpus = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        engine.step()
        b.record()
        torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - t0))
        gpus.append(a.elapsed_time(b))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    pr.disable()
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(40)
    return {"wall_ms": sorted(walls)[len(walls) // 2], "events_ms": sorted(gpus)[len(gpus) // 2]}


def op_table(run, steps: int, top: int = 30) -> list[str]:
    """Device time of the torch ops (not the Triton kernels) by op and the Python line that
    called it: where the small glue kernels of a step come from."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages(group_by_stack_n=4):
        us = getattr(ev, "self_device_time_total", 0) or 0
        if us and ev.key.startswith("aten::"):
            stack = " < ".join(f.split("/flashpd/")[-1] for f in (ev.stack or [])[:4])
            rows.append((us / steps / 1e3, ev.count // steps, ev.key, stack))
    rows.sort(reverse=True)
    lines = ["| torch op | ms/step | calls/step | called from |", "|---|---|---|---|"]
    for ms, n, key, stack in rows[:top]:
        lines.append(f"| `{key}` | {ms:.3f} | {n} | {stack[:160]} |")
    return lines


def prefill_profile(cfg, model, length: int, steps: int) -> list[str]:
    """The prefill role's job (encoder path + layer 20's KV write) on one `length`-token
    prompt: kernel table and torch-op table after a warm-up run."""
    engine = LLMEngine(model, EngineConfig(
        role="prefill", dtype="bfloat16", device="cuda", num_blocks=length // 64 + 8,
        num_slots=2, max_num_batched_tokens=8192, max_num_seqs=2, model_id="flashpd-profile"))
    g = torch.Generator().manual_seed(1)
    counter = iter(range(1_000_000))

    def one() -> None:
        rid = f"pf{next(counter)}"
        prompt = torch.randint(10, cfg.vocab_size - 10, (length,), generator=g).tolist()
        engine.add_request(rid, prompt, SamplingParams())
        done = False
        while not done:
            done = any(o.finished for o in engine.step())
        engine.release_kv(rid)

    one()
    torch.cuda.synchronize()
    total, groups, per_kernel = kernel_table_of(one, 1)
    lines = [f"## Prefill role, {length:,}-token prompt", "",
             f"Device time: {total:.1f} ms (eager).", "", "| group | ms | share |", "|---|---|---|"]
    for group, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {group} | {ms:.2f} | {100 * ms / total:.0f}% |")
    lines += ["", "Top kernels:", "", "| kernel | ms |", "|---|---|"]
    for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]:
        lines.append(f"| `{name[:80]}` | {ms:.2f} |")
    lines += ["", "Torch ops:", ""] + op_table(one, 1) + [""]
    return lines


def kernel_table_of(run, steps: int) -> tuple[float, dict, dict]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        if str(ev.device_type).endswith("CUDA"):
            us = getattr(ev, "self_device_time_total", None)
            us = ev.self_cuda_time_total if us is None else us
            per_kernel[ev.key] += us / steps / 1e3
    groups: dict[str, float] = defaultdict(float)
    for name, ms in per_kernel.items():
        groups[group_of(name)] += ms
    return sum(per_kernel.values()), groups, per_kernel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--host", action="store_true", help="also graphed steps under cProfile")
    ap.add_argument("--ops", action="store_true", help="also torch ops by calling line")
    ap.add_argument("--prefill", type=int, default=0, help="also profile an N-token prefill")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = preset_config(args.preset)
    import time

    t0 = time.perf_counter()
    model = random_gpu_model(cfg, "cuda", seed=0, warm=False)
    t1 = time.perf_counter()
    model.warmup()
    print(f"model built in {t1 - t0:.1f} s, warmed in {time.perf_counter() - t1:.1f} s", flush=True)
    graphs = model.graphs
    lines = [f"# Decode step GPU time by kernel: `{args.preset}` preset, "
             f"{args.context:,}-token context (eager, torch.profiler)", "",
             "Command: `python -m flashpd.bench.gpu_profile --out bench/results/h200`", "",
             "Eager steps (graphs off, so that every kernel shows under its own name); the "
             "captured graph replays the same kernels.", ""]
    for batch in args.batch:
        engine = _engine(cfg, model, args.context, batch)
        rids = _start(engine, cfg, args.context, batch, f"b{batch}_")
        host = None
        if args.host and graphs is not None:
            host = host_split(engine, args.steps)
            print(f"B={batch} graphed: {host}", flush=True)
        model.graphs = None
        total, groups, per_kernel = kernel_table(engine, args.steps)
        ops = op_table(engine.step, args.steps) if args.ops else []
        model.graphs = graphs
        for rid in rids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        del engine
        lines += [f"## B={batch}", "", f"Device time per step: {total:.1f} ms over "
                  f"{args.steps} steps (eager).", ""]
        if host:
            lines += [f"Graphed step: wall {host['wall_ms']:.1f} ms, device span (CUDA "
                      f"events) {host['events_ms']:.1f} ms.", ""]
        lines += ["| group | ms/step | share |", "|---|---|---|"]
        for group, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {group} | {ms:.2f} | {100 * ms / total:.0f}% |")
        lines += ["", "Top kernels:", "", "| kernel | ms/step |", "|---|---|"]
        for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]:
            lines.append(f"| `{name[:80]}` | {ms:.2f} |")
        lines.append("")
        if ops:
            lines += ["Torch ops (eager):", ""] + ops + [""]
        print("\n".join(lines), flush=True)
    if args.prefill:
        lines += prefill_profile(cfg, model, args.prefill, args.steps)
        print("\n".join(lines[-60:]), flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_profile.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
