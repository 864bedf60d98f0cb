"""Engram host-table lookups and the fused gate (kernels/engram/triton.py)."""

from __future__ import annotations

import torch

from flashpd.kernels.engram import ref as eref
from flashpd.kernels.engram import triton as et
from flashpd.kernels.quant import ref as qref


def _table(rows: int = 50, dim: int = 64, seed: int = 0):
    w, s = qref.quantize_fp8_rows(torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)))
    return w, s, et.HostTable.from_quantized(w, s)


def test_gather_dequantises_the_hashed_rows_exactly():
    w, s, table = _table()
    ids = torch.randint(0, 50, (3, 5), generator=torch.Generator().manual_seed(1))
    want = qref.dequantize_fp8_rows(w[ids.reshape(-1)], s[ids.reshape(-1)]).reshape(3, -1)
    assert torch.equal(et.gather_rows(table, ids), want)


def test_prefetch_returns_the_same_rows_and_refuses_a_second_prefetch():
    _, _, table = _table(seed=2)
    ids = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(3))
    pf = et.EngramPrefetcher(table)
    pf.prefetch(ids)
    try:
        pf.prefetch(ids)
        raise AssertionError("a second prefetch in flight must raise")
    except RuntimeError:
        pass
    assert torch.equal(pf.wait(), et.gather_rows(table, ids))


def test_inject_matches_reference():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 64, generator=g).bfloat16()
    rows = torch.randn(3, 96, generator=g).bfloat16()
    wkv = (torch.randn(5 * 64, 96, generator=g) * 0.1).bfloat16()
    qk = torch.randn(4, 64, generator=g)
    got = et.engram_inject(x, rows, wkv, qk, 1e-20)
    torch.testing.assert_close(got.float(), eref.engram_inject(x, rows, wkv, qk, 1e-20).float(), rtol=8e-3, atol=1e-2)


def test_gates_match_reference():
    g = torch.Generator().manual_seed(5)
    x, keys = torch.randn(2, 3, 4, 64, generator=g).bfloat16()
    qk = torch.randn(4, 64, generator=g)
    torch.testing.assert_close(
        et.engram_gates(x, keys, qk, 1e-20), eref.engram_gates(x, keys, qk, 1e-20), rtol=1e-5, atol=1e-6
    )


def test_cpu_tables_are_plain_memory():
    _, _, table = _table(seed=6)
    assert not table.pinned and not table.huge_pages
    assert et.transparent_huge_pages_mode() in ("always", "madvise", "never", "unavailable")
