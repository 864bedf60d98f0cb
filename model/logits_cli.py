"""`flashpd logits`: FP32 logits of a prompt (every position) from a checkpoint, saved as .npz."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("logits", help="run the reference forward and save logits [T, V]")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--out", required=True, help="output .npz (key `logits`, FP32 [T, vocab])")
    p.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default="bfloat16",
        help="compute dtype of the forward (logits are FP32 either way)",
    )
    p.set_defaults(func=_run)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated ints: {e}") from e
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def prompt_logits(checkpoint: str, prompt_ids: list[int], dtype: torch.dtype) -> np.ndarray:
    from flashpd.model.model import LogitsRequest, SeqPlan, load_model

    model = load_model(checkpoint, dtype)
    logits = model.run(model.new_state(), prompt_ids, SeqPlan(logits=LogitsRequest.ALL))
    return logits.to(torch.float32).numpy()


def _run(args: argparse.Namespace) -> int:
    ids = parse_ids(args.prompt_ids)
    logits = prompt_logits(args.checkpoint, ids, _DTYPES[args.dtype])
    np.savez(args.out, logits=logits)
    json.dump({"out": args.out, "shape": list(logits.shape), "dtype": args.dtype}, sys.stdout)
    sys.stdout.write("\n")
    return 0
