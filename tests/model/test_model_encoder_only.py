"""Encoder-only prefill (§11.2) produces exactly the full forward's global KV, and no logits."""

from __future__ import annotations

import pytest

from flashpd.model.model import SeqPlan
from flashpd.model.state import StateError


def test_encoder_only_global_kv_equals_full_forward(tiny_model, make_prompt, assert_global_equal):
    ids = make_prompt(261, seed=11)
    full_state = tiny_model.new_state()
    tiny_model.run(full_state, ids)
    enc_state = tiny_model.new_state()
    assert tiny_model.run(enc_state, ids, SeqPlan.encoder_only()) is None
    assert_global_equal(enc_state.global_state(), full_state.global_state())


def test_chunked_encoder_only_equals_one_shot(tiny_model, make_prompt, assert_global_equal):
    ids = make_prompt(200, seed=12)
    one = tiny_model.new_state()
    tiny_model.run(one, ids, SeqPlan.encoder_only())
    chunked = tiny_model.new_state()
    for lo, hi in ((0, 77), (77, 78), (78, 200)):
        tiny_model.run(chunked, ids[lo:hi], SeqPlan.encoder_only())
    assert_global_equal(chunked.global_state(), one.global_state())


def test_decoder_after_encoder_only_needs_a_replay(tiny_model, make_prompt):
    ids = make_prompt(40, seed=13)
    state = tiny_model.new_state()
    tiny_model.run(state, ids, SeqPlan.encoder_only())
    with pytest.raises(StateError, match="window"):
        tiny_model.run(state, [1])


def test_encoder_only_plan_refuses_logits():
    from flashpd.model.model import LogitsRequest

    with pytest.raises(ValueError, match="no logits"):
        SeqPlan(logits=LogitsRequest.LAST, decoder_rows=0)
