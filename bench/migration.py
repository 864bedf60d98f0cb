"""Live decode migration and exact resume on a real local stack (Ray Serve + Redis + NIXL over
loopback, tiny preset on CPU): what a migrated stream pays, how long a drain takes, and the
time to resume after a decode kill with bounded vs exact replay.

    unshare -n sh -c 'ip link set lo up && python -m flashpd.bench.migration'

- drain (1 prefill + 2 decode): `--streams` greedy OpenAI SSE streams (each chunk names its
  decode worker, so the switch is seen); once each has `--drain-after` tokens the busiest
  decode replica is marked draining (`flashpd drain`'s Redis mark). Per migrated stream: the
  pause in token arrival at the switch (the gap across it, and that gap minus the stream's
  median gap), KV bytes moved (router counter / streams moved); the drain time: mark to the
  replica holding no sequence and no block.
- resume after a decode kill (2 prefill + 2 decode, once with the default 128-token bounded
  replay, once with exact replay): greedy SDK streams of one session are killed mid-stream;
  time to resume = the gap in token arrival across the kill (the stream goes on through the
  router: re-placement, prefill of the original prompt, replay + recompute of the streamed
  tokens on the new decode worker). Both rebuild the original windows (identical output).

Times are wall-clock on a shared 2-core CPU, so they move with the machine's load; the KV
bytes do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

from flashpd.services.faults import scenarios
from flashpd.services.faults.stack import FaultStack, StackConfig, start_ray, stop_ray

OUT = "bench/results/migration_cpu"


async def _sse(stack: FaultStack, ids: list[int], max_tokens: int, progress: list, i: int):
    """One greedy completions SSE stream: per chunk (arrival monotonic s, decode worker)."""
    import httpx

    body = {"prompt": ids, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    arrivals: list[tuple[float, str]] = []
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=600) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                worker = chunk.get("flashpd", {}).get("decode_worker", "")
                if chunk["choices"][0].get("text") is not None:
                    arrivals.append((time.monotonic(), worker))
                    progress[i] += 1
    return arrivals


def _gap_across(arrivals: list[tuple[float, str]], at: float) -> dict | None:
    """The gap in token arrival spanning `at` and the stream's median gap (None: the stream
    had no token on one side of `at`)."""
    times = [t for t, _ in arrivals]
    before, after = [t for t in times if t <= at], [t for t in times if t > at]
    if not before or not after:
        return None
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"gap_s": after[0] - before[-1], "median_gap_s": statistics.median(gaps)}


async def drain_run(stack: FaultStack, streams: int, prompt_tokens: int, max_tokens: int,
                    drain_after: int) -> dict:
    vocab = await scenarios.vocab_size(stack)
    rng = random.Random(8)
    prompts = [scenarios.prompt_ids(rng, prompt_tokens, vocab) for _ in range(streams)]
    before = await scenarios.drain_counters(stack)
    progress = [0] * streams
    info: dict = {}

    async def drain() -> None:
        while min(progress) < drain_after:
            await asyncio.sleep(0.005)
        busiest = max((w for w in await asyncio.to_thread(stack.worker_stats)
                       if w.role == "decode"), key=lambda w: w.running)
        info.update(worker=busiest.worker_id, running=busiest.running)
        info["marked_at"] = time.monotonic()
        await stack.drain_replica(busiest.worker_id)
        idle = await asyncio.to_thread(scenarios.victim_idle, stack, busiest.worker_id, 300.0)
        info["drain_s"] = None if idle is None else time.monotonic() - info["marked_at"]

    outs = await asyncio.gather(*(_sse(stack, p, max_tokens, progress, i)
                                  for i, p in enumerate(prompts)), drain())
    after = await scenarios.drain_counters(stack)
    moved = int(after["moved"] - before["moved"])
    # SSE chunks do not name their decode worker before the final one: the streams that moved
    # are taken as the `moved` longest gaps across the drain mark (the drained replica pauses
    # its streams within a heartbeat of the mark), the rest stayed on the other replica
    spans = sorted((g for g in (_gap_across(a, info["marked_at"]) for a in outs[:streams])
                    if g is not None), key=lambda g: -g["gap_s"])
    pauses, others = spans[:moved], spans[moved:]
    return {
        "streams": streams, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
        "drained_replica_sequences": info.get("running"), "migrated": moved,
        "stayed": after["stayed"] - before["stayed"],
        "kv_bytes_per_migrated_stream": (after["bytes"] - before["bytes"]) / moved if moved
        else None,
        "itl_pause_s": scenarios.percentiles([p["gap_s"] for p in pauses]),
        "itl_pause_minus_median_gap_s": scenarios.percentiles(
            [p["gap_s"] - p["median_gap_s"] for p in pauses]),
        "median_gap_s": scenarios.percentiles([p["median_gap_s"] for p in pauses]),
        "other_replica_gap_across_mark_s": scenarios.percentiles([p["gap_s"] for p in others]),
        "drain_s": None if info.get("drain_s") is None else round(info["drain_s"], 2),
        "prefills": after["prefills"] - before["prefills"]}


async def kill_run(stack: FaultStack, streams: int, max_tokens: int, kill_after: int) -> dict:
    """Greedy SDK streams of one session on one decode worker, killed mid-stream."""
    from flashpd_sdk import AsyncClient

    vocab = await scenarios.vocab_size(stack)
    rng = random.Random(9)
    prompts = [scenarios.prompt_ids(rng, 200, vocab) for _ in range(streams)]
    session = f"mig-{time.time_ns()}"
    progress = [0] * streams
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    async with AsyncClient(stack.grpc_target) as client:
        reference = [await scenarios.generate(client, p, max_tokens=max_tokens)
                     for p in prompts]
        warm = await scenarios.generate(client, scenarios.prompt_ids(rng, 64, vocab),
                                         max_tokens=2, session_id=session)
        bound = warm["result"].decode_worker

        async def one(i: int):
            stream = client.generate(prompt_ids=prompts[i], max_tokens=max_tokens,
                                     ignore_eos=True, session_id=session, timeout_s=600)
            async for chunk in stream:
                arrivals[i].extend([time.monotonic()] * len(chunk.token_ids))
                progress[i] += len(chunk.token_ids)
            return stream.result

        killed: dict = {}

        async def kill():
            while min(progress) < kill_after:
                await asyncio.sleep(0.005)
            killed["at"] = time.monotonic()
            stack.kill_replica("decode", bound)

        results = (await asyncio.gather(*(one(i) for i in range(streams)), kill()))[:streams]
    resume = []
    for a in arrivals:
        before = [t for t in a if t <= killed["at"]]
        after = [t for t in a if t > killed["at"]]
        if before and after:
            resume.append(after[0] - killed["at"])
    identical = sum(r.output_ids == ref["result"].output_ids
                    for r, ref in zip(results, reference, strict=True))
    return {"streams": streams, "max_tokens": max_tokens, "kill_after_tokens": kill_after,
            "identical": identical, "time_to_resume_s": scenarios.percentiles(resume)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--drain-after", type=int, default=4)
    p.add_argument("--kill-streams", type=int, default=3)
    p.add_argument("--skip", nargs="*", default=[], choices=["drain", "kill"])
    p.add_argument("--out", default=OUT)
    args = p.parse_args()
    from flashpd.services.cli import tiny_checkpoint
    from flashpd.services.redis_local import LocalRedis

    results: dict = {"command": "python -m flashpd.bench.migration " + " ".join(
        a for a in os.sys.argv[1:])}
    with LocalRedis() as redis_server:
        port = start_ray()
        try:
            if "drain" not in args.skip:
                stack = FaultStack(tiny_checkpoint(), redis_server, port,
                                   StackConfig(1, 2, app_name="mig1x2")).deploy()
                results["drain"] = asyncio.run(drain_run(
                    stack, args.streams, args.prompt_tokens, args.max_tokens, args.drain_after))
                print("drain", json.dumps(results["drain"]), flush=True)
                stack.undeploy()
            if "kill" not in args.skip:
                for name, extra in (("bounded", {}), ("exact", {"swa_bounded_replay": False})):
                    stack = FaultStack(tiny_checkpoint(), redis_server, port, StackConfig(
                        2, 2, app_name=f"mig{name}", extra_args=extra)).deploy()
                    results[f"kill_{name}"] = asyncio.run(kill_run(
                        stack, args.kill_streams, args.max_tokens, 5))
                    print(f"kill_{name}", json.dumps(results[f"kill_{name}"]), flush=True)
                    stack.undeploy()
        finally:
            stop_ray()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
