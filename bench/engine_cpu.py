"""Engine figures on CPU, tiny preset: decode throughput by batch, TTFT cold vs prefix hit,
pool memory for 32 concurrent 2K-token requests against the bytes the config predicts.

    python -m flashpd.bench.engine_cpu --out bench/results/engine_cpu.md
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from flashpd.bench.records import write_markdown
from flashpd.engine.kv_pools import PoolGeometry
from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def decode_throughput(model, batch: int, prompt_tokens: int = 64, new_tokens: int = 16) -> float:
    """Output tokens/s once every request is decoding (prefill excluded)."""
    engine = LLMEngine(
        model, EngineConfig(num_blocks=4 * batch + 8, num_slots=batch, max_num_seqs=batch, max_num_batched_tokens=8192)
    )
    for i in range(batch):
        engine.add_request(
            f"r{i}", _prompt(prompt_tokens, i), SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True)
        )
    engine.step()  # all prompts in one step; each request sampled its first token
    t0, produced = time.perf_counter(), 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - t0)


def ttft_ms(model, prompt: list[int], replay: bool, warm_prefix: list[int] | None) -> tuple[float, int]:
    engine = LLMEngine(model, EngineConfig(num_blocks=64, swa_bounded_replay=replay, max_num_batched_tokens=2048))
    if warm_prefix is not None:
        engine.add_request("warm", warm_prefix, SamplingParams(max_tokens=1))
        _drain(engine)
    engine.add_request("q", prompt, SamplingParams(max_tokens=1))
    t0 = time.perf_counter()
    cached = 0
    while engine.has_unfinished():
        for o in engine.step():
            cached = o.cached_tokens
    return 1e3 * (time.perf_counter() - t0), cached


def pool_memory(cfg, requests: int = 32, tokens: int = 2048) -> dict:
    from flashpd.engine.kv_pools import KVPools

    blocks = requests * (tokens // 128)
    pools = KVPools(cfg, num_blocks=blocks, num_slots=requests)
    geo = PoolGeometry(cfg)
    return {
        "global_bytes": pools.global_bytes,
        "private_bytes": pools.private_bytes,
        "predicted_global": int(cfg.global_kv_bytes_per_token * requests * tokens),
        "predicted_private": geo.slot_bytes * requests,
    }


def main(argv: list[str] | None = None) -> int:
    from flashpd.model.checkpoint import write_random_checkpoint
    from flashpd.model.model import load_model
    from flashpd.model.presets import preset_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/engine_cpu.md")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = preset_config("tiny")
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(cfg, tmp, seed=0)
        model = load_model(tmp, torch.float32)
    lines = [
        "# Engine on CPU, tiny preset (FP32)",
        "",
        f"torch threads: {args.threads}; machine: {os.cpu_count()} cores",
        "",
        "## Decode throughput (64-token prompts, 16 decode steps)",
        "",
        "| batch | output tok/s | ms per step |",
        "|---|---|---|",
    ]
    for batch in (1, 8, 32):
        tps = decode_throughput(model, batch)
        lines.append(f"| {batch} | {tps:.1f} | {1e3 * batch / tps:.1f} |")
        print(lines[-1], flush=True)
    prompt = _prompt(2048, 99)
    prefix = prompt[:1920] + _prompt(64, 98)  # shares 15 chunks with the prompt
    lines += ["", "## TTFT of a 2,048-token prompt", "", "| case | TTFT ms | cached tokens |", "|---|---|---|"]
    for label, replay, warm in (
        ("cold, replay on", True, None),
        ("cold, replay off", False, None),
        ("after 1,920-token prefix hit, bounded replay on", True, prefix),
        ("after 1,920-token prefix hit, replay off (exact)", False, prefix),
    ):
        ms, cached = ttft_ms(model, prompt, replay, warm)
        lines.append(f"| {label} | {ms:.0f} | {cached} |")
        print(lines[-1], flush=True)
    mem = pool_memory(cfg)
    lines += [
        "",
        "## Pool memory, 32 concurrent 2,048-token requests",
        "",
        "| pool | allocated bytes | predicted from config |",
        "|---|---|---|",
        f"| global (compressed KV + index keys) | {mem['global_bytes']:,} | "
        f"{mem['predicted_global']:,} ({cfg.global_kv_bytes_per_token:.0f} B/token) |",
        f"| private (window rings + open-group rows) | {mem['private_bytes']:,} | {mem['predicted_private']:,} |",
        "",
        "Command: `python -m flashpd.bench.engine_cpu`",
    ]
    write_markdown(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
