"""The serving engine on one GPU: LLMEngine + GpuModel on a preset with random weights.

    python -m flashpd.bench.gpu_engine --out bench/results/h200           (GPU, `bench` preset)
    python -m flashpd.bench.gpu_engine --preset tiny --smoke              (CPU, interpreter)
    python -m flashpd.bench.gpu_engine --summary --out bench/results/h200 (+ summary.json)
    python -m flashpd.bench.gpu_engine --first-hit --out bench/results/h200  (no stall at a new shape)

Unlike bench/gpu_floor.py, which times kernel compositions outside the engine, every figure here
goes through the engine's scheduler, KV cache manager (prefix hits, block tables), runner and
sampler, with the weights in the released formats (random values, generated on the device) and
the KV pools packed on the device:

    TTFT   cold prompt of L tokens (the prefix is computed: encoder path on every row, the
           decoder on the last 128 rows) vs the same L tokens + a 64-token new turn after the
           L-token prefix is cached (bounded replay of the last 128 rows, then the turn);
           L = 8K, 32K, 128K
    decode B sequences sharing one 8K prefix (each admitted through a prefix hit + replay),
           then the wall time of engine.step() with all B decoding (sampling and the
           logits' device-to-host copy included); B = 1, 8, 64
    first  (--summary) a fresh process's first request: load done -> its first token
    hit    (--first-hit) after the load-time warm-up (every graph up to max_model_len): per
           context, the first and second prefix hit at a width the engine has not served yet,
           and the graphs captured on the request path (must be 0); decode at 8K
    host   decode ms/step the host is busy (the step's wall time minus the time it waits for
           the device's sampled ids): with async scheduling it overlaps the device's forward
    floor  decode: bytes of active weights + KV read per step / measured copy bandwidth
           (bench/gpu_floor.py's byte law); prefill: FLOPs / 790 TFLOP/s bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import torch

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  (before any kernel import)
# isort: on

from flashpd.bench import gpu_floor
from flashpd.bench.compile_watch import CompileWatch
from flashpd.engine.gpu.loading import random_gpu_model
from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.warmup import WarmupPlan
from flashpd.engine.warmup import warm_up as warm_engine
from flashpd.model.presets import preset_config

PLANS = {
    "bench": dict(
        contexts=(8192, 32768, 131072),
        decode_context=8192,
        batches=(1, 8, 64),
        turn=64,
        decode_steps=8,
        chunk=8192,
        sampled_batches=(64,),
    ),
    "smoke": dict(
        contexts=(256,), decode_context=256, batches=(1, 2), turn=8, decode_steps=2, chunk=256, sampled_batches=(2,)
    ),
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_points(engine: LLMEngine, steps: int) -> dict[str, int]:
    """Where the host waits for the device inside `steps` engine steps, other than for the
    sampled ids: torch's sync debug mode warns at each synchronizing op; counted by the
    innermost flashpd frame ("file:line")."""
    import traceback
    import warnings

    found: dict[str, int] = {}

    def note(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "flashpd" in f.filename]
        where = f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}" if frames else f"{filename}:{lineno}"
        found[where] = found.get(where, 0) + 1

    show = warnings.showwarning
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            for _ in range(steps):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = show
    _sync()
    return found


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=g).tolist()


def _until_first_token(engine: LLMEngine, rid: str) -> float:
    """Step until `rid` has a token; returns its TTFT in ms (engine clock)."""
    while engine.stats[rid].first_token_s is None:
        engine.step()
    return engine.stats[rid].ttft_ms


def _finish(engine: LLMEngine, rids: list[str]) -> None:
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def warm_up(engine: LLMEngine, plan: dict, vocab: int, log) -> float:
    """A cold prompt and a hit turn at every measured context but the longest (other tokens),
    so that the Triton kernels those shapes need are compiled before the clock runs (some
    kernels specialise on the power of two above the entry count)."""
    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for i, length in enumerate(plan["contexts"][:-1] or plan["contexts"]):
        prompt = _prompt(length, 7 + i, vocab)
        engine.add_request(f"warm{i}", prompt, params)
        while engine.has_unfinished():
            engine.step()
        engine.add_request(f"warm_hit{i}", prompt + _prompt(plan["turn"], 50 + i, vocab), params)
        while engine.has_unfinished():
            engine.step()
    seconds = time.perf_counter() - t0
    log(f"warm-up {seconds:.1f} s")
    return seconds


def encoder_prefill(model, plan: dict, vocab: int, log, reps: int = 5) -> dict:
    """The prefill worker's job alone (role "prefill": encoder path, global KV written, no
    logits) on one `decode_context`-token prompt: `reps` prompts one after another, the first
    a warm-up; the median of the others is reported (one run alone is at the host's mercy)."""
    length = plan["decode_context"]
    engine = LLMEngine(
        model,
        EngineConfig(
            role="prefill",
            dtype="bfloat16",
            device=str(model.device),
            num_blocks=length // 64 + 8,
            num_slots=2,
            max_num_batched_tokens=plan["chunk"],
            max_num_seqs=2,
            model_id="flashpd-prefill-bench",
        ),
    )
    times = []
    for rep in range(max(2, reps)):
        engine.add_request(f"p{rep}", _prompt(length, 400 + rep, vocab), SamplingParams())
        _sync()
        t0 = time.perf_counter()
        done = False
        while not done:
            done = any(o.finished for o in engine.step())
        _sync()
        times.append(time.perf_counter() - t0)
        engine.release_kv(f"p{rep}")
    timed = times[1:]
    seconds = statistics.median(timed)
    row = {"tokens": length, "seconds": seconds, "tok_s": length / seconds, "runs_s": times, "min_s": min(timed)}
    log(
        f"encoder-path prefill {length} tokens: median {seconds:.3f} s ({row['tok_s']:.0f} "
        f"tok/s) over {len(timed)} runs after a warm-up; runs {', '.join(f'{t:.3f}' for t in times)} s"
    )
    return row


def ttft(engine: LLMEngine, plan: dict, vocab: int, log) -> list[dict]:
    rows = []
    for i, length in enumerate(plan["contexts"]):
        prompt = _prompt(length, 100 + i, vocab)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        engine.add_request(f"cold{i}", prompt, params)
        _sync()
        cold = _until_first_token(engine, f"cold{i}")
        _finish(engine, [])
        hits = []
        for rep in range(2):  # the first hit at a new key-table width also captures its graph
            turn = prompt + _prompt(plan["turn"], 200 + 10 * rep + i, vocab)
            engine.add_request(f"hit{i}_{rep}", turn, params)
            hits.append(_until_first_token(engine, f"hit{i}_{rep}"))
            out = engine.stats[f"hit{i}_{rep}"]
            _finish(engine, [])
        hit = hits[-1]
        row = {
            "context": length,
            "cold_ttft_ms": cold,
            "hit_ttft_ms": hit,
            "first_hit_ms": hits[0],
            "speedup": cold / hit,
            "cold_tok_s": length / (cold * 1e-3),
        }
        log(
            f"ttft L={length}: cold {cold:.0f} ms ({row['cold_tok_s']:.0f} tok/s), "
            f"hit+replay {hit:.0f} ms ({cold / hit:.1f}x), prompt {out.prompt_tokens}"
        )
        rows.append(row)
    return rows


SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # the drawing decode rows' parameters


def decode(engine: LLMEngine, plan: dict, vocab: int, log, sampling: dict | None = None, batches=None) -> list[dict]:
    """Decode ms/step per batch (greedy, or `sampling`'s SamplingParams fields)."""
    cfg = engine.model.cfg
    tag = "s" if sampling else "d"
    prefix = _prompt(plan["decode_context"], 300, vocab)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.add_request(f"prefix_{tag}", prefix, params)
    _until_first_token(engine, f"prefix_{tag}")
    _finish(engine, [])
    copy_gbps = gpu_floor.measure_copy_gbps()
    rows = []
    for batch in plan["batches"] if batches is None else batches:
        long = SamplingParams(max_tokens=10_000, ignore_eos=True, **(sampling or {}))
        rids = [f"{tag}{batch}_{b}" for b in range(batch)]
        for b, rid in enumerate(rids):
            engine.add_request(rid, prefix + _prompt(16, 1000 + b, vocab), long)
        t0 = time.perf_counter()
        while any(engine.stats[r].first_token_s is None for r in rids):
            engine.step()
        admit_s = time.perf_counter() - t0
        times, hosts = [], []
        engine.step()  # fills the pipeline (async scheduling: the next step is in flight)
        _sync()
        for _ in range(plan["decode_steps"] + 1):  # back to back, as a serving loop runs
            t = time.perf_counter()
            outs = engine.step()
            times.append(1e3 * (time.perf_counter() - t))
            hosts.append(times[-1] - 1e3 * engine.last_wait_s)  # busy, not waiting for ids
            assert sum(1 for o in outs if o.new_token_ids) == batch, "not all sequences decoded"
        _sync()
        if os.environ.get("FLASHPD_SYNC_DEBUG") == "1" and torch.cuda.is_available():
            log(f"B={batch}: host-device syncs in 3 more steps: {sync_points(engine, 3)}")
        _finish(engine, rids)
        ms = statistics.median(times[1:])
        host_ms = statistics.median(hosts[1:])
        floor = gpu_floor.decode_step_bytes(cfg, batch, plan["decode_context"])
        floor_ms = (floor["weights"] + floor["kv"]) / (copy_gbps * 1e9) * 1e3
        row = {
            "batch": batch,
            "step_ms": ms,
            "tok_s": batch / (ms * 1e-3),
            "floor_ms": floor_ms,
            "x_floor": ms / floor_ms,
            "admit_s": admit_s,
            "copy_GBps": copy_gbps,
            "host_ms": host_ms,
            "sampling": sampling or "greedy",
        }
        log(
            f"decode B={batch} ({row['sampling']}): {ms:.1f} ms/step ({row['tok_s']:.0f} tok/s), "
            f"floor "
            f"{floor_ms:.2f} ms ({row['x_floor']:.0f}x), host {host_ms} ms/step, admission "
            f"{admit_s:.1f} s"
        )
        rows.append(row)
    return rows


def first_request(engine: LLMEngine, plan: dict, vocab: int, log) -> tuple[float, dict]:
    """ms from the end of load (model built and warmed, engine made) to the first token of the
    first request: a `decode_context`-token prompt, then one decode step of it; and where that
    time went: the Triton variants compiled on the way (none, when the load-time warm-up covers
    the request) and the CUDA graphs captured."""
    graphs = getattr(engine.model, "graphs", None)
    captures, capture_s = (graphs.num_captures, graphs.capture_s) if graphs else (0, 0.0)
    t0 = time.perf_counter()
    with CompileWatch() as watch:
        engine.add_request(
            "first", _prompt(plan["decode_context"], 900, vocab), SamplingParams(max_tokens=2, ignore_eos=True)
        )
        _until_first_token(engine, "first")
        ms = 1e3 * (time.perf_counter() - t0)
        _finish(engine, ["first"])
    detail = {
        "compiles": watch.summary(),
        "graph_captures": graphs.num_captures - captures if graphs else 0,
        "graph_capture_s": round(graphs.capture_s - capture_s, 3) if graphs else 0.0,
    }
    log(
        f"first request after load: first token in {ms:.0f} ms; {watch.report()}; "
        f"{detail['graph_captures']} graph captures, {detail['graph_capture_s']:.2f} s"
    )
    return ms, detail


FIRST_HIT_CONTEXTS = {"bench": (8192, 32768), "smoke": (256,)}
FIRST_HIT_MAX_LEN = {"bench": 65536, "smoke": 1024}


def _graph_counts(engine: LLMEngine) -> dict:
    return engine.graph_counters() or {"graph_captures": 0, "graph_builds": 0, "graph_misses": 0}


def first_hits(engine: LLMEngine, contexts, plan: dict, vocab: int, log) -> list[dict]:
    """Per context L: a cold L-token prompt, then two prefix hits on it with new 64-token turns
    (the first at a key width this process has not served: its bounded replay and turn take
    the graphs the warm-up captured), with the graphs captured and eager misses on the way."""
    rows = []
    for i, length in enumerate(contexts):
        prompt = _prompt(length, 600 + i, vocab)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        before = _graph_counts(engine)
        engine.add_request(f"fh_cold{i}", prompt, params)
        cold_ms = _until_first_token(engine, f"fh_cold{i}")
        _finish(engine, [f"fh_cold{i}"])
        hits = []
        for j in range(2):
            rid = f"fh_hit{i}_{j}"
            engine.add_request(rid, prompt + _prompt(plan["turn"], 700 + 10 * i + j, vocab), params)
            hits.append(_until_first_token(engine, rid))
            _finish(engine, [rid])
        after = _graph_counts(engine)
        row = {
            "context": length,
            "cold_ttft_ms": cold_ms,
            "first_hit_ms": hits[0],
            "second_hit_ms": hits[1],
            "request_path_captures": after["graph_captures"] - before["graph_captures"],
            "request_path_builds": after["graph_builds"] - before["graph_builds"],
            "graph_misses": after["graph_misses"] - before["graph_misses"],
        }
        log(
            f"L={length}: first hit {hits[0]:.0f} ms, second hit {hits[1]:.0f} ms (cold {cold_ms:.0f} ms); "
            f"request-path captures {row['request_path_captures']}, builds {row['request_path_builds']}, "
            f"eager misses {row['graph_misses']}"
        )
        rows.append(row)
    return rows


def first_hit_main(args, plan: dict, cfg, model, build_s: float, log) -> dict:
    """--first-hit: an engine with max_model_len, warmed at load (every graph up to it), then
    `first_hits` at 8K and 32K and decode at 8K, B = 1/8/64."""
    key = "smoke" if args.smoke else "bench"
    contexts = FIRST_HIT_CONTEXTS[key]
    max_len = args.max_model_len or FIRST_HIT_MAX_LEN[key]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = LLMEngine(
        model,
        EngineConfig(
            dtype="bfloat16",
            device=device,
            # the contexts twice over, and one decode sequence's 10,000-token budget (`decode`)
            num_blocks=max(2 * max(contexts), plan["decode_context"] + 10_016) // 128 + 64,
            num_slots=max(plan["batches"]) + 4,
            max_num_batched_tokens=plan["chunk"],
            max_num_seqs=max(plan["batches"]),
            model_id=f"flashpd-{args.preset}",
            max_model_len=max_len,
            graph_width_ratio=args.graph_width_ratio,
        ),
    )
    # the smoke run: a short plan (the interpreter); the GPU: the load-time default plan
    wplan = WarmupPlan(long_tokens=136, short_tokens=128, batches=(1, 2)) if args.smoke else None
    done = warm_engine(engine, wplan)
    log(
        f"warm-up: {done['seconds']:.1f} s, {done['requests']} requests, {done['graph_captures']} graph captures "
        f"({done['graph_builds']} built), classes {done['graph_classes']}"
    )
    hits = first_hits(engine, contexts, plan, cfg.vocab_size, log)
    before = _graph_counts(engine)
    decode_rows = decode(engine, dict(plan, decode_steps=min(plan["decode_steps"], 8)), cfg.vocab_size, log)
    after = _graph_counts(engine)
    decode_captures = after["graph_captures"] - before["graph_captures"]
    decode_misses = after["graph_misses"] - before["graph_misses"]
    log(f"decode: request-path captures {decode_captures}, eager misses {decode_misses}")
    return {
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "build_s": build_s,
        "max_model_len": max_len,
        "graph_width_ratio": args.graph_width_ratio,
        "warmup": done,
        "first_hits": hits,
        "decode": decode_rows,
        "decode_request_path_captures": decode_captures,
        "decode_graph_misses": decode_misses,
        "counters": _graph_counts(engine),
    }


def watched(name: str, payload: dict, log, fn, *args, **kwargs):
    """fn(*args, **kwargs), with the Triton compiles it made under payload["compiles"][name]."""
    with CompileWatch() as watch:
        out = fn(*args, **kwargs)
    payload.setdefault("compiles", {})[name] = watch.summary()
    log(f"{name}: {watch.report()}")
    return out


def summary(payload: dict, commit: str) -> dict:
    """bench/results/h200/summary.json (issue 13's keys; ms, MFU as a fraction)."""
    dec = {str(r["batch"]): r for r in payload["decode"]}
    ttft_rows = {str(r["context"]): r for r in payload["ttft"]}
    return {
        "preset": payload["preset"],
        "context": payload["decode_context"],
        "decode_ms_per_step": {b: round(r["step_ms"], 2) for b, r in dec.items()},
        "decode_floor_ms": {b: round(r["floor_ms"], 2) for b, r in dec.items()},
        "host_ms_per_step": {b: None if r["host_ms"] is None else round(r["host_ms"], 2) for b, r in dec.items()},
        "prefill_tok_s_8k": round(payload["prefill"]["tok_s"], 1),
        "prefill_mfu_8k": round(payload["prefill"]["mfu"], 4),
        "ttft_cold_ms": {c: round(r["cold_ttft_ms"], 1) for c, r in ttft_rows.items()},
        "ttft_hit_ms": {
            c: round(r["hit_ttft_ms"], 1) for c, r in ttft_rows.items() if c == str(payload["decode_context"])
        },
        "first_request_ms": round(payload["first_request_ms"], 1),
        "command": payload["command"],
        "commit": commit,
    }


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=os.path.dirname(__file__)
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def render(payload: dict) -> str:
    lines = [
        f"# Engine on {payload['device']}: `{payload['preset']}` preset",
        "",
        f"Command: `{payload['command']}`",
        "",
        "LLMEngine + GpuModel (Triton kernels, weights in checkpoint formats, packed KV "
        "pools on the device), scheduler/KV manager/sampler included.",
        "",
        "## TTFT: cold prompt vs prefix hit + bounded replay (64-token new turn)",
        "",
        "| context | cold TTFT ms | cold tok/s | MFU | hit + replay TTFT ms | speedup |",
        "|---|---|---|---|---|---|",
    ]
    for r in payload["ttft"]:
        lines.append(
            f"| {r['context']:,} | {r['cold_ttft_ms']:.0f} | {r['cold_tok_s']:.0f} | "
            f"{100 * r.get('mfu', 0):.1f}% | {r['hit_ttft_ms']:.0f} | "
            f"{r['speedup']:.1f}x |"
        )
    p = payload["prefill"]
    lines += [
        "",
        "## Encoder-path prefill (prefill role: layers 0-19 + layer 20's KV write)",
        "",
        "| tokens | seconds | tok/s | MFU (790 TFLOP/s bf16) |",
        "|---|---|---|---|",
        f"| {p['tokens']:,} | {p['seconds']:.2f} | {p['tok_s']:.0f} | {100 * p['mfu']:.1f}% |",
    ]
    lines += [
        "",
        f"## Decode, {payload['decode_context']:,}-token context per sequence",
        "",
        "| batch | ms/step | host ms/step | tok/s | HBM floor ms | x floor |",
        "|---|---|---|---|---|---|",
    ]
    for r in payload["decode"]:
        host = "-" if r.get("host_ms") is None else f"{r['host_ms']:.1f}"
        lines.append(
            f"| {r['batch']} | {r['step_ms']:.1f} | {host} | {r['tok_s']:.0f} | "
            f"{r['floor_ms']:.2f} | {r['x_floor']:.0f}x |"
        )
    for r in payload.get("decode_sampled", []):
        host = "-" if r.get("host_ms") is None else f"{r['host_ms']:.1f}"
        lines.append(
            f"| {r['batch']}, drawing ({r['sampling']}) | {r['step_ms']:.1f} | {host} | "
            f"{r['tok_s']:.0f} | {r['floor_ms']:.2f} | {r['x_floor']:.0f}x |"
        )
    if payload.get("first_request_ms") is not None:
        lines += [
            "",
            f"First request after load (model built in {payload['build_s']:.1f} s, "
            f"kernels warmed): first token {payload['first_request_ms']:.0f} ms "
            f"({payload['decode_context']:,}-token prompt).",
        ]
    lines += ["", "Notes:"] + [f"- {n}" for n in payload["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--decode-only", action="store_true", help="skip prefill and TTFT")
    ap.add_argument(
        "--compare-sync", action="store_true", help="with --decode-only: decode again with async scheduling off"
    )
    ap.add_argument(
        "--prefill-only", action="store_true", help="only the encoder-path prefill (no warm-up, TTFT or decode)"
    )
    ap.add_argument(
        "--ttft-only", action="store_true", help="only the cold and hit TTFT at the decode context (after the warm-up)"
    )
    ap.add_argument(
        "--summary", action="store_true", help="everything, first request after load included; writes summary.json"
    )
    ap.add_argument(
        "--engine-warmup", action="store_true", help="warm the engine as load_engine does (always with --summary)"
    )
    ap.add_argument(
        "--first-hit",
        action="store_true",
        help="warm-up captures, first/second prefix hit at a new width (8K, 32K), decode at 8K",
    )
    ap.add_argument(
        "--max-model-len", type=int, default=None, help="with --first-hit: the context limit (default 65,536)"
    )
    ap.add_argument("--graph-width-ratio", type=int, default=2, help="with --first-hit: EngineConfig.graph_width_ratio")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git HEAD)")
    args = ap.parse_args(argv)
    plan = PLANS["smoke" if args.smoke else args.preset]
    cfg = preset_config(args.preset)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model = random_gpu_model(cfg, device, seed=0)
    _sync()
    build_s = time.perf_counter() - t0
    print(f"model built in {build_s:.1f} s", flush=True)
    if args.first_hit:
        t0 = time.perf_counter()
        payload = first_hit_main(args, plan, cfg, model, build_s, lambda m: print(m, flush=True))
        payload["seconds_after_build"] = time.perf_counter() - t0
        payload["command"] = "python -m flashpd.bench.gpu_engine " + " ".join(sys.argv[1:] if argv is None else argv)
        print(json.dumps({k: payload[k] for k in ("first_hits", "decode_request_path_captures")}, indent=1))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            name = "first_hit" if not args.smoke else "first_hit_smoke"
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump(payload, f, indent=1)
        return 0
    blocks = 2 * max(plan["contexts"]) // 128 + 64
    slots = max(plan["batches"]) + 4
    engine = LLMEngine(
        model,
        EngineConfig(
            dtype="bfloat16",
            device=device,
            num_blocks=blocks,
            num_slots=slots,
            max_num_batched_tokens=plan["chunk"],
            max_num_seqs=max(plan["batches"]),
            model_id=f"flashpd-{args.preset}",
        ),
    )
    log = lambda m: print(m, flush=True)  # noqa: E731
    engine_warmup, early = None, {}
    if args.summary or args.engine_warmup:  # as engine.loading.load_engine does on a GPU
        engine_warmup = watched("engine_warmup", early, log, warm_engine, engine)
        log(
            f"engine warm-up: {engine_warmup['requests']} requests, {engine_warmup['steps']} "
            f"steps, {engine_warmup['seconds']:.1f} s"
        )
    first_ms, first_detail = first_request(engine, plan, cfg.vocab_size, log) if args.summary else (None, None)
    payload = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "command": "python -m flashpd.bench.gpu_engine " + " ".join(sys.argv[1:] if argv is None else argv),
        "build_s": build_s,
        "decode_context": plan["decode_context"],
        "first_request_ms": first_ms,
        "first_request_detail": first_detail,
        "engine_warmup": engine_warmup,
        **early,
    }
    if args.decode_only:
        payload["decode"] = decode(engine, plan, cfg.vocab_size, log)
        if args.compare_sync:  # the same engine with async scheduling off
            engine.config = dataclasses.replace(engine.config, async_scheduling=False)
            log("async scheduling off:")
            payload["decode_sync"] = decode(engine, plan, cfg.vocab_size, log)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "engine_decode.json"), "w") as f:
                json.dump(payload, f, indent=1)
        return 0
    if not args.prefill_only:
        payload["warmup_s"] = watched("warm_up", payload, log, warm_up, engine, plan, cfg.vocab_size, log)
    if args.ttft_only:
        payload["ttft"] = ttft(engine, dict(plan, contexts=(plan["decode_context"],)), cfg.vocab_size, log)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "engine_ttft.json"), "w") as f:
                json.dump(payload, f, indent=1)
        return 0
    payload["prefill"] = encoder_prefill(model, plan, cfg.vocab_size, log)
    flops = sum(gpu_floor.encoder_prefill_flops(cfg, payload["prefill"]["tokens"]).values())
    payload["prefill"]["mfu"] = flops / payload["prefill"]["seconds"] / (gpu_floor.PEAK_BF16_TFLOPS * 1e12)
    if args.prefill_only:
        log(f"prefill MFU {100 * payload['prefill']['mfu']:.1f}%")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "engine_prefill.json"), "w") as f:
                json.dump(payload, f, indent=1)
        return 0
    payload["ttft"] = watched("ttft", payload, log, ttft, engine, plan, cfg.vocab_size, log)
    for r in payload["ttft"]:
        flops = sum(gpu_floor.encoder_prefill_flops(cfg, r["context"]).values())
        r["mfu"] = flops / (r["cold_ttft_ms"] * 1e-3) / (gpu_floor.PEAK_BF16_TFLOPS * 1e12)
    payload["decode"] = watched("decode", payload, log, decode, engine, plan, cfg.vocab_size, log)
    payload["decode_sampled"] = decode(engine, plan, cfg.vocab_size, log, SAMPLED, plan["sampled_batches"])
    payload["notes"] = [
        "Cold TTFT runs the encoder path on every prompt row and the decoder layers on the last "
        "128 rows (decoder narrowing, bounded replay's colocated form); MFU counts the "
        "encoder-path FLOPs (bench/gpu_floor.py's law) against 790 TFLOP/s bf16.",
        "Hit TTFT: the L-token prefix comes from the prefix cache (chunk-aligned), the last 128 "
        "cached rows are replayed through all layers (a captured graph, one per key-table "
        "width: the second of two hits is reported, the first includes the captures), then the "
        "64-token turn (a captured graph per bucket and width since bb82f3a; eager before).",
        "Decode ms/step is the median wall time of one engine.step() with every sequence "
        "decoding, steps back to back: scheduler + host-side tables + one CUDA-graph replay of "
        "the engine's forward (GpuModel.compute captured by engine/gpu/decode_graph.py; batch "
        "padded to the next power of two) + the bookkeeping after it + sampling on the device "
        "(one host copy; greedy, and the 'drawing' rows: temperature 0.8, top-p 0.95). With "
        "async scheduling (EngineConfig.async_scheduling, on) a step's host work runs while "
        "the previous step's forward is on the device. Host ms/step: that wall time minus "
        "the time the step waited for the device's sampled ids (the host's own work).",
        "Cold and hit prefills run eagerly (one Triton launch per kernel, no graph); the index "
        "scoring is one paged launch per index layer for the whole batch.",
    ]
    text = render(payload)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "engine" if not args.smoke else "engine_smoke"
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(payload, f, indent=1)
        with open(os.path.join(args.out, f"{name}.md"), "w") as f:
            f.write(text)
        if args.summary:
            with open(os.path.join(args.out, "summary.json"), "w") as f:
                json.dump(summary(payload, args.commit or _commit()), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
