"""Indexer scores over packed MXFP4 keys, radix top-k and candidates (kernels/indexer/triton.py)."""

from __future__ import annotations

import torch

from flashpd.kernels import configs
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
    torch.testing.assert_close(it.index_scores_packed(q, w, rec, n_vis), want, rtol=1e-6, atol=1e-6)


def test_topk_is_ascending_and_padded_like_reference():
    q, w, rec, n_vis = _inputs(seed=1)
    scores = iref.index_scores(q, w, qref.unpack_mxfp4(rec, torch.bfloat16), n_vis)
    for k in (1, 16, 250):  # 250 > entries: padded with -1
        assert torch.equal(it.select_topk(scores, k), iref.select_topk(scores, k))


def test_topk_ties_prefer_lower_positions():
    scores = torch.tensor(
        [[1.0, 0.0, 1.0, 1.0, -0.0, 0.0, 2.0, float("-inf")], [0.0, 0.0, -0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    )
    assert torch.equal(it.select_topk(scores, 4), iref.select_topk(scores, 4))
    assert it.select_topk(scores, 4).tolist() == [[0, 2, 3, 6], [0, 1, 2, 3]]


def test_candidate_mask_forces_the_newest_block():
    q, w, rec, n_vis = _inputs(seed=2)
    scores = iref.index_scores(q, w, qref.unpack_mxfp4(rec, torch.bfloat16), n_vis)
    assert torch.equal(it.candidate_mask(scores, n_vis, 4, 6), iref.candidate_mask(scores, n_vis, 4, 6))


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


def test_small_batch_topk_in_slices_equals_one_pass():
    """Small batches select rows of >= 2 slices in two stages (entry ids and scores of each
    slice's top-k, then the top-k of those): same ids as one pass, ties, -inf, the allowed
    mask, candidate blocks and pool rows included."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 5, (3, 150), generator=g).float()  # many exact ties
    scores[1, 40:] = float("-inf")
    scores[2, :] = float("-inf")
    allowed = torch.rand(3, 150, generator=g) > 0.3
    key_rows = torch.randperm(1000, generator=g)[: 2 * 150].reshape(2, 150)
    seq_of = torch.tensor([1, 0, 1])
    # reindex layers: 19 candidate blocks of 8 over 400 paged entries (152 scored columns)
    q, w, _, _ = _inputs(t=3, n=400, seed=6)
    pool = qref.pack_mxfp4(torch.randn(900, 32, generator=g))
    pool_rows = torch.randperm(900, generator=g)[: 2 * 400].reshape(2, 400).int()
    n_vis = torch.tensor([400, 111, 400])
    blocks = torch.stack([torch.randperm(50, generator=g)[:19].sort().values for _ in range(3)])
    blocks[1, 14:] = -1

    def run(**fields):
        t = configs.override(configs.DEFAULT, indexer=fields)
        return [
            it.select_topk(scores, 8, tuned=t),
            it.select_topk(scores, 8, allowed, tuned=t),
            it.select_topk(scores, 8, pool_rows=(key_rows, seq_of), tuned=t),
            it.index_topk_sparse_paged(q, w, pool, pool_rows, seq_of, n_vis, blocks, 8, 8, tuned=t),
            it.index_topk_sparse_paged(q, w, pool, pool_rows, seq_of, n_vis, blocks, 8, 8, as_pool_rows=True, tuned=t),
        ]

    one_pass = run(topk_split_q=0)
    sliced = configs.IndexerConfig(topk_split_q=16, topk_min_slice=32)
    assert it.topk_slice(3, 150, 8, sliced) == 32 and it.topk_slice(17, 150, 8, sliced) == 0
    assert it.topk_slice(3, 63, 8, sliced) == 0  # fewer than two slices: one pass
    assert torch.equal(one_pass[0], iref.select_topk(scores, 8))
    assert torch.equal(one_pass[1], iref.select_topk(scores, 8, allowed))
    assert (one_pass[3] >= 0).sum() == 3 * 8  # every row had >= 8 visible candidates
    for a, b in zip(run(topk_split_q=16, topk_min_slice=32), one_pass, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_small_batch_scoring_takes_fewer_tiles_per_program():
    c = configs.IndexerConfig(score_target=264)
    assert it.score_tiles(1, 8192, c) == 1  # 128 programs of one tile, not 16 of eight
    assert it.score_tiles(64, 8192, c) == 8  # 1,024 programs already
    assert it.score_tiles(8, 8192, c) == 2  # 8 x 32 = 256 < 264 at 4 tiles... halved to >= 264
    q, w, rec, n_vis = _inputs(n=700)
    want = iref.index_scores(q, w, qref.unpack_mxfp4(rec, torch.bfloat16), n_vis)
    eight = it.index_scores_packed(
        q, w, rec, n_vis, tuned=configs.override(configs.DEFAULT, indexer={"score_target": 0})
    )  # 11 tiles: 2 programs of 8 per query
    one = it.index_scores_packed(
        q, w, rec, n_vis, tuned=configs.override(configs.DEFAULT, indexer={"score_target": 1000})
    )  # 11 programs of 1 per query
    assert torch.equal(eight, one)
    torch.testing.assert_close(one, want, rtol=1e-6, atol=1e-6)
