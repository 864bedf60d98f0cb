"""`flashpd bench {gen,run,sweep,report,ab}`: the AgentX-like benchmark from the command line.

    flashpd bench gen --out wl.jsonl --trees 64 --scale 1000 --time-scale 100
    flashpd bench run --target 127.0.0.1:9000 --gpus 2 -c 8 --window-s 60 --out runs/c8
    flashpd bench sweep --target 127.0.0.1:9000 --gpus 2 --concurrency 1,2,4,8 --out study/
    flashpd bench ab --target base=127.0.0.1:9000 --target new=127.0.0.1:9100 --gpus 2 --out ab/
    flashpd bench report study/ --cap 150 --ttft-limit-s 5 --tiers 20,60,150 --baseline base

A study directory holds <configuration>/c<C>/{meta.json,records.jsonl}, the report and
summary.json (goodput tiers per configuration and, with --baseline, the A/B ratios: tiers.py).
Exit codes:
0 done, 1 a run aborted (too many consecutive errors), 130 interrupted (records kept).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from dataclasses import dataclass
from pathlib import Path

from flashpd.bench.backend import Backend, SdkBackend
from flashpd.bench.driver import DriverConfig, LaneFailure, RunResult, run_closed_loop
from flashpd.bench.records import RecordWriter, write_meta
from flashpd.bench.report import Study, load_study, write_report
from flashpd.bench.tiers import study_summary, write_summary
from flashpd.bench.workload import Workload, WorkloadConfig, generate_workload, summarize

DEFAULT_SWEEP = "1,2,4,8,16,32,64,128"
EXIT_ABORTED, EXIT_INTERRUPTED = 1, 130
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def connect(target: str) -> Backend:
    """The backend for a target address (the seam tests replace)."""
    return SdkBackend.connect(target)


@dataclass(frozen=True)
class Target:
    name: str
    address: str
    num_gpus: int


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="AgentX-like closed-loop benchmark")
    actions = bench.add_subparsers(dest="bench_action", required=True)
    gen = actions.add_parser("gen", help="generate a workload file and print its shape")
    _add_workload_args(gen, with_file=False)
    gen.add_argument("--out", required=True, help="workload JSONL to write")
    gen.set_defaults(func=cmd_gen)
    run = actions.add_parser("run", help="one closed-loop run at one concurrency")
    _add_run_args(run, single_target=True)
    run.add_argument("-c", "--concurrency", type=int, required=True)
    run.set_defaults(func=cmd_run)
    sweep = actions.add_parser("sweep", help="runs over a concurrency sweep, then the report")
    _add_run_args(sweep, single_target=True)
    _add_sweep_args(sweep)
    sweep.set_defaults(func=cmd_sweep)
    ab = actions.add_parser("ab", help="the same workload and seed against several named targets")
    _add_run_args(ab, single_target=False)
    _add_sweep_args(ab)
    ab.set_defaults(func=cmd_ab)
    report = actions.add_parser("report", help="markdown + PNG report of a study directory")
    report.add_argument("study_dir")
    _add_limit_args(report)
    report.set_defaults(func=cmd_report)


def _add_workload_args(p: argparse.ArgumentParser, with_file: bool) -> None:
    g = p.add_argument_group("workload")
    if with_file:
        g.add_argument("--workload", help="replay this workload JSONL instead of generating one")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trees", type=int, default=64, help="session trees to generate")
    g.add_argument("--scale", type=float, default=1.0, help="divides every token count")
    g.add_argument("--time-scale", type=float, default=1.0, help="divides every think time")
    g.add_argument("--output-scale", type=float, default=None, help="divides outputs (default: --scale)")
    g.add_argument("--max-turns", type=int, default=None, help="cap on turns per session")
    g.add_argument("--vocab-lo", type=int, default=1000, help="synthetic ids from [lo, hi)")
    g.add_argument("--vocab-hi", type=int, default=128_000)


def _add_run_args(p: argparse.ArgumentParser, single_target: bool) -> None:
    if single_target:
        p.add_argument("--target", required=True, help="gRPC address host:port")
        p.add_argument("--name", default=None, help="configuration name (default: the target)")
        p.add_argument("--gpus", type=int, required=True, help="prefill + decode GPUs of the target")
    else:
        p.add_argument("--target", action="append", required=True, help="NAME=host:port (repeat)")
        p.add_argument("--gpus", action="append", required=True, help="N for all, or NAME=N")
    p.add_argument("--out", required=True, help="run or study directory")
    _add_workload_args(p, with_file=True)
    d = p.add_argument_group("driver")
    d.add_argument("--window-s", type=float, default=3600.0, help="measurement window")
    d.add_argument("--warmup-requests", type=int, default=10, help="warm-up requests per lane")
    d.add_argument("--tree-idle-cap-s", type=float, default=None, help="default 300 / time scale")
    d.add_argument("--system-idle-cap-s", type=float, default=None, help="default 10 / time scale")
    d.add_argument("--request-timeout-s", type=float, default=600.0)
    d.add_argument("--drain-timeout-s", type=float, default=600.0)
    d.add_argument("--max-consecutive-errors", type=int, default=50)
    d.add_argument("--salt-epoch", type=int, default=0, help="change to avoid a warm server cache")
    d.add_argument("--no-splice", action="store_true", help="keep synthetic ids for past outputs")
    d.add_argument("--no-progress", action="store_true")


def _add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default=DEFAULT_SWEEP, help="comma-separated C values")
    _add_limit_args(p)


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cap", type=float, default=150.0, help="interactivity cap, tok/s/user")
    p.add_argument("--ttft-limit-s", type=float, default=5.0, help="p90 TTFT limit for goodput")
    p.add_argument("--tiers", default="20,60,150", help="comma-separated tok/s/user tiers for summary.json")
    p.add_argument("--baseline", default=None, help="configuration the A/B ratios in summary.json compare against")
    p.add_argument("--candidate", default=None, help="configuration summarised at the top (default: the first)")


def parse_tiers(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--tiers needs positive numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"--tiers needs positive numbers, got {text!r}")
    return sorted(set(values))


def _report(args: argparse.Namespace, study_dir: str | Path, study: Study) -> None:
    """report.md + plots, then summary.json (tiers, and the A/B ratios with --baseline)."""
    path = write_report(study_dir, study, args.cap, args.ttft_limit_s)
    print(f"report: {path}")
    metrics = {name: [p.metrics for p in points] for name, points in study.items()}
    summary = study_summary(
        metrics,
        baseline=args.baseline,
        candidate=args.candidate,
        tiers=parse_tiers(args.tiers),
        ttft_limit_s=args.ttft_limit_s,
    )
    print(f"summary: {write_summary(study_dir, summary)}")


def _workload(args: argparse.Namespace) -> Workload:
    if getattr(args, "workload", None):
        return Workload.read_jsonl(args.workload)
    return generate_workload(
        WorkloadConfig(
            seed=args.seed,
            num_trees=args.trees,
            scale=args.scale,
            time_scale=args.time_scale,
            output_scale=args.output_scale,
            max_turns=args.max_turns,
            vocab_lo=args.vocab_lo,
            vocab_hi=args.vocab_hi,
        )
    )


def _driver_config(args: argparse.Namespace, workload: Workload, concurrency: int) -> DriverConfig:
    caps = {}
    if args.tree_idle_cap_s is not None:
        caps["tree_idle_cap_s"] = args.tree_idle_cap_s
    if args.system_idle_cap_s is not None:
        caps["system_idle_cap_s"] = args.system_idle_cap_s
    return DriverConfig.for_time_scale(
        workload.config.time_scale,
        concurrency=concurrency,
        window_s=args.window_s,
        warmup_requests=args.warmup_requests,
        request_timeout_s=args.request_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
        max_consecutive_errors=args.max_consecutive_errors,
        seed=workload.config.seed,
        salt_epoch=args.salt_epoch,
        splice_outputs=not args.no_splice,
        show_progress=not args.no_progress,
        **caps,
    )


def parse_concurrency(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--concurrency needs positive integers, got {text!r}")
    return sorted(set(values))


def parse_targets(targets: list[str], gpus: list[str]) -> list[Target]:
    addresses: dict[str, str] = {}
    for item in targets:
        name, sep, address = item.partition("=")
        if not sep or not _NAME.match(name) or not address:
            raise ValueError(f"--target needs NAME=host:port, got {item!r}")
        if name in addresses:
            raise ValueError(f"target {name!r} given twice")
        addresses[name] = address
    per_name = _parse_gpus(gpus, set(addresses))
    return [Target(name, addr, per_name[name]) for name, addr in addresses.items()]


def _parse_gpus(gpus: list[str], names: set[str]) -> dict[str, int]:
    default, per_name = None, {}
    for item in gpus:
        name, sep, count = item.rpartition("=")
        if not sep:
            default = int(count)
        elif name not in names:
            raise ValueError(f"--gpus names unknown target {name!r}")
        else:
            per_name[name] = int(count)
    out = {n: per_name.get(n, default) for n in names}
    missing = sorted(n for n, v in out.items() if v is None)
    if missing:
        raise ValueError(f"no GPU count for targets {missing}: pass --gpus N or --gpus NAME=N")
    if any(v < 1 for v in out.values()):
        raise ValueError("GPU counts must be >= 1")
    return out  # type: ignore[return-value]


async def _run_point(workload: Workload, target: Target, config: DriverConfig, run_dir: Path) -> RunResult:
    backend = connect(target.address)
    writer = RecordWriter(run_dir)
    try:
        result = await run_closed_loop(
            workload,
            backend,
            config,
            name=target.name,
            target=target.address,
            num_gpus=target.num_gpus,
            on_record=writer,
        )
    except LaneFailure as exc:
        write_meta(run_dir, exc.result.meta)
        raise
    finally:
        writer.close()
        await backend.aclose()
    write_meta(run_dir, result.meta)
    return result


def _run_targets(args: argparse.Namespace, targets: list[Target], concurrencies: list[int], study_dir: Path) -> int:
    workload = _workload(args)
    workload.write_jsonl(study_dir / "workload.jsonl")
    for target in targets:
        for c in concurrencies:
            config = _driver_config(args, workload, c)
            result = asyncio.run(_run_point(workload, target, config, study_dir / target.name / f"c{c}"))
            code = _exit_code(result)
            if code != 0:
                print(f"{target.name} C={c}: stopped ({result.meta.aborted_reason or 'interrupted'})")
                return code
    return 0


def _exit_code(result: RunResult) -> int:
    if result.meta.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_ABORTED if result.meta.aborted_reason else 0


def cmd_gen(args: argparse.Namespace) -> int:
    workload = _workload(args)
    workload.write_jsonl(args.out)
    print(json.dumps(summarize(workload), indent=2))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    workload = _workload(args)
    target = Target(args.name or args.target, args.target, args.gpus)
    config = _driver_config(args, workload, args.concurrency)
    result = asyncio.run(_run_point(workload, target, config, Path(args.out)))
    print(f"{len(result.records)} records in {args.out}")
    return _exit_code(result)


def cmd_sweep(args: argparse.Namespace) -> int:
    target = Target(args.name or _safe_name(args.target), args.target, args.gpus)
    return _study(args, [target])


def cmd_ab(args: argparse.Namespace) -> int:
    return _study(args, parse_targets(args.target, args.gpus))


def _study(args: argparse.Namespace, targets: list[Target]) -> int:
    parse_tiers(args.tiers)  # a bad value fails before the runs, not after them
    study_dir = Path(args.out)
    study_dir.mkdir(parents=True, exist_ok=True)
    code = _run_targets(args, targets, parse_concurrency(args.concurrency), study_dir)
    _report(args, study_dir, load_study(study_dir))
    return code


def cmd_report(args: argparse.Namespace) -> int:
    _report(args, args.study_dir, load_study(args.study_dir))
    return 0


def _safe_name(address: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", address)
