"""Indexer over a paged key pool: key_rows, batched scores and sparse top-k (kernels/indexer).

Every batched result is compared with the per-sequence path it replaces: gather the sequence's
records, then index_scores_packed / select_topk / index_topk_sparse on them alone.
"""

from __future__ import annotations

import pytest
import torch

from flashpd.kernels import configs
from flashpd.kernels.indexer import ref as iref
from flashpd.kernels.indexer import triton as it
from flashpd.kernels.quant import ref as qref

NEG = float("-inf")
EPB = 4  # entries per pool block
NUM_ENTRIES = [13, 0, 22]  # B = 3 sequences, one empty
WIDTH = 24  # N: key_rows columns (>= every sequence's entries)


def _batch(seed: int = 0, heads: int = 4, head_dim: int = 32):
    """A pool with shuffled block tables and spare garbage blocks; 7 queries over 3 sequences."""
    g = torch.Generator().manual_seed(seed)
    num_pool_blocks = 12
    pool = qref.pack_mxfp4(torch.randn(num_pool_blocks * EPB, head_dim, generator=g))
    perm = torch.randperm(num_pool_blocks, generator=g).tolist()
    tables = [perm[0:4], [], perm[4:10]]  # 4 + 0 + 6 blocks: 2 stay unused
    key_rows = iref.paged_key_rows(tables, EPB, NUM_ENTRIES, WIDTH, "cpu")
    seq_of = torch.tensor([2, 0, 1, 2, 0, 2, 2], dtype=torch.int32)
    n_visible = torch.tensor([22, 13, 0, 9, 1, 17, 0], dtype=torch.int32)
    num_q = seq_of.shape[0]
    q = qref.fake_quant_mxfp4(torch.randn(num_q, heads, head_dim, generator=g)).bfloat16()
    w = torch.randn(num_q, heads, generator=g)
    return q, w, pool, key_rows, seq_of, n_visible


def _per_sequence(seq_of: torch.Tensor, key_rows: torch.Tensor, pool: torch.Tensor):
    """(sequence b, its query ids, its gathered records [num_entries[b], rec]) per sequence."""
    for b, count in enumerate(NUM_ENTRIES):
        queries = (seq_of == b).nonzero().flatten()
        yield b, queries, pool[key_rows[b, :count].long()]


def test_paged_key_rows_follow_the_block_tables():
    rows = iref.paged_key_rows([[5, 2], [], [0]], 3, [5, 0, 2], 6, "cpu")
    assert rows.dtype == torch.int32
    assert rows.tolist() == [[15, 16, 17, 6, 7, -1], [-1] * 6, [0, 1, -1, -1, -1, -1]]
    assert it.paged_key_rows is iref.paged_key_rows


@pytest.mark.parametrize(
    "tables, num_entries, width, field",
    [
        ([[0]], [5], 8, "block_tables[0]"),  # 1 block of 3 cannot hold 5 entries
        ([[0, 1]], [5], 4, "num_entries[0]"),  # wider than width
        ([[0]], [1, 1], 4, "num_entries"),
    ],
)
def test_paged_key_rows_refuse_inconsistent_tables(tables, num_entries, width, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[")):
        iref.paged_key_rows(tables, 3, num_entries, width, "cpu")


def test_paged_scores_equal_per_sequence_packed_scores_bit_for_bit():
    q, w, pool, key_rows, seq_of, n_vis = _batch()
    scores = it.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis)
    assert scores.shape == (q.shape[0], WIDTH) and scores.dtype == torch.float32
    for b, queries, records in _per_sequence(seq_of, key_rows, pool):
        want = it.index_scores_packed(q[queries], w[queries], records, n_vis[queries])
        count = NUM_ENTRIES[b]
        assert torch.equal(scores[queries, :count], want)
        assert (scores[queries, count:] == NEG).all()  # rows of -1 never score


def test_reference_paged_scores_match_the_kernel():
    q, w, pool, key_rows, seq_of, n_vis = _batch(seed=1)
    want = iref.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis)
    got = it.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis)
    assert torch.isfinite(want).sum() == sum(
        min(int(n), NUM_ENTRIES[int(b)]) for b, n in zip(seq_of, n_vis, strict=True)
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_rows_outside_the_pool_and_unknown_sequences_score_minus_inf():
    q, w, pool, key_rows, seq_of, n_vis = _batch(seed=2)
    key_rows = key_rows.clone()
    key_rows[2, 3] = pool.shape[0]  # one past the pool
    seq_of = seq_of.clone()
    seq_of[1] = 3  # no such sequence (B = 3)
    for impl in (iref, it):
        scores = impl.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis)
        assert (scores[seq_of == 2, 3] == NEG).all() and (scores[1] == NEG).all()
        assert torch.isfinite(scores[0, :3]).all()


def test_topk_over_paged_scores_equals_per_sequence_selection():
    q, w, pool, key_rows, seq_of, n_vis = _batch(seed=3)
    scores = it.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis)
    k = 8
    picked = it.select_topk(scores, k)
    assert torch.equal(picked, iref.select_topk(scores, k))
    for _, queries, records in _per_sequence(seq_of, key_rows, pool):
        alone = it.index_scores_packed(q[queries], w[queries], records, n_vis[queries])
        assert torch.equal(picked[queries], it.select_topk(alone, k))


@pytest.mark.parametrize("num_blocks", [2, 6])  # 2 x 4 < N: sparse path; 6 x 4 >= N: all blocks
def test_sparse_paged_topk_equals_per_sequence_sparse_topk(num_blocks):
    q, w, pool, key_rows, seq_of, n_vis = _batch(seed=4)
    bs, k = 4, 5
    scores = it.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis)
    blocks = it.candidate_blocks(scores, n_vis, bs, num_blocks)  # [T, <= num_blocks]
    got = it.index_topk_sparse_paged(q, w, pool, key_rows, seq_of, n_vis, blocks, bs, k)
    assert got.shape == (q.shape[0], k)
    assert torch.equal(got, iref.index_topk_sparse_paged(q, w, pool, key_rows, seq_of, n_vis, blocks, bs, k))
    for _, queries, records in _per_sequence(seq_of, key_rows, pool):
        alone = it.index_scores_packed(q[queries], w[queries], records, n_vis[queries])
        seq_blocks = it.candidate_blocks(alone, n_vis[queries], bs, num_blocks)
        want = it.index_topk_sparse(q[queries], w[queries], records, n_vis[queries], seq_blocks, bs, k)
        assert torch.equal(got[queries], want)


def test_sparse_paged_topk_keeps_to_the_candidate_blocks():
    q, w, pool, key_rows, seq_of, n_vis = _batch(seed=5)
    blocks = torch.full((q.shape[0], 2), -1, dtype=torch.int64)
    blocks[:, 0] = 1  # entries 4..7 only
    got = it.index_topk_sparse_paged(q, w, pool, key_rows, seq_of, n_vis, blocks, 4, 6)
    live = got[got >= 0]
    assert live.numel() and ((live >= 4) & (live < 8)).all()
    assert torch.equal(got, iref.index_topk_sparse_paged(q, w, pool, key_rows, seq_of, n_vis, blocks, 4, 6))


@pytest.mark.parametrize("num_blocks", [2, 6])
def test_topk_as_pool_rows_equals_the_gather_of_the_ids(num_blocks):
    """The forward's top-k: pool rows straight from the top-k kernel (int32, -1 padded) equal
    key_rows[seq_of[t], id] of the ids; the head-weight scale folded into the scoring kernel
    equals scaling the weights first, bit for bit."""
    q, w, pool, key_rows, seq_of, n_vis = _batch(seed=7)
    wb = w.bfloat16()
    bs, k, scale = 4, 5, 1.0 / 64
    scores = it.index_scores_paged(q, wb, pool, key_rows, seq_of, n_vis, weight_scale=scale)
    assert torch.equal(scores, it.index_scores_paged(q, wb.float() * scale, pool, key_rows, seq_of, n_vis))
    torch.testing.assert_close(
        iref.index_scores_paged(q, wb, pool, key_rows, seq_of, n_vis, weight_scale=scale), scores, rtol=1e-6, atol=1e-6
    )
    ids = it.select_topk(scores, k)
    want = torch.full_like(ids, -1, dtype=torch.int32)
    for t in range(ids.shape[0]):
        for j in range(k):
            if ids[t, j] >= 0:
                want[t, j] = key_rows[seq_of[t], ids[t, j]]
    for impl in (it, iref):
        rows = impl.select_topk(scores, k, pool_rows=(key_rows, seq_of))
        assert rows.dtype == torch.int32 and torch.equal(rows, want)
    blocks = it.candidate_blocks(scores, n_vis, bs, num_blocks)
    for impl in (it, iref):
        ids = impl.index_topk_sparse_paged(q, wb, pool, key_rows, seq_of, n_vis, blocks, bs, k, weight_scale=scale)
        rows = impl.index_topk_sparse_paged(
            q, wb, pool, key_rows, seq_of, n_vis, blocks, bs, k, weight_scale=scale, as_pool_rows=True
        )
        assert rows.dtype == torch.int32
        assert torch.equal(rows, iref.to_pool_rows(ids, key_rows, seq_of))


def test_paged_ops_never_read_tensor_values_on_the_host(monkeypatch):
    """CUDA-graph safety: no .item()/.tolist()/bool()/nonzero while scoring and selecting."""
    q, w, pool, key_rows, seq_of, n_vis = _batch(seed=6)
    blocks = it.candidate_blocks(it.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis), n_vis, 4, 2)

    def refuse(*args, **kwargs):
        raise AssertionError("host read of a tensor value")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "nonzero", refuse)
    it.index_topk_sparse_paged(q, w, pool, key_rows, seq_of, n_vis, blocks, 4, 5)
    it.index_topk_sparse_paged(q, w, pool, key_rows, seq_of, n_vis, blocks, 8, 5)  # all blocks
    it.index_topk_sparse_paged(q, w, pool, key_rows, seq_of, n_vis, blocks, 4, 5, weight_scale=0.5, as_pool_rows=True)
    it.select_topk(it.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis), 5, pool_rows=(key_rows, seq_of))


def _bad(name: str):
    q, w, pool, key_rows, seq_of, n_vis = _batch()
    args = dict(q=q, head_weights=w, key_pool=pool, key_rows=key_rows, seq_of=seq_of, n_visible=n_vis)
    args[name] = {
        "q": q.to(torch.float16),
        "head_weights": w[:, :2],
        "key_pool": pool[:, :-1],
        "key_rows": key_rows.float(),
        "seq_of": seq_of[:-1],
        "n_visible": n_vis[:, None],
    }[name]
    return args


@pytest.mark.parametrize("impl", [iref, it], ids=["ref", "triton"])
@pytest.mark.parametrize("name", ["q", "head_weights", "key_pool", "key_rows", "seq_of", "n_visible"])
def test_bad_shapes_and_dtypes_raise_naming_the_argument(impl, name):
    with pytest.raises(ValueError, match=f"^{name} "):
        impl.index_scores_paged(**_bad(name))


@pytest.mark.parametrize("impl", [iref, it], ids=["ref", "triton"])
def test_bad_candidate_blocks_raise_naming_the_argument(impl):
    q, w, pool, key_rows, seq_of, n_vis = _batch()
    with pytest.raises(ValueError, match="^blocks "):
        impl.index_topk_sparse_paged(q, w, pool, key_rows, seq_of, n_vis, torch.zeros(2, 3, dtype=torch.int64), 4, 5)
    with pytest.raises(ValueError, match="^block_size "):
        impl.index_topk_sparse_paged(
            q, w, pool, key_rows, seq_of, n_vis, torch.zeros(q.shape[0], 3, dtype=torch.int64), 0, 5
        )


def _widen(key_rows: torch.Tensor, width: int) -> torch.Tensor:
    """key_rows padded with -1 columns to `width` (a key table sized to a larger context class)."""
    wide = torch.full((key_rows.shape[0], width), -1, dtype=key_rows.dtype)
    wide[:, : key_rows.shape[1]] = key_rows
    return wide


@pytest.mark.parametrize("split_q", [0, 16])  # one pass, and two stages over slices of 32
def test_a_wide_padded_key_table_selects_what_the_tight_one_does(split_q):
    """Padding a key table to a wider class changes no score of a real entry nor any
    selection: the scoring kernel skips tiles past a row's visible count (-inf, nothing read)
    and the top-k with n_visible stops scanning there, in one pass and in two stages."""
    q, w, pool, key_rows, seq_of, n_vis = _batch(seed=8)
    wide_rows = _widen(key_rows, 8 * WIDTH + 5)  # tiles and slices wholly past every count
    tuned = configs.override(configs.DEFAULT, indexer={"topk_split_q": split_q, "topk_min_slice": 32})
    tight = it.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis)
    wide = it.index_scores_paged(q, w, pool, wide_rows, seq_of, n_vis)
    assert torch.equal(wide[:, :WIDTH], tight) and (wide[:, WIDTH:] == NEG).all()
    k = 6
    want = it.select_topk(tight, k, pool_rows=(key_rows, seq_of), tuned=tuned)
    got = it.select_topk(wide, k, pool_rows=(wide_rows, seq_of), n_visible=n_vis, tuned=tuned)
    assert torch.equal(got, want) and torch.equal(got, iref.select_topk(tight, k, pool_rows=(key_rows, seq_of)))
    assert torch.equal(iref.select_topk(wide, k, pool_rows=(wide_rows, seq_of), n_visible=n_vis), want)
    blocks = torch.full((q.shape[0], 64), -1, dtype=torch.int64)  # every block: the all-entries path
    tight_sparse = it.index_topk_sparse_paged(q, w, pool, key_rows, seq_of, n_vis, blocks, 4, k, tuned=tuned)
    wide_sparse = it.index_topk_sparse_paged(q, w, pool, wide_rows, seq_of, n_vis, blocks, 4, k, tuned=tuned)
    assert torch.equal(wide_sparse, tight_sparse)


def test_topk_with_n_visible_reads_nothing_past_the_count():
    """Columns from n_visible[t] on are not read: finite garbage there changes nothing."""
    g = torch.Generator().manual_seed(9)
    scores = torch.randint(0, 5, (3, 300), generator=g).float()
    n_vis = torch.tensor([300, 37, 0], dtype=torch.int32)
    clean = scores.clone()
    clean[1, 37:] = NEG
    clean[2] = NEG
    for split_q in (0, 16):
        tuned = configs.override(configs.DEFAULT, indexer={"topk_split_q": split_q, "topk_min_slice": 32})
        got = it.select_topk(scores, 8, n_visible=n_vis, tuned=tuned)
        assert torch.equal(got, it.select_topk(clean, 8, tuned=tuned))
        assert torch.equal(got, iref.select_topk(scores, 8, n_visible=n_vis))


def test_reference_paged_scores_do_not_depend_on_the_query_chunk(monkeypatch):
    """The reference scores queries in chunks bounded in memory (a GPU model may run it at long
    contexts); a chunk of one query gives the same scores, bit for bit, as one chunk of all."""
    q, w, pool, key_rows, seq_of, n_vis = _batch(seed=7)
    whole = iref.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis, weight_scale=0.5)
    monkeypatch.setattr(iref, "_CHUNK_ELEMENTS", 1)
    assert torch.equal(iref.index_scores_paged(q, w, pool, key_rows, seq_of, n_vis, weight_scale=0.5), whole)
