"""Indexer: ReLU-weighted scores, candidate blocks with the newest forced in, sorted top-k."""

from __future__ import annotations

import torch

from flashpd.kernels.indexer import ref

NEG = float("-inf")


def test_scores_are_relu_weighted_and_masked_past_n_visible():
    g = torch.Generator().manual_seed(0)
    q, keys = torch.randn(2, 3, 8, generator=g), torch.randn(5, 8, generator=g)
    w = torch.randn(2, 3, generator=g)
    n_vis = torch.tensor([5, 2])
    scores = ref.index_scores(q, w, keys, n_vis)
    want = (w[:, :, None] * torch.relu(torch.einsum("thd,nd->thn", q, keys))).sum(1)
    torch.testing.assert_close(scores[0], want[0])
    torch.testing.assert_close(scores[1, :2], want[1, :2])
    assert scores[1, 2:].tolist() == [NEG] * 3


def test_topk_sorted_ascending_padded_and_ties_to_lower_index():
    scores = torch.tensor([[1.0, 5.0, 3.0, 5.0, NEG, 0.0]])
    assert ref.select_topk(scores, 3).tolist() == [[1, 2, 3]]
    assert ref.select_topk(scores, 8).tolist() == [[0, 1, 2, 3, 5, -1, -1, -1]]  # -inf dropped
    ties = torch.zeros(1, 6)
    assert ref.select_topk(ties, 2).tolist() == [[0, 1]]
    allowed = torch.tensor([[True, False, True, False, True, True]])
    assert ref.select_topk(scores, 2, allowed).tolist() == [[0, 2]]


def test_candidate_blocks_force_the_newest_block_and_drop_invisible_ones():
    # 10 entries, blocks of 2; query sees 7 entries -> newest block is 3 (entries 6, 7)
    scores = torch.tensor([[9.0, 0.0, 1.0, 1.0, 8.0, 0.0, -5.0, NEG, NEG, NEG]])
    mask = ref.candidate_mask(scores, torch.tensor([7]), block_size=2, num_blocks=2)
    assert mask.tolist() == [[True, True, False, False, False, False, True, True, False, False]]
    wide = ref.candidate_mask(scores, torch.tensor([7]), block_size=2, num_blocks=5)
    assert wide[0, :8].all() and not wide[0, 8:].any()  # the all -inf block is not kept
    empty = ref.candidate_mask(torch.zeros(1, 0), torch.tensor([0]), 2, 2)
    assert empty.shape == (1, 0)


def test_short_context_selects_every_visible_entry():
    scores = ref.index_scores(torch.randn(1, 2, 4), torch.ones(1, 2), torch.randn(6, 4), torch.tensor([3]))
    assert ref.select_topk(scores, 4).tolist() == [[0, 1, 2, -1]]
