"""A simple sampling loop over one sequence (greedy or temperature), used by the CLI before the
engine exists. Prefill the prompt in one call, then decode one token per call."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashpd.model.model import Model


def sample_token(logits: torch.Tensor, temperature: float,
                 generator: torch.Generator | None = None) -> int:
    """logits [V] FP32 -> token id: argmax at temperature 0, else softmax(logits / T) sampling."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.to(torch.float32) / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate_ids(model: Model, prompt_ids: Sequence[int], max_tokens: int,
                 temperature: float = 0.0, seed: int | None = None,
                 eos_id: int | None = None) -> list[int]:
    """Generated ids (prompt excluded); stops after `max_tokens` or after emitting `eos_id`."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    state = model.new_state()
    out: list[int] = []
    if max_tokens == 0:
        return out
    logits = model.run(state, prompt_ids)  # [1, V]
    while True:
        token = sample_token(logits[-1], temperature, generator)
        out.append(token)
        if len(out) >= max_tokens or (eos_id is not None and token == eos_id):
            return out
        logits = model.run(state, [token])
