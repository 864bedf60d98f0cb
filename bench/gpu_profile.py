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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = preset_config(args.preset)
    model = random_gpu_model(cfg, "cuda", seed=0, decode_graphs=False)
    engine = LLMEngine(model, EngineConfig(
        dtype="bfloat16", device="cuda", num_blocks=args.context // 64 + 16, num_slots=4,
        max_num_batched_tokens=8192, max_num_seqs=4, model_id="flashpd-profile"))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, cfg.vocab_size - 10, (args.context,), generator=g).tolist()
    engine.add_request("p", prompt, SamplingParams(max_tokens=1000, ignore_eos=True))
    while engine.stats["p"].first_token_s is None:
        engine.step()
    for _ in range(2):  # compile the decode shapes
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        if str(ev.device_type).endswith("CUDA"):  # kernels only (CPU ops would count twice)
            us = getattr(ev, "self_device_time_total", None)
            us = ev.self_cuda_time_total if us is None else us
            per_kernel[ev.key] += us / args.steps / 1e3  # ms per step
    total = sum(per_kernel.values())
    groups: dict[str, float] = defaultdict(float)
    for name, ms in per_kernel.items():
        groups[group_of(name)] += ms
    lines = [f"# Decode step GPU time by kernel: `{args.preset}` preset, B=1, "
             f"{args.context:,}-token context (eager, torch.profiler)", "",
             "Command: `python -m flashpd.bench.gpu_profile --out bench/results/h200`", "",
             f"Device time per step: {total:.1f} ms over {args.steps} steps.", "",
             "| group | ms/step | share |", "|---|---|---|"]
    for group, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {group} | {ms:.2f} | {100 * ms / total:.0f}% |")
    lines += ["", "Top kernels:", "", "| kernel | ms/step |", "|---|---|"]
    for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]:
        lines.append(f"| `{name[:80]}` | {ms:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_profile.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
