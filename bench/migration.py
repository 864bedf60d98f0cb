"""Live decode migration and exact resume on a real local stack (Ray Serve + Redis + NIXL over
loopback, tiny preset on CPU): what a migrated stream pays, how long a drain takes, and the
time to resume after a decode kill with bounded vs exact replay.

    unshare -n sh -c 'ip link set lo up && python -m flashpd.bench.migration'

- drain (1 prefill + 2 decode): `--streams` greedy SDK streams; once each has `--drain-after`
  tokens the busiest decode replica is marked draining (`flashpd drain`'s Redis mark). Per
  migrated stream (its Timeline.migrate_ms > 0): the longest gap in token arrival (the pause)
  against its median gap, the router's migrate_ms, KV bytes moved (router counter / streams
  moved); the drain time: mark to the replica holding no sequence and no block.
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


async def _stream(client, ids: list[int], max_tokens: int, progress: list, i: int):
    """One greedy SDK stream: arrival time of each chunk, and the result."""
    arrivals: list[float] = []
    stream = client.generate(prompt_ids=ids, max_tokens=max_tokens, ignore_eos=True, timeout_s=600)
    async for chunk in stream:
        arrivals.append(time.monotonic())
        progress[i] += len(chunk.token_ids)
    return arrivals, stream.result


def _gaps(arrivals: list[float]) -> list[float]:
    return [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


async def drain_run(stack: FaultStack, streams: int, prompt_tokens: int, max_tokens: int, drain_after: int) -> dict:
    """Per migrated stream (Timeline.migrate_ms > 0): its longest gap in token arrival (the
    migration pause) against its median gap, and the router's migrate_ms (pause to the new
    stream); the same longest gap for the streams that stayed on the other replica."""
    from flashpd_sdk import AsyncClient

    vocab = await scenarios.vocab_size(stack)
    rng = random.Random(8)
    prompts = [scenarios.prompt_ids(rng, prompt_tokens, vocab) for _ in range(streams)]
    before = await scenarios.drain_counters(stack)
    progress = [0] * streams
    info: dict = {}

    async def drain() -> None:
        while min(progress) < drain_after:
            await asyncio.sleep(0.005)
        busiest = max(
            (w for w in await asyncio.to_thread(stack.worker_stats) if w.role == "decode"), key=lambda w: w.running
        )
        info.update(worker=busiest.worker_id, running=busiest.running)
        marked_at = time.monotonic()
        await stack.drain_replica(busiest.worker_id)
        idle = await asyncio.to_thread(scenarios.victim_idle, stack, busiest.worker_id, 300.0)
        info["drain_s"] = None if idle is None else time.monotonic() - marked_at

    async with AsyncClient(stack.grpc_target) as client:
        outs = (
            await asyncio.gather(*(_stream(client, p, max_tokens, progress, i) for i, p in enumerate(prompts)), drain())
        )[:streams]
    after = await scenarios.drain_counters(stack)
    moved = [(a, r) for a, r in outs if r.timeline["migrate_ms"] > 0]
    stayed = [(a, r) for a, r in outs if r.timeline["migrate_ms"] == 0 and len(a) > 2]
    n = int(after["moved"] - before["moved"])
    pct = scenarios.percentiles
    return {
        "streams": streams,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "drained_replica_sequences": info.get("running"),
        "migrated": n,
        "stayed": after["stayed"] - before["stayed"],
        "kv_bytes_per_migrated_stream": (after["bytes"] - before["bytes"]) / n if n else None,
        "migrated_longest_gap_s": pct([max(_gaps(a)) for a, _ in moved]),
        "migrated_median_gap_s": pct([statistics.median(_gaps(a)) for a, _ in moved]),
        "migrated_router_migrate_ms": pct([r.timeline["migrate_ms"] for _, r in moved]),
        "others_longest_gap_s": pct([max(_gaps(a)) for a, _ in stayed]),
        "others_median_gap_s": pct([statistics.median(_gaps(a)) for a, _ in stayed]),
        "drain_s": None if info.get("drain_s") is None else round(info["drain_s"], 2),
        "prefills": after["prefills"] - before["prefills"],
    }


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
        reference = [await scenarios.generate(client, p, max_tokens=max_tokens) for p in prompts]
        warm = await scenarios.generate(client, scenarios.prompt_ids(rng, 64, vocab), max_tokens=2, session_id=session)
        bound = warm["result"].decode_worker

        async def one(i: int):
            stream = client.generate(
                prompt_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True, session_id=session, timeout_s=600
            )
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
    identical = sum(r.output_ids == ref["result"].output_ids for r, ref in zip(results, reference, strict=True))
    return {
        "streams": streams,
        "max_tokens": max_tokens,
        "kill_after_tokens": kill_after,
        "identical": identical,
        "time_to_resume_s": scenarios.percentiles(resume),
    }


def engine_resume(prompt_tokens: int, streamed: int, reps: int = 3) -> dict:
    """Time to the first new token of a continuation on a decode engine alone (no Ray, no
    transfer: the compute a resume adds), FP32 tiny on CPU: KV arrived -> first token.
    bounded / exact: the continuation (replay from the prompt boundary, then the streamed
    tokens one per step) with the 128-token and the exact replay; fresh: a new request's replay
    (what an unbroken stream paid once)."""
    import torch

    from flashpd.engine.llm_engine import EngineConfig, LLMEngine
    from flashpd.engine.request import PrefixPolicy
    from flashpd.engine.sampling import SamplingParams
    from flashpd.model.model import load_model
    from flashpd.services.cli import tiny_checkpoint

    torch.set_num_threads(1)
    model = load_model(tiny_checkpoint(), torch.float32)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 500, (prompt_tokens,), generator=g).tolist()
    outputs = torch.randint(3, 500, (streamed,), generator=g).tolist()

    def first_token_s(bounded: bool, ids, prefix) -> float:
        cfg = dict(num_blocks=64, num_slots=4, swa_bounded_replay=bounded)
        d = LLMEngine(model, EngineConfig(role="decode", **cfg))
        d.reserve("r", ids, SamplingParams(max_tokens=2, ignore_eos=True), prefix=prefix)
        d.kv_arrived("r")  # the KV bytes do not matter for the compute time
        t0 = time.perf_counter()
        while not any(o.new_token_ids for o in d.step()):
            pass
        return time.perf_counter() - t0

    out = {}
    for name, bounded, ids, prefix in (
        ("fresh_bounded", True, prompt, None),
        ("continuation_bounded", True, prompt + outputs, PrefixPolicy(kv_tokens=prompt_tokens)),
        ("continuation_exact", False, prompt + outputs, PrefixPolicy(kv_tokens=prompt_tokens)),
    ):
        times = [first_token_s(bounded, ids, prefix) for _ in range(reps)]
        out[name] = round(1e3 * statistics.median(times), 1)
    return {"prompt_tokens": prompt_tokens, "streamed_tokens": streamed, "first_token_ms": out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--drain-after", type=int, default=4)
    p.add_argument("--kill-streams", type=int, default=3)
    p.add_argument("--skip", nargs="*", default=[], choices=["drain", "kill", "engine"])
    p.add_argument("--out", default=OUT)
    args = p.parse_args()
    from flashpd.services.cli import tiny_checkpoint
    from flashpd.services.redis_local import LocalRedis

    results: dict = {"command": "python -m flashpd.bench.migration " + " ".join(a for a in os.sys.argv[1:])}
    if "engine" not in args.skip:
        results["engine_resume"] = [engine_resume(1500, g) for g in (8, 32)]
        print("engine_resume", json.dumps(results["engine_resume"]), flush=True)
    if {"drain", "kill"} <= set(args.skip):
        return _write(args, results)
    with LocalRedis() as redis_server:
        port = start_ray()
        try:
            if "drain" not in args.skip:
                stack = FaultStack(tiny_checkpoint(), redis_server, port, StackConfig(1, 2, app_name="mig1x2")).deploy()
                results["drain"] = asyncio.run(
                    drain_run(stack, args.streams, args.prompt_tokens, args.max_tokens, args.drain_after)
                )
                print("drain", json.dumps(results["drain"]), flush=True)
                stack.undeploy()
            if "kill" not in args.skip:
                for name, extra in (("bounded", {}), ("exact", {"swa_bounded_replay": False})):
                    stack = FaultStack(
                        tiny_checkpoint(),
                        redis_server,
                        port,
                        StackConfig(2, 2, app_name=f"mig{name}", extra_args=extra),
                    ).deploy()
                    results[f"kill_{name}"] = asyncio.run(kill_run(stack, args.kill_streams, args.max_tokens, 5))
                    print(f"kill_{name}", json.dumps(results[f"kill_{name}"]), flush=True)
                    stack.undeploy()
        finally:
            stop_ray()
    return _write(args, results)


def _write(args, results: dict) -> int:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    if args.skip and os.path.exists(path):  # a partial run keeps the parts it skipped
        with open(path) as f:
            results = {**json.load(f), **results}
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
