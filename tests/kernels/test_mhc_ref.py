"""mHC: Sinkhorn order and doubly-stochastic output, collapse and expand (§2.2-§2.3)."""

from __future__ import annotations

import torch

from flashpd.kernels.mhc import ref


def test_sinkhorn_is_doubly_stochastic():
    logits = torch.randn(6, 4, 4, generator=torch.Generator().manual_seed(0))
    c = ref.sinkhorn(logits, iters=20, eps=1e-6)
    torch.testing.assert_close(c.sum(-2), torch.ones(6, 4), atol=1e-5, rtol=0)  # columns exact
    torch.testing.assert_close(c.sum(-1), torch.ones(6, 4), atol=1e-3, rtol=0)
    assert (c > 0).all()


def test_sinkhorn_follows_the_spec_order():
    logits = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1))
    eps = 1e-6
    c = torch.softmax(logits, -1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(2):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    torch.testing.assert_close(ref.sinkhorn(logits, iters=3, eps=eps), c)


def test_mixes_shapes_and_ranges():
    g = torch.Generator().manual_seed(2)
    streams = torch.randn(3, 4, 8, generator=g)
    fn, base = torch.randn(24, 32, generator=g) * 0.1, torch.randn(24, generator=g)
    pre, post, comb = ref.hc_mixes(streams, fn, base, torch.ones(3), 20, 1e-6, 1e-20)
    assert pre.shape == post.shape == (3, 4) and comb.shape == (3, 4, 4)
    assert ((pre > 1e-6) & (pre < 1 + 1e-6)).all() and ((post > 0) & (post < 2)).all()
    z = streams.reshape(3, -1)
    m = (z @ fn.T) / torch.sqrt(z.square().mean(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(pre, torch.sigmoid(m[:, :4] + base[:4]) + 1e-6)


def test_collapse_one_hot_is_exact_and_expand_maps_source_to_destination():
    streams = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(3))
    one_hot = torch.tensor([[1.0, 0, 0, 0]] * 2)
    assert torch.equal(ref.collapse(streams, one_hot), streams[:, 0])
    comb = torch.zeros(2, 4, 4)
    comb[:, 1, 3] = 1.0  # source stream 1 -> destination stream 3
    y = torch.ones(2, 8)
    out = ref.expand(y, streams, torch.full((2, 4), 0.5), comb)
    torch.testing.assert_close(out[:, 3], 0.5 + streams[:, 1])
    torch.testing.assert_close(out[:, 0], torch.full((2, 8), 0.5))
