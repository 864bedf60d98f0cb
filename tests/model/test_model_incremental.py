"""Prefill in one call, in random chunks, or token by token: the same logits and state (§11.1)."""

from __future__ import annotations

import torch

from flashpd.model.model import LogitsRequest, SeqPlan

ALL = SeqPlan(logits=LogitsRequest.ALL)
NUM_TOKENS = 320  # > window (128); > 2*16 ratio-2 entries (top-k); > 32 ratio-1 entries (pool)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _assert_windows_equal(cfg, a, b) -> None:
    for layer in range(cfg.num_layers):
        wa, wb = a.window(layer), b.window(layer)
        assert wa.start_pos == wb.start_pos
        assert torch.equal(wa.kv, wb.kv), f"window of layer {layer}"


def test_tiny_prompt_exercises_window_topk_and_candidates(tiny_model):
    cfg = tiny_model.cfg
    assert NUM_TOKENS > cfg.sliding_window
    assert NUM_TOKENS // 2 > cfg.index_topk  # ratio-2 sources select
    assert NUM_TOKENS > cfg.candidate_topk_blocks * cfg.candidate_block_size  # pool bites


def test_token_by_token_decode_matches_full_forward(tiny_model, make_prompt, assert_global_equal):
    """Decode steps over the first 24 positions and over 200..319, where the window, the
    ratio-2 groups, top-k and the candidate pool all bite (one chunk in between, for time)."""
    ids = make_prompt(NUM_TOKENS, seed=1)
    full_state = tiny_model.new_state()
    full = tiny_model.run(full_state, ids, ALL)  # [T, V]
    step_state = tiny_model.new_state()
    head = [tiny_model.run(step_state, [t]) for t in ids[:24]]
    middle = tiny_model.run(step_state, ids[24:200], ALL)
    tail = [tiny_model.run(step_state, [t]) for t in ids[200:]]
    steps = torch.cat([*head, middle, *tail])  # [T, V]
    assert _rel_err(steps, full) <= 1e-4
    assert torch.equal(steps, full)  # same arithmetic per token: bitwise equal in FP32
    assert_global_equal(step_state.global_state(), full_state.global_state())
    _assert_windows_equal(tiny_model.cfg, step_state, full_state)


def test_random_chunkings_match_one_shot_prefill(tiny_model, make_prompt, assert_global_equal):
    ids = make_prompt(301, seed=2)  # odd length: ends inside a ratio-2 group
    one_state = tiny_model.new_state()
    one_shot = tiny_model.run(one_state, ids, ALL)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        state, pieces, at = tiny_model.new_state(), [], 0
        while at < len(ids):
            size = int(torch.randint(1, 140, (1,), generator=g))
            pieces.append(tiny_model.run(state, ids[at : at + size], ALL))
            at += size
        assert _rel_err(torch.cat(pieces), one_shot) <= 1e-4
        assert torch.equal(torch.cat(pieces), one_shot)
        assert_global_equal(state.global_state(), one_state.global_state())
        for src in (2, 4):
            assert torch.equal(state.open_group(src).kv, one_state.open_group(src).kv)


def test_decode_after_chunked_prefill_continues_exactly(tiny_model, make_prompt):
    ids = make_prompt(200, seed=3)
    ref_state = tiny_model.new_state()
    ref = tiny_model.run(ref_state, ids, ALL)
    state = tiny_model.new_state()
    tiny_model.run(state, ids[:133])
    tiny_model.run(state, ids[133:190])
    tail = torch.cat([tiny_model.run(state, [t]) for t in ids[190:]])
    assert torch.equal(tail, ref[190:])
