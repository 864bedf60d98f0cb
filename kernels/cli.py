"""`flashpd verify-kernels`: every Triton kernel against its torch reference, as a table.

On a CPU host the kernels run in Triton's interpreter at tiny shapes; on a GPU the default is
the bench preset's shapes, timed with CUDA events.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("verify-kernels", help="check Triton kernels against ref.py")
    p.add_argument("--scale", choices=("tiny", "bench"), default=None,
                   help="tiny (default on CPU, interpreter) or bench (default on GPU)")
    p.add_argument("--ops", nargs="*", default=None,
                   help="subset: kv_write moe_gate mhc indexer attention gemm engram")
    p.add_argument("--no-timing", action="store_true", help="skip the timings")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # Triton is imported only here: `flashpd --help` and the other commands never need it.
    from flashpd.kernels import configs, triton_runtime, tuning, verify

    # FLASHPD_* launch overrides are validated here (a bad value fails the command); the cases
    # run each kernel with its table entry for this device (kernels/configs.py).
    tuned = tuning.load()
    if tuned != configs.for_device():
        print("verify-kernels: FLASHPD_* launch overrides are set; the cases check the table's "
              "configs for this device")
    scale = args.scale or ("tiny" if triton_runtime.interpreting() else "bench")
    if scale == "bench" and triton_runtime.interpreting():
        raise SystemExit("--scale bench needs a GPU; the interpreter runs tiny shapes only")
    results = verify.run_checks(scale, args.ops, timing=None if not args.no_timing else False)
    print(f"verify-kernels: scale={scale}, device={verify.device()}, "
          f"interpreter={triton_runtime.interpreting()}")
    print(verify.format_table(results))
    failed = [c for c in results if not c.passed]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([c.as_dict() for c in results], f, indent=1)
    return 1 if failed else 0
