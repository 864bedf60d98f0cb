"""engine/gpu/weights.py: checkpoint tensors -> kernel-format weights without dequantising.

Each kernel operand, dequantised with the reference formats (kernels/quant/ref.py), must equal
what the reference loader (model/weights.py) makes of the same checkpoint tensor.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  before anything imports triton
# isort: on

from flashpd.engine.gpu.weights import GpuWeights, from_checkpoint_tensors, random_checkpoint_tensors
from flashpd.kernels.dense.triton import W_FP8, W_MXFP4, Weights
from flashpd.kernels.quant import ref as qref
from flashpd.model.checkpoint import LOADED_TORCH_DTYPES, load_checkpoint, manifest
from flashpd.model.presets import preset_config
from flashpd.model.weights import WeightError, load_weights


@pytest.fixture(scope="module")
def tiny_tensors(ckpt_dir) -> dict[str, torch.Tensor]:
    return load_checkpoint(ckpt_dir).tensors


@pytest.fixture(scope="module")
def varied_tensors(tiny_tensors) -> dict[str, torch.Tensor]:
    """The tiny checkpoint with every scale byte shifted by a position-dependent 0..6: random
    weights give nearly uniform tile scales, under which a mis-laid scale would go unseen."""
    out = dict(tiny_tensors)
    for name, t in tiny_tensors.items():
        if name.endswith(".scale"):
            shift = (torch.arange(t.numel()) % 7).to(torch.uint8).view(t.shape)
            out[name] = t + shift
    return out


@pytest.fixture(scope="module")
def reference(varied_tensors):
    return load_weights(preset_config("tiny"), varied_tensors, torch.float32)


@pytest.fixture(scope="module")
def gpu(varied_tensors) -> GpuWeights:
    return from_checkpoint_tensors(preset_config("tiny"), varied_tensors, "cpu")


def _fp8(w: Weights, e: int = 0) -> torch.Tensor:
    assert w.fmt == W_FP8
    return qref.dequantize_fp8_blockwise(w.data[e].view(torch.float8_e4m3fn), w.scale[e], torch.float32)


def _mxfp4(w: Weights, e: int) -> torch.Tensor:
    assert w.fmt == W_MXFP4
    return qref.dequantize_mxfp4_weight(w.data[e], w.scale[e], torch.float32)


def _equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert torch.equal(a, b)


def test_dense_fp8_weights_dequantise_to_the_reference(gpu, reference):
    for lw, ref in zip(gpu.layers, reference.layers, strict=True):
        assert lw.wq_a.num_experts == 1
        _equal(_fp8(lw.wq_a), ref.attn.wq_a)  # views of the stacked [wq_a; wkv]
        _equal(_fp8(lw.wkv), ref.attn.wkv)
        assert lw.wq_a_kv.out_dim == lw.wq_a.out_dim + lw.wkv.out_dim
        _equal(_fp8(lw.wq_b), ref.attn.wq_b)
        _equal(_fp8(lw.wo_b), ref.attn.wo_b)


def test_wo_a_splits_into_groups_with_their_own_tiles(gpu, reference):
    cfg = gpu.cfg
    for lw, ref in zip(gpu.layers, reference.layers, strict=True):
        assert lw.wo_a.num_experts == cfg.o_groups
        assert lw.wo_a.scale.shape[:2] == (cfg.o_groups, cfg.o_lora_rank // 32)
        per_group = ref.attn.wo_a.reshape(cfg.o_groups, cfg.o_lora_rank, -1)
        for g in range(cfg.o_groups):
            _equal(_fp8(lw.wo_a, g), per_group[g])


def test_routed_experts_dequantise_to_the_reference(gpu, reference):
    num = gpu.cfg.n_routed_experts
    for lw, ref in zip(gpu.layers, reference.layers, strict=True):
        assert lw.experts.num_experts == num
        for e in (0, 3, num - 1):
            _equal(_mxfp4(lw.experts.w1, e), ref.moe.experts.w1[e])
            _equal(_mxfp4(lw.experts.w2, e), ref.moe.experts.w2[e])
            _equal(_mxfp4(lw.experts.w3, e), ref.moe.experts.w3[e])


def test_shared_expert_is_one_fp8_expert(gpu, reference):
    for lw, ref in zip(gpu.layers, reference.layers, strict=True):
        assert lw.shared.num_experts == 1
        _equal(_fp8(lw.shared.w1), ref.moe.shared.w1[0])
        _equal(_fp8(lw.shared.w2), ref.moe.shared.w2[0])
        _equal(_fp8(lw.shared.w3), ref.moe.shared.w3[0])


def test_engram_keeps_its_table_and_fuses_qk(gpu, reference):
    engram_layers = [i for i, s in enumerate(gpu.cfg.layers) if s.has_engram]
    assert engram_layers
    for i in engram_layers:
        ew, ref = gpu.layers[i].engram, reference.layers[i].engram
        _equal(_fp8(ew.wkv), ref.wkv)
        _equal(ew.table.weight, ref.table.rows_f8.view(torch.uint8))
        _equal(ew.table.scale, ref.table.scale_u8)
        _equal(ew.qk, ref.qk)


def test_plain_tensors_keep_their_values(gpu, reference):
    for lw, ref in zip(gpu.layers, reference.layers, strict=True):
        assert lw.gate.dtype == torch.bfloat16 and lw.gate_bias.dtype == torch.float32
        _equal(lw.gate.float(), ref.moe.gate)
        _equal(lw.gate_bias, ref.moe.bias)
        _equal(lw.sink, ref.attn.sink)
        for got, want in ((lw.hc_attn, ref.hc_attn), (lw.hc_ffn, ref.hc_ffn)):
            for g, w in zip((got.fn, got.base, got.scale), (want.fn, want.base, want.scale), strict=True):
                _equal(g, w)
        if ref.compressor is not None:
            _equal(lw.comp_wkv.float(), ref.compressor.wkv)
            _equal(lw.idx_wk.float(), ref.compressor.index_wk)
        if ref.index_query is not None:
            _equal(_fp8(lw.idx_wq_b), ref.index_query.wq_b)
    _equal(gpu.embed.float(), reference.embed)
    _equal(gpu.head.float(), reference.head)


def test_missing_tensor_is_named(tiny_tensors):
    name = "layers.1.ffn.experts.5.w3.scale"
    tensors = {n: t for n, t in tiny_tensors.items() if n != name}
    with pytest.raises(KeyError, match=name):
        from_checkpoint_tensors(preset_config("tiny"), tensors, "cpu")


def test_extra_tensor_is_named(tiny_tensors):
    tensors = {**tiny_tensors, "layers.0.attn.stray.weight": torch.zeros(2)}
    with pytest.raises(WeightError, match="layers.0.attn.stray.weight"):
        from_checkpoint_tensors(preset_config("tiny"), tensors, "cpu")


def test_wrong_dtype_is_named(tiny_tensors):
    name = "layers.2.attn.wkv.weight"
    tensors = {**tiny_tensors, name: tiny_tensors[name].to(torch.bfloat16)}
    with pytest.raises(WeightError, match=name):
        from_checkpoint_tensors(preset_config("tiny"), tensors, "cpu")


def test_wo_a_needs_whole_tiles_per_group():
    cfg = preset_config("tiny").replace(o_lora_rank=48)
    tensors = random_checkpoint_tensors(cfg, seed=0, device="cpu")
    with pytest.raises(ValueError, match="o_lora_rank 48"):
        from_checkpoint_tensors(cfg, tensors, "cpu")


# ============================================================================ random checkpoint
@pytest.fixture(scope="module")
def random_tensors() -> dict[str, torch.Tensor]:
    return random_checkpoint_tensors(preset_config("tiny"), seed=3, device="cpu")


def test_random_checkpoint_matches_the_manifest(random_tensors):
    specs = manifest(preset_config("tiny"))
    assert list(random_tensors) == list(specs)
    for name, spec in specs.items():
        t = random_tensors[name]
        assert (tuple(t.shape), t.dtype) == (spec.shape, LOADED_TORCH_DTYPES[spec.dtype]), name


def test_random_checkpoint_is_seeded():
    cfg = preset_config("tiny")
    a = random_checkpoint_tensors(cfg, seed=5, device="cpu")
    b = random_checkpoint_tensors(cfg, seed=5, device="cpu")
    c = random_checkpoint_tensors(cfg, seed=6, device="cpu")
    name = "layers.0.attn.wq_a.weight"
    assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8))
    assert not torch.equal(a[name].view(torch.uint8), c[name].view(torch.uint8))


def _tensors_of(obj) -> list[torch.Tensor]:
    """Every tensor reachable through dataclasses, tuples and lists."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _tensors_of(getattr(obj, f.name))]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in _tensors_of(x)]
    return []


def test_random_checkpoint_loads_finite_in_the_reference(random_tensors):
    weights = load_weights(preset_config("tiny"), random_tensors, torch.float32)
    tensors = _tensors_of(weights)
    assert len(tensors) > 100
    assert all(torch.isfinite(t).all() for t in tensors)
    rows = weights.layers[1].engram.table.rows(torch.tensor([[0, 5]]), torch.float32)
    assert torch.isfinite(rows).all() and rows.abs().max() > 0


def test_random_checkpoint_values_stay_unit_order(random_tensors):
    """A projection of a unit-RMS input has outputs of order one (scales follow fan-in)."""
    weights = load_weights(preset_config("tiny"), random_tensors, torch.float32)
    layer = weights.layers[0]
    engram = next(lw.engram for lw in weights.layers if lw.engram is not None)
    for w in (layer.attn.wq_a, layer.attn.wo_b, layer.moe.experts.w1[0], layer.moe.shared.w2[0], engram.wkv):
        x = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(0))
        rms = (x @ w.T).pow(2).mean().sqrt()
        assert 0.25 < rms < 4.0


def test_random_checkpoint_loads_in_kernel_format(random_tensors):
    cfg = preset_config("tiny")
    gpu = from_checkpoint_tensors(cfg, random_tensors, "cpu")
    assert len(gpu.layers) == cfg.num_layers
    experts = gpu.layers[0].experts.w1
    # the per-expert tensors are views of one buffer: stacked without a copy
    first = random_tensors["layers.0.ffn.experts.0.w1.weight"]
    assert experts.data.data_ptr() == first.data_ptr()
    assert experts.data.shape == (cfg.n_routed_experts, *first.shape)
    _equal(
        experts.data[cfg.n_routed_experts - 1],
        random_tensors[f"layers.0.ffn.experts.{cfg.n_routed_experts - 1}.w1.weight"],
    )
