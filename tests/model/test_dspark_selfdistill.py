"""`flashpd train --drafter --teacher-source greedy|mix`: batched greedy generation, the greedy
teacher rows, the per-slot loss weights (CPU)."""

from __future__ import annotations

import argparse

import pytest
import torch

from flashpd.model.checkpoint import write_random_checkpoint
from flashpd.model.presets import preset_config
from flashpd.model.presets.small import checkpoint_path
from flashpd.model.train_drafter import (
    GreedySpec,
    build_teacher_rows,
    greedy_chains,
    greedy_continuation,
    greedy_prompts,
    greedy_teacher_rows,
    load_frozen_backbone,
    paged_states,
    slot_weights,
)

QUIET = dict(log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_base")
    write_random_checkpoint(preset_config("tiny"), str(out), seed=13)
    target, _ = load_frozen_backbone(str(out), "tiny")
    return target


@pytest.fixture(scope="module")
def small():
    target, _ = load_frozen_backbone(checkpoint_path(), "small")
    return target


def _prompts(lengths, seed=0, hi=500):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, hi, (n,), generator=g).tolist() for n in lengths]


def test_batched_chains_equal_each_prompt_alone_on_the_small_checkpoint(small):
    # real text-like ids: the checkpoint's vocabulary, prompts of different lengths in one batch
    prompts = _prompts([9, 23], seed=3, hi=small.cfg.vocab_size)
    chains = greedy_chains(small, prompts, 12, spec=GreedySpec(1, 1, 12, decode_batch=2))
    for prompt, chain in zip(prompts, chains, strict=True):
        alone, _ = greedy_continuation(small, prompt, 12)
        assert chain == alone


def test_batched_chains_split_into_decode_batches_and_paged_states(tiny):
    prompts = _prompts([5, 17, 11])
    alone = [greedy_continuation(tiny, p, 9)[0] for p in prompts]
    # 3 sequences, 2 per decode forward, 20 prompt tokens per prefill forward (groups [0, 1], [2])
    spec = GreedySpec(1, 1, 9, decode_batch=2, prefill_tokens=22)
    assert greedy_chains(tiny, prompts, 9, spec=spec) == alone
    # the GPU generator's state kind (KVPools blocks and slots) on the reference forward
    states = paged_states(tiny, [len(p) + 9 for p in prompts])
    assert len({s.slot for s in states}) == 3
    assert not set(states[0].block_table) & set(states[1].block_table)
    assert greedy_chains(tiny, prompts, 9, states, spec) == alone


def test_greedy_teacher_rows_are_prompt_plus_chain_labelled_by_the_chain(tiny):
    prompts = _prompts([6, 14])
    spec = GreedySpec(4, 16, 10)
    rows = greedy_teacher_rows(tiny, prompts, spec, **QUIET)
    d = 3 * tiny.cfg.hidden_size
    for prompt, row in zip(prompts, rows, strict=True):
        chain, taps = greedy_continuation(tiny, prompt, 10)
        n, p = len(prompt) + 10, len(prompt)
        assert row.ids.tolist() == prompt + chain
        assert row.taps.shape == (n, d) and row.greedy.shape == (n,)
        # label i = the backbone's next token = the chain's token i+1 (drafter_loss's y_j = g_{a+j})
        assert row.greedy[p - 1 : -1].tolist() == chain
        # the prefill taps are the decode taps of the same positions (the walk's rows)
        assert torch.allclose(row.taps[: n - 1], taps.float(), atol=1e-4)


def test_greedy_prompts_draw_lengths_in_range_and_skip_short_rows():
    rows = torch.full((5, 40), 2)
    for i, n in enumerate([40, 3, 25, 40, 12]):
        rows[i, :n] = torch.arange(10, 10 + n)
    spec = GreedySpec(10, 30, 8)
    prompts = greedy_prompts(rows, 2, 4, spec, torch.Generator().manual_seed(0))
    assert len(prompts) == 4  # the 3-token row is skipped
    assert all(10 <= len(p) <= 30 for p in prompts)
    assert len(prompts[1]) <= 25 and len(prompts[3]) <= 12
    assert prompts[0] == list(range(10, 10 + len(prompts[0])))


def _args(**kw):
    base = dict(
        teacher_source="mix",
        greedy_fraction=0.5,
        teacher_rows=4,
        prompt_min=4,
        prompt_max=8,
        greedy_tokens=6,
        seq_len=32,
        decode_batch=256,
        greedy_generator="reference",
        device="cpu",
    )
    return argparse.Namespace(**{**base, **kw})


def test_mix_splits_the_rows_between_text_and_greedy(tiny):
    rows = torch.randint(5, 500, (10, 32), generator=torch.Generator().manual_seed(1))
    out = build_teacher_rows(_args(), tiny, rows, 2, torch.Generator().manual_seed(0), **QUIET)
    assert [r.ids.numel() for r in out][:2] == [32, 32]  # text rows: whole rows
    assert all(10 <= r.ids.numel() <= 14 for r in out[2:]) and len(out) == 4  # prompt 4-8 + 6 greedy
    with pytest.raises(ValueError, match="greedy-fraction"):
        build_teacher_rows(_args(greedy_fraction=1.5), tiny, rows, 2, torch.Generator(), **QUIET)
    with pytest.raises(ValueError, match="teacher-source"):
        build_teacher_rows(_args(teacher_source="web"), tiny, rows, 2, torch.Generator(), **QUIET)


def test_greedy_spec_rejects_bad_lengths():
    with pytest.raises(ValueError, match="prompt tokens"):
        GreedySpec(20, 10, 5)
    with pytest.raises(ValueError, match=">= 1"):
        GreedySpec(1, 2, 0)


def test_survival_weights_are_the_accept_probability_of_earlier_slots():
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.2, 0.8], [0.9, 0.1]]]))  # [1, 3, 2]
    labels = torch.tensor([[0, 1, 1]])
    w = slot_weights(logits, labels, "survival")
    assert torch.allclose(w, torch.tensor([[1.0, 0.5, 0.4]]))
    assert torch.equal(slot_weights(logits, labels, "uniform"), torch.ones(1, 3))
    with pytest.raises(ValueError, match="slot weights"):
        slot_weights(logits, labels, "linear")
