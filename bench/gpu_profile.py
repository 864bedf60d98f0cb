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
import re
import time
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
    ("gemv", "GEMM (FP8 dense / MXFP4 experts, dequantised in registers)"),
    ("swapab", "GEMM (FP8 dense / MXFP4 experts, dequantised in registers)"),
    ("fp8_swap", "GEMM (FP8 dense / MXFP4 experts, dequantised in registers)"),
    ("cutlass", "GEMM (cuBLAS / CUTLASS on dequantised BF16 weights)"),
    ("nvjet", "GEMM (cuBLAS / CUTLASS on dequantised BF16 weights)"),
    ("_dequant", "GEMM (cuBLAS / CUTLASS on dequantised BF16 weights)"),
    ("_swiglu", "GEMM (cuBLAS / CUTLASS on dequantised BF16 weights)"),
    ("heads_kernel", "sparse attention"),
    ("_prep_kernel", "GEMM (FP8 dense / MXFP4 experts, dequantised in registers)"),
    ("sort_pairs", "MoE gate"),
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


def _engine(cfg, model, context: int, batch: int, spec=None) -> LLMEngine:
    """spec: a SpeculativeConfig (the profiled steps are then its verify steps)."""
    return LLMEngine(
        model,
        EngineConfig(
            dtype="bfloat16",
            device="cuda",
            num_blocks=context // 64 + 16 + 2 * batch,
            num_slots=batch + 4,
            max_num_batched_tokens=8192,
            max_num_seqs=batch,
            model_id="flashpd-profile",
            speculative=spec,
        ),
    )


FIRST_PROMPT_MS: list[float] = []  # per _start call: ms to the prefix prompt's first token


def _start(engine: LLMEngine, cfg, context: int, batch: int, tag: str) -> list[str]:
    """`batch` sequences decoding over one shared `context`-token prefix (prefix hits)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, cfg.vocab_size - 10, (context,), generator=g).tolist()
    t0 = time.perf_counter()
    engine.add_request(f"{tag}p", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    FIRST_PROMPT_MS.append(1e3 * (time.perf_counter() - t0))
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


_FRAME = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\): (?P<func>.*)$")


def _profile_kwargs() -> dict:
    """with_stack alone leaves FunctionEvent.stack empty (torch 2.x): the Python stacks are
    attached only with the verbose experimental config."""
    kwargs = {"activities": [ProfilerActivity.CPU, ProfilerActivity.CUDA], "with_stack": True}
    try:
        from torch._C._profiler import _ExperimentalConfig

        kwargs["experimental_config"] = _ExperimentalConfig(verbose=True)
    except (ImportError, TypeError):  # no verbose config in this torch: the profiler's
        kwargs["experimental_config"] = None  # default; op rows then lose their call sites
    return kwargs


def _caller(ev, depth: int = 2) -> str:
    """The innermost `depth` flashpd frames of an op event, "file:function" innermost first:
    from its recorded stack, else from the Python-function events above it in the tree."""
    frames = list(ev.stack or [])
    if not frames:
        parent = ev.cpu_parent
        while parent is not None:
            if _FRAME.match(parent.name):
                frames.append(parent.name)
            parent = parent.cpu_parent
    out = []
    for frame in frames:
        m = _FRAME.match(frame)
        path = m.group("file") if m else frame
        if "flashpd/" not in path and "/work/" not in path:
            continue
        rel = path.split("flashpd/")[-1] if "flashpd/" in path else path.split("/work/main/")[-1]
        if rel.startswith("bench/gpu_profile"):
            break  # the driver, not a source of ops
        out.append(f"{rel}:{m.group('func') if m else ''}")
        if len(out) == depth:
            break
    return " < ".join(out)


def op_table(run, steps: int, top: int = 30, sites: int = 40) -> list[str]:
    """Device time of the torch ops (not the Triton kernels): per op, then per op and the
    flashpd functions that called it (where the small glue kernels of a step come from)."""
    with profile(**_profile_kwargs()) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    per_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    per_site: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        us = getattr(ev, "self_device_time_total", None)
        us = getattr(ev, "self_cuda_time_total", 0) if us is None else us
        if not us:
            continue
        for table, key in ((per_op, ev.name), (per_site, (ev.name, _caller(ev)))):
            table[key][0] += us
            table[key][1] += 1
    total = sum(v[0] for v in per_op.values()) / steps / 1e3
    lines = [
        f"Torch ops: {total:.2f} ms per step ({sum(v[1] for v in per_op.values()) / steps:.0f} launches).",
        "",
        "| torch op | ms/step | calls/step |",
        "|---|---|---|",
    ]
    for key, (us, n) in sorted(per_op.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| `{key}` | {us / steps / 1e3:.3f} | {n / steps:.0f} |")
    lines += ["", "| torch op | called from | ms/step | calls/step |", "|---|---|---|---|"]
    for (key, site), (us, n) in sorted(per_site.items(), key=lambda kv: -kv[1][0])[:sites]:
        lines.append(f"| `{key}` | {site or '?'} | {us / steps / 1e3:.3f} | {n / steps:.0f} |")
    return lines


def prefill_profile(cfg, model, length: int, steps: int) -> list[str]:
    """The prefill role's job (encoder path + layer 20's KV write) on one `length`-token
    prompt: kernel table and torch-op table after a warm-up run."""
    engine = LLMEngine(
        model,
        EngineConfig(
            role="prefill",
            dtype="bfloat16",
            device="cuda",
            num_blocks=length // 64 + 8,
            num_slots=2,
            max_num_batched_tokens=8192,
            max_num_seqs=2,
            model_id="flashpd-profile",
        ),
    )
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
    lines = [
        f"## Prefill role, {length:,}-token prompt",
        "",
        f"Device time: {total:.1f} ms (eager).",
        "",
        "| group | ms | share |",
        "|---|---|---|",
    ]
    for group, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {group} | {ms:.2f} | {100 * ms / total:.0f}% |")
    lines += ["", "Top kernels:", "", "| kernel | ms |", "|---|---|"]
    for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]:
        lines.append(f"| `{name[:80]}` | {ms:.2f} |")
    lines += [""] + op_table(one, 1) + [""]
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
    ap.add_argument(
        "--warm-prefill",
        type=int,
        default=None,
        help="rows of the load-time prefill warm-up (default: the model's; 0: none)",
    )
    ap.add_argument(
        "--spec",
        type=float,
        default=None,
        metavar="AL",
        help="profile speculative verify steps instead: prompt-lookup drafts of 5, acceptance forced "
        "to AL (a benchmark mode: needs FLASHPD_BENCH_FORCED_ACCEPTANCE=1); writes verify_profile.md",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    spec = None
    if args.spec is not None:
        from flashpd.engine.speculative import SpeculativeConfig

        spec = SpeculativeConfig(num_tokens=5, max_batch=max(args.batch), bench_forced_acceptance_length=args.spec)
    cfg = preset_config(args.preset)
    t0 = time.perf_counter()
    model = random_gpu_model(cfg, "cuda", seed=0, warm=False)
    t1 = time.perf_counter()
    model.warmup(prefill_rows=args.warm_prefill)
    split = getattr(model, "warmup_s", {})
    warm = (
        f"model built in {t1 - t0:.1f} s, warmed in {time.perf_counter() - t1:.1f} s ("
        + ", ".join(f"{k} {v:.1f} s" for k, v in split.items())
        + ")"
    )
    print(warm, flush=True)
    graphs = model.graphs
    step_kind = "Decode step" if spec is None else f"Speculative verify step (5 drafts, forced AL {args.spec})"
    command = "python -m flashpd.bench.gpu_profile --out bench/results/h200"
    if spec is not None:
        command = f"FLASHPD_BENCH_FORCED_ACCEPTANCE=1 {command} --spec {args.spec}"
    lines = [
        f"# {step_kind} GPU time by kernel: `{args.preset}` preset, "
        f"{args.context:,}-token context (eager, torch.profiler)",
        "",
        f"Command: `{command}`",
        "",
        "Eager steps (graphs off, so that every kernel shows under its own name); the "
        "captured graph replays the same kernels.",
        "",
        warm + ".",
        "",
    ]
    for batch in args.batch:
        engine = _engine(cfg, model, args.context, batch, spec)
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
        lines += [
            f"## B={batch}",
            "",
            f"Device time per step: {total:.1f} ms over {args.steps} steps (eager).",
            "",
            f"The {args.context:,}-token prefix prompt (the engine's first request "
            f"{'after load' if batch == args.batch[0] else ''}): first token in "
            f"{FIRST_PROMPT_MS[-1]:.0f} ms.",
            "",
        ]
        if host:
            lines += [
                f"Graphed step: wall {host['wall_ms']:.1f} ms, device span (CUDA events) {host['events_ms']:.1f} ms.",
                "",
            ]
        lines += ["| group | ms/step | share |", "|---|---|---|"]
        for group, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {group} | {ms:.2f} | {100 * ms / total:.0f}% |")
        lines += ["", "Top kernels:", "", "| kernel | ms/step |", "|---|---|"]
        for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]:
            lines.append(f"| `{name[:80]}` | {ms:.2f} |")
        lines.append("")
        if ops:
            lines += ops + [""]
        print("\n".join(lines), flush=True)
    if args.prefill:
        lines += prefill_profile(cfg, model, args.prefill, args.steps)
        print("\n".join(lines[-60:]), flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "decode_profile.md" if spec is None else "verify_profile.md"
        with open(os.path.join(args.out, name), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
