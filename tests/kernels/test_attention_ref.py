"""Sparse attention: one softmax over window ∪ compressed slots, denominator-only sink (§3.5)."""

from __future__ import annotations

import math

import torch

from flashpd.kernels.attention import ref


def _brute(q, keys, valid, sink, scale):
    out = torch.zeros_like(q)
    for t in range(q.shape[0]):
        k = keys[t][valid[t]]  # [n, d]
        for h in range(q.shape[1]):
            s = (k @ q[t, h]) * scale
            m = max(float(sink[h]), float(s.max())) if len(s) else float(sink[h])
            e = torch.exp(s - m)
            p = e / (math.exp(float(sink[h]) - m) + e.sum())
            out[t, h] = p @ k if len(s) else 0
    return out


def test_sparse_attention_matches_the_formula():
    g = torch.Generator().manual_seed(0)
    q, keys = torch.randn(3, 2, 8, generator=g), torch.randn(3, 6, 8, generator=g)
    valid = torch.rand(3, 6, generator=g) > 0.3
    valid[0] = False  # a query with no key outputs 0
    sink = torch.tensor([0.5, -1.0])
    out = ref.sparse_attention(q, keys, valid, sink, 8**-0.5)
    torch.testing.assert_close(out, _brute(q, keys, valid, sink, 8**-0.5))
    assert torch.equal(out[0], torch.zeros(2, 8))


def test_sink_only_lowers_the_weights():
    q = torch.zeros(1, 1, 4)
    keys = torch.eye(4)[None]  # four keys with equal scores 0
    valid = torch.ones(1, 4, dtype=torch.bool)
    out = ref.sparse_attention(q, keys, valid, torch.tensor([0.0]), 1.0)
    torch.testing.assert_close(out[0, 0], torch.full((4,), 1 / 5))  # sink takes exp(0) of 5


def test_window_slots_are_aligned_to_the_query():
    kv = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 2)  # positions 20..29
    keys, valid = ref.window_keys(kv, 20, torch.tensor([22, 29]), window=4)
    assert valid.tolist() == [[False, True, True, True], [True, True, True, True]]
    assert keys[0, 1:, 0].tolist() == [0, 1, 2]  # positions 20, 21, 22
    assert keys[1, :, 0].tolist() == [6, 7, 8, 9]  # positions 26..29


def test_compressed_slots_skip_invalid_picks():
    entries = torch.arange(5, dtype=torch.float32)[:, None]
    keys, valid = ref.compressed_keys(entries, torch.tensor([[0, 3, -1]]))
    assert valid.tolist() == [[True, True, False]]
    assert keys[0, :2, 0].tolist() == [0, 3]
    _, none_valid = ref.compressed_keys(torch.zeros(0, 1), torch.tensor([[-1, -1]]))
    assert not none_valid.any()
