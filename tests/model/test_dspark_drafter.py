"""The DSpark drafter (model/dspark.py) on the tiny preset's random drafter, FP32, CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashpd.model.checkpoint import Checkpoint
from flashpd.model.dspark import DrafterError, DraftOut, DSparkDrafter, greedy_choose

W = 128  # the drafter's window (tiny: sliding_window = 128)


@pytest.fixture(scope="module")
def drafter(tiny_ckpt, tiny_model):
    return DSparkDrafter.from_checkpoint(tiny_ckpt, tiny_model)


def _taps(drafter, n: int, seed: int = 0) -> torch.Tensor:
    """Random tap rows [n, 3*D] (the drafter's input; the tap itself: test_dspark_tap.py)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3 * drafter.cfg.hidden_size, generator=g)


def _state(drafter, positions, taps):
    st = drafter.new_state()
    drafter.insert_context([st], [list(positions)], taps)
    return st


def _draft(drafter, states, anchors, anchor_positions) -> DraftOut:
    return drafter.draft(states, torch.tensor(anchors), anchor_positions, greedy_choose)


def test_from_checkpoint_is_none_without_mtp_tensors(tiny_ckpt, tiny_model):
    bare = dataclasses.replace(tiny_ckpt, cfg=tiny_ckpt.cfg.replace(dspark=None), drafter_tensors={})
    assert isinstance(bare, Checkpoint)
    assert DSparkDrafter.from_checkpoint(bare, tiny_model) is None


def test_draft_shapes_and_ranges(drafter):
    taps = _taps(drafter, 40)
    states = [_state(drafter, range(40), taps), _state(drafter, range(20), taps[:20])]
    out = _draft(drafter, states, [11, 12], [40, 20])
    k, vocab = drafter.k, drafter.cfg.vocab_size
    assert k == 5
    assert out.tokens.shape == (2, k) and out.tokens.dtype == torch.int64
    assert out.probs.shape == (2, k, vocab) and out.probs.dtype == torch.float32
    assert torch.allclose(out.probs.sum(-1), torch.ones(2, k))
    assert out.confidences.shape == (2, k) and out.confidences.dtype == torch.float32
    assert ((out.confidences > 0) & (out.confidences < 1)).all()


def test_draft_is_deterministic_and_reads_windows_only(drafter):
    st = _state(drafter, range(60), _taps(drafter, 60))
    kv, held = st.kv.clone(), st.slot_pos.clone()
    a = _draft(drafter, [st], [9], [60])
    b = _draft(drafter, [st], [9], [60])
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.probs, b.probs)
    assert torch.equal(a.confidences, b.confidences)
    assert torch.equal(st.kv, kv) and torch.equal(st.slot_pos, held)  # no rollback needed


def test_greedy_choose_is_argmax_of_base_plus_markov_bias(drafter):
    st = _state(drafter, range(30), _taps(drafter, 30, seed=1))
    anchors = torch.tensor([17])
    x, base = drafter.forward_block([st], anchors, [30])
    out = drafter.markov(x, base, anchors, greedy_choose)
    w = drafter.w
    prev = 17
    for j in range(drafter.k):
        bias = w.markov_head @ w.markov_embed[prev]  # [V] = H . E[prev], by hand
        want = int(torch.argmax(base[0, j] + bias))
        assert int(out.tokens[0, j]) == want
        assert out.probs[0, j, want] == 1.0
        prev = want


def test_chooser_sees_each_slot_and_its_token_feeds_the_next(drafter):
    st = _state(drafter, range(30), _taps(drafter, 30, seed=1))
    anchors = torch.tensor([17])
    x, base = drafter.forward_block([st], anchors, [30])
    seen = []

    def always_three(logits, slot):
        seen.append((slot, logits.clone()))
        return greedy_choose(torch.zeros_like(logits).index_fill_(1, torch.tensor([3]), 1.0), slot)

    out = drafter.markov(x, base, anchors, always_three)
    assert [s for s, _ in seen] == list(range(drafter.k))
    assert out.tokens.tolist() == [[3] * drafter.k]
    w = drafter.w
    assert torch.allclose(seen[0][1][0], base[0, 0] + w.markov_head @ w.markov_embed[17])
    assert torch.allclose(seen[2][1][0], base[0, 2] + w.markov_head @ w.markov_embed[3])


def test_confidence_is_the_head_on_prenorm_hidden_and_previous_token(drafter):
    st = _state(drafter, range(30), _taps(drafter, 30, seed=2))
    anchors = torch.tensor([5])
    x, base = drafter.forward_block([st], anchors, [30])
    out = drafter.markov(x, base, anchors, greedy_choose)
    w, dim = drafter.w, drafter.cfg.hidden_size
    prevs = [5] + out.tokens[0, :-1].tolist()
    for j, prev in enumerate(prevs):
        score = x[0, j] @ w.confidence[:dim] + w.markov_embed[prev] @ w.confidence[dim:]
        want = torch.sigmoid(score)
        assert torch.allclose(out.confidences[0, j], want)


def test_batch_invariance(drafter):
    taps = _taps(drafter, 200, seed=3)
    specs = [(range(200), 7, 200), (range(50, 90), 8, 90), (range(3), 9, 3)]
    states = [_state(drafter, r, taps[r.start : r.stop]) for r, _, _ in specs]
    batch = _draft(drafter, states, [a for _, a, _ in specs], [p for _, _, p in specs])
    for b, (r, a, p) in enumerate(specs):
        alone = _draft(drafter, [_state(drafter, r, taps[r.start : r.stop])], [a], [p])
        assert torch.equal(batch.tokens[b], alone.tokens[0])
        assert torch.equal(batch.probs[b], alone.probs[0])
        assert torch.equal(batch.confidences[b], alone.confidences[0])


# ----------------------------------------------------------------------------- the mask
def test_context_mask_by_position(drafter):
    st = _state(drafter, range(200, 260), _taps(drafter, 60))
    _, valid = drafter.context([st], torch.tensor([230]))
    held = st.slot_pos
    want = (held >= 200) & (held <= 230)
    assert torch.equal(valid[0], want)
    assert int(valid.sum()) == 31  # positions 200..230; 231..259 lie after the anchor's context
    _, valid = drafter.context([st], torch.tensor([400]))
    assert int(valid.sum()) == 0  # everything is W or more behind position 400


def test_window_holds_the_last_128_committed_positions(drafter):
    taps = _taps(drafter, 300, seed=4)
    full = _state(drafter, range(300), taps)  # one call: only the last W are kept
    assert full.positions() == list(range(300 - W, 300)) and full.end_pos == 300
    stepwise = drafter.new_state()
    for start in range(0, 300, 7):  # as decode commits them, a few per step
        stop = min(start + 7, 300)
        drafter.insert_context([stepwise], [list(range(start, stop))], taps[start:stop])
    suffix = _state(drafter, range(300 - W, 300), taps[300 - W :])
    outs = [_draft(drafter, [s], [3], [300]) for s in (full, stepwise, suffix)]
    for o in outs[1:]:
        assert torch.equal(o.probs, outs[0].probs) and torch.equal(o.tokens, outs[0].tokens)
    assert torch.equal(full.kv, suffix.kv)


def test_never_written_slots_are_masked(drafter):
    """A fresh decode-side state: garbage in unwritten slots changes nothing (dspark.md §6)."""
    taps = _taps(drafter, 10, seed=5)
    clean = _state(drafter, range(10), taps)
    dirty = _state(drafter, range(10), taps)
    dirty.kv[:, 10:] = 1e3 * torch.randn_like(dirty.kv[:, 10:])
    a, b = _draft(drafter, [clean], [4], [10]), _draft(drafter, [dirty], [4], [10])
    assert torch.equal(a.probs, b.probs) and torch.equal(a.confidences, b.confidences)


def test_context_after_the_anchor_is_invisible(drafter):
    taps = _taps(drafter, 50, seed=6)
    ahead = _state(drafter, range(50), taps)
    exact = _state(drafter, range(30), taps[:30])
    a, b = _draft(drafter, [ahead], [4], [30]), _draft(drafter, [exact], [4], [30])
    assert torch.equal(a.probs, b.probs)


def test_context_changes_the_draft(drafter):
    a = _draft(drafter, [_state(drafter, range(20), _taps(drafter, 20, seed=7))], [4], [20])
    b = _draft(drafter, [_state(drafter, range(20), _taps(drafter, 20, seed=8))], [4], [20])
    assert not torch.equal(a.probs, b.probs)


def test_block_attention_is_bidirectional(drafter):
    """Slot 0 (the anchor) sees the later block slots: changing the noise row changes x_0."""
    st = _state(drafter, range(20), _taps(drafter, 20, seed=9))
    other = dataclasses.replace(drafter.ds, noise_token_id=drafter.ds.noise_token_id + 1)
    twin = DSparkDrafter(drafter.cfg.replace(dspark=other), drafter.w, drafter.target)
    x, _ = drafter.forward_block([st], torch.tensor([4]), [20])
    y, _ = twin.forward_block([st], torch.tensor([4]), [20])
    assert not torch.allclose(x[0, 0], y[0, 0])


# ----------------------------------------------------------------------------- bad input
def test_insert_rejects_bad_input(drafter):
    st = _state(drafter, range(300), _taps(drafter, 300))
    with pytest.raises(DrafterError, match="taps must be"):
        drafter.insert_context([st], [[300, 301]], _taps(drafter, 3))
    with pytest.raises(DrafterError, match="ascending"):
        drafter.insert_context([st], [[301, 300]], _taps(drafter, 2))
    with pytest.raises(DrafterError, match="behind"):
        drafter.insert_context([st], [[100]], _taps(drafter, 1))
    with pytest.raises(DrafterError, match="states"):
        drafter.insert_context([st, st], [[300]], _taps(drafter, 1))


def test_draft_rejects_bad_input(drafter):
    st = _state(drafter, range(5), _taps(drafter, 5))
    with pytest.raises(DrafterError, match="anchors"):
        drafter.draft([st], torch.tensor([1.0]), [5])
    with pytest.raises(DrafterError, match="anchor id"):
        drafter.draft([st], torch.tensor([drafter.cfg.vocab_size]), [5])
    with pytest.raises(DrafterError, match="anchor_positions"):
        drafter.draft([st], torch.tensor([1]), [5, 6])
    with pytest.raises(DrafterError, match="choose returned"):
        drafter.draft([st], torch.tensor([1]), [5], lambda lg, j: (lg.argmax(-1), lg[:, :3]))


def test_random_drafter_is_made_from_the_seed(tiny_model):
    """DSparkDrafter.random: weights drawn on the target's device (benchmarks), deterministic."""
    cfg = tiny_model.cfg
    a, b = DSparkDrafter.random(cfg, tiny_model, seed=4), DSparkDrafter.random(cfg, tiny_model, 4)
    c = DSparkDrafter.random(cfg, tiny_model, seed=5)
    assert torch.equal(a.w.main_proj, b.w.main_proj) and not torch.equal(a.w.main_proj, c.w.main_proj)
    assert a.w.layers[2].moe.experts.w2.shape == (
        cfg.dspark.n_routed_experts,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
    )
    st = _state(a, range(12), _taps(a, 12))
    out = _draft(a, [st], [3], [12])
    assert out.tokens.shape == (1, a.k)


@pytest.mark.slow
def test_the_triton_kernel_set_drafts_as_the_reference(tiny_ckpt, tiny_model):
    """The GPU path's kernels (`dispatch.fastest()`, interpreted on CPU: ~20 s) accept the
    drafter's inputs and draft the same tokens."""
    from flashpd.kernels import dispatch
    from flashpd.model.model import Model

    fast = Model.from_checkpoint(tiny_ckpt, torch.float32, kernels=dispatch.fastest())
    outs = []
    for target in (tiny_model, fast):
        d = DSparkDrafter.from_checkpoint(tiny_ckpt, target)
        st = _state(d, range(20), _taps(d, 20, seed=11))
        outs.append(_draft(d, [st], [5], [20]))
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.allclose(outs[0].probs, outs[1].probs, atol=1e-5)
    assert torch.allclose(outs[0].confidences, outs[1].confidences, atol=1e-5)
