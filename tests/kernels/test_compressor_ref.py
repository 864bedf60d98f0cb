"""Ratio-2 gated pooling in FP32 with an open-group row carried across calls (§4.1, §4.5)."""

from __future__ import annotations

import torch

from flashpd.kernels.compressor import ref


def test_pooling_is_a_per_channel_softmax_over_the_pair():
    g = torch.Generator().manual_seed(0)
    a, gate = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    pooled, left = ref.pool_pairs(a, gate, None)
    assert left is None and pooled.shape == (2, 8)
    w = torch.softmax(gate.reshape(2, 2, 8), dim=1)
    torch.testing.assert_close(pooled, (w * a.reshape(2, 2, 8)).sum(1))


def test_open_row_carries_across_calls_exactly():
    g = torch.Generator().manual_seed(1)
    a, gate = torch.randn(7, 8, generator=g), torch.randn(7, 8, generator=g)
    whole, left = ref.pool_pairs(a, gate, None)
    assert torch.equal(left.kv, a[6]) and torch.equal(left.gate, gate[6])
    first, carry = ref.pool_pairs(a[:3], gate[:3], None)
    second, left2 = ref.pool_pairs(a[3:], gate[3:], carry)
    assert torch.equal(torch.cat((first, second)), whole)
    assert torch.equal(left2.kv, left.kv)


def test_gated_projection_is_fp32_and_latent_rounds_before_the_norm():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    wkv = torch.randn(8, 16, generator=g).to(torch.bfloat16)
    a, gate = ref.gated_projection(x, wkv, wkv)
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, x.float() @ wkv.float().T)
    lat = ref.latent(a, torch.ones(8, dtype=torch.bfloat16), 1e-20, torch.bfloat16)
    p = a.to(torch.bfloat16).float()
    assert torch.equal(lat, (p * torch.rsqrt(p.square().mean(-1, keepdim=True) + 1e-20)).to(torch.bfloat16))
