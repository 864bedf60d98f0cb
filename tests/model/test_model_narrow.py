"""Decoder narrowing (§11.2-§11.3): decoder layers on the last rows only, global KV exact."""

from __future__ import annotations

import torch

from flashpd.model.model import LogitsRequest, SeqPlan


def test_narrowing_wider_than_the_chunk_is_the_full_forward(tiny_model, make_prompt):
    ids = make_prompt(100, seed=40)
    full = tiny_model.run(tiny_model.new_state(), ids)
    narrow = tiny_model.run(tiny_model.new_state(), ids, SeqPlan(decoder_rows=128))
    assert torch.equal(narrow, full)


def test_narrowing_keeps_global_kv_and_windows_for_decode(tiny_model, make_prompt, assert_global_equal):
    ids = make_prompt(300, seed=41)
    full_state = tiny_model.new_state()
    full = tiny_model.run(full_state, ids)
    state = tiny_model.new_state()
    narrow = tiny_model.run(state, ids, SeqPlan(decoder_rows=128))
    assert_global_equal(state.global_state(), full_state.global_state())
    cand = tiny_model.cfg.candidate_source_layer_id
    for layer in range(tiny_model.cfg.num_layers):
        win, want = state.window(layer), full_state.window(layer)
        assert (win.start_pos, win.end_pos) == (want.start_pos, want.end_pos)
        if layer < cand:  # encoder windows are exact
            assert torch.equal(win.kv, want.kv)
    assert not torch.equal(narrow, full)  # decoder windows were clipped at 300 - 128
    torch.testing.assert_close(narrow, full, rtol=0, atol=2.0)
    assert tiny_model.run(state, [3]).shape == full.shape


def test_narrowing_refuses_all_row_logits(tiny_model, make_prompt):
    import pytest

    with pytest.raises(ValueError, match="all rows"):
        tiny_model.run(
            tiny_model.new_state(), make_prompt(200, seed=42), SeqPlan(logits=LogitsRequest.ALL, decoder_rows=128)
        )
