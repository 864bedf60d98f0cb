"""The AgentX-like sweep on one GPU machine, one configuration per call (issue 28).

    python -m flashpd.bench.agentx_gpu sweep --config infra/serve.h200.yaml --name flashpd \
        --out OUT [--concurrency 1,2,4,8,16,32,64] [--window-s 45] [--end-unix T]
    python -m flashpd.bench.agentx_gpu sweep --config infra/serve.h200.baseline.yaml \
        --name baseline --out OUT ...
    python -m flashpd.bench.agentx_gpu report OUT --baseline baseline --candidate flashpd \
        --commit SHA

`sweep` brings the stack up from the Serve config (services/gpu_stack.py: Redis, Ray, router +
prefill + decode on the GPU, ready after warm-up), runs `flashpd bench sweep` through the
router's gRPC port into OUT/<name>/c<C>, and takes the stack down; points that would end past
--end-unix are not started (a device call has a hard limit). `report` renders OUT/report.md and
OUT/summary.json (bench/tiers.py: goodput tiers of 20 / 60 / 150 tok/s per user, the A/B
ratios) with the commit and preset added.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from flashpd.bench.cli import parse_concurrency

PRESET = "bench"
STARTUP_MARGIN_S = 60.0  # what one point needs beyond its window: lanes' warm-up and the drain


def sweep_command(target: str, name: str, out: str, concurrency: int, window_s: float, trees: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "flashpd.cli",
        "bench",
        "run",
        "--target",
        target,
        "--name",
        name,
        "--gpus",
        "1",
        "-c",
        str(concurrency),
        "--window-s",
        str(window_s),
        "--warmup-requests",
        "2",
        "--trees",
        str(trees),
        "--drain-timeout-s",
        "60",
        "--request-timeout-s",
        "300",
        "--no-progress",
        "--out",
        str(Path(out) / name / f"c{concurrency}"),
    ]


def run_sweep(args: argparse.Namespace) -> int:
    from flashpd.services.gpu_stack import gpu_stack

    points = parse_concurrency(args.concurrency)
    end = args.end_unix if args.end_unix is not None else float("inf")
    code = 0
    with gpu_stack(args.config) as stack:
        for c in points:
            left = end - time.time()
            if left < args.window_s + STARTUP_MARGIN_S:
                print(f"agentx {args.name} c={c}: not started ({left:.0f} s left)", flush=True)
                continue
            cmd = sweep_command(stack.grpc_target, args.name, args.out, c, args.window_s, args.trees)
            try:
                rc = subprocess.run(cmd, timeout=min(left, 3600.0)).returncode
            except subprocess.TimeoutExpired:
                rc = 124
            print(f"agentx {args.name} c={c}: exit {rc}", flush=True)
            code = code or rc
    return code


def finish_report(args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "flashpd.cli",
        "bench",
        "report",
        args.out,
        "--tiers",
        args.tiers,
        "--ttft-limit-s",
        str(args.ttft_limit_s),
    ]
    for flag in ("baseline", "candidate"):
        if getattr(args, flag):
            cmd += [f"--{flag}", getattr(args, flag)]
    subprocess.run(cmd, check=True)
    path = Path(args.out) / "summary.json"
    summary = {"commit": args.commit, "preset": PRESET, **json.loads(path.read_text())}
    summary.setdefault(
        "pd_vs_colocated",
        {"measured": False, "why": "flashpd serves disaggregated only: no colocated Serve deployment to sweep"},
    )
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashpd.bench.agentx_gpu")
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("sweep")
    s.add_argument("--config", required=True)
    s.add_argument("--name", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    s.add_argument("--window-s", type=float, default=45.0)
    s.add_argument("--trees", type=int, default=64)
    s.add_argument("--end-unix", type=float, default=None)
    r = sub.add_parser("report")
    r.add_argument("out")
    r.add_argument("--baseline", default=None)
    r.add_argument("--candidate", default=None)
    r.add_argument("--tiers", default="20,60,150")
    r.add_argument("--ttft-limit-s", type=float, default=5.0)
    r.add_argument("--commit", default="unknown")
    a = p.parse_args(argv)
    if a.action == "sweep":
        return run_sweep(a)
    print(json.dumps(finish_report(a), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
