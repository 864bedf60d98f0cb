"""The product on one GPU, measured through real clients (issue 25).

    bash scripts/gpu_stack.sh bench OUT                   (on the GPU machine; both phases)
    python -m flashpd.bench.h200_stack --out OUT --phase reference   (colocated engine alone)
    python -m flashpd.bench.h200_stack --out OUT --phase stack       (the stack + clients)

reference  the GPU engines alone, same weights (`random:bench:0`), in one process: greedy ids
           of the check prompts, one request at a time, (a) through a prefill engine and a
           decode engine over one model, the KV copied between their pools (the stack's
           scheme: encoder prefill, push, 128-row bounded replay on decode; what the service
           must reproduce) and (b) through the colocated engine (decoder narrowing: another
           approximation, so not expected to match under bounded replay); and the decode step
           time at batch 1 and 8 over 8K-token prompts (engine.step() wall time, sampling
           included). Runs in its own process before the stack, whose two replicas need the
           GPU's memory.
stack      scripts' one command (services/gpu_stack.py) brings up Redis, Ray and the app from
           infra/serve.h200.yaml; then, each phase time-boxed:
             greedy     the check prompts over gRPC (SDK, ids) and HTTP (openai client, text)
                        against the reference's P/D engines (and the colocated engine)
             transfer   a warm-up push (UCX wire-up: first_push_ms), then distinct cold 8K / 32K /
                        128K prompts, 3 of each, medians: e2e GB/s (the router's transfer_ms:
                        compute end -> push done on the prefill worker) and transport GB/s
                        (post -> completion), with the prefill's per-phase split of each push
             sessions   a two-turn session: the second turn's cached tokens and TTFT (the first
                        prefix hit at that width), then a second hit at the same width
             clients    openai client and SDK at concurrency 1, 8, 32 (8K prompts, 64 tokens):
                        TTFT, ITL, tok/s per user, total tok/s, errors
             itl_b8     8 sessions primed (prompt cached on both sides), then all 8 at once:
                        decode at batch 8 throughout, ITL against the engine's step at 8
             faults     cancels around the KV push of 32K prompts, a decode replica killed
                        mid-stream: blocks held after, and a request served after
             agentx     what the box has left: the AgentX-like closed-loop sweep (bench/cli.py
                        `bench sweep`) through the router at concurrency 1, 4, 16
Writes OUT/results.json, OUT/summary.json (the issue's keys), OUT/reference.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

from flashpd.services.stack_logs import SERVER_ERRORS_FILE, write_excerpts

CHECKPOINT = "random:bench:0"
CHECK_PROMPTS = {"short": 300, "2k": 2048, "8k": 8192}
CHECK_TOKENS = 32
CLIENT_PROMPT, CLIENT_TOKENS = 8192, 64
CONCURRENCY = {1: 3, 8: 8, 32: 32}  # concurrency -> requests
TRANSFER_PROMPTS = (8192, 32768, 131072)
TRANSFER_REPEATS, TRANSFER_WARMUP_PROMPT = 3, 1024  # 3 x 128K: ~33 s of prefill on the H200
SESSION_PROMPT = 9000
CANCEL_PROMPT, CANCEL_AFTER_S = 32768, (1.9, 2.0, 2.1, 2.2, 2.3, 2.5)
VOCAB_IDS = 6000
REF_ENGINE = {"dtype": "bfloat16", "device": "cuda"}
STACK_CONFIG = os.path.abspath("infra/serve.h200.yaml")  # --config: the replicas' engine settings
ITL_B8_PROMPT, ITL_B8_TOKENS = 8192, 96
AGENTX_CONCURRENCY, AGENTX_WINDOW_S = (1, 4, 16), 40.0


def smoke_plan(checkpoint: str) -> None:
    """CPU smoke of every phase's client path against a tiny-preset stack (no reference)."""
    global CHECKPOINT, CHECK_PROMPTS, CLIENT_PROMPT, CLIENT_TOKENS, CONCURRENCY
    global TRANSFER_PROMPTS, TRANSFER_WARMUP_PROMPT, SESSION_PROMPT, CANCEL_PROMPT, CANCEL_AFTER_S, VOCAB_IDS
    global ITL_B8_PROMPT, ITL_B8_TOKENS, AGENTX_CONCURRENCY, AGENTX_WINDOW_S
    REF_ENGINE.update(dtype="float32", device="cpu")
    ITL_B8_PROMPT, ITL_B8_TOKENS, AGENTX_CONCURRENCY, AGENTX_WINDOW_S = 200, 6, (1,), 5.0
    CHECKPOINT, CHECK_PROMPTS, CLIENT_PROMPT, CLIENT_TOKENS = checkpoint, {"s": 40}, 200, 8
    CONCURRENCY, TRANSFER_PROMPTS, SESSION_PROMPT = {1: 1, 2: 2}, (256, 512), 300
    TRANSFER_WARMUP_PROMPT = 128
    CANCEL_PROMPT, CANCEL_AFTER_S, VOCAB_IDS = 1024, (0.3, 0.6), 400


BYTES_PER_BLOCK = 113_920  # 890 B/token x 128 (bench = released KV geometry)


def prompt_ids(n: int, seed: int) -> list[int]:
    """Distinct prompts of `n` ids (inside the small tokenizer's range: any id decodes)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB_IDS) for _ in range(n)]


def http_name(name: str) -> str:
    return f"{name}/http"


def http_prompt(name: str, n: int, i: int) -> list[int]:
    """The greedy check's HTTP prompt for check prompt `name` (i-th, n ids): distinct from the
    gRPC one, so both reach the stack cold."""
    return prompt_ids(n, 200 + i)


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)


# ------------------------------------------------------------------------------ reference
def run_reference(out: str, config: str | None = None) -> dict:
    from flashpd.engine.llm_engine import EngineConfig
    from flashpd.engine.loading import load_engine
    from flashpd.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    engine = load_engine(
        CHECKPOINT,
        EngineConfig(
            role="colocated", num_blocks=2048, num_slots=16, max_num_seqs=16, max_num_batched_tokens=8192, **REF_ENGINE
        ),
    )
    load_s = time.perf_counter() - t0
    greedy = {}
    for i, (name, n) in enumerate(CHECK_PROMPTS.items()):
        rid = f"g-{name}"
        engine.add_request(rid, prompt_ids(n, 100 + i), SamplingParams(max_tokens=CHECK_TOKENS, ignore_eos=True))
        ids: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                ids.extend(o.new_token_ids)
        greedy[name] = ids
    prompts = {name: prompt_ids(n, 100 + i) for i, (name, n) in enumerate(CHECK_PROMPTS.items())}
    # HTTP gets prompts of its own: sent after the gRPC one, the same prompt would be a prefix
    # hit on the stack (a replay + turn path, not the cold one the reference computed)
    prompts.update({http_name(name): http_prompt(name, n, i) for i, (name, n) in enumerate(CHECK_PROMPTS.items())})
    pd = pd_greedy(engine.model, prompts, config)
    steps = {b: engine_step_ms(engine, b) for b in (1, 8)}
    ref = {"load_s": round(load_s, 1), "greedy": greedy, "pd_greedy": pd, "engine_step_ms": steps}
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    print(f"reference: load {load_s:.1f} s, engine step ms {steps}", flush=True)
    return ref


def stack_engine_configs(config_path: str) -> dict:
    """role -> the EngineConfig the stack's replicas of that role build (the Serve config's args,
    through the application's own parsing), so the reference runs what the replicas run."""
    import yaml

    from flashpd.services.app import AppArgs

    with open(config_path) as f:
        app = yaml.safe_load(f)["applications"][0]
    args = AppArgs.model_validate(app["args"])
    # redis_url only fills WorkerConfig: the engines never connect
    return {role: args.worker_config(role, redis_url="redis://127.0.0.1:1/0").engine for role in ("prefill", "decode")}


def pd_greedy(model, prompts: dict[str, list[int]], config_path: str | None = None) -> dict[str, list[int]]:
    """Greedy ids through a prefill engine and a decode engine over one model, each built with the
    stack's engine config for its role (pools, slots, batch limits, graph classes) and warmed up
    as a replica is at load (the same CUDA graphs), the prompt's KV blocks copied from the prefill
    pools into the decode reservation's blocks (what NIXL does between the replicas), one prompt
    at a time. Random weights leave logits near ties: only the replicas' own shapes and kernels
    reproduce their tokens bit for bit."""
    import dataclasses

    from flashpd.engine.llm_engine import LLMEngine
    from flashpd.engine.sampling import SamplingParams
    from flashpd.engine.warmup import warm_up

    cfgs = stack_engine_configs(config_path or STACK_CONFIG)
    pre = LLMEngine(model, dataclasses.replace(cfgs["prefill"], **REF_ENGINE))
    dec = LLMEngine(model, dataclasses.replace(cfgs["decode"], **REF_ENGINE))
    for engine in (pre, dec):
        warm_up(engine)
    out = {}
    for name, ids in prompts.items():
        rid = f"pd-{name}"
        pre.add_request(rid, ids, SamplingParams(max_tokens=1))
        ready = None
        while ready is None:
            ready = next((o for o in pre.step() if o.request_id == rid and o.finished), None)
        if ready.finish_reason != "kv_ready":
            raise RuntimeError(f"prefill of {name} ended with {ready.finish_reason}")
        r = dec.reserve(rid, ids, SamplingParams(max_tokens=CHECK_TOKENS, ignore_eos=True))
        hand_over_kv(pre, dec, rid, ready, r)
        dec.kv_arrived(rid)
        got: list[int] = []
        while dec.has_unfinished():
            for o in dec.step():
                got.extend(o.new_token_ids)
        out[name] = got
    return out


def hand_over_kv(pre, dec, rid: str, ready, reservation) -> None:
    """What NIXL does between the replicas, in one process: the prefill engine's blocks of `rid`
    that the decode reservation lacks are copied into its blocks, then the prefill lets them go."""
    import torch

    src = torch.tensor(ready.kv_block_ids[reservation.num_cached_blocks :], dtype=torch.long)
    dst = torch.tensor(reservation.missing_block_ids, dtype=torch.long)
    theirs, ours = pre.pools.transfer_groups(), dec.pools.transfer_groups()
    for group, pool in theirs.items():
        ours[group][dst.to(pool.device)] = pool[src.to(pool.device)]
    pre.release_kv(rid)


def streamed_text(tok, ids: list[int]) -> str:
    """The text an HTTP stream of `ids` carries: the router's streaming detokenizer (a character
    split across tokens is held until complete), not one decode of the whole list."""
    from flashpd.engine.detokenizer import TextStream
    from flashpd.services.router.deployment import HFTokenizer

    stream = TextStream(HFTokenizer(tok))
    return "".join(stream.push(t) for t in ids) + stream.flush()


def engine_step_ms(engine, batch: int, steps: int = 24) -> float:
    """Median engine.step() wall time with `batch` sequences decoding at 8K context."""
    from flashpd.engine.sampling import SamplingParams

    rids = [f"s{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(rids):
        engine.add_request(
            rid, prompt_ids(CLIENT_PROMPT, 500 + 37 * batch + i), SamplingParams(max_tokens=steps + 40, ignore_eos=True)
        )
    while any(engine.stats[r].first_token_s is None for r in rids):
        engine.step()
    for _ in range(4):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return round(statistics.median(times), 2)


# ---------------------------------------------------------------------------------- stack
class Rec:
    """One request's client-side record."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.arrivals: list[float] = []
        self.tokens = 0
        self.error = None
        self.result = None
        self.text = ""

    def add(self, n_tokens: int) -> None:
        self.arrivals.append(time.perf_counter())
        self.tokens += n_tokens

    def row(self) -> dict:
        a = self.arrivals
        ttft = (a[0] - self.t0) * 1e3 if a else None
        gaps = [(y - x) * 1e3 for x, y in zip(a, a[1:], strict=False)]
        decode_s = a[-1] - a[0] if len(a) > 1 else 0
        return {
            "ttft_ms": ttft,
            "gaps_ms": gaps,
            "tokens": self.tokens,
            "error": self.error,
            "tok_s_user": (self.tokens - 1) / decode_s if decode_s > 0 else None,
            "e2e_s": (a[-1] - self.t0) if a else None,
        }


async def sdk_request(client, ids, max_tokens, rec: Rec | None = None, **kw):
    rec = rec or Rec()
    try:
        stream = client.generate(
            prompt_ids=ids, max_tokens=max_tokens, ignore_eos=True, temperature=0.0, timeout_s=600, **kw
        )
        async for chunk in stream:
            if chunk.token_ids:
                rec.add(len(chunk.token_ids))
        rec.result = stream.result
    except Exception as e:  # noqa: BLE001 - recorded as the client's error
        rec.error = f"{type(e).__name__}: {e}"[:300]
    return rec


async def openai_request(client, model, ids, max_tokens, rec: Rec | None = None):
    rec = rec or Rec()
    text = []
    try:
        stream = await client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                rec.add(1)
                text.append(chunk.choices[0].text)
            if getattr(chunk, "usage", None):
                rec.result = chunk.usage
    except Exception as e:  # noqa: BLE001
        rec.error = f"{type(e).__name__}: {e}"[:300]
    rec.text = "".join(text)
    return rec


async def phase_greedy(stack, ref: dict, tok) -> dict:
    from openai import AsyncOpenAI

    from flashpd_sdk import AsyncClient

    out = {}
    client = AsyncClient(stack.grpc_target)
    oai = AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0)
    for i, name in enumerate(CHECK_PROMPTS):
        ids = prompt_ids(CHECK_PROMPTS[name], 100 + i)
        pd = ref.get("pd_greedy") or ref["greedy"]
        want = pd[name]
        g = await sdk_request(client, ids, CHECK_TOKENS)
        got = list(g.result.output_ids) if g.result else []
        cold = http_name(name) in pd  # a reference of its own: HTTP's prompt reaches the stack cold
        h_ids = http_prompt(name, CHECK_PROMPTS[name], i) if cold else ids
        h = await openai_request(oai, stack.model_id, h_ids, CHECK_TOKENS)
        want_text = streamed_text(tok, pd[http_name(name)] if cold else want)
        out[name] = {
            "grpc_identical": got == want,
            "http_identical": h.text == want_text,
            "http_prompt": "cold" if cold else "prefix hit (the gRPC prompt again)",
            "grpc_error": g.error,
            "http_error": h.error,
            "first_diff": next((k for k, (x, y) in enumerate(zip(got, want, strict=False)) if x != y), None),
            "grpc_ids": got,
            "colocated_identical": got == ref["greedy"][name],
        }
    await client.close()
    await oai.close()
    return out


async def phase_transfer(stack) -> dict:
    """The KV push at each size, TRANSFER_REPEATS times, medians. Every prompt is distinct: a
    repeated prompt would be a prefix hit on the decode worker, which then reserves (and the
    prefill pushes) only the chunks it lacks (none but the last partial one), not the prompt's
    KV; a prefill-side hit alone would still push every block the ticket names, but the decode
    side's hit comes first. A warm-up push connects the peer first: the first push to a decode
    worker pays UCX's wire-up (30 ms at 1fdeb33), reported on its own as `first_push_ms` (the
    run's very first push when the prefill replica still holds its record)."""
    from flashpd_sdk import AsyncClient

    client = AsyncClient(stack.grpc_target)
    earlier = await asyncio.to_thread(_push_records, stack)
    warm = await _transfer_once(client, stack, TRANSFER_WARMUP_PROMPT, 8999)
    first = earlier[0] if earlier and len(earlier) < 64 else (warm.get("push") or {})
    out: dict = {"first_push_ms": first.get("total_ms"), "first_push": first, "warmup": warm}
    for n in TRANSFER_PROMPTS:
        runs = [await _transfer_once(client, stack, n, 9000 + n + 7919 * k) for k in range(TRANSFER_REPEATS)]
        out[str(n)] = _transfer_medians(runs)
        print(f"transfer {n}: {json.dumps({k: v for k, v in out[str(n)].items() if k != 'runs'})}", flush=True)
    await client.close()
    return out


def _push_records(stack) -> list[dict]:
    try:
        return list(stack.push_records())
    except Exception as e:  # noqa: BLE001 - the figures without the split
        return [{"error": repr(e)[:300]}]


async def _transfer_once(client, stack, n: int, seed: int) -> dict:
    """One cold prompt of n tokens: the router's timeline and the prefill's record of its push
    (compute end -> the write seen complete = transfer_ms, the e2e figure; post -> done =
    wire_ms; compute end -> the prefill's event loop has it = handoff_ms)."""
    rec = await sdk_request(client, prompt_ids(n, seed), 2)
    r = rec.result
    if r is None:
        return {"error": rec.error}
    records = await asyncio.to_thread(_push_records, stack)
    push = records[-1] if records else {}
    num_bytes = -(-n // 128) * BYTES_PER_BLOCK
    ms, wire_ms = r.timeline.get("transfer_ms", 0.0), push.get("wire_ms")
    return {
        "transfer_ms": round(ms, 3),
        "bytes": num_bytes,
        "pushed_all_blocks": push.get("bytes") == num_bytes,
        "gb_s": round(num_bytes / ms / 1e6, 1) if ms else None,
        "wire_ms": round(wire_ms, 3) if wire_ms else None,
        # compute end -> the prefill's event loop has the push done (the kv_ready output's hop
        # included): transfer_ms before the engine thread polled its own post
        "handoff_ms": round(push["total_ms"], 3) if isinstance(push.get("total_ms"), (int, float)) else None,
        "gb_s_transport": round(num_bytes / wire_ms / 1e6, 1) if wire_ms else None,
        "ttft_ms": round(r.timeline.get("first_token_ms", 0), 1),
        "prefill_ms": round(r.timeline.get("prefill_ms", 0), 1),
        "replay_ms": round(r.timeline.get("replay_ms", 0), 1),
        "route_ms": round(r.timeline.get("route_ms", 0), 2),
        "reserve_ms": round(r.timeline.get("reserve_ms", 0), 2),
        "push": push,
    }


def _transfer_medians(runs: list[dict]) -> dict:
    """Medians over the repeats: gb_s (e2e: compute end -> push done, what summary.json's
    transfer_gb_s holds), gb_s_transport (post -> done), and the push's split (ms)."""
    ok = [r for r in runs if "error" not in r]
    out: dict = {"runs": runs, "repeats": len(ok), "errors": len(runs) - len(ok)}
    if not ok:
        return out
    for key in ("transfer_ms", "gb_s", "wire_ms", "gb_s_transport", "handoff_ms", "ttft_ms", "prefill_ms", "replay_ms"):
        values = [r[key] for r in ok if r.get(key) is not None]
        out[key] = round(statistics.median(values), 3) if values else None
    out["bytes"] = ok[0]["bytes"]
    out["pushed_all_blocks"] = all(r["pushed_all_blocks"] for r in ok)
    out["inline"] = [r["push"].get("inline") for r in ok]
    split: dict = {}
    for r in ok:
        push = r["push"]
        for key, value in [*((k, push.get(k)) for k in ("hop_ms", "post_ms")), *push.get("phases", {}).items()]:
            if isinstance(value, (int, float)):
                split.setdefault(key, []).append(value)
    out["split_ms"] = {k: round(statistics.median(v), 4) for k, v in split.items()}
    return out


async def phase_sessions(stack) -> dict:
    """Turn 1 cold (9,000 tokens), turn 2 = turn 1 + its answer + 64 new tokens (a prefix hit
    at a width no earlier request had), turn 3 the same again (a second hit, one width up)."""
    from flashpd_sdk import AsyncClient

    client = AsyncClient(stack.grpc_target)
    history = prompt_ids(SESSION_PROMPT, 77)
    turns = []
    for turn in range(3):
        rec = await sdk_request(client, history, 16, session_id="s-width")
        r = rec.result
        if r is None:
            turns.append({"error": rec.error})
            break
        turns.append(
            {
                "prompt_tokens": r.usage.prompt_tokens,
                "cached_tokens": r.usage.cached_tokens,
                "cached_tokens_decode": r.usage.cached_tokens_decode,
                "ttft_ms": round(r.timeline.get("first_token_ms", 0), 1),
                "prefill_worker": r.prefill_worker,
                # where a hit's first token goes: route, reserve, prefill, push, replay (ms)
                "timeline_ms": {k: round(v, 2) for k, v in sorted(r.timeline.items())},
            }
        )
        history = history + list(r.output_ids) + prompt_ids(64, 900 + turn)
    await client.close()
    return {"turns": turns}


async def phase_itl_b8(stack) -> dict:
    """8 sessions whose prompts are primed on both sides (max_tokens 1, one at a time), then
    all 8 again at once: after their replays the decode batch is 8 throughout, so the gaps
    compare with the engine's step at batch 8 (the client runs' batches ramp with prefills)."""
    from flashpd_sdk import AsyncClient

    client = AsyncClient(stack.grpc_target)
    prompts = [prompt_ids(ITL_B8_PROMPT, 31000 + i) for i in range(8)]
    for i, ids in enumerate(prompts):
        await sdk_request(client, ids, 1, session_id=f"b8-{i}")
    recs = await asyncio.gather(
        *(sdk_request(client, ids, ITL_B8_TOKENS, session_id=f"b8-{i}") for i, ids in enumerate(prompts))
    )
    await client.close()
    rows = [r.row() for r in recs]
    gaps = [g for r in rows if r["error"] is None for g in r["gaps_ms"][8:]]  # all 8 decoding
    return {
        "requests": len(rows),
        "errors": sum(r["error"] is not None for r in rows),
        "itl_ms_p50": pct(gaps, 0.5),
        "itl_ms_p90": pct(gaps, 0.9),
        "ttft_ms_p50": pct([r["ttft_ms"] for r in rows if r["ttft_ms"]], 0.5),
    }


def phase_agentx(stack, out: str, deadline: float) -> dict:
    """The AgentX-like sweep through the router (`flashpd bench sweep`, SDK backend), each
    point time-boxed; the study lands in OUT/agentx with its report."""
    study = os.path.join(out, "agentx")
    done = {}
    for c in AGENTX_CONCURRENCY:
        left = deadline - time.monotonic() - 20
        if left < AGENTX_WINDOW_S + 30:
            done[str(c)] = "skipped: time box"
            continue
        cmd = [
            sys.executable,
            "-m",
            "flashpd.cli",
            "bench",
            "run",
            "--target",
            stack.grpc_target,
            "--gpus",
            "1",
            "-c",
            str(c),
            "--window-s",
            str(AGENTX_WINDOW_S),
            "--warmup-requests",
            "1",
            "--trees",
            "32",
            "--drain-timeout-s",
            "30",
            "--request-timeout-s",
            "120",
            "--no-progress",
            "--name",
            "flashpd",
            "--out",
            os.path.join(study, "flashpd", f"c{c}"),
        ]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
            done[str(c)] = {"rc": r.returncode, "tail": (r.stdout + r.stderr)[-600:]}
        except subprocess.TimeoutExpired:
            done[str(c)] = "timed out (records so far kept)"
        print(f"agentx c={c}: {done[str(c)]}", flush=True)
    rep = subprocess.run(
        [sys.executable, "-m", "flashpd.cli", "bench", "report", study], capture_output=True, text=True, timeout=120
    )
    done["report"] = (rep.stdout + rep.stderr)[-3000:]
    return done


async def http_request(client, model, ids, max_tokens, rec: Rec | None = None):
    """The OpenAI completions route over plain httpx, the body serialised by json.dumps: the
    server's HTTP path without the official client's own request building (which costs
    ~350 ms for an 8K-id prompt on a 2-core VM: bench/results/client_overhead_cpu.md)."""
    rec = rec or Rec()
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0}
    body.update(stream=True, ignore_eos=True)
    try:
        async with client.stream("POST", "/v1/completions", content=json.dumps(body).encode()) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        rec.add(1)
    except Exception as e:  # noqa: BLE001 - recorded as the client's error
        rec.error = f"{type(e).__name__}: {e}"[:300]
    return rec


def _client(stack, kind: str):
    if kind == "sdk":
        from flashpd_sdk import AsyncClient

        return AsyncClient(stack.grpc_target)
    if kind == "http":
        import httpx

        return httpx.AsyncClient(base_url=stack.http_url, timeout=600)
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=stack.http_url + "/v1", api_key="none", max_retries=0)


async def run_clients(stack, kind: str, concurrency: int, requests: int, seed: int) -> dict:
    """kind: "openai" (the official client), "sdk" (gRPC) or "http" (plain httpx, same route)."""
    client = _client(stack, kind)
    queue = list(range(requests))
    recs: list[Rec] = []

    async def lane():
        while queue:
            i = queue.pop()
            ids = prompt_ids(CLIENT_PROMPT, seed + i)
            if kind == "sdk":
                rec = await sdk_request(client, ids, CLIENT_TOKENS)
            elif kind == "http":
                rec = await http_request(client, stack.model_id, ids, CLIENT_TOKENS)
            else:
                rec = await openai_request(client, stack.model_id, ids, CLIENT_TOKENS)
            recs.append(rec)

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await (client.aclose() if kind == "http" else client.close())
    rows = [r.row() for r in recs]
    ok = [r for r in rows if r["error"] is None and r["ttft_ms"] is not None]
    gaps = [g for r in ok for g in r["gaps_ms"]]
    return {
        "client": kind,
        "concurrency": concurrency,
        "requests": len(rows),
        "errors": len(rows) - len(ok),
        "error_samples": [r["error"] for r in rows if r["error"]][:3],
        "ttft_ms_p50": pct([r["ttft_ms"] for r in ok], 0.5),
        "ttft_ms_p90": pct([r["ttft_ms"] for r in ok], 0.9),
        "itl_ms_p50": pct(gaps, 0.5),
        "itl_ms_p90": pct(gaps, 0.9),
        "itl_ms_mean": round(statistics.mean(gaps), 2) if gaps else None,
        "tok_s_per_user_p50": pct([r["tok_s_user"] for r in ok if r["tok_s_user"]], 0.5),
        "total_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1),
        "wall_s": round(wall, 1),
    }


async def phase_faults(stack, deadline: float) -> dict:
    from flashpd_sdk import AsyncClient

    client = AsyncClient(stack.grpc_target)
    out: dict = {}
    # cancels at staggered times around the end of a 32K prefill (~2.1 s), i.e. its KV push
    cancels = []
    for k, after_s in enumerate(CANCEL_AFTER_S):
        task = asyncio.ensure_future(sdk_request(client, prompt_ids(CANCEL_PROMPT, 7000 + k), 8))
        await asyncio.sleep(after_s)
        task.cancel()
        try:
            await task
            cancels.append("finished")
        except asyncio.CancelledError:
            cancels.append("cancelled")
    idle = await asyncio.to_thread(stack.wait_idle_blocks, 30.0)
    held = stack.blocks_held()
    after = await sdk_request(client, prompt_ids(256, 1), 4)
    out["cancel"] = {
        "outcomes": cancels,
        "idle_after_s": idle,
        "blocks_held_after": held,
        "served_after": after.error is None,
    }
    print(f"faults cancel: {out['cancel']}", flush=True)
    if time.monotonic() > deadline - 150:
        out["decode_kill"] = {"skipped": "no time left in the box"}
        return out
    # a decode replica killed mid-stream
    rec = Rec()
    task = asyncio.ensure_future(sdk_request(client, prompt_ids(CLIENT_PROMPT, 5), 400, rec=rec))
    while rec.tokens < 20 and not task.done():
        await asyncio.sleep(0.01)
    (victim,) = list(stack.replica_actors("decode"))
    stack.kill_replica("decode", victim)
    t_kill = time.monotonic()
    await task
    ready = None
    while time.monotonic() < deadline - 20:
        stats = stack.worker_stats()
        if any(w.role == "decode" and w.worker_id != victim for w in stats):
            ready = time.monotonic() - t_kill
            break
        await asyncio.sleep(1.0)
    after = await sdk_request(client, prompt_ids(256, 2), 4) if ready else None
    idle = await asyncio.to_thread(stack.wait_idle_blocks, 15.0) if ready else None
    out["decode_kill"] = {
        "stream_tokens": rec.tokens,
        "stream_error": rec.error,
        "replacement_ready_s": ready,
        "idle_after_s": idle,
        "blocks_held_after": stack.blocks_held() if ready else None,
        "served_after": bool(after and after.error is None),
        "after_error": after.error if after else None,
    }
    print(f"faults decode kill: {out['decode_kill']}", flush=True)
    await client.close()
    return out


def transports(stack) -> dict:
    try:
        peers = stack.kv_transports()
    except Exception as e:  # noqa: BLE001
        return {"transport": "unknown", "error": repr(e)[:300]}
    return {"transport": "+".join(sorted(set(peers.values()))) or "unknown", "peers": peers}


def gpu_memory() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except Exception as e:  # noqa: BLE001
        return repr(e)


def run_stack(out: str, config: str, budget_s: float, only: tuple[str, ...] = ()) -> dict:
    from flashpd.engine.loading import load_tokenizer
    from flashpd.services.gpu_stack import gpu_stack

    deadline = time.monotonic() + budget_s
    ref_path = os.path.join(out, "reference.json")
    ref = json.load(open(ref_path)) if os.path.exists(ref_path) else None
    tok = load_tokenizer(CHECKPOINT)
    res: dict = {"config": config}
    t0 = time.monotonic()
    with gpu_stack(config, ready_timeout_s=max(60.0, budget_s - 60)) as stack:
        res["ready_s"] = round(time.monotonic() - t0, 1)
        res["gpu_memory"] = gpu_memory()
        print(res["gpu_memory"], flush=True)
        stack.wait_idle_blocks = lambda timeout_s: _wait_idle(stack, timeout_s)
        phases = [
            ("greedy", lambda: phase_greedy(stack, ref, tok) if ref else None),
            ("transfer", lambda: phase_transfer(stack)),
            ("sessions", lambda: phase_sessions(stack)),
        ]
        for kind in ("openai", "sdk"):
            for c, n in CONCURRENCY.items():
                phases.append(
                    (
                        f"{kind}_c{c}",
                        lambda k=kind, c=c, n=n: run_clients(
                            stack, k, c, n, 20000 + 1000 * c + (0 if k == "sdk" else 500)
                        ),
                    )
                )
        # the HTTP route without the openai client's request building, at concurrency 1 (TTFT); its
        # prompts are its own (the openai phase's seeds again were prefix hits: 165-174 ms "TTFT")
        phases.append(("http_c1", lambda: run_clients(stack, "http", 1, CONCURRENCY[1], 21700)))
        phases.append(("itl_b8", lambda: phase_itl_b8(stack)))
        phases.append(("faults", lambda: phase_faults(stack, deadline)))
        if only:  # --only: these phases, in the usual order
            unknown = set(only) - {name for name, _ in phases}
            if unknown:
                raise SystemExit(f"--only: no phase {sorted(unknown)}; phases are {[n for n, _ in phases]}")
            phases = [(name, make) for name, make in phases if name in only]
        for name, make in phases:
            if time.monotonic() > deadline - 30:
                res[name] = {"skipped": "time box"}
                continue
            t1 = time.monotonic()
            try:
                coro = make()
                res[name] = asyncio.run(coro) if coro is not None else {"skipped": "no ref"}
            except Exception as e:  # noqa: BLE001 - one phase failing keeps the others
                res[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"== {name} ({time.monotonic() - t1:.1f} s): {json.dumps(res[name])[:600]}", flush=True)
            _dump(out, res)
            if name == "transfer":
                res["transport"] = transports(stack)
                print(f"transport: {res['transport']}", flush=True)
                res["push_records"] = _push_records(stack)[-(1 + len(TRANSFER_PROMPTS) * TRANSFER_REPEATS) :]
                print(f"pushes: {res['push_records']}", flush=True)
        if not only and time.monotonic() < deadline - AGENTX_WINDOW_S - 60:
            res["agentx"] = phase_agentx(stack, out, deadline)
            _dump(out, res)
        res["server_errors"] = keep_server_errors(stack, out)  # before the teardown takes the logs
    _dump(out, res)
    return res


def keep_server_errors(stack, out: str) -> int | str:
    """The replicas' error excerpts (`GpuStack.errors`: Ray's session logs) into
    OUT/server_errors.log; their count (a failed read: its repr). The fault phase's kills leave
    some by design: the file says what each failed request met."""
    try:
        excerpts = stack.errors()
    except Exception as e:  # noqa: BLE001 - telemetry must not fail the bench
        return repr(e)
    write_excerpts(excerpts, os.path.join(out, SERVER_ERRORS_FILE))
    print(f"server error excerpts: {len(excerpts)}", flush=True)
    return len(excerpts)


def _wait_idle(stack, timeout_s: float):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        stats = stack.worker_stats()
        if stats and all(w.kv_blocks_used == 0 and w.running == 0 for w in stats):
            return round(time.monotonic() - t0, 2)
        time.sleep(0.25)
    return None


def _dump(out: str, res: dict) -> None:
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def summary(out: str, commit: str) -> dict:
    res = json.load(open(os.path.join(out, "results.json")))
    ref_path = os.path.join(out, "reference.json")
    ref = json.load(open(ref_path)) if os.path.exists(ref_path) else {}
    greedy = res.get("greedy") or {}
    clients = {c: res.get(f"openai_c{c}", {}) for c in CONCURRENCY}
    all_runs = [res.get(f"{k}_c{c}", {}) for k in ("openai", "sdk") for c in CONCURRENCY]
    turns = (res.get("sessions") or {}).get("turns") or []
    s = {
        "commit": commit,
        "preset": "bench",
        "transport": (res.get("transport") or {}).get("transport", "unknown"),
        # e2e: compute end -> push done (the router's transfer_ms), median of TRANSFER_REPEATS
        "transfer_gb_s": {k: _transfer_field(res, k, "gb_s") for k in ("8192", "32768", "131072")},
        # the transport alone: post (descriptors built) -> completion seen by the sender
        "transfer_gb_s_transport": {k: _transfer_field(res, k, "gb_s_transport") for k in ("8192", "32768", "131072")},
        "transfer_ms": {k: _transfer_field(res, k, "transfer_ms") for k in ("8192", "32768", "131072")},
        "transfer_handoff_ms": {k: _transfer_field(res, k, "handoff_ms") for k in ("8192", "32768", "131072")},
        "transfer_first_push_ms": (res.get("transfer") or {}).get("first_push_ms"),
        "push_split_ms": {k: _transfer_field(res, k, "split_ms") for k in ("8192", "32768", "131072")},
        # against the engines alone under the stack's scheme (P/D engines in one process)
        "greedy_identical_to_colocated": bool(greedy)
        and all(isinstance(g, dict) and g.get("grpc_identical") and g.get("http_identical") for g in greedy.values()),
        "greedy_identical_to_colocated_narrowing": bool(greedy)
        and all(isinstance(g, dict) and g.get("colocated_identical") for g in greedy.values()),
        "itl_ms_p50_batch8_isolated": (res.get("itl_b8") or {}).get("itl_ms_p50"),
        "ttft_ms_p50": {str(c): clients[c].get("ttft_ms_p50") for c in CONCURRENCY},
        # the same HTTP route from plain httpx (no openai-client request building), concurrency 1
        "ttft_ms_p50_http_raw_c1": (res.get("http_c1") or {}).get("ttft_ms_p50"),
        "itl_ms_p50": {str(c): clients[c].get("itl_ms_p50") for c in CONCURRENCY},
        "engine_step_ms": {str(b): (ref.get("engine_step_ms") or {}).get(str(b)) for b in (1, 8)},
        "requests": sum(r.get("requests", 0) for r in all_runs),
        "errors": sum(r.get("errors", 0) for r in all_runs),
        "first_hit_new_width_ms": turns[1].get("ttft_ms") if len(turns) > 1 else None,
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    return s


def _transfer_field(res: dict, size: str, key: str):
    entry = (res.get("transfer") or {}).get(size)
    return entry.get(key) if isinstance(entry, dict) else None


def config_with(src: str, settings: list[str], out: str) -> str:
    """`src` with the application's args overridden (`--set key=value`, the value read as
    YAML: `--set kv_push_early=true`), written to OUT/config.yaml; `src` when there is none."""
    if not settings:
        return src
    import yaml

    raw = yaml.safe_load(open(src).read())
    (app,) = raw["applications"]
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set wants key=value, got {item!r}")
        app["args"][key] = yaml.safe_load(value)
    path = os.path.join(out, "config.yaml")
    with open(path, "w") as f:
        f.write(yaml.safe_dump(raw, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashpd.bench.h200_stack")
    p.add_argument("--out", required=True)
    p.add_argument("--phase", choices=["reference", "stack", "both"], default="both")
    p.add_argument("--config", default=os.path.abspath("infra/serve.h200.yaml"))
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument(
        "--only", default="", help="comma-separated stack phases to run (default: all), e.g. transfer,sessions"
    )
    p.add_argument(
        "--end-unix", type=float, default=None, help="finish the stack phase by this unix time (overrides --budget-s)"
    )
    p.add_argument("--commit", default=os.environ.get("FLASHPD_COMMIT", "unknown"))
    p.add_argument("--set", action="append", default=[], help="override one of the config's app args, key=value (YAML)")
    p.add_argument("--smoke-checkpoint", help="CPU smoke: tiny sizes, this checkpoint")
    a = p.parse_args(argv)
    if a.smoke_checkpoint:
        smoke_plan(a.smoke_checkpoint)
    os.makedirs(a.out, exist_ok=True)
    a.config = config_with(a.config, a.set, a.out)
    if a.phase == "both":  # the reference in its own process: its GPU memory goes back
        cmd = [sys.executable, "-m", "flashpd.bench.h200_stack", "--out", a.out, "--phase", "reference"]
        cmd += ["--config", a.config]
        if a.smoke_checkpoint:
            cmd += ["--smoke-checkpoint", a.smoke_checkpoint]
        subprocess.run(cmd, check=False)
    if a.phase == "reference":
        run_reference(a.out, a.config)
        return 0
    budget_s = a.budget_s if a.end_unix is None else a.end_unix - time.time() - 25
    run_stack(a.out, a.config, budget_s, tuple(x for x in a.only.split(",") if x))
    print(json.dumps(summary(a.out, a.commit), indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
