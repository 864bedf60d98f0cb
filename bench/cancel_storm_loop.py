"""The fault suite's cancel storm (`tests/faults`, its QUICK counts) run N times in a row on one
2 prefill + 2 decode stack, each run's counts and verdict appended to a text file.

    unshare -n sh -c 'ip link set lo up && python -m flashpd.bench.cancel_storm_loop --runs 20'

One deploy serves every run (the pytest test deploys once per module as well); each run uses
its own seed, so prompts, cancel points and modes differ between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from flashpd.services.faults import scenarios
from flashpd.services.faults.cli import QUICK
from flashpd.services.faults.stack import FaultStack, StackConfig, start_ray, stop_ray


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--out", default="bench/results/cancel_storm_20.txt")
    args = p.parse_args()
    from flashpd.services.cli import tiny_checkpoint
    from flashpd.services.redis_local import LocalRedis

    failed = 0
    with open(args.out, "w") as out, LocalRedis() as redis_server:
        out.write(
            "# unshare -n sh -c 'ip link set lo up && python -m "
            f"flashpd.bench.cancel_storm_loop --runs {args.runs}'\n"
            f"# counts per run: {QUICK['cancel_storm']}\n"
        )
        port = start_ray()
        try:
            stack = FaultStack(tiny_checkpoint(), redis_server, port, StackConfig(2, 2, app_name="storm2x2")).deploy()
            for i in range(args.runs):
                started = time.monotonic()
                r = asyncio.run(scenarios.cancel_storm(stack, seed=i, **QUICK["cancel_storm"]))
                failed += not r.passed
                line = (
                    f"run {i + 1}: {'passed' if r.passed else 'FAILED'} in "
                    f"{time.monotonic() - started:.1f} s {r.counts} {r.failures}"
                )
                print(line, flush=True)
                out.write(line + "\n")
                out.flush()
            out.write(f"# {args.runs - failed} of {args.runs} passed\n")
        finally:
            stop_ray()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
