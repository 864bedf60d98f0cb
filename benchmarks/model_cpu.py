"""CPU measurements of the reference model on `tiny`: prefill / decode time and replay deviation.

    python benchmarks/model_cpu.py [--checkpoint DIR] [--threads N] [--repeats R]

Without --checkpoint a random tiny checkpoint is written to a temporary directory. Prints:

1. Time of a 512-token prefill and of one decode step after it, FP32 and BF16 (wall and
   process CPU time; median of R runs).
2. Bounded replay vs the exact path (a cold full forward), FP32, last-token logits:
   decode-side replay of the last 128 tokens of a 400-token prompt from shipped global KV, and
   encoder-side replay [128, 256) after a 256-token prefix hit, then [256, 400) normally.
   Reported: max |delta logit| and KL(exact || replay) of the last-token distribution.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from flashpd.model.model import LogitsRequest, Model, SeqPlan, replay_segment

PREFILL_TOKENS = 512
DECODE_STEPS = 16
REPLAY_PROMPT = 400
PREFIX_HIT = 256


def _timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median (wall seconds, process CPU seconds) of `repeats` calls."""
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def time_model(model: Model, repeats: int) -> dict[str, tuple[float, float]]:
    ids = _prompt(PREFILL_TOKENS + DECODE_STEPS, model.cfg.vocab_size, seed=0)
    prefill = _timed(lambda: model.run(model.new_state(), ids[:PREFILL_TOKENS]), repeats)
    state = model.new_state()
    model.run(state, ids[:PREFILL_TOKENS])

    def decode_steps() -> None:
        for token in ids[PREFILL_TOKENS:]:
            model.run(state, [token])

    wall, cpu = _timed(decode_steps, 1)
    return {"prefill": prefill, "decode": (wall / DECODE_STEPS, cpu / DECODE_STEPS)}


def _deviation(exact: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    """(max |delta logit|, KL(exact || approx)) of one logit row."""
    log_p, log_q = torch.log_softmax(exact, -1), torch.log_softmax(approx, -1)
    return float((exact - approx).abs().max()), float((log_p.exp() * (log_p - log_q)).sum())


def _shipped_state(model: Model, ids: list[int]):
    encoder = model.new_state()
    model.run(encoder, ids, SeqPlan.encoder_only())
    state = model.new_state()
    state.load_global_state(encoder.global_state())
    return state


def replay_deviation(model: Model) -> dict[str, tuple[float, float]]:
    window = model.cfg.sliding_window
    ids = _prompt(REPLAY_PROMPT, model.cfg.vocab_size, seed=1)
    exact = model.run(model.new_state(), ids)[-1]
    state = _shipped_state(model, ids)
    decode_side = model.run_replay(state, replay_segment(ids, len(ids), window))[-1]
    state = _shipped_state(model, ids[:PREFIX_HIT])
    model.run_replay(state, replay_segment(ids, PREFIX_HIT, window, LogitsRequest.NONE))
    encoder_side = model.run(state, ids[PREFIX_HIT:])[-1]
    return {
        f"decode-side replay ({REPLAY_PROMPT}-token prompt, last {window})": _deviation(exact, decode_side),
        f"encoder-side replay (hit {PREFIX_HIT}, prompt {REPLAY_PROMPT})": _deviation(exact, encoder_side),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="tiny checkpoint directory (default: random)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: small ops are dispatch-bound)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from flashpd.model.checkpoint import load_checkpoint, write_random_checkpoint
    from flashpd.model.presets import preset_config

    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint
        if path is None:
            write_random_checkpoint(preset_config("tiny"), tmp, seed=0)
            path = tmp
        ckpt = load_checkpoint(path)
        models = {
            name: Model.from_checkpoint(ckpt, dtype)
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        }
    print(f"tiny model on CPU, {args.threads} thread(s), median of {args.repeats}")
    print(f"{'dtype':<6} {'what':<34} {'wall ms':>10} {'cpu ms':>10}")
    for name, model in models.items():
        times = time_model(model, args.repeats)
        (pw, pc), (dw, dc) = times["prefill"], times["decode"]
        print(f"{name:<6} {f'prefill {PREFILL_TOKENS} tokens':<34} {pw * 1e3:>10.1f} {pc * 1e3:>10.1f}")
        print(f"{name:<6} {'decode, per token':<34} {dw * 1e3:>10.1f} {dc * 1e3:>10.1f}")
    print()
    print(f"{'bounded replay vs exact (fp32)':<58} {'max|dlogit|':>12} {'KL':>10}")
    for what, (max_abs, kl) in replay_deviation(models["fp32"]).items():
        print(f"{what:<58} {max_abs:>12.4f} {kl:>10.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
