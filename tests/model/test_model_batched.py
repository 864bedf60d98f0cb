"""A sequence's results do not depend on its batch neighbours (FP32, bitwise)."""

from __future__ import annotations

import copy

import torch

from flashpd.model.model import LogitsRequest, SeqInput, SeqPlan, replay_segment


def _mixed_work(model, make_prompt):
    """Four states, each about to run a different mode: (state, ids, start, plan)."""
    a, b, c, d = (make_prompt(n, seed=30 + i) for i, n in enumerate((180, 150, 90, 140)))
    states = [model.new_state() for _ in range(4)]
    model.run(states[0], a[:179])  # then a decode step
    model.run(states[1], b[:60])  # then a prefill chunk with all-row logits
    encoder = model.new_state()  # states[3]: shipped global KV, then a bounded replay
    model.run(encoder, d, SeqPlan.encoder_only())
    states[3].load_global_state(encoder.global_state())
    replay = replay_segment(d, len(d), 128)
    return [
        (states[0], a[179:], 179, SeqPlan()),
        (states[1], b[60:150], 60, SeqPlan(logits=LogitsRequest.ALL)),
        (states[2], c, 0, SeqPlan.encoder_only()),
        (states[3], list(replay.token_ids), replay.start_pos, replay.plan),
    ]


def test_batched_equals_alone(tiny_model, make_prompt, assert_global_equal):
    work = _mixed_work(tiny_model, make_prompt)
    batch_states = [copy.deepcopy(w[0]) for w in work]
    alone = [tiny_model.run(state, ids, plan, start) for state, ids, start, plan in work]
    token_ids = torch.tensor([t for _, ids, _, _ in work for t in ids])
    inputs = [
        SeqInput(state, start, len(ids), plan) for state, (_, ids, start, plan) in zip(batch_states, work, strict=True)
    ]
    batched = tiny_model.forward(token_ids, inputs)
    cand = tiny_model.cfg.candidate_source_layer_id
    for i, (one, many) in enumerate(zip(alone, batched, strict=True)):
        assert (one is None and many is None) or torch.equal(one, many)
        single, in_batch = work[i][0], batch_states[i]
        assert_global_equal(in_batch.global_state(), single.global_state())
        for layer in range(cand if i == 2 else tiny_model.cfg.num_layers):  # 2: encoder-only
            assert torch.equal(in_batch.window(layer).kv, single.window(layer).kv)
