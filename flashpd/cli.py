"""`flashpd` command line: each area registers its own subcommands.

Every module listed in SUBCOMMAND_MODULES exposes `register(subparsers)`, which adds parsers
whose `func(args) -> int` runs the command. Modules are imported lazily per command so that
`flashpd inspect` never imports Ray or gRPC.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module that implements it
SUBCOMMAND_MODULES = {
    "make-checkpoint": "flashpd.model.cli",
    "inspect": "flashpd.model.cli",
    "logits": "flashpd.model.logits_cli",
    "generate": "flashpd.engine.cli",
    "serve": "flashpd.services.cli",
    "demo": "flashpd.services.cli",
    "bench": "flashpd.bench.cli",
    "faults": "flashpd.services.faults.cli",
    "drain": "flashpd.services.drain",
    "verify-kernels": "flashpd.kernels.cli",
    "train": "flashpd.model.train",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashpd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    modules = sorted(set(SUBCOMMAND_MODULES.values()))
    if only is not None:
        modules = [SUBCOMMAND_MODULES[only]]
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in SUBCOMMAND_MODULES else None
    parser = build_parser(only=command)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
