"""The DSpark drafter's graph path (engine/gpu/draft_graph.py) and the pooled adapter on the CPU:
the bucket's padded static program (what a CUDA graph replays) drafts the tokens of the eager
pooled drafter and of the per-sequence reference; a capture that fails or a bucket missing after
freeze runs eagerly, counted; sampled batches draft eagerly with the engine's chooser."""

from __future__ import annotations

import pytest
import torch

from flashpd.engine.gpu.draft_graph import DraftGraphs
from flashpd.engine.speculative import DSparkDrafterAdapter, SpeculativeConfig, build_drafter
from flashpd.model.checkpoint import load_checkpoint
from flashpd.model.dspark import DSparkDrafter, greedy_choose


@pytest.fixture(scope="module")
def drafter(ckpt_dir, model_f32):
    return DSparkDrafter.from_checkpoint(load_checkpoint(ckpt_dir), model_f32)


def _taps(drafter, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3 * drafter.cfg.hidden_size, generator=torch.Generator().manual_seed(seed))


def _adapter(drafter, graphs: str, lengths: list[int]) -> tuple[DSparkDrafterAdapter, list]:
    """An adapter with one state per length, its prompt rows observed."""
    ad = DSparkDrafterAdapter(drafter, max_seqs=8, graphs=graphs)
    states = [ad.new_state([]) for _ in lengths]
    ad.observe(states, [list(range(n)) for n in lengths], _taps(drafter, sum(lengths), seed=1))
    return ad, states


@pytest.mark.parametrize("lengths", [[40], [300, 7, 129], [5, 60, 200, 1, 130]])
def test_static_bucket_drafts_what_eager_and_the_reference_draft(drafter, lengths):
    """Batches of 1, 3 (bucket 4) and 5 (bucket 8) sequences: windows partly filled and wrapped."""
    anchors, positions = [11 + i for i in range(len(lengths))], list(lengths)
    graph, states = _adapter(drafter, "static", lengths)
    eager, _ = _adapter(drafter, "off", lengths)
    got = graph.propose(states, anchors, positions, None)
    want = eager.propose(states, anchors, positions, None)
    assert got.tokens == want.tokens and got.probs is None and want.probs is None
    assert graph.counters()["graph"] == 1 and eager.counters()["eager_fallback"] == 1
    ref_states = [drafter.new_state() for _ in lengths]
    drafter.insert_context(ref_states, [list(range(n)) for n in lengths], _taps(drafter, sum(lengths), seed=1))
    ref = drafter.draft(ref_states, torch.tensor(anchors), positions, greedy_choose)
    assert got.tokens == ref.tokens.tolist()


def test_graph_replays_read_the_pool_as_it_is_now(drafter):
    """A bucket's program is built once and replayed over later windows (no stale inputs)."""
    ad, states = _adapter(drafter, "static", [50, 20])
    ad.propose(states, [3, 4], [50, 20], None)
    ad.observe(states, [[50, 51], [20]], _taps(drafter, 3, seed=2))
    got = ad.propose(states, [5, 6], [52, 21], None)
    ref = drafter.draft_pooled(
        ad.pool, torch.tensor([st.pool_row for st in states]), *map(torch.tensor, ([5, 6], [52, 21]))
    )
    assert got.tokens == ref.tokens.tolist()
    assert ad.graphs.counters()["graph_replays"] == 2 and len(ad.graphs._graphs) == 1


def test_a_failed_capture_falls_back_to_eager_and_is_counted(drafter, monkeypatch, caplog):
    ad, states = _adapter(drafter, "static", [30])

    def broken(inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(ad.graphs, "_program", broken)
    out = ad.propose(states, [9], [30], None)
    want = drafter.draft_pooled(ad.pool, torch.tensor([states[0].pool_row]), torch.tensor([9]), torch.tensor([30]))
    assert out.tokens == want.tokens.tolist()
    c = ad.counters()
    assert c["graph_failures"] == 1 and c["graph_failed"] and c["eager_fallback"] == 1 and c["graph"] == 0
    assert "capture failed" in caplog.text
    ad.propose(states, [9], [30], None)  # no second attempt: eager from now on
    assert ad.counters()["graph_failures"] == 1 and ad.counters()["eager_fallback"] == 2


def test_warm_up_builds_each_bucket_then_freezes(drafter):
    ad, states = _adapter(drafter, "static", [10, 10, 10])
    assert ad.warm_up(2) == 2 + 5  # drafts of 1, 2 sequences; inserts of 1 .. 16 rows (2 x 6 = 12)
    ad.propose(states[:2], [1, 2], [10, 10], None)
    ad.propose(states, [1, 2, 3], [10, 10, 10], None)  # bucket 4: missing after freeze
    c = ad.counters()
    assert c["graph"] == 1 and c["graph_misses"] == 1 and c["eager_fallback"] == 1


def test_sampled_batches_draft_eagerly_with_the_engine_chooser(drafter):
    ad, states = _adapter(drafter, "static", [25, 40])
    calls = []

    def choose(logits, slot):
        calls.append(slot)
        probs = torch.softmax(logits, dim=-1)
        return probs.argmax(-1), probs

    out = ad.propose(states, [3, 4], [25, 40], choose)
    assert calls == list(range(drafter.k)) and out.probs.shape == (2, drafter.k, drafter.cfg.vocab_size)
    assert ad.counters()["eager_sampled"] == 1 and ad.counters()["graph"] == 0


def test_rows_go_back_to_the_pool(drafter):
    ad = build_drafter(SpeculativeConfig(method="dspark", draft_graphs="static"), drafter, max_seqs=2)
    a, b = ad.new_state([]), ad.new_state([])
    ad.release(a)
    c = ad.new_state([])
    assert c.pool_row == 0 and ad.pool.num_free == 0 and b.pool_row == 1
    with pytest.raises(ValueError, match="draft_graphs"):
        SpeculativeConfig(method="dspark", draft_graphs="sometimes")


def test_draft_graphs_buckets_end_at_the_pool(drafter):
    g = DraftGraphs(drafter, drafter.new_pool(6), capture=False)
    assert g.buckets == (1, 2, 4, 6) and g.bucket(3) == 4 and g.bucket(5) == 6 and g.bucket(7) is None
    assert g.warm(3) == 3 + 6  # drafts of 1, 2, 4; inserts of 1 .. 32 rows (3 x 6 = 18)
    assert DraftGraphs(drafter, drafter.new_pool(8), capture=False).buckets == (1, 2, 4, 8)


def test_static_inserts_write_what_eager_inserts_write(drafter):
    """Decode-sized inserts (1 .. 6 rows per sequence, 2 sequences: row buckets 2 .. 16) through
    the row buckets' static programs leave the windows eager inserts leave; a prompt's 300 rows
    (more than a row bucket) go eagerly; padding rows touch only the sink row."""
    graph, gs = _adapter(drafter, "static", [300, 7])
    eager, es = _adapter(drafter, "off", [300, 7])
    lens = [300, 7]
    for step, extra in enumerate([0, 3, 5, 1]):
        pos = [list(range(lens[i], lens[i] + 1 + (extra + i) % 6)) for i in range(2)]
        taps = _taps(drafter, sum(len(p) for p in pos), seed=20 + step)
        graph.observe(gs, pos, taps)
        eager.observe(es, pos, taps)
        lens = [p[-1] + 1 for p in pos]
    for a, b in zip(gs, es, strict=True):
        assert torch.equal(a.slot_pos, b.slot_pos) and a.end_pos == b.end_pos
        held = b.slot_pos >= 0
        assert torch.equal(a.kv[:, held], b.kv[:, held])
    assert graph.counters()["observe_graph"] == 4 and graph.counters()["observes"] == 5  # + the prompt
    assert graph.counters()["write_graph_replays"] == 4 and eager.counters()["observe_graph"] == 0
    pad = graph.pool.pad_row
    assert bool((graph.pool.slot_pos[pad] == -1).all()) and not graph.pool.kv[pad].any()
    got = graph.propose(gs, [3, 4], lens, None)
    assert got.tokens == eager.propose(es, [3, 4], lens, None).tokens


def test_warm_up_builds_the_insert_row_buckets(drafter):
    ad = DSparkDrafterAdapter(drafter, max_seqs=4, graphs="static")
    assert ad.warm_up(2) == 2 + 5  # drafts of 1, 2 sequences; inserts up to 2 x (k+1) = 12 rows
    assert sorted(k[1] for k in ad.graphs._writes) == [1, 2, 4, 8, 16]
    assert ad.warm_up(2) == 0  # built once; frozen
