"""The pooled drafter path (`DrafterPool`, `insert_pooled`, `draft_pooled`) against the
per-sequence reference (`insert_context`, `draft`): the same windows, tokens and q for random
weights, sequences of different lengths, windows partly filled and wrapped, positions rewritten
after rejections, sampled choosers and padded batches (tiny preset, FP32, CPU)."""

from __future__ import annotations

import pytest
import torch

from flashpd.model.dspark import DrafterError, DSparkDrafter, greedy_choose

W = 128


@pytest.fixture(scope="module")
def drafter(tiny_ckpt, tiny_model):
    return DSparkDrafter.from_checkpoint(tiny_ckpt, tiny_model)


def _taps(drafter, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3 * drafter.cfg.hidden_size, generator=g)


class Twin:
    """The same inserts into reference states (storage of their own) and into pool states."""

    def __init__(self, drafter, num_seqs: int, pool_rows: int = 6):
        self.d = drafter
        self.pool = drafter.new_pool(pool_rows)
        self.ref = [drafter.new_state() for _ in range(num_seqs)]
        self.pooled = [self.pool.acquire() for _ in range(num_seqs)]

    def insert(self, which: list[int], positions: list[list[int]], seed: int) -> None:
        taps = _taps(self.d, sum(len(p) for p in positions), seed)
        self.d.insert_context([self.ref[i] for i in which], positions, taps)
        self.d.insert_pooled(self.pool, [self.pooled[i] for i in which], positions, taps)

    def assert_same_windows(self) -> None:
        for ref, st in zip(self.ref, self.pooled, strict=True):
            assert torch.equal(st.slot_pos, ref.slot_pos) and st.end_pos == ref.end_pos
            held = ref.slot_pos >= 0  # unwritten slots hold anything
            assert torch.equal(st.kv[:, held], ref.kv[:, held])

    def draft(self, anchors: list[int], positions: list[int], choose=greedy_choose, seqs=None):
        seqs = list(range(len(self.ref))) if seqs is None else seqs
        ref = self.d.draft([self.ref[i] for i in seqs], torch.tensor(anchors), positions, choose)
        rows = torch.tensor([self.pooled[i].pool_row for i in seqs])
        pooled = self.d.draft_pooled(self.pool, rows, torch.tensor(anchors), torch.tensor(positions), choose)
        return ref, pooled


def _assert_same(ref, pooled) -> None:
    assert torch.equal(pooled.tokens, ref.tokens)
    assert torch.allclose(pooled.probs, ref.probs, atol=1e-6)
    assert torch.allclose(pooled.confidences, ref.confidences, atol=1e-6)


def test_pooled_matches_the_reference_through_prefill_decode_and_rewrites(drafter):
    """Three sequences: a long prompt (window wrapped), a short one (window partly filled), one
    that starts empty; committed rows of 1..6 per step; then positions rewritten after
    rejections (a verify row of a later step lands on a position inserted before)."""
    t = Twin(drafter, 3)
    t.insert([0, 1], [list(range(300)), list(range(40))], seed=1)  # prefill chunks
    t.assert_same_windows()
    _assert_same(*t.draft([7, 8, 9], [300, 40, 0]))
    lens = {0: 300, 1: 40, 2: 0}
    for step, accepted in enumerate([3, 0, 5, 1, 2, 4]):  # anchor + accepted rows committed
        pos = [list(range(lens[i], lens[i] + 1 + (accepted + i) % 6)) for i in range(3)]
        t.insert([0, 1, 2], pos, seed=10 + step)
        for i in range(3):
            lens[i] = pos[i][-1] + 1
        t.assert_same_windows()
        _assert_same(*t.draft([11 + step, 12, 13], [lens[0], lens[1], lens[2]]))
    # rewrites: positions already held get new rows (each sequence its last 3), the newest
    # position stays where it was
    t.insert([0, 1, 2], [list(range(lens[i] - 3, lens[i])) for i in range(3)], seed=99)
    t.assert_same_windows()
    _assert_same(*t.draft([5, 6, 7], [lens[0], lens[1], lens[2]]))
    _assert_same(*t.draft([5, 6], [lens[0] - 2, lens[1] - 1], seqs=[0, 1]))  # an earlier anchor


def test_one_call_keeps_what_sequential_writes_keep(drafter):
    """Within one call: per entry its last W positions; two positions on one slot (a gap of W)
    and the same sequence twice: the later write wins, as in the reference's loop."""
    t = Twin(drafter, 3)
    gapped = [1] + list(range(2 * W, 4 * W, 2))  # W+1 positions; the last W miss slot 1
    t.insert([0, 0, 1, 2], [[5, 133], [134, 135], list(range(10, 10 + 2 * W + 3)), gapped], seed=3)
    t.assert_same_windows()
    assert int(t.pooled[0].slot_pos[5]) == 133 and t.pooled[0].end_pos == 136
    assert int(t.pooled[2].slot_pos[1]) == -1  # position 1 is not among the entry's last W
    _assert_same(*t.draft([1, 2, 3], [136, 10 + 2 * W + 3, 4 * W - 1]))


def test_sampled_chooser_sees_the_same_logits(drafter):
    """A sampling chooser (the engine's: a draw per row, its q returned) gets the same logits in
    the same order on both paths, so with one seed both draft the same tokens and q."""
    t = Twin(drafter, 2)
    t.insert([0, 1], [list(range(60)), list(range(9))], seed=4)

    def sampler():
        gen = torch.Generator().manual_seed(0)

        def choose(logits, slot):
            probs = torch.softmax(logits / 0.8, dim=-1)
            return torch.multinomial(probs, 1, generator=gen)[:, 0], probs

        return choose

    ref = drafter.draft(t.ref, torch.tensor([3, 4]), [60, 9], sampler())
    rows = torch.tensor([st.pool_row for st in t.pooled])
    pooled = drafter.draft_pooled(t.pool, rows, torch.tensor([3, 4]), torch.tensor([60, 9]), sampler())
    _assert_same(ref, pooled)
    assert not torch.equal(ref.probs.amax(-1), torch.ones_like(ref.probs.amax(-1)))  # not point masses


def test_padding_with_the_pad_row_changes_no_real_row(drafter):
    """A batch padded to a graph bucket (pad row, noise anchor, position 0): the real rows'
    drafts are those of the unpadded batch; the pad row holds nothing."""
    t = Twin(drafter, 3)
    t.insert([0, 1, 2], [list(range(150)), list(range(20)), [0]], seed=5)
    pool = t.pool
    rows = [st.pool_row for st in t.pooled]
    anchors, positions = [4, 5, 6], [150, 20, 1]
    plain = drafter.draft_pooled(pool, torch.tensor(rows), torch.tensor(anchors), torch.tensor(positions))
    noise = drafter.ds.noise_token_id
    padded = drafter.draft_pooled(
        pool, torch.tensor(rows + [pool.pad_row]), torch.tensor(anchors + [noise]), torch.tensor(positions + [0])
    )
    assert torch.equal(padded.tokens[:3], plain.tokens)
    assert torch.allclose(padded.confidences[:3], plain.confidences, atol=1e-6)
    assert bool((pool.slot_pos[pool.pad_row] == -1).all())


def test_pool_rows_are_handed_out_once_and_reset(drafter):
    pool = drafter.new_pool(2)
    a, b = pool.acquire(), pool.acquire()
    assert {a.pool_row, b.pool_row} == {0, 1} and pool.num_free == 0
    with pytest.raises(DrafterError, match="pool full"):
        pool.acquire()
    drafter.insert_pooled(pool, [a], [list(range(10))], _taps(drafter, 10, seed=6))
    row = a.pool_row
    pool.release(a)
    with pytest.raises(DrafterError, match="not held"):
        pool.release(a)
    c = pool.acquire()  # the row again, empty
    assert c.pool_row == row and c.end_pos == 0 and bool((c.slot_pos == -1).all())
    with pytest.raises(DrafterError, match="states of the pool"):
        drafter.insert_pooled(pool, [drafter.new_state()], [[0]], _taps(drafter, 1, seed=7))
    drafter.insert_pooled(pool, [b], [list(range(300))], _taps(drafter, 300, seed=8))
    with pytest.raises(DrafterError, match="behind"):  # the reference's checks, on host ints
        drafter.insert_pooled(pool, [b], [[100]], _taps(drafter, 1, seed=8))


def test_host_checks_of_a_pooled_draft(drafter):
    drafter.check_host_draft(2, [1, 2], [5, 6])
    with pytest.raises(DrafterError, match="anchor id"):
        drafter.check_host_draft(1, [drafter.cfg.vocab_size], [5])
    with pytest.raises(DrafterError, match="anchor_positions must"):
        drafter.check_host_draft(1, [1], [-1])
    with pytest.raises(DrafterError, match="for 2 states"):
        drafter.check_host_draft(2, [1], [5])
