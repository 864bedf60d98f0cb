"""Sampler cost per decode step: B rows of bench-preset logits (V = 129,280) on the device.

    python -m flashpd.bench.sampler_bench [--before OLD_SAMPLING_PY] [--batch 1 8 64]

Times `Sampler.sample` (wall ms per call, logits already on the device, median of 10 calls after
2 warm calls) for greedy rows, temperature 0.8 / top-p 0.95 rows, and top-k 50 rows;
--before loads another engine/sampling.py (e.g. `git show <rev>:engine/sampling.py`) and times
its Sampler on the same inputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import torch

from flashpd.engine.sampling import Sampler, SamplingParams

CASES = {
    "greedy": SamplingParams(),
    "t0.8 top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "t1.0 top-k 50 seeded": SamplingParams(temperature=1.0, top_k=50, seed=5),
}


def _load(path: str):
    spec = importlib.util.spec_from_file_location("sampling_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file runs
    spec.loader.exec_module(mod)
    return mod.Sampler


def _ms(sampler, logits, rids, params) -> float:
    times = []
    for i in range(12):
        if logits.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sampler.sample(logits, rids, params)
        if logits.is_cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--vocab", type=int, default=129_280)
    ap.add_argument("--before", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    samplers = {"now": Sampler}
    if args.before:
        samplers["before"] = _load(args.before)
    print("| rows | params | " + " | ".join(f"{k} ms" for k in samplers) + " |")
    print("|---|---|" + "---|" * len(samplers))
    for b in args.batch:
        logits = torch.randn(b, args.vocab, generator=torch.Generator().manual_seed(b)).to(args.device)
        rids = [f"r{i}" for i in range(b)]
        for name, p in CASES.items():
            cells = [f"{_ms(cls(0), logits, rids, [p] * b):.2f}" for cls in samplers.values()]
            print(f"| {b} | {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
