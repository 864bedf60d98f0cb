"""A session's turns through a prefill and a decode engine, as the stack's replicas run them, with
what each turn compiled or captured on the request path (issue 25: no stall at a new shape).

    python -m flashpd.bench.pd_session --config infra/serve.h200.yaml --out OUT      (GPU)
    python -m flashpd.bench.pd_session --smoke CHECKPOINT --out OUT                   (CPU)

The H200 stack's sessions phase (bench/h200_stack.py) saw turn 3 of a 9,000-token session spend
2,883 ms in prefill for 328 new tokens (a cold 9,000-token prompt took 702 ms), and the
decode side 121-167 ms in its bounded replay per turn. This runs the same turns at the engine
level: one model, a prefill engine and a decode engine built from the Serve config's engine
settings (h200_stack.stack_engine_configs) and warmed up as a replica is at load, the KV blocks
copied between the pools as NIXL would. Per turn: the prefill's time to kv_ready, the decode's
time from the KV's arrival to its first token, the Triton compiles (bench/compile_watch.py)
and the graph captures / eager misses during each.

Turn k's prompt = turn k-1's prompt + its 16-token answer + 64 new tokens (the stack's phase).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time

import torch

from flashpd.bench.compile_watch import CompileWatch
from flashpd.bench.h200_stack import hand_over_kv, stack_engine_configs
from flashpd.bench.turn_profile import HostProfile, TurnProfile, format_profile
from flashpd.engine.llm_engine import LLMEngine
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.warmup import WarmupPlan, warm_up

FIRST, ANSWER, NEW, TURNS = 9000, 16, 64, 4
SMOKE = {"first": 300, "answer": 4, "new": 16}


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=g).tolist()


def _counters(engine: LLMEngine) -> dict:
    return engine.graph_counters() or {"graph_captures": 0, "graph_builds": 0, "graph_misses": 0}


def _delta(after: dict, before: dict) -> dict:
    keys = ("graph_captures", "graph_builds", "graph_misses", "graph_runs_pd")
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def prefill_turn(pre: LLMEngine, rid: str, prompt: list[int], wrap=contextlib.nullcontext) -> tuple[dict, object]:
    """Prefill `prompt` to kv_ready; its ms, compiles, graph counters and the finished output.
    wrap: a context around the turn (a profiler)."""
    before = _counters(pre)
    t0 = time.perf_counter()
    with CompileWatch() as watch, wrap():
        pre.add_request(rid, prompt, SamplingParams(max_tokens=1))
        ready = None
        while ready is None:
            ready = next((o for o in pre.step() if o.request_id == rid and o.finished), None)
    if ready.finish_reason != "kv_ready":
        raise RuntimeError(f"prefill of {rid} ended with {ready.finish_reason}")
    row = {"prefill_ms": round(1e3 * (time.perf_counter() - t0), 1), "prefill_compiles": watch.summary(4)}
    row.update({f"prefill_{k}": v for k, v in _delta(_counters(pre), before).items()})
    return row, ready


def decode_turn(
    pre: LLMEngine, dec: LLMEngine, rid: str, prompt: list[int], ready, answer: int, wrap=contextlib.nullcontext
) -> tuple[dict, list]:
    """Reserve on the decode engine, copy the missing blocks, run to `answer` tokens. wrap: a
    context around the KV's arrival -> the first token (the replay; a profiler)."""
    r = dec.reserve(rid, prompt, SamplingParams(max_tokens=answer, ignore_eos=True))
    hand_over_kv(pre, dec, rid, ready, r)
    before = _counters(dec)
    got: list[int] = []
    first_ms = None
    with CompileWatch() as watch:
        with wrap():
            t0 = time.perf_counter()
            dec.kv_arrived(rid)
            while not got:
                for o in dec.step():
                    got.extend(o.new_token_ids)
            first_ms = round(1e3 * (time.perf_counter() - t0), 1)
        while dec.has_unfinished():
            for o in dec.step():
                got.extend(o.new_token_ids)
    row = {
        "decode_cached_tokens": r.num_cached_blocks * 128,
        "decode_first_token_ms": first_ms,
        "decode_compiles": watch.summary(4),
    }
    row.update({f"decode_{k}": v for k, v in _delta(_counters(dec), before).items()})
    return row, got


def _wrapper(kind: str | None, sink: list):
    """A context factory for one phase of a turn: nothing, TurnProfile or HostProfile; the
    entered object is appended to sink (read after the turn)."""
    if kind is None:
        return contextlib.nullcontext

    @contextlib.contextmanager
    def wrap():
        obj = TurnProfile() if kind == "device" else HostProfile()
        with obj:
            yield obj
        sink.append(obj)

    return wrap


def session(
    pre: LLMEngine,
    dec: LLMEngine | None,
    vocab: int,
    sizes: dict,
    log,
    turns: int = TURNS,
    profile_from: int | None = None,
    host_profile_dir: str | None = None,
) -> list[dict]:
    """The turns; with no decode engine, the prefill side alone (the answer: generated ids).
    From turn `profile_from` on, the even turns' prefill and replay run under torch.profiler
    (row keys prefill_profile / decode_profile) and the odd ones under cProfile when
    host_profile_dir is given (its text files land there); the unprofiled ms stay in the rows
    of turns before."""
    prompt = _ids(sizes["first"], 77, vocab)
    rows = []
    for turn in range(turns):
        rid = f"turn{turn}"
        kind = None
        if profile_from is not None and turn >= profile_from:
            kind = "device" if (turn - profile_from) % 2 == 0 or host_profile_dir is None else "host"
        got_pre: list = []
        got_dec: list = []
        row, ready = prefill_turn(pre, rid, prompt, _wrapper(kind, got_pre))
        if dec is not None:
            drow, answer = decode_turn(pre, dec, rid, prompt, ready, sizes["answer"], _wrapper(kind, got_dec))
        else:
            pre.release_kv(rid)
            drow, answer = {}, _ids(sizes["answer"], 500 + turn, vocab)
        row = {"turn": turn, "prompt_tokens": len(prompt), **row, **drow}
        log(
            f"turn {turn} ({len(prompt)} tokens): prefill {row['prefill_ms']} ms "
            f"({row['prefill_compiles']['count']} compiles, {row['prefill_compiles']['seconds']} s) "
            f"{row['prefill_compiles']['kernels'][:2]}; decode {drow or '-'}"
        )
        for phase, got in (("prefill", got_pre), ("decode", got_dec)):
            for obj in got:
                if isinstance(obj, TurnProfile):
                    row[f"{phase}_profile"] = obj.summary()
                    log(format_profile(f"{phase} profile", row[f"{phase}_profile"]))
                elif host_profile_dir is not None:
                    path = os.path.join(host_profile_dir, f"host_{phase}_turn{turn}.txt")
                    with open(path, "w") as f:
                        f.write(obj.text)
                    log(f"  {phase} host profile -> {path}")
        rows.append(row)
        prompt = prompt + answer + _ids(sizes["new"], 900 + turn, vocab)
    return rows


def build(args):
    """(model, prefill engine, decode engine or None) over the config's engine settings."""
    cfgs = stack_engine_configs(args.config)
    roles = ("prefill", "decode") if not args.prefill_only else ("prefill",)
    if args.smoke:
        from flashpd.model.model import load_model

        model = load_model(args.smoke, torch.float32)
        over = {"dtype": "float32", "device": "cpu", "num_blocks": 512, "max_model_len": 4096}
        engines = [LLMEngine(model, dataclasses.replace(cfgs[r], **over)) for r in roles]
        return model, engines[0], engines[1] if len(engines) > 1 else None
    from flashpd.engine.gpu.loading import random_gpu_model
    from flashpd.model.presets import preset_config

    model = random_gpu_model(preset_config("bench"), "cuda", 0)
    engines = [LLMEngine(model, cfgs[r]) for r in roles]
    return model, engines[0], engines[1] if len(engines) > 1 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashpd.bench.pd_session")
    p.add_argument("--config", default=os.path.abspath("infra/serve.h200.yaml"))
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", default=None, help="CPU: this checkpoint, short turns, a short warm-up")
    p.add_argument("--commit", default=os.environ.get("FLASHPD_COMMIT", "unknown"))
    p.add_argument("--prefill-only", action="store_true", help="the prefill engine alone (turns to kv_ready)")
    p.add_argument("--turns", type=int, default=TURNS)
    p.add_argument("--no-warmup", action="store_true", help="skip the replicas' load-time warm-up")
    p.add_argument(
        "--profile-from",
        type=int,
        default=None,
        help="profile turns from this one on: torch.profiler (even), cProfile with --host-profile (odd)",
    )
    p.add_argument("--host-profile", action="store_true", help="cProfile text of the odd profiled turns into OUT")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    model, pre, dec = build(args)
    plan = WarmupPlan(long_tokens=136, short_tokens=128, batches=(1, 2)) if args.smoke else None
    warm = {}
    if not args.no_warmup:
        warm = {role: warm_up(e, plan) for role, e in (("prefill", pre), ("decode", dec)) if e is not None}
    print(f"built and warmed in {time.perf_counter() - t0:.1f} s", flush=True)
    sizes = SMOKE if args.smoke else {"first": FIRST, "answer": ANSWER, "new": NEW}
    os.makedirs(args.out, exist_ok=True)
    rows = session(
        pre,
        dec,
        model.cfg.vocab_size,
        sizes,
        lambda m: print(m, flush=True),
        turns=args.turns,
        profile_from=args.profile_from,
        host_profile_dir=args.out if args.host_profile else None,
    )
    out = {"commit": args.commit, "config": args.config, "warmup": warm, "turns": rows}
    with open(os.path.join(args.out, "pd_session.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
