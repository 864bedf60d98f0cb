"""Speculative decoding speed with forced acceptance: tok/s per user and in total at batch
1 / 8 / 64, with and without speculation, through the engine (scheduler, runner, sampler).

    python -m flashpd.bench.spec_decode                                   (CPU, tiny preset)
    python -m flashpd.bench.spec_decode --device cuda --preset bench \\
        --context 8192 --out bench/results/h200/spec_summary.json         (GPU, random weights)

Random weights accept nothing, so the accepted drafts follow the engine's benchmark schedule
(`speculative.bench_forced_acceptance_length`, default 3.51 = InferenceX's golden AL for
V4.1-Flash with 5 drafts): every figure printed and written says so. This script is the
explicit benchmark flag: it sets FLASHPD_BENCH_FORCED_ACCEPTANCE=1 for its own engines.

Each batch B: B requests share a `context`-token prefix (admitted through a prefix hit) plus 16
tokens of their own, ignore EOS; once all decode, `--steps` engine steps are timed back to back
(nothing else runs): tok/s total = tokens emitted / wall time, per user = total / B. The
speculating engine speculates at every measured batch (max_batch = the largest), so the
crossover batch (the smallest B where speculation's total falls below plain decoding) is read
from the same run. `--method ngram` (default) drafts by prompt lookup: its draft costs only host
time, so the figures leave out what a DSpark drafter's forward adds; `--method dspark` runs the
preset's random DSpark drafter (`DSparkDrafter.random` on the GPU) through the engine's pooled
adapter. `greedy_identical`: a short greedy run with real (not forced) speculation of the same
method gives the same tokens as without.

DSpark drafting cost (`--draft-modes`, dspark only): each batch runs the speculating engine once
per mode, `eager` (SpeculativeConfig.draft_graphs "off": every draft launched op by op) and
`graph` (a CUDA graph per batch bucket for the draft and per row bucket for the context insert,
captured before the timed steps; on a CPU the graphs' static path without capture). Per run:
drafter ms per step = host seconds in the drafter's `propose` + `observe` over the timed steps
/ steps. `propose` ends with the drafts' one device-to-host read, which also waits for the
`observe` kernels queued after the last verify, so the sum holds the drafter's device time
without extra syncs (`--draft-sync` adds a sync around each call: each part's own device time,
at the cost of those syncs). A table is printed and every figure goes to the JSON (`draft`). A
`graph` run whose graphs were not used for every draft and insert (a capture that failed, a
bucket missing) is reported as a DRAFT GRAPH FAILURE and the script exits 2 after writing its
results (the engine itself drafted eagerly, counted). With `--method dspark` the greedy check
runs the DSpark drafter (graphs on a GPU) against plain decoding.

    python -m flashpd.bench.spec_decode --device cuda --preset bench --context 8192 \
        --method dspark --batches 1 8 --draft-modes eager graph \
        --out bench/results/h200/dspark_draft.json                   (GPU: drafting cost)
    python -m flashpd.bench.spec_decode --device cpu --preset tiny --method dspark \
        --batches 1 8 --draft-modes eager graph --steps 4              (CPU: the same path)
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.speculative import BENCH_ENV, SpeculativeConfig

DRAFT_MODES = ("eager", "graph")  # --draft-modes -> SpeculativeConfig.draft_graphs by device


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 1, (n,), generator=g).tolist()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_model(preset: str, device: str, method: str):
    """(model, dtype, DSpark drafter or None) with random weights."""
    from flashpd.model.dspark import DSparkDrafter
    from flashpd.model.presets import preset_config

    cfg = preset_config(preset)
    if device.startswith("cuda"):
        from flashpd.engine.gpu.loading import random_gpu_model

        model = random_gpu_model(cfg, device, seed=0)
        drafter = DSparkDrafter.random(cfg, model) if method == "dspark" else None
        if drafter is None:
            model.tap_layer_ids = ()  # nothing reads the tap (before any graph is captured)
        return model, "bfloat16", drafter
    from flashpd.model.checkpoint import load_checkpoint, write_random_checkpoint
    from flashpd.model.model import Model

    out = tempfile.mkdtemp(prefix="spec_bench_")
    write_random_checkpoint(cfg, out, seed=0)
    ckpt = load_checkpoint(out)
    model = Model.from_checkpoint(ckpt, torch.float32)
    drafter = DSparkDrafter.from_checkpoint(ckpt, model) if method == "dspark" else None
    if drafter is None:
        model.tap_layer_ids = ()
    return model, "float32", drafter


def make_engine(
    model,
    dtype: str,
    device: str,
    batch: int,
    context: int,
    spec: SpeculativeConfig | None,
    new_tokens: int = 256,
    dspark=None,
    graph_width_ratio: int = 2,
) -> LLMEngine:
    blocks = (batch + 2) * (-(-(context + 16 + new_tokens) // 128)) + 16
    return LLMEngine(
        model,
        EngineConfig(
            dtype=dtype,
            device=device,
            num_blocks=blocks,
            num_slots=batch + 2,
            max_num_batched_tokens=max(2048, context + 64),
            max_num_seqs=batch + 2,
            speculative=spec,
            graph_width_ratio=graph_width_ratio,
        ),
        dspark=dspark if spec is not None else None,
    )


WARM_STEPS = 3  # untimed steps once every request decodes


def new_tokens(steps: int) -> int:
    """max_tokens of a measured request: room for every timed and warm step at 17 tokens
    (k <= 16)."""
    return 17 * (steps + WARM_STEPS + 4)


def measure(engine: LLMEngine, batch: int, context: int, steps: int, vocab: int, profile: bool = False) -> dict:
    """Admit B requests on a shared prefix, then time `steps` steps with all of them decoding."""
    prefix = _prompt(context, 7, vocab)
    engine.add_request("prefix", prefix, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    params = SamplingParams(max_tokens=new_tokens(steps), ignore_eos=True)
    rids = [f"r{b}" for b in range(batch)]
    for b, rid in enumerate(rids):
        engine.add_request(rid, prefix + _prompt(16, 100 + b, vocab), params)
    while any(engine.stats[r].first_token_s is None for r in rids):
        engine.step()
    for _ in range(WARM_STEPS):  # async scheduling's pipeline is full, speculation has
        engine.step()  # started, the verify shape's graph is captured
    _sync()
    graphs = getattr(engine.model, "graphs", None)
    captures = graphs.num_captures if graphs is not None else 0
    drafter_before = _drafter_counters(engine)
    prof = cProfile.Profile() if profile else None
    t0, tokens = time.perf_counter(), 0
    if prof is not None:
        prof.enable()
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    _sync()
    seconds = time.perf_counter() - t0
    if prof is not None:  # where the host waits and works (a device sync shows as its caller)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    captures = (graphs.num_captures if graphs is not None else 0) - captures
    draft = _draft_figures(drafter_before, _drafter_counters(engine), steps)
    for rid in rids:
        engine.abort(rid)
    total = tokens / seconds
    return {
        "draft": draft,
        "batch": batch,
        "steps": steps,
        "tokens": tokens,
        "seconds": seconds,
        "tok_s_total": total,
        "tok_s_per_user": total / batch,
        "tokens_per_step_per_user": tokens / steps / batch,
        "graph_captures_while_timed": captures,
        "verify_graph_replays": graphs.num_verify_replays if graphs is not None else 0,
        "spec": engine.spec_stats.snapshot() if engine.spec is not None else None,
    }


def _drafter_counters(engine: LLMEngine) -> dict | None:
    """The DSpark adapter's counters (None: no drafter with counters, e.g. ngram)."""
    counters = getattr(engine.drafter, "counters", None)
    return counters() if counters is not None else None


def _draft_figures(before: dict | None, after: dict | None, steps: int) -> dict | None:
    """Drafter time and paths over the timed steps (differences of the adapter's counters)."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int | float) and k != "graph_failed"}
    return {
        "drafter_ms_per_step": 1e3 * (d["propose_s"] + d["observe_s"]) / steps,
        "propose_ms_per_step": 1e3 * d["propose_s"] / steps,
        "observe_ms_per_step": 1e3 * d["observe_s"] / steps,
        "proposes": d["proposes"],
        "observes": d["observes"],
        "observe_graph": d["observe_graph"],
        "graph": d["graph"],
        "eager_fallback": d["eager_fallback"],
        "eager_sampled": d["eager_sampled"],
        "graph_failures": after.get("graph_failures", 0),
        "graph_failed": bool(after.get("graph_failed", False)),
        "graph_misses": d.get("graph_misses", 0),
        "graph_captures": after.get("graph_captures", 0),
        "graph_capture_s": after.get("graph_capture_s", 0.0),
    }


def draft_graphs_setting(mode: str, device: str) -> str:
    """--draft-modes name -> SpeculativeConfig.draft_graphs: graph = CUDA graphs on a GPU, the
    graphs' static path (no capture) on a CPU."""
    if mode not in DRAFT_MODES:
        raise ValueError(f"draft mode must be one of {list(DRAFT_MODES)}, got {mode!r}")
    if mode == "eager":
        return "off"
    return "auto" if device.startswith("cuda") else "static"


def graph_failure(draft: dict | None) -> str:
    """'' when a graph run drafted through its graphs at every timed step, else why not."""
    if draft is None:
        return "no DSpark drafter counters"
    if draft["graph_failed"] or draft["graph_failures"]:
        return f"{draft['graph_failures']} capture failure(s): drafts ran eagerly (see the log's traceback)"
    if draft["graph"] != draft["proposes"] or not draft["proposes"]:
        return (
            f"{draft['graph']} of {draft['proposes']} drafts through graphs "
            f"({draft['eager_fallback']} eager fallbacks, {draft['graph_misses']} missing buckets, "
            f"{draft['eager_sampled']} sampled)"
        )
    if draft["observe_graph"] != draft["observes"]:  # decode steps insert <= B (k+1) rows
        return f"{draft['observe_graph']} of {draft['observes']} context inserts through graphs"
    return ""


def greedy_identical(model, dtype: str, device: str, vocab: int, method: str = "ngram", dspark=None) -> bool:
    """4 requests x 24 greedy tokens: real speculation of `method` (prompts with repeats, so
    ngram drafts get accepted and rejected) gives the same tokens as plain decoding."""
    prompts = {f"g{i}": _prompt(20, 50 + i, vocab) * 3 for i in range(4)}
    outs = []
    spec = SpeculativeConfig(method=method, num_tokens=5, max_batch=64)
    for cfg in (None, spec):
        engine = make_engine(model, dtype, device, 4, 64, cfg, dspark=dspark)
        if cfg is not None:
            engine.drafter.warm_up(4)
        got: dict[str, list[int]] = {}
        for rid, p in prompts.items():
            engine.add_request(rid, p, SamplingParams(max_tokens=24, ignore_eos=True))
        while engine.has_unfinished():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        outs.append(got)
    return outs[0] == outs[1]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def spec_runs(args, spec: SpeculativeConfig) -> list[tuple[str, SpeculativeConfig]]:
    """The speculating runs of each batch: one (`spec`) for ngram, one per draft mode for dspark
    (`spec-eager`, `spec-graph`)."""
    if args.method != "dspark":
        return [("spec", spec)]
    modes = args.draft_modes or ["graph"]
    return [(f"spec-{m}", dataclasses.replace(spec, draft_graphs=draft_graphs_setting(m, args.device))) for m in modes]


def _measure_row(args, model, dtype, dspark, vocab, batch: int, name: str, cfg) -> dict:
    engine = make_engine(
        model, dtype, args.device, batch, args.context, cfg, new_tokens(args.steps), dspark, args.graph_width_ratio
    )
    if cfg is not None:  # the draft graphs of every bucket up to B, before anything is timed
        engine.drafter.time_device = args.draft_sync
        engine.drafter.warm_up(batch)
    profile = name != "nonspec" and batch in args.profile
    row = measure(engine, batch, args.context, args.steps, vocab, profile=profile)
    draft = row["draft"]
    extra = "" if draft is None else f", drafter {draft['drafter_ms_per_step']:.2f} ms/step"
    print(
        f"B={batch:3d} {name:10s} {row['tok_s_per_user']:9.1f} tok/s/user "
        f"{row['tok_s_total']:9.1f} tok/s total ({row['tokens_per_step_per_user']:.2f}"
        f" tok/step/user{extra})",
        flush=True,
    )
    return row


def print_table(rows: dict, batches: list[int], names: list[str]) -> None:
    print(
        f"{'B':>4} {'mode':10} {'tok/s/user':>11} {'tok/s total':>12} {'draft ms/step':>14} "
        f"{'propose ms':>11} {'observe ms':>11} {'graph':>6} {'eager':>6} {'captures':>9} {'failures':>9}"
    )
    for b in batches:
        for name in names:
            r = rows[(name, b)]
            d = r["draft"]
            cells = (
                ("-",) * 7
                if d is None
                else (
                    f"{d['drafter_ms_per_step']:.2f}",
                    f"{d['propose_ms_per_step']:.2f}",
                    f"{d['observe_ms_per_step']:.2f}",
                    d["graph"],
                    d["eager_fallback"] + d["eager_sampled"],
                    d["graph_captures"],
                    d["graph_failures"],
                )
            )
            print(
                f"{b:4d} {name:10} {r['tok_s_per_user']:11.1f} {r['tok_s_total']:12.1f} {cells[0]:>14} "
                f"{cells[1]:>11} {cells[2]:>11} {cells[3]:>6} {cells[4]:>6} {cells[5]:>9} {cells[6]:>9}"
            )


def run(args) -> dict:
    commit = args.commit or _commit()  # the code loaded now (HEAD may move during a run)
    os.environ[BENCH_ENV] = "1"  # this script is the benchmark flag
    print(
        f"BENCHMARK MODE: forced acceptance length {args.forced} (accepted drafts follow a "
        "schedule; outputs are not the model's)",
        flush=True,
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    model, dtype, dspark = build_model(args.preset, args.device, args.method)
    vocab = model.cfg.vocab_size
    spec = SpeculativeConfig(
        method=args.method,
        num_tokens=args.num_tokens,
        max_batch=max(args.batches),
        bench_forced_acceptance_length=args.forced,
    )
    runs = [("nonspec", None), *spec_runs(args, spec)]
    rows, failures = {}, []
    for batch in args.batches:
        for name, cfg in runs:
            rows[(name, batch)] = row = _measure_row(args, model, dtype, dspark, vocab, batch, name, cfg)
            why = graph_failure(row["draft"]) if name == "spec-graph" else ""
            if why:  # loudly: the figures of this row are the eager drafter's
                failures.append({"batch": batch, "why": why})
                print(f"DRAFT GRAPH FAILURE at B={batch}: {why}", file=sys.stderr, flush=True)
        if args.out:  # what is measured so far survives a time box
            partial = {"partial": True, "rows": [dict(r, mode=n) for (n, _), r in rows.items()]}
            with open(args.out, "w") as f:
                json.dump(partial, f, indent=1)
    names = [n for n, _ in runs]
    print_table(rows, args.batches, names)
    main_spec = "spec-graph" if "spec-graph" in names else names[1]  # the summary's speculating run
    crossover = next(
        (b for b in args.batches if rows[(main_spec, b)]["tok_s_total"] < rows[("nonspec", b)]["tok_s_total"]), None
    )
    identical = greedy_identical(model, dtype, args.device, vocab, args.method, dspark) if args.greedy_check else None
    keyed = lambda name, key: {str(b): rows[(name, b)][key] for b in args.batches}  # noqa: E731
    return {
        "commit": commit,
        "preset": args.preset,
        "context": args.context,
        "forced_acceptance": args.forced,
        "device": args.device,
        "method": args.method,
        "num_tokens": args.num_tokens,
        "graph_width_ratio": args.graph_width_ratio,
        "spec_mode": main_spec,
        "tok_s_per_user": keyed(main_spec, "tok_s_per_user"),
        "tok_s_total": keyed(main_spec, "tok_s_total"),
        "nonspec_tok_s_per_user": keyed("nonspec", "tok_s_per_user"),
        "nonspec_tok_s_total": keyed("nonspec", "tok_s_total"),
        "crossover_batch": crossover,
        "small_acceptance_length": None,  # measured by the drafter's quality bench (issue 26)
        "greedy_identical": identical,
        "draft": {n: {str(b): rows[(n, b)]["draft"] for b in args.batches} for n in names[1:]},
        "draft_sync": args.draft_sync,
        "draft_graph_failures": failures,
        "command": "python -m flashpd.bench.spec_decode " + " ".join(sys.argv[1:]),
        "rows": [dict(r, mode=name) for (name, _), r in rows.items()],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=256, help="shared prompt tokens")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per run")
    ap.add_argument("--num-tokens", type=int, default=5, help="drafts per step")
    ap.add_argument("--forced", type=float, default=3.51, help="forced acceptance length")
    ap.add_argument("--method", default="ngram", choices=["ngram", "dspark"])
    ap.add_argument(
        "--draft-modes",
        nargs="+",
        choices=list(DRAFT_MODES),
        default=None,
        help="dspark: speculating runs per batch, drafts eager and/or through graphs (default: graph)",
    )
    ap.add_argument(
        "--draft-sync",
        action="store_true",
        help="dspark: sync the device around each drafter call (each part's own device time)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--no-greedy-check", dest="greedy_check", action="store_false")
    ap.add_argument(
        "--profile",
        type=int,
        nargs="*",
        default=[],
        help="batches whose timed speculative steps are profiled (cProfile)",
    )
    ap.add_argument(
        "--graph-width-ratio",
        type=int,
        default=2,
        help="EngineConfig.graph_width_ratio (0: the old 1,024-entry width steps; to compare with the context classes)",
    )
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None, help="JSON path (spec_summary keys)")
    args = ap.parse_args(argv)
    if args.draft_modes and args.method != "dspark":
        ap.error("--draft-modes needs --method dspark (ngram drafts on the host)")
    summary = run(args)
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    if summary["draft_graph_failures"]:
        print(f"DRAFT GRAPH FAILURE: {summary['draft_graph_failures']}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
