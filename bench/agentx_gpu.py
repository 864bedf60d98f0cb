"""The AgentX-like sweep on one GPU machine, one configuration per device call (issue 28).

    python -m flashpd.bench.agentx_gpu sweep --config infra/serve.h200.yaml --name flashpd \
        --out OUT [--concurrency 1,2,4,8,16,32,64] [--window-s 15] [--window-low-s 20] [--end-unix T]
    python -m flashpd.bench.agentx_gpu sweep --config infra/serve.h200.baseline.yaml \
        --name baseline --out OUT ...
    python -m flashpd.bench.agentx_gpu sweep --config infra/serve.h200.colocated.yaml \
        --name colocated --out OUT ...          (colocated serving: report's pd_vs_colocated)
    python -m flashpd.bench.agentx_gpu sweep --config infra/serve.h200.spec.yaml \
        --name spec --out OUT ...               (speculative, FORCED acceptance 3.51: the 150 tier)
    python -m flashpd.bench.agentx_gpu merge STUDY CALL_OUT --commit SHA   (one call's sweeps into the study)
    python -m flashpd.bench.agentx_gpu report OUT --baseline baseline --candidate flashpd --commit SHA
    python -m flashpd.bench.agentx_gpu cpu-config infra/serve.h200.yaml --checkpoint DIR --out FILE

`sweep` brings the stack up from the Serve config (services/gpu_stack.py: Redis, Ray, router +
prefill + decode on the GPU, ready after warm-up), runs `flashpd bench run` per concurrency
point through the router's gRPC port into OUT/<name>/c<C>, and takes the stack down; it writes
OUT/<name>/sweep.json (bring-up time, each point's exit code, start and end, the points not
started). A device call has a hard limit, so every point is guarded by --end-unix: a point whose
estimate (cold prefill of its lanes' primers + window + drain, see `point_estimate_s`) would end
past it is not started, and a running point is interrupted with SIGINT (the driver keeps its
records and writes meta.json) when the deadline comes.

The workload defaults are AgentX's shape on one H200 (`H200_WORKLOAD`): token counts / 7.8125
(prompts 3K-123K, mean ~28K, context cap 128K), main outputs / 4 (median ~150 tokens), think
times / 5 (median ~1 s, capped at 5 s per turn). Each point's lanes start cold: the driver
primes every lane with the turn before its start point (a full prefill, max_tokens=1) and the
window opens only once every lane is primed, so the window never holds the cold prefill; the
cost is wall time (C x ~28K tokens at ~14K tok/s before the window), which the guard counts.
Points do not share sessions: the driver salts sessions by concurrency, and replaying a lane's
turns again at the next point would re-send prompts the server already holds in full.

`report` renders OUT/report.md (the AgentX summary, the seed's ratios beside ours, the exact
commands, what one H200 cannot show, then bench/report.py's tables and plots) and
OUT/summary.json (bench/tiers.py's tiers and A/B ratios with commit, preset, errors, coverage).

`cpu-config` rewrites an H200 config for the CPU (tiny checkpoint, small pools, no GPU
fractions, no cuda_ipc policy; the speculative block and its benchmark flag are kept: prompt
lookup runs on the CPU), so the whole sweep + report runs end to end on a CPU
(tests/bench/test_agentx_dry_run.py).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from flashpd.bench.cli import parse_concurrency
from flashpd.services.stack_logs import SERVER_ERRORS_FILE, write_excerpts

PRESET = "bench"
SEED_SPEEDUP_LOW_CONCURRENCY = 1.9  # the seed's "1.9x faster at low concurrency"
SEED_THROUGHPUT_AT_150 = 5.3  # the seed's "5.3x more total throughput at 150 tok/s per user"
DRAIN_ESTIMATE_S = 8.0  # a point's in-flight requests after its window (~150 tokens at ~40 ms)
POINT_OVERHEAD_S = 3.0  # a point's process start (imports, workload generation) and exit
CALIBRATE_MIN_TOKENS = 100_000  # primer tokens a point needs before its prefill rate replaces the guess
LOW_CONCURRENCY = 4  # points up to this get --window-low-s: few lanes send few requests
INTERRUPT_GRACE_S = 20.0  # SIGINT -> the driver writes meta.json; then the point is killed
SWEEP_FILE = "sweep.json"
CONFIGS = {
    "flashpd": "infra/serve.h200.yaml",
    "baseline": "infra/serve.h200.baseline.yaml",
    "colocated": "infra/serve.h200.colocated.yaml",
    # flashpd + speculative decoding under FORCED acceptance (benchmark mode, AL 3.51): the 150
    # tok/s/user tier; the report marks it forced and takes that tier from it
    "spec": "infra/serve.h200.spec.yaml",
}
CALL_BUDGET_S = 570  # of the device call's 600 s: the sweep's --end-unix (install and bring-up included);
# points end --teardown-s before it, and the stack is down with ~30 s to spare

# AgentX (5K-131K prompts, mean ~27K, ~150-token outputs, ~1 s tool delays) on one H200
H200_WORKLOAD = {
    "trees": 64,
    "scale": 7.8125,  # the 1M context cap -> 128K; main prompts p50 ~18K, mean ~28K
    "time_scale": 5.0,  # think p50 4.9 s -> ~1 s
    "output_scale": 4.0,  # main output p50 600 -> ~150
    "tree_idle_cap_s": 5.0,  # a tool delay never idles a lane longer (think p90 would be ~26 s)
}


def window_s(concurrency: int, a: argparse.Namespace) -> float:
    return a.window_low_s if concurrency <= LOW_CONCURRENCY else a.window_s


def sweep_command(target: str, name: str, out: str, concurrency: int, a: argparse.Namespace) -> list[str]:
    """One point's `flashpd bench run` (its own process: an interrupt ends only that point)."""
    cmd = [sys.executable, "-m", "flashpd.cli", "bench", "run", "--target", target, "--name", name, "--gpus", "1"]
    cmd += ["-c", str(concurrency), "--window-s", f"{window_s(concurrency, a):g}"]
    cmd += ["--warmup-requests", str(a.warmup_requests)]
    cmd += ["--trees", str(a.trees), "--scale", f"{a.scale:g}", "--time-scale", f"{a.time_scale:g}"]
    cmd += ["--output-scale", f"{a.output_scale:g}", "--tree-idle-cap-s", f"{a.tree_idle_cap_s:g}"]
    cmd += ["--vocab-lo", str(a.vocab_lo), "--vocab-hi", str(a.vocab_hi)]
    if a.max_turns is not None:
        cmd += ["--max-turns", str(a.max_turns)]
    cmd += ["--drain-timeout-s", f"{a.drain_timeout_s:g}", "--request-timeout-s", f"{a.request_timeout_s:g}"]
    return cmd + ["--no-progress", "--out", str(Path(out) / name / f"c{concurrency}")]


def mean_primer_tokens(a: argparse.Namespace) -> float:
    """Mean main-agent prompt of the sweep's workload: what one lane's primer prefills cold."""
    from flashpd.bench.workload import WorkloadConfig, generate_workload

    config = WorkloadConfig(
        num_trees=a.trees,
        scale=a.scale,
        time_scale=a.time_scale,
        output_scale=a.output_scale,
        max_turns=a.max_turns,
        vocab_lo=a.vocab_lo,
        vocab_hi=a.vocab_hi,
    )
    prompts = [r.prompt_tokens for r in generate_workload(config).requests() if not r.is_subagent]
    return sum(prompts) / len(prompts)


def point_estimate_s(concurrency: int, window_s: float, primer_tokens: float, prefill_tok_s: float) -> float:
    """Wall seconds one point takes: its lanes' primers prefilled one after another on the
    shared GPU, the window, the drain, the process's start."""
    return concurrency * primer_tokens / prefill_tok_s + window_s + DRAIN_ESTIMATE_S + POINT_OVERHEAD_S


def run_point(cmd: list[str], deadline_unix: float) -> int:
    """Runs one point; at the deadline it is interrupted (SIGINT: records and meta.json kept),
    then killed if it has not ended INTERRUPT_GRACE_S later. Returns its exit code (124: cut)."""
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait(timeout=max(1.0, deadline_unix - time.time()))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=INTERRUPT_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return 124


def observed_prefill_tok_s(run_dir: Path) -> float | None:
    """Cold prefill rate a finished point saw: its primers' tokens over the time until its window
    opened (every lane primed); None when it primed too few tokens to say or never opened."""
    from flashpd.bench.records import Phase, read_run

    if not (run_dir / "meta.json").exists():
        return None
    meta, records = read_run(run_dir)
    tokens = sum(r.prompt_tokens for r in records if r.phase is Phase.PRIMER and r.ok)
    if meta.window_start_s is None or meta.window_start_s <= 0 or tokens < CALIBRATE_MIN_TOKENS:
        return None
    return tokens / meta.window_start_s


def _plan_point(c: int, a: argparse.Namespace, primer: float, end: float, prefill_tok_s: float) -> str | None:
    """Why point C is not started (None: start it)."""
    need_s = point_estimate_s(c, window_s(c, a), primer, prefill_tok_s)
    left_s = end - a.teardown_s - time.time()
    if need_s > left_s:
        return f"needs ~{need_s:.0f} s (cold prefill of {c} primers + window + drain), {left_s:.0f} s left"
    return None


def run_sweep(a: argparse.Namespace) -> int:
    """Stack up, the points, stack down; OUT/<name>/sweep.json says what happened (a failed
    bring-up included: its error is recorded before it propagates)."""
    from flashpd.services.gpu_stack import gpu_stack

    parse_concurrency(a.concurrency)  # a bad list fails before the bring-up, not after it
    _switched(a)
    end = a.end_unix if a.end_unix is not None else math.inf
    primer = mean_primer_tokens(a)
    record: dict = {"config": a.config, "name": a.name, "argv": sys.argv[1:], "primer_tokens_mean": round(primer)}
    record.update(started_unix=time.time(), points=[], not_started=[])
    # a bring-up that cannot leave time for the first point is not waited for to the end
    ready_timeout_s = min(a.ready_timeout_s, end - time.time() - a.teardown_s)
    try:
        with gpu_stack(a.config, ready_timeout_s=max(1.0, ready_timeout_s)) as stack:
            record["ready_s"] = round(time.time() - record["started_unix"], 1)
            try:
                code = _sweep_points(a, stack, primer, end, record)
            finally:  # before the teardown takes the session's logs away
                _keep_server_errors(a, stack, record)
    except BaseException as exc:
        record["error"] = repr(exc)
        raise
    finally:
        record["ended_unix"] = time.time()
        _write_sweep(a, record)
    return code


def _keep_server_errors(a: argparse.Namespace, stack, record: dict) -> None:
    """The replicas' error excerpts (Ray's logs: the stack runs with log_to_driver off) into
    OUT/<name>/server_errors.log, their count into the record, the first one printed: a failed
    request's cause survives the teardown and comes back with the call's files."""
    excerpts = _stack_fact(stack.errors)
    if isinstance(excerpts, dict):  # the read-back failed: recorded, not raised
        record["server_errors"] = excerpts
        return
    record["server_errors"] = len(excerpts)
    if excerpts:
        path = Path(a.out) / a.name / SERVER_ERRORS_FILE
        write_excerpts(excerpts, path)
        first = excerpts[0].splitlines()
        print(f"agentx {a.name}: {len(excerpts)} server error excerpt(s) in {path}; the first:", flush=True)
        print("\n".join(first[:12] + (["..."] if len(first) > 12 else [])), flush=True)


def _stack_fact(read):
    """A read-back of the running stack for sweep.json; a failure is recorded, never raised."""
    try:
        return read()
    except Exception as exc:  # noqa: BLE001 - telemetry must not end the sweep
        return {"error": repr(exc)}


def _workers(stack) -> list[dict]:
    """Each worker's KV blocks in use / total and queue after a point (the prefix cache's fill
    shows in `kv_blocks_total - kv_blocks_used - free`; the heartbeat carries used and total)."""
    keys = ("role", "kv_blocks_used", "kv_blocks_total", "running", "waiting", "queued")
    return [{k: getattr(w, k) for k in keys} for w in stack.worker_stats()]


def _sweep_points(a: argparse.Namespace, stack, primer: float, end: float, record: dict) -> int:
    code, rate = 0, a.prefill_tok_s
    for c in parse_concurrency(a.concurrency):
        why = _plan_point(c, a, primer, end, rate)
        if why is not None:
            print(f"agentx {a.name} c={c}: not started ({why})", flush=True)
            record["not_started"].append({"concurrency": c, "why": why})
            continue
        t0 = time.time()
        rc = run_point(sweep_command(stack.grpc_target, a.name, a.out, c, a), end - a.teardown_s)
        seen = observed_prefill_tok_s(Path(a.out) / a.name / f"c{c}")
        rate = seen or rate
        wall_s = round(time.time() - t0, 1)
        if "kv_transports" not in record:  # after the first point (pushes done, time to spare)
            record["kv_transports"] = _stack_fact(stack.kv_transports)
        workers = _stack_fact(lambda: _workers(stack))
        record["points"].append(
            {
                "concurrency": c,
                "exit": rc,
                "wall_s": wall_s,
                "prefill_tok_s": seen,
                "workers_after": workers,
                "gpu_memory_after": _stack_fact(gpu_memory),
            }
        )
        print(
            f"agentx {a.name} c={c}: exit {rc} after {time.time() - t0:.0f} s (prefill {seen or '-'} tok/s)", flush=True
        )
        code = code or rc
        _write_sweep(a, record)
    return code


def gpu_memory(run=subprocess.run) -> dict | None:
    """The GPUs' used / total MiB and each process's MiB (nvidia-smi), after a point: the two
    replicas share one card with no cap on either's caching allocator, so a request that fails
    for memory shows which process held it. None where nvidia-smi is missing (CPU runs)."""
    if shutil.which("nvidia-smi") is None:
        return None

    def query(what: str) -> list[list[str]]:
        out = run(
            ["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]

    from flashpd.services.gpu_stack import gpu_processes  # the per-process query the stack waits on

    gpus = [{"used_mib": int(u), "total_mib": int(t)} for u, t in query("gpu=memory.used,memory.total")]
    procs = [{"pid": pid, "used_mib": mib} for pid, mib in gpu_processes(run) or []]
    return {"gpus": gpus, "processes": procs}


def _write_sweep(a: argparse.Namespace, record: dict) -> None:
    path = Path(a.out) / a.name / SWEEP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def device_command(name: str) -> str:
    """What goes into one device call for configuration `name` (run in the checkout's root, $OUT
    comes back): the GPU's memory noted (a previous call's leftovers show there), the bundle
    installed and the stack swept by scripts/gpu_stack.sh into /tmp, the sweep tarred into $OUT
    every 15 s and at the end (the device returns no nested result folders, and a call cut at
    its limit keeps what the last tar held), the log tail printed."""
    return (
        f"END=$(( $(date +%s) + {CALL_BUDGET_S} )); "
        f'nvidia-smi --query-gpu=memory.used,memory.total --format=csv > "$OUT/gpu_before_{name}.csv" 2>&1; '
        f'(while sleep 15; do tar czf "$OUT/agentx_{name}.tgz" -C /tmp agentx_h200 2>/dev/null; done) & '
        f'bash scripts/gpu_stack.sh agentx sweep --config "$PWD/{CONFIGS[name]}" '
        f'--name {name} --out /tmp/agentx_h200 --end-unix "$END" > "$OUT/agentx_{name}.log" 2>&1; rc=$?; '
        f'tar czf "$OUT/agentx_{name}.tgz" -C /tmp agentx_h200; '
        f'tail -n 60 "$OUT/agentx_{name}.log"; exit $rc'
    )


def report_command(study_dir: str = "bench/results/agentx_h200") -> str:
    return f"python -m flashpd.bench.agentx_gpu report {study_dir} --baseline baseline --candidate flashpd --commit SHA"


# ---- folding one device call's sweeps into the study ----------------------------------------------


def _as_runs(record: dict, commit: str) -> dict:
    """A sweep.json as the merged form: `runs` (one entry per device call, with its commit and the
    concurrencies it ran) and `points` each tagged with the commit that ran it."""
    if "runs" in record:
        return record
    run = {k: v for k, v in record.items() if k != "points"}
    run.update(commit=commit, concurrency=[p["concurrency"] for p in record["points"]])
    points = [{**p, "commit": p.get("commit", commit)} for p in record["points"]]
    merged = {k: record[k] for k in ("config", "name") if k in record}
    merged.update(runs=[run], points=points)
    return _settle(merged)


def _settle(merged: dict) -> dict:
    """The fields the report reads, from the runs: the latest run's bring-up, every transport
    seen, and the points some run skipped that no run has since."""
    run_c = {p["concurrency"] for p in merged["points"]}
    merged["points"] = sorted(merged["points"], key=lambda p: p["concurrency"])
    skipped = {s["concurrency"]: s for r in merged["runs"] for s in r.get("not_started", [])}
    merged["not_started"] = [s for c, s in sorted(skipped.items()) if c not in run_c]
    merged["ready_s"] = merged["runs"][-1].get("ready_s")
    merged["kv_transports"] = {k: v for r in merged["runs"] for k, v in (r.get("kv_transports") or {}).items()}
    merged["config"] = merged["runs"][-1].get("config", merged.get("config"))
    return merged


def all_failed(point: Path) -> bool:
    """Every request of a point folder's records.jsonl failed (a broken deployment, not a
    measurement); False for an empty or unreadable one."""
    try:
        rows = [json.loads(line) for line in (point / "records.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return False
    return bool(rows) and all(isinstance(r, dict) and r.get("error_type") is not None for r in rows)


def merge_sweeps(
    study: Path, call: Path, commit: str, study_commit: str = "unknown", *, keep_failed: bool = False, log=print
) -> list[str]:
    """Fold the sweeps one device call left in `call` (its <name>/sweep.json and c<C> point
    folders) into `study`: point folders are copied (a concurrency run again replaces the older
    one), and <name>/sweep.json keeps every call as a run with its commit. A sweep.json of the
    study without runs is taken as one run of `study_commit`. A sweep whose every point failed
    every request (`all_failed`) is left out, and said (it would replace measured points with a
    broken deployment's), unless keep_failed. Returns the names merged."""
    names = []
    for sweep in sorted(call.glob(f"*/{SWEEP_FILE}")):
        name, record = sweep.parent.name, json.loads(sweep.read_text())
        points = [sweep.parent / f"c{p['concurrency']}" for p in record.get("points", [])]
        if not keep_failed and points and all(all_failed(pt) for pt in points):
            log(f"merge: {name} left out: every request of its points failed ({sweep.parent}; --keep-failed merges it)")
            continue
        dest = study / name
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / SWEEP_FILE
        merged = _as_runs(json.loads(target.read_text()), study_commit) if target.exists() else None
        new = _as_runs(record, commit)
        if merged is None:
            merged = new
        else:
            again = {p["concurrency"] for p in new["points"]}
            merged["points"] = [p for p in merged["points"] if p["concurrency"] not in again] + new["points"]
            merged["runs"] += new["runs"]
        for p in new["points"]:
            src = sweep.parent / f"c{p['concurrency']}"
            if src.is_dir():
                shutil.rmtree(dest / src.name, ignore_errors=True)
                shutil.copytree(src, dest / src.name)
        target.write_text(json.dumps(_settle(merged), indent=1) + "\n")
        names.append(name)
    return names


# ---- the CPU variant of a config (dry runs) ----------------------------------------------------


def cpu_config(src: str, checkpoint: str, *, grpc_port: int, http_port: int, model_len: int = 4096) -> dict:
    """`src` (an H200 config) for the CPU: the same switches (routing, replay, KV format, env),
    with a checkpoint directory, float32, small pools and no GPU fractions or cuda_ipc policy."""
    raw = yaml.safe_load(Path(src).read_text())
    raw["http_options"]["port"] = http_port
    (app,) = raw["applications"]
    env = app["runtime_env"]["env_vars"]
    env.pop("FLASHPD_KV_TRANSPORTS", None)  # the CPU pools move over TCP or shared memory
    args = app["args"]
    args.update(checkpoint=checkpoint, model_id="flashpd-tiny", dtype="float32", device="cpu")
    args.update(grpc_port=grpc_port, max_model_len=model_len)
    roles = ("colocated",) if args.get("mode") == "colocated" else ("prefill", "decode")
    for role in roles:
        args[role].update(num_gpus=0, num_blocks=256, max_num_batched_tokens=512)
    return raw


# ---- single-switch configs (the A/B one optimisation at a time) ---------------------------------
# The baseline's switches, each alone: flashpd's config with one optimisation off. A sweep with
# `--switch-off NAME` derives its config from --config and writes it beside its records; the
# report sets each such sweep against the candidate (`single_switch` in summary.json).
SWITCHES = {
    "replay": {"args": {"swa_bounded_replay": False}},  # exact replay instead of the 128-row bound
    "nvfp4": {"args": {"kv_format": "fp8"}},  # FP8 compressed KV instead of NVFP4
    "affinity": {"args": {"routing": "round_robin"}},  # no session affinity / prefix-aware placement
    "graph_turns": {"env": {"FLASHPD_GRAPH_TURNS": "0"}},  # no CUDA graphs for turns after a hit
    "graph_pd": {"env": {"FLASHPD_GRAPH_PD": "0"}},  # no CUDA graphs for the P/D first-hit steps
    "indexer": {"args": {"kernel_impls": {"indexer": "ref"}}},  # the torch indexer, not the Triton one
    "mhc": {"args": {"kernel_impls": {"mhc": "ref"}}},  # unfused mHC: the torch reference
}


def switched_config(src: str, switch: str) -> dict:
    """`src` with the one optimisation `switch` turned off (a key of SWITCHES)."""
    if switch not in SWITCHES:
        raise ValueError(f"--switch-off: {switch!r} is not one of {sorted(SWITCHES)}")
    raw = yaml.safe_load(Path(src).read_text())
    (app,) = raw["applications"]
    args = app["args"]
    for key, value in SWITCHES[switch].get("args", {}).items():  # kernel_impls: one op more
        args[key] = {**args.get(key, {}), **value} if isinstance(value, dict) else value
    app.setdefault("runtime_env", {}).setdefault("env_vars", {}).update(SWITCHES[switch].get("env", {}))
    return raw


def _switched(a: argparse.Namespace) -> None:
    """--switch-off: write the derived config under OUT/<name>/ and sweep that instead."""
    if not a.switch_off:
        return
    raw = switched_config(a.config, a.switch_off)
    path = Path(a.out) / a.name / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    a.config = str(path)


# ---- report ------------------------------------------------------------------------------------


def finish_report(a: argparse.Namespace) -> dict:
    from flashpd.bench import agentx_report

    return agentx_report.write(a)


def _add_sweep_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True)
    s.add_argument(
        "--switch-off", default=None, choices=sorted(SWITCHES), help="sweep --config with this one optimisation off"
    )
    s.add_argument("--name", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    s.add_argument("--window-s", type=float, default=15.0, help="measurement window of each point")
    s.add_argument("--window-low-s", type=float, default=20.0, help=f"the window at concurrency <= {LOW_CONCURRENCY}")
    s.add_argument("--warmup-requests", type=int, default=0, help="after each lane's primer")
    s.add_argument("--trees", type=int, default=H200_WORKLOAD["trees"])
    s.add_argument("--scale", type=float, default=H200_WORKLOAD["scale"])
    s.add_argument("--time-scale", type=float, default=H200_WORKLOAD["time_scale"])
    s.add_argument("--output-scale", type=float, default=H200_WORKLOAD["output_scale"])
    s.add_argument("--tree-idle-cap-s", type=float, default=H200_WORKLOAD["tree_idle_cap_s"])
    s.add_argument("--max-turns", type=int, default=None)
    s.add_argument("--vocab-lo", type=int, default=1000, help="synthetic ids from [lo, hi): inside the model's vocab")
    s.add_argument("--vocab-hi", type=int, default=128_000)
    s.add_argument(
        "--drain-timeout-s",
        type=float,
        default=120.0,
        help="in-flight requests finish after the window (30 s cut 21 streams at c=64 on the H200)",
    )
    s.add_argument("--request-timeout-s", type=float, default=300.0)
    s.add_argument("--end-unix", type=float, default=None, help="no point runs past this (minus --teardown-s)")
    s.add_argument("--teardown-s", type=float, default=20.0, help="kept for stopping Serve, Ray and Redis")
    s.add_argument(
        "--prefill-tok-s",
        type=float,
        default=14_000.0,
        help="cold prefill rate the guard assumes until a point measures it",
    )
    s.add_argument("--ready-timeout-s", type=float, default=420.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashpd.bench.agentx_gpu")
    sub = p.add_subparsers(dest="action", required=True)
    _add_sweep_args(sub.add_parser("sweep"))
    r = sub.add_parser("report")
    r.add_argument("out")
    r.add_argument("--baseline", default=None)
    r.add_argument("--candidate", default=None)
    r.add_argument("--tiers", default="20,60,150")
    r.add_argument("--ttft-limit-s", type=float, default=5.0)
    r.add_argument("--commit", default="unknown")
    r.add_argument("--colocated", default="colocated", help="the colocated sweep (pd_vs_colocated against --candidate)")
    r.add_argument(
        "--switch-reference",
        default=None,
        help="the sweep each off-<switch> sweep is set against (default --candidate): one run at the "
        "single-switch sweeps' commit, so that a ratio measures the switch and not the commits between",
    )
    r.add_argument(
        "--speculative",
        default="spec",
        help="the speculative sweep: gives the tiers --candidate meets at no point (the 150 tok/s/user one)",
    )
    m = sub.add_parser("merge", help="fold one device call's sweeps (its OUT) into the study folder")
    m.add_argument("study")
    m.add_argument("call")
    m.add_argument("--commit", required=True, help="the commit the call ran")
    m.add_argument("--study-commit", default="unknown", help="the commit of a study sweep.json without runs")
    m.add_argument("--keep-failed", action="store_true", help="merge a sweep whose every request failed too")
    c = sub.add_parser("cpu-config")
    c.add_argument("src")
    c.add_argument("--checkpoint", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--grpc-port", type=int, default=9000)
    c.add_argument("--http-port", type=int, default=8000)
    a = p.parse_args(argv)
    if a.action == "sweep":
        return run_sweep(a)
    if a.action == "merge":
        names = merge_sweeps(Path(a.study), Path(a.call), a.commit, a.study_commit, keep_failed=a.keep_failed)
        print(f"merged {', '.join(names) or 'nothing'} into {a.study}")
        return 0
    if a.action == "cpu-config":
        raw = cpu_config(a.src, a.checkpoint, grpc_port=a.grpc_port, http_port=a.http_port)
        Path(a.out).write_text(yaml.safe_dump(raw, sort_keys=False))
        return 0
    summary = finish_report(a)
    print(json.dumps({k: summary[k] for k in ("tiers", "ab") if k in summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
