"""Checkpoint tensors are dequantised once, strictly, into the compute dtype."""

from __future__ import annotations

import pytest
import torch

from flashpd.kernels.quant import ref as quant
from flashpd.model.weights import WeightError, load_weights


def test_fp8_and_mxfp4_weights_are_dequantised(tiny_ckpt):
    cfg, t = tiny_ckpt.cfg, tiny_ckpt.tensors
    w = load_weights(cfg, t, torch.bfloat16)
    want = quant.dequantize_fp8_blockwise(t["layers.3.attn.wq_b.weight"], t["layers.3.attn.wq_b.scale"], torch.float32)
    assert w.layers[3].attn.wq_b.dtype == torch.bfloat16
    assert torch.equal(w.layers[3].attn.wq_b.float(), want)  # exact in BF16
    e5 = quant.dequantize_mxfp4_weight(
        t["layers.0.ffn.experts.5.w2.weight"], t["layers.0.ffn.experts.5.w2.scale"], torch.float32
    )
    assert torch.equal(w.layers[0].moe.experts.w2[5].float(), e5)
    assert w.layers[0].hc_attn.fn.dtype == torch.float32  # F32 tensors stay FP32
    assert w.layers[0].attn.sink.dtype == torch.float32


def test_roles_get_their_parts(tiny_ckpt):
    w = load_weights(tiny_ckpt.cfg, tiny_ckpt.tensors, torch.float32)
    roles = {
        i: (l.compressor is not None, l.index_query is not None, l.engram is not None) for i, l in enumerate(w.layers)
    }
    assert roles[2] == (True, True, False) and roles[3] == (False, False, False)
    assert roles[4] == (True, True, True) and roles[8] == (False, True, False)
    assert w.layers[2].compressor.wgate is not None and w.layers[6].compressor.wgate is None


def test_missing_and_unused_tensors_raise(tiny_ckpt):
    tensors = dict(tiny_ckpt.tensors)
    del tensors["layers.7.attn.wkv.scale"]
    with pytest.raises(WeightError, match="layers.7.attn.wkv.scale"):
        load_weights(tiny_ckpt.cfg, tensors, torch.float32)
    tensors = dict(tiny_ckpt.tensors, **{"layers.0.extra.weight": torch.zeros(1)})
    with pytest.raises(WeightError, match="unused"):
        load_weights(tiny_ckpt.cfg, tensors, torch.float32)


def test_engram_rows_dequantise_at_lookup(tiny_ckpt):
    w = load_weights(tiny_ckpt.cfg, tiny_ckpt.tensors, torch.float32)
    table = w.layers[1].engram.table
    ids = torch.tensor([[0, 5], [table.num_rows - 1, 3]])
    rows = table.rows(ids, torch.float32)
    t = tiny_ckpt.tensors
    want = quant.dequantize_fp8_rows(
        t["layers.1.engram.embed.weight"][ids.flatten()], t["layers.1.engram.embed.scale"][ids.flatten()], torch.float32
    )
    assert torch.equal(rows, want.reshape(2, -1))
    with pytest.raises(IndexError):
        table.rows(torch.tensor([[table.num_rows]]), torch.float32)
