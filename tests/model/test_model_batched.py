"""A sequence's results do not depend on its batch neighbours (FP32, bitwise)."""

from __future__ import annotations

import copy

import torch

from flashpd.model.model import LogitsRequest, SeqInput, SeqPlan, replay_segment


def test_batched_equals_alone(tiny_model, make_prompt, assert_global_equal):
    a, b, c, d = (make_prompt(n, seed=30 + i) for i, n in enumerate((180, 150, 90, 140)))
    states = [tiny_model.new_state() for _ in range(4)]
    tiny_model.run(states[0], a[:179])  # decode step next
    tiny_model.run(states[1], b[:60])  # a prefill chunk next
    encoder = tiny_model.new_state()  # states[3]: shipped global KV, replay next
    tiny_model.run(encoder, d, SeqPlan.encoder_only())
    states[3].load_global_state(encoder.global_state())
    replay = replay_segment(d, len(d), 128)
    work = [
        (a[179:], 179, SeqPlan()),
        (b[60:150], 60, SeqPlan(logits=LogitsRequest.ALL)),
        (c, 0, SeqPlan.encoder_only()),
        (list(replay.token_ids), replay.start_pos, replay.plan),
    ]
    batch_states = copy.deepcopy(states)
    alone = [tiny_model.run(s, ids, plan, start) for s, (ids, start, plan) in zip(states, work)]
    ids = torch.tensor([t for w in work for t in w[0]])
    batched = tiny_model.forward(ids, [SeqInput(s, start, len(w_ids), plan) for s, (w_ids, start,
                                       plan) in zip(batch_states, work)])
    for one, many in zip(alone, batched):
        assert (one is None and many is None) or torch.equal(one, many)
    for s_alone, s_batch in zip(states, batch_states):
        assert_global_equal(s_batch.global_state(), s_alone.global_state())
        for layer in range(tiny_model.cfg.num_layers):
            assert torch.equal(s_batch.window(layer).kv, s_alone.window(layer).kv) or (
                s_alone is states[2] and layer >= tiny_model.cfg.candidate_source_layer_id)
