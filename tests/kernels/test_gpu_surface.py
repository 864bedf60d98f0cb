"""Every kernel function the GPU model calls is reached through `kernels.dispatch` under a name
its op's reference also has (kernels/<op>/ref.py), and the two agree on tiny shapes."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from flashpd.kernels import dispatch, verify
from flashpd.kernels.attention import ref as aref
from flashpd.kernels.attention import triton as at
from flashpd.kernels.dense import ref as dref
from flashpd.kernels.dense import triton as dt
from flashpd.kernels.engram import ref as eref
from flashpd.kernels.engram import triton as et
from flashpd.kernels.moe import ref as mref
from flashpd.kernels.moe import triton as mt
from flashpd.kernels.quant import ref as qref
from flashpd.kernels.quant import triton as qt
from flashpd.kernels.rope import ref as rope

from .conftest import mxfp4_experts, rel_err

FORWARD = pathlib.Path(__file__).parents[2] / "engine" / "gpu" / "forward.py"
# GpuModel's kernel attributes (model.Model's names) and the local aliases forward.py uses
ATTRS = {
    "dense": "dense",
    "quant": "quant",
    "rope": "rope",
    "mhc": "mhc",
    "engram": "engram",
    "attention": "attention",
    "compressor": "compressor",
    "indexer": "indexer",
    "moe_k": "moe",
    "d": "dense",
    "ix": "indexer",
}


def gpu_calls() -> set[tuple[str, str]]:
    """(op, name) of every kernel-op attribute engine/gpu/forward.py reads."""
    text = FORWARD.read_text()
    found = re.findall(
        r"self\.(dense|quant|rope|mhc|engram|attention|compressor|indexer|"
        r"moe_k)\.([A-Za-z_]\w*)",
        text,
    )
    found += re.findall(r"(?<![\w.])(d|ix)\.([A-Za-z_]\w*)\(", text)  # d = self.dense, ...
    return {(ATTRS[a], n) for a, n in found if not n.startswith("_")}


def test_every_name_the_gpu_model_calls_has_a_reference_beside_it():
    calls = gpu_calls()
    assert ("attention", "sparse_attention_packed") in calls  # the scan sees the forward
    missing = [
        f"{op}/{impl}.{name}"
        for op, name in sorted(calls)
        for impl in dispatch.available(op)
        if not hasattr(dispatch.get(op, impl), name)
    ]
    assert missing == []
    for op in {op for op, _ in calls} - {"rope", "quant"}:  # rope: no Triton module; quant:
        assert verify.surface_mismatches(op) == [], op  # its ref keeps encode/decode helpers


def _fp8(n: int, k: int, groups: int = 1, seed: int = 0) -> dt.Weights:
    g = torch.Generator().manual_seed(seed)
    q, s = qref.quantize_fp8_blockwise(torch.randn(groups * n, k, generator=g) * 0.3)
    if groups == 1:
        return dt.Weights.fp8(q, s)
    return dt.Weights.fp8(q.view(groups, n, k), s.view(groups, -(-n // 32), -1))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "plain"])
def test_linear_weights(fmt):
    g = torch.Generator().manual_seed(1)
    if fmt == "fp8":
        w = _fp8(64, 96)
    elif fmt == "mxfp4":
        w = dt.Weights.mxfp4(*qref.quantize_mxfp4_weight(torch.randn(64, 96, generator=g)))
    else:
        w = dt.Weights.plain(torch.randn(64, 96, generator=g).bfloat16())
    x = torch.randn(5, 96, generator=g).bfloat16()
    want = dref.linear_weights(x, w, torch.float32)
    torch.testing.assert_close(dt.linear_weights(x, w, torch.float32), want, rtol=1e-5, atol=1e-5)


def test_block_diagonal():
    w = _fp8(64, 96, groups=3, seed=2)
    x = torch.randn(4, 3, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    torch.testing.assert_close(dt.block_diagonal(x, w).float(), dref.block_diagonal(x, w).float(), rtol=8e-3, atol=1e-2)


def test_gather_rows_and_run_engram():
    g = torch.Generator().manual_seed(4)
    w, s = qref.quantize_fp8_rows(torch.randn(40, 64, generator=g))
    table = et.HostTable.from_quantized(w, s)
    ids = torch.randint(0, 40, (3, 2), generator=g)
    assert torch.equal(et.gather_rows(table, ids), eref.gather_rows(table, ids))
    x = torch.randn(3, 4, 64, generator=g).bfloat16()
    kv = torch.randn(3, 5 * 64, generator=g).bfloat16()
    qk = torch.randn(4, 64, generator=g)
    for inject in (False, True):
        got, want = et.run_engram(x, kv, qk, 1e-20, inject), eref.run_engram(x, kv, qk, 1e-20, inject)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[0].float(), want[0].float(), rtol=8e-3, atol=1e-2)


def test_moe_quantized():
    routed = mxfp4_experts(4, 64, 32, seed=5)
    shared = mt.ExpertSet(_fp8(32, 64, seed=6), _fp8(32, 64, seed=7), _fp8(64, 32, seed=8))
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 64, generator=g).bfloat16()
    gate = (torch.randn(4, 64, generator=g) * 0.125).bfloat16()
    bias = torch.zeros(4)
    got = mt.moe_quantized(x, gate, bias, routed, shared, 2, 1.5, 10.0)
    want = mref.moe_quantized(x, gate, bias, routed, shared, 2, 1.5, 10.0)
    assert rel_err(got.float(), want.float()) < 2e-2


@pytest.mark.parametrize("fmt", [qref.FMT_WINDOW_FP8, qref.FMT_NVFP4, qref.FMT_MXFP4])
def test_write_unchecked(fmt):
    g = torch.Generator().manual_seed(10 + fmt)
    values = torch.randn(3, 64, generator=g).bfloat16()
    rows = torch.tensor([4, -1, 1], dtype=torch.int32)
    width = (qref.window_fp8_record_bytes, qref.nvfp4_record_bytes, qref.mxfp4_record_bytes)[fmt](64)
    tables = rope.rope_cos_sin(torch.tensor([3, 9, 27]), rope.rope_frequencies(16, 1e4, None))
    pools = [torch.zeros(6, width, dtype=torch.uint8) for _ in range(2)]
    qt.write_unchecked(fmt, values, rows, pools[0], tables)
    qref.write_unchecked(fmt, values, rows, pools[1], tables)
    assert torch.equal(pools[0], pools[1]) and int(pools[0][[0, 2, 3, 5]].sum()) == 0


@pytest.mark.parametrize("comp_format", [aref.FMT_NVFP4, aref.FMT_FP8, None])
def test_sparse_attention_packed(comp_format):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(3, 4, 64, generator=g).bfloat16()
    sink = torch.randn(4, generator=g)
    win = qref.pack_window_fp8(torch.randn(16, 64, generator=g))
    pack = qref.pack_window_fp8 if comp_format == aref.FMT_FP8 else qref.pack_nvfp4
    comp = None if comp_format is None else pack(torch.randn(20, 64, generator=g))
    win_rows = torch.randint(-1, 16, (3, 8), generator=g)
    comp_rows = None if comp is None else torch.randint(-1, 20, (3, 6), generator=g)
    tables = rope.rope_cos_sin(torch.tensor([5, 77, 300]), rope.rope_frequencies(16, 1e4, None))
    fmt = {} if comp_format is None else {"comp_format": comp_format}
    args = (q, tables, win, win_rows, comp, comp_rows, sink, 0.125)
    torch.testing.assert_close(
        at.sparse_attention_packed(*args, **fmt).float(),
        aref.sparse_attention_packed(*args, **fmt).float(),
        rtol=2e-2,
        atol=2e-2,
    )


def test_reference_warmups_compile_nothing():
    assert dref.warmup([]) == 0 and mref.warmup(None, None, 4, 2) == 0
    assert aref.warmup(4, 64, 8, 8, (0,)) == 0
