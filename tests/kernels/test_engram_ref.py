"""Engram gate: per-token, per-stream statistics, signed sqrt, value shared by streams (§8.5)."""

from __future__ import annotations

import math

import torch

from flashpd.kernels.engram import ref


def test_gate_formula_per_stream():
    g = torch.Generator().manual_seed(0)
    streams, keys = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g)
    qk = torch.randn(3, 16, generator=g)
    gates = ref.engram_gates(streams, keys, qk, 1e-20)
    for t in range(2):
        for k in range(3):
            h, key = streams[t, k], keys[t, k]
            rho = 1 / math.sqrt(float(h.square().mean())) / math.sqrt(float(key.square().mean()))
            dot = rho * float((h * qk[k] * key).sum()) / math.sqrt(16)
            want = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)))
            assert abs(float(gates[t, k]) - want) < 1e-6


def test_zero_dot_takes_the_positive_sign():
    streams = torch.ones(1, 1, 4)
    gates = ref.engram_gates(streams, torch.ones(1, 1, 4), torch.zeros(1, 4), 1e-20)
    want = 1 / (1 + math.exp(-math.sqrt(1e-6)))
    assert abs(float(gates[0, 0]) - want) < 1e-7


def test_inject_adds_gated_shared_value():
    g = torch.Generator().manual_seed(1)
    s, d, width = 2, 8, 12
    streams, rows = torch.randn(3, s, d, generator=g), torch.randn(3, width, generator=g)
    wkv = torch.randn((s + 1) * d, width, generator=g)
    qk = torch.randn(s, d, generator=g)
    out = ref.engram_inject(streams, rows, wkv, qk, 1e-20)
    kv = rows @ wkv.T
    gates = ref.engram_gates(streams, kv[:, : s * d].reshape(3, s, d), qk, 1e-20)
    torch.testing.assert_close(out, streams + gates[..., None] * kv[:, None, s * d :])
