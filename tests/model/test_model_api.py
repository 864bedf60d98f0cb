"""Forward-call validation, one-token steps over a kept state and `flashpd logits`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashpd.model.model import LogitsRequest, SeqInput, SeqPlan
from flashpd.model.state import StateError


def test_segment_must_start_where_the_state_ends(tiny_model):
    state = tiny_model.new_state()
    tiny_model.run(state, [1, 2, 3])
    with pytest.raises(StateError, match="starts at 2"):
        tiny_model.run(state, [4], start_pos=2)


def test_batch_validation(tiny_model):
    state = tiny_model.new_state()
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="twice"):
        tiny_model.forward(ids, [SeqInput(state, 0, 1), SeqInput(state, 1, 2)])
    with pytest.raises(ValueError, match="cover 2 tokens"):
        tiny_model.forward(ids, [SeqInput(state, 0, 2)])
    with pytest.raises(ValueError, match="token id"):
        tiny_model.forward(torch.tensor([512]), [SeqInput(state, 0, 1)])


def test_logits_requests(tiny_model):
    ids = [5, 6, 7, 8]
    all_rows = tiny_model.run(tiny_model.new_state(), ids, SeqPlan(logits=LogitsRequest.ALL))
    last = tiny_model.run(tiny_model.new_state(), ids)
    none = tiny_model.run(tiny_model.new_state(), ids, SeqPlan(logits=LogitsRequest.NONE))
    assert all_rows.shape == (4, 512) and all_rows.dtype == torch.float32
    assert torch.equal(last, all_rows[-1:]) and none is None


def test_one_token_steps_continue_the_state_like_a_full_recompute(tiny_model):
    """Greedy decoding one token per `run` over a kept state picks, at every step, the argmax of
    a fresh forward over everything before it (the serving engine's generation loop lives in
    engine/; this is the model-level property it relies on)."""
    prompt = [10, 20, 30, 40, 50]
    state = tiny_model.new_state()
    logits, out = tiny_model.run(state, prompt), []
    for _ in range(6):
        out.append(int(logits[-1].argmax()))
        logits = tiny_model.run(state, out[-1:])
    for i, token in enumerate(out):
        fresh = tiny_model.run(tiny_model.new_state(), prompt + out[:i])
        assert token == int(fresh[-1].argmax())


def test_logits_cli_writes_fp32_logits(tiny_model, tiny_ckpt_dir, tmp_path):
    from flashpd.cli import main

    out = tmp_path / "logits.npz"
    rc = main(
        ["logits", "--checkpoint", tiny_ckpt_dir, "--prompt-ids", "1,2,3", "--out", str(out), "--dtype", "float32"]
    )
    assert rc == 0
    saved = np.load(out)["logits"]
    assert saved.dtype == np.float32 and saved.shape == (3, 512)
    want = tiny_model.run(tiny_model.new_state(), [1, 2, 3], SeqPlan(logits=LogitsRequest.ALL))
    np.testing.assert_array_equal(saved, want.numpy())
