"""`flashpd verify-kernels`: every Triton kernel against its torch reference, as a table.

On a CPU host the kernels run in Triton's interpreter at tiny shapes; on a GPU the default is
the bench preset's shapes, timed with CUDA events.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("verify-kernels", help="check Triton kernels against ref.py")
    p.add_argument(
        "--scale",
        choices=("tiny", "bench"),
        default=None,
        help="tiny (default on CPU, interpreter) or bench (default on GPU)",
    )
    p.add_argument("--ops", nargs="*", default=None, help="subset: kv_write moe_gate mhc indexer attention gemm engram")
    p.add_argument("--no-timing", action="store_true", help="skip the timings")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # Triton is imported only here: `flashpd --help` and the other commands never need it.
    from flashpd.kernels import triton_runtime, tuning, verify

    # the configs an engine on this device would load: the table's entry with the FLASHPD_*
    # overrides (validated: a bad value fails the command); every case runs with them
    tuned = tuning.load()
    scale = args.scale or ("tiny" if triton_runtime.interpreting() else "bench")
    if scale == "bench" and triton_runtime.interpreting():
        raise SystemExit("--scale bench needs a GPU; the interpreter runs tiny shapes only")
    results = verify.run_checks(scale, args.ops, timing=None if not args.no_timing else False, tuned=tuned)
    print(f"verify-kernels: scale={scale}, device={verify.device()}, interpreter={triton_runtime.interpreting()}")
    print(verify.format_table(results))
    failed = [c for c in results if not c.passed]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([c.as_dict() for c in results], f, indent=1)
    return 1 if failed else 0
