"""The target tap (Model.taps(step), Model.forward_taps): stream means entering the tap layers."""

from __future__ import annotations

import torch

from flashpd.model.dspark import DSparkDrafter, greedy_choose
from flashpd.model.model import LogitsRequest, Model, SeqInput, SeqPlan


def _record_layer_inputs(model: Model, monkeypatch) -> dict[int, torch.Tensor]:
    """layer id -> the streams [T, S, D] handed to Model._layer (the residual entering it)."""
    seen: dict[int, torch.Tensor] = {}
    original = Model._layer

    def spy(self, spec, lw, rows, streams, carried_pre, step):
        seen[spec.layer_id] = streams.clone()
        return original(self, spec, lw, rows, streams, carried_pre, step)

    monkeypatch.setattr(Model, "_layer", spy)
    return seen


def _step(model, segments):
    """segments: (state, ids, plan) -> the computed step."""
    ids = torch.tensor([t for _, seg, _ in segments for t in seg])
    seqs = [SeqInput(st, st.num_tokens, len(seg), plan) for st, seg, plan in segments]
    step = model.prepare(ids, seqs)
    model.compute(step)
    model.commit(step)
    return step


def test_tap_is_the_stream_mean_entering_each_target_layer(tiny_model, make_prompt, monkeypatch):
    seen = _record_layer_inputs(tiny_model, monkeypatch)
    step = _step(tiny_model, [(tiny_model.new_state(), make_prompt(30), SeqPlan())])
    ids = tiny_model.cfg.dspark.target_layer_ids
    assert ids == (7, 8, 9)
    want = torch.cat([seen[i].mean(dim=1) for i in ids], dim=-1)  # by hand: plain mean over S
    values, positions = tiny_model.taps(step).of(0)
    assert values.shape == (30, 3 * tiny_model.cfg.hidden_size)
    assert positions == range(0, 30)
    assert torch.allclose(values, want, rtol=0, atol=1e-6)
    assert values.dtype == tiny_model.dtype


def test_tap_rows_follow_the_decoder_rows_per_segment(tiny_model, make_prompt, monkeypatch):
    seen = _record_layer_inputs(tiny_model, monkeypatch)
    a, b, c = (tiny_model.new_state() for _ in range(3))
    narrow = SeqPlan(decoder_rows=4)  # the decoder layers compute only the last 4 rows
    step = _step(
        tiny_model,
        [
            (a, make_prompt(12, 1), narrow),
            (b, make_prompt(9, 2), SeqPlan.encoder_only()),
            (c, make_prompt(7, 3), SeqPlan(logits=LogitsRequest.ALL)),
        ],
    )
    va, pa = tiny_model.taps(step).of(0)
    vb, pb = tiny_model.taps(step).of(1)
    vc, pc = tiny_model.taps(step).of(2)
    assert (pa, pb, pc) == (range(8, 12), range(0), range(0, 7))
    assert va.shape[0] == 4 and vb.shape[0] == 0 and vc.shape[0] == 7
    # batch rows: a = 0..11 (tap rows 8..11), b = 12..20, c = 21..27
    d = tiny_model.cfg.hidden_size
    for j, layer in enumerate((7, 8, 9)):
        cols = slice(j * d, (j + 1) * d)
        assert torch.allclose(va[:, cols], seen[layer][8:12].mean(dim=1), rtol=0, atol=1e-6)
        assert torch.allclose(vc[:, cols], seen[layer][21:28].mean(dim=1), rtol=0, atol=1e-6)


def test_a_model_without_a_drafter_records_no_tap(tiny_ckpt, make_prompt):
    import dataclasses

    bare = dataclasses.replace(tiny_ckpt, cfg=tiny_ckpt.cfg.replace(dspark=None), drafter_tensors={})
    model = Model.from_checkpoint(bare, torch.float32)
    assert model.tap_layer_ids == ()
    step = _step(model, [(model.new_state(), make_prompt(5), SeqPlan())])
    assert model.taps(step) is None and "taps" not in step.outputs


def test_tap_feeds_the_drafter_end_to_end(tiny_ckpt, tiny_model, make_prompt):
    """Prefill -> insert the prompt's taps -> draft; a decode step's tap row then extends it."""
    drafter = DSparkDrafter.from_checkpoint(tiny_ckpt, tiny_model)
    st, ds = tiny_model.new_state(), drafter.new_state()
    prompt = make_prompt(20, 4)
    step = _step(tiny_model, [(st, prompt, SeqPlan())])
    values, positions = tiny_model.taps(step).of(0)
    logits, taps = tiny_model.forward_taps(
        torch.tensor(prompt), [SeqInput(tiny_model.new_state(), 0, 20)]
    )  # the one-call form gives the same tap
    assert torch.equal(taps.values, values) and logits[0].shape == (1, tiny_model.cfg.vocab_size)
    drafter.insert_context([ds], [list(positions)], values)
    out = drafter.draft([ds], torch.tensor([prompt[-1]]), [20], greedy_choose)
    assert out.tokens.shape == (1, drafter.k)
    step = _step(tiny_model, [(st, [int(out.tokens[0, 0])], SeqPlan())])
    values, positions = tiny_model.taps(step).of(0)
    assert positions == range(20, 21)
    drafter.insert_context([ds], [list(positions)], values)
    assert ds.positions() == list(range(21)) and ds.end_pos == 21


def test_decode_side_replay_rebuilds_the_tap_of_the_last_window(tiny_ckpt, make_prompt):
    """P/D: the decode side's replay of the prompt's tail yields the tap rows its drafter windows
    need; with exact replay rows they equal the cold prefill's tap (short window: fewer rows)."""
    import dataclasses

    from flashpd.model.model import exact_replay_rows, replay_segment

    w = 16
    cfg = tiny_ckpt.cfg.replace(sliding_window=w)
    model = Model.from_checkpoint(dataclasses.replace(tiny_ckpt, cfg=cfg), torch.float32)
    ids = make_prompt(200, seed=31)
    _, cold = model.forward_taps(torch.tensor(ids), [SeqInput(model.new_state(), 0, 200)])
    encoder = model.new_state()
    model.run(encoder, ids, SeqPlan.encoder_only())
    state = model.new_state()
    state.load_global_state(encoder.global_state())
    seg = replay_segment(ids, 200, exact_replay_rows(cfg))
    _, taps = model.forward_taps(
        torch.tensor(seg.token_ids), [SeqInput(state, seg.start_pos, len(seg.token_ids), seg.plan)]
    )
    values, positions = taps.of(0)
    assert positions == range(seg.start_pos, 200)
    cold_values, _ = cold.of(0)
    assert torch.equal(values[-(w - 1) :], cold_values[-(w - 1) :])
