"""Bounded replay (§11.3-§11.4): clipped windows, suppressed global writes; exact with enough rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashpd.model.model import LogitsRequest, Model, SeqPlan, exact_replay_rows, replay_segment
from flashpd.model.state import StateError

SHORT_WINDOW = 16  # exact replay needs W + (L-1)(W-1) rows: 151 here instead of 1271


@pytest.fixture(scope="module")
def short_window_model(tiny_ckpt):
    cfg = tiny_ckpt.cfg.replace(sliding_window=SHORT_WINDOW)
    return Model.from_checkpoint(dataclasses.replace(tiny_ckpt, cfg=cfg), torch.float32)


def _shipped_state(model, ids):
    """A decode-side state holding only the global KV of `ids` (as prefill ships it)."""
    encoder = model.new_state()
    model.run(encoder, ids, SeqPlan.encoder_only())
    state = model.new_state()
    state.load_global_state(encoder.global_state())
    return state


def test_exact_replay_rows_formula(tiny_model):
    assert exact_replay_rows(tiny_model.cfg) == 128 + 9 * 127


@pytest.mark.parametrize("num_tokens", [300, 301])
def test_exact_decode_side_replay_equals_full_forward(short_window_model, make_prompt, num_tokens):
    model = short_window_model
    ids = make_prompt(num_tokens, seed=21)
    cold = model.new_state()
    cold_logits = model.run(cold, ids)
    state = _shipped_state(model, ids)
    rows = exact_replay_rows(model.cfg)
    assert rows < num_tokens
    logits = model.run_replay(state, replay_segment(ids, num_tokens, rows))
    assert torch.equal(logits, cold_logits)
    for src in (2, 4):  # the open-group row is rebuilt when the prompt ends mid-group
        rebuilt, want = state.open_group(src), cold.open_group(src)
        assert (rebuilt is None) == (want is None) == (num_tokens % 2 == 0)
        if want is not None:
            assert torch.equal(rebuilt.kv, want.kv) and torch.equal(rebuilt.gate, want.gate)
    for token in (7, 300, 42):  # and decode continues exactly
        assert torch.equal(model.run(state, [token]), model.run(cold, [token]))


def test_exact_encoder_side_replay_after_prefix_hit(short_window_model, make_prompt, assert_global_equal):
    model = short_window_model
    ids, hit = make_prompt(320, seed=22), 256
    cold = model.new_state()
    cold_logits = model.run(cold, ids)
    cached = model.new_state()
    model.run(cached, ids[:hit], SeqPlan.encoder_only())
    state = model.new_state()
    state.load_global_state(cached.global_state())
    model.run_replay(state, replay_segment(ids, hit, exact_replay_rows(model.cfg), LogitsRequest.NONE))
    logits = model.run(state, ids[hit:])
    assert torch.equal(logits, cold_logits)
    assert_global_equal(state.global_state(), cold.global_state())


def test_bounded_replay_rebuilds_windows_without_global_writes(tiny_model, make_prompt, assert_global_equal):
    ids = make_prompt(301, seed=23)
    state = _shipped_state(tiny_model, ids)
    before = state.global_state()
    seg = replay_segment(ids, len(ids), tiny_model.cfg.sliding_window)
    assert seg.start_pos == 301 - 128 and seg.plan.replay.lookback_ids == tuple(ids[170:173])
    logits = tiny_model.run_replay(state, seg)
    assert logits.shape == (1, tiny_model.cfg.vocab_size)
    assert_global_equal(state.global_state(), before)  # nothing rewritten
    for layer in range(tiny_model.cfg.num_layers):
        win = state.window(layer)  # last W-1 positions of the replayed rows
        assert (win.start_pos, win.end_pos) == (301 - 127, 301)
    assert state.open_group(2) is not None  # 301 is odd: the lone token's row is rebuilt
    assert tiny_model.run(state, [5]).shape == (1, tiny_model.cfg.vocab_size)


def test_bounded_replay_row_zero_equals_cold_row_when_prompt_fits(tiny_model, make_prompt):
    """A prompt no longer than the replay is replayed whole: exactly a cold run."""
    ids = make_prompt(100, seed=24)
    cold_logits = tiny_model.run(tiny_model.new_state(), ids)
    state = _shipped_state(tiny_model, ids)
    logits = tiny_model.run_replay(state, replay_segment(ids, 100, 128))
    assert torch.equal(logits, cold_logits)


def test_replay_must_end_where_the_state_ends(tiny_model, make_prompt):
    ids = make_prompt(50, seed=25)
    state = _shipped_state(tiny_model, ids)
    with pytest.raises(StateError, match="must end where the state ends"):
        tiny_model.run_replay(state, replay_segment(ids, 49, 10))
