"""Disaggregated path vs the single-process engine on the tiny preset (CPU), and router decision
latency. Runs the same sequential requests (fixed prompts, greedy, ignore_eos) both ways.

    unshare -n sh -c 'ip link set lo up && python -m flashpd.bench.pd_overhead'
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from flashpd.bench.records import write_markdown
from flashpd.engine.llm_engine import EngineConfig
from flashpd.engine.sampling import SamplingParams


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def local_engine(checkpoint: str, prompts, max_tokens: int) -> dict[str, list[float]]:
    from flashpd.engine.loading import load_engine

    engine = load_engine(checkpoint, EngineConfig(num_blocks=256, num_threads=1))  # as workers
    ttft, e2e = [], []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        first = None
        while engine.has_unfinished():
            for o in engine.step():
                if o.new_token_ids and first is None:
                    first = time.perf_counter()
        ttft.append(1e3 * (first - t0))
        e2e.append(1e3 * (time.perf_counter() - t0))
    return {"ttft": ttft, "e2e": e2e}


def served(args, prompts, max_tokens: int) -> dict[str, list[float]]:
    from flashpd.services.cli import local_stack, wait_healthy
    from flashpd_sdk import Client

    parts = ("route_ms", "reserve_ms", "prefill_ms", "transfer_ms", "replay_ms")
    out: dict[str, list[float]] = {"ttft": [], "e2e": [], **{k: [] for k in parts}}
    with local_stack(args):
        client = Client(f"127.0.0.1:{args.grpc_port}")
        wait_healthy(client)
        for p in prompts:
            t0 = time.perf_counter()
            stream = client.generate(prompt_ids=p, max_tokens=max_tokens, ignore_eos=True, timeout_s=120)
            first = None
            for _ in stream:
                first = first or time.perf_counter()
            out["ttft"].append(1e3 * (first - t0))
            out["e2e"].append(1e3 * (time.perf_counter() - t0))
            for k in parts:
                out[k].append(stream.result.timeline.get(k, 0.0))
        client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from flashpd.services.cli import tiny_checkpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default="bench/results/pd_overhead_cpu.md")
    args = ap.parse_args(argv)
    for key, value in dict(
        checkpoint=None,
        redis=None,
        prefill_replicas=1,
        decode_replicas=1,
        grpc_port=9000,
        http_port=8000,
        routing="affinity",
        no_swa_bounded_replay=False,
        transfer_backend="nixl",
        num_blocks=512,
        kv_format="nvfp4",
    ).items():
        setattr(args, key, value)
    ckpt = tiny_checkpoint()
    prompts = [_prompt(args.prompt_tokens, 1000 + i) for i in range(args.requests)]
    local = local_engine(ckpt, prompts, args.max_tokens)
    pd = served(args, prompts, args.max_tokens)
    rows = [
        "# Disaggregated path overhead, tiny preset on CPU",
        "",
        f"{args.requests} sequential requests, {args.prompt_tokens}-token prompts (distinct, "
        f"no prefix hits), {args.max_tokens} output tokens, greedy; 1 prefill + 1 decode "
        "replica on local Ray, NIXL over UCX loopback, Redis index; versus LLMEngine in "
        f"one process. Machine: {os.cpu_count()} cores.",
        "",
        "| path | TTFT p50 ms | TTFT p90 ms | e2e p50 ms | e2e p90 ms |",
        "|---|---|---|---|---|",
    ]
    for name, r in (("single-process engine", local), ("disaggregated (gRPC, P->D)", pd)):
        rows.append(
            f"| {name} | {statistics.median(r['ttft']):.1f} | {_pct(r['ttft'], 0.9):.1f} "
            f"| {statistics.median(r['e2e']):.1f} | {_pct(r['e2e'], 0.9):.1f} |"
        )
    over_ttft = statistics.median(pd["ttft"]) - statistics.median(local["ttft"])
    over_e2e = statistics.median(pd["e2e"]) - statistics.median(local["e2e"])
    rows += [
        "",
        f"Per-request overhead (p50): TTFT +{over_ttft:.1f} ms, e2e +{over_e2e:.1f} ms.",
        "",
        "| router decision latency | p50 ms | p99 ms |",
        "|---|---|---|",
        f"| placement (Redis lookup + policy) | {statistics.median(pd['route_ms']):.2f} | "
        f"{_pct(pd['route_ms'], 0.99):.2f} |",
        "",
        "Disaggregated timeline, p50 ms: "
        + ", ".join(
            f"{k[:-3]} {statistics.median(pd[k]):.1f}" for k in ("reserve_ms", "prefill_ms", "transfer_ms", "replay_ms")
        ),
        "",
        "Command: `unshare -n sh -c 'ip link set lo up && python -m flashpd.bench.pd_overhead'`",
    ]
    write_markdown(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
