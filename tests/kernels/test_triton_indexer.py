"""Indexer scores over packed MXFP4 keys, radix top-k and candidates (kernels/indexer/triton.py)."""

from __future__ import annotations

import torch

from flashpd.kernels.indexer import ref as iref
from flashpd.kernels.indexer import triton as it
from flashpd.kernels.quant import ref as qref


def _inputs(t: int = 4, h: int = 4, di: int = 32, n: int = 200, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = qref.fake_quant_mxfp4(torch.randn(t, h, di, generator=g)).bfloat16()
    w = torch.randn(t, h, generator=g)
    records = qref.pack_mxfp4(torch.randn(n, di, generator=g))
    n_vis = torch.tensor([0, 1, n // 3, n])[:t]
    return q, w, records, n_vis


def test_packed_scores_equal_scores_of_unpacked_keys():
    q, w, rec, n_vis = _inputs()
    want = iref.index_scores(q, w, qref.unpack_mxfp4(rec, torch.bfloat16), n_vis)
    torch.testing.assert_close(it.index_scores_packed(q, w, rec, n_vis), want,
                               rtol=1e-6, atol=1e-6)


def test_topk_is_ascending_and_padded_like_reference():
    q, w, rec, n_vis = _inputs(seed=1)
    scores = iref.index_scores(q, w, qref.unpack_mxfp4(rec, torch.bfloat16), n_vis)
    for k in (1, 16, 250):  # 250 > entries: padded with -1
        assert torch.equal(it.select_topk(scores, k), iref.select_topk(scores, k))


def test_topk_ties_prefer_lower_positions():
    scores = torch.tensor([[1.0, 0.0, 1.0, 1.0, -0.0, 0.0, 2.0, float("-inf")],
                           [0.0, 0.0, -0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(it.select_topk(scores, 4), iref.select_topk(scores, 4))
    assert it.select_topk(scores, 4).tolist() == [[0, 2, 3, 6], [0, 1, 2, 3]]


def test_candidate_mask_forces_the_newest_block():
    q, w, rec, n_vis = _inputs(seed=2)
    scores = iref.index_scores(q, w, qref.unpack_mxfp4(rec, torch.bfloat16), n_vis)
    assert torch.equal(it.candidate_mask(scores, n_vis, 4, 6),
                       iref.candidate_mask(scores, n_vis, 4, 6))


def test_sparse_reindex_equals_candidate_masked_dense_selection():
    q, w, rec, n_vis = _inputs(seed=3)
    scores = iref.index_scores(q, w, qref.unpack_mxfp4(rec, torch.bfloat16), n_vis)
    blocks = it.candidate_blocks(scores, n_vis, 4, 6)
    want = iref.select_topk(scores, 8, allowed=iref.candidate_mask(scores, n_vis, 4, 6))
    assert torch.equal(it.index_topk_sparse(q, w, rec, n_vis, blocks, 4, 8), want)


def test_two_stage_topk_of_long_rows_keeps_ties_and_order(monkeypatch):
    monkeypatch.setattr(it, "_SPLIT_COLS", 32)  # rows of >= 128 entries take two stages
    g = torch.Generator().manual_seed(4)
    scores = torch.randint(0, 6, (2, 150), generator=g).float()  # many exact ties
    scores[1, 100:] = float("-inf")
    allowed = torch.rand(2, 150, generator=g) > 0.3
    assert torch.equal(it.select_topk(scores, 8), iref.select_topk(scores, 8))
    assert torch.equal(it.select_topk(scores, 8, allowed), iref.select_topk(scores, 8, allowed))
