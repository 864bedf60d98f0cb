"""Released checkpoint format: manifest (§10.5), random writer, strict loader."""

from __future__ import annotations

import filecmp
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashpd.kernels.quant import ref as q
from flashpd.model.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    TensorSpec,
    load_checkpoint,
    manifest,
    write_random_checkpoint,
)
from flashpd.model.presets import preset_config


@pytest.fixture(scope="module")
def tiny_cfg():
    return preset_config("tiny")


@pytest.fixture(scope="module")
def released_manifest():
    return manifest(preset_config("released"))


@pytest.fixture
def tiny_dir(tiny_cfg, tmp_path):
    out = tmp_path / "tiny"
    write_random_checkpoint(tiny_cfg, str(out), seed=7, max_shard_bytes=1 << 20)
    return out


def _count(specs: dict, suffix: str) -> int:
    return sum(name.endswith(suffix) for name in specs)


# ----------------------------------------------------------------------------- manifest
def test_released_manifest_role_counts(released_manifest):
    m = released_manifest
    assert _count(m, "attn.wq_a.weight") == 40
    assert _count(m, "compressor.wkv.weight") == 4
    assert _count(m, "compressor.wgate.weight") == 3
    assert _count(m, "indexer.wq_b.weight") == 8
    assert _count(m, "indexer.wk.weight") == 4
    assert _count(m, "engram.embed.weight") == 2
    assert sum(".ffn.experts." in n and n.endswith(".w1.weight") for n in m) == 15360
    assert len(m) == 93418  # 40*2334 + 19 + 24 + 12 + 3


def test_released_manifest_shapes(released_manifest):
    m = released_manifest
    expect = {
        "embed.weight": ("BF16", (129280, 5120)),
        "head.weight": ("BF16", (129280, 5120)),
        "layers.0.hc_attn_fn": ("F32", (24, 20480)),
        "layers.0.hc_ffn_scale": ("F32", (3,)),
        "layers.0.attn.wq_a.scale": ("F8_E8M0", (40, 160)),
        "layers.0.attn.wq_b.scale": ("F8_E8M0", (1024, 40)),
        "layers.0.attn.wkv.scale": ("F8_E8M0", (16, 160)),
        "layers.5.attn.wo_a.weight": ("F8_E4M3", (8192, 4096)),
        "layers.5.attn.wo_a.scale": ("F8_E8M0", (256, 128)),
        "layers.5.attn.wo_b.scale": ("F8_E8M0", (160, 256)),
        "layers.5.attn.attn_sink": ("F32", (64,)),
        "layers.5.ffn.gate.bias_vl": ("F32", (384,)),
        "layers.5.ffn.shared_experts.w2.scale": ("F8_E8M0", (160, 72)),
        "layers.9.ffn.experts.383.w1.weight": ("I8", (2304, 2560)),
        "layers.9.ffn.experts.383.w1.scale": ("F8_E8M0", (2304, 160)),
        "layers.9.ffn.experts.0.w2.weight": ("I8", (5120, 1152)),
        "layers.9.ffn.experts.0.w2.scale": ("F8_E8M0", (5120, 72)),
        "layers.20.attn.compressor.wkv.weight": ("BF16", (512, 5120)),
        "layers.20.attn.indexer.wk.weight": ("BF16", (128, 512)),
        "layers.24.attn.indexer.wq_b.scale": ("F8_E8M0", (128, 40)),
        "layers.24.attn.indexer.weights_proj.weight": ("BF16", (32, 5120)),
        "layers.1.engram.embed.weight": ("F8_E4M3", (384006168, 256)),
        "layers.14.engram.embed.scale": ("F8_E8M0", (384016682, 8)),
        "layers.14.engram.wkv.scale": ("F8_E8M0", (800, 192)),
        "layers.1.engram.q_weight": ("BF16", (4, 5120)),
    }
    for name, (dtype, shape) in expect.items():
        assert m[name] == TensorSpec(dtype, shape), name


def test_released_manifest_places_per_role_tensors(released_manifest):
    m = released_manifest
    gate_layers = {int(n.split(".")[1]) for n in m if n.endswith("compressor.wgate.weight")}
    assert gate_layers == {2, 8, 14}
    index_q_layers = {int(n.split(".")[1]) for n in m if n.endswith("indexer.wq_b.weight")}
    assert index_q_layers == {2, 8, 14, 20, 24, 28, 32, 36}
    assert "layers.24.attn.indexer.wk.weight" not in m
    assert "layers.21.attn.indexer.wq_b.weight" not in m


# ----------------------------------------------------------------------------- write / read
def test_write_then_load_is_bit_exact(tiny_cfg, tiny_dir):
    ck = load_checkpoint(str(tiny_dir))
    assert ck.cfg == tiny_cfg
    assert set(ck.tensors) == set(manifest(tiny_cfg))
    with open(tiny_dir / INDEX_FILE) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    assert len(shards) > 1
    loaded = {**ck.tensors, **ck.drafter_tensors}  # the drafter's mtp.* apart (test_dspark_*)
    for shard in shards:
        for name, raw in load_file(str(tiny_dir / shard)).items():
            got = loaded[name]
            assert torch.equal(got.view(torch.uint8), raw.view(torch.uint8)), name


def test_loaded_dtypes_are_raw(tiny_dir):
    t = load_checkpoint(str(tiny_dir)).tensors
    assert t["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.0.attn.wq_a.scale"].dtype == torch.uint8
    assert t["layers.0.ffn.experts.0.w1.weight"].dtype == torch.uint8
    assert t["layers.0.ffn.experts.0.w1.scale"].dtype == torch.uint8
    assert t["layers.1.engram.embed.scale"].dtype == torch.uint8
    assert t["layers.0.hc_attn_fn"].dtype == torch.float32
    assert t["embed.weight"].dtype == torch.bfloat16


def test_random_weights_have_the_intended_scales(tiny_cfg, tiny_dir):
    t = load_checkpoint(str(tiny_dir)).tensors
    wq_a = q.dequantize_fp8_blockwise(t["layers.3.attn.wq_a.weight"], t["layers.3.attn.wq_a.scale"], torch.float32)
    assert wq_a.std().item() == pytest.approx(tiny_cfg.hidden_size**-0.5, rel=0.1)
    w2 = q.dequantize_mxfp4_weight(
        t["layers.3.ffn.experts.1.w2.weight"], t["layers.3.ffn.experts.1.w2.scale"], torch.float32
    )
    assert w2.std().item() == pytest.approx(tiny_cfg.moe_intermediate_size**-0.5, rel=0.15)
    rows = q.dequantize_fp8_rows(t["layers.4.engram.embed.weight"], t["layers.4.engram.embed.scale"], torch.float32)
    assert rows.std().item() == pytest.approx(1.0, rel=0.1)
    assert torch.all(t["layers.3.attn.q_norm.weight"] == 1)
    assert torch.all(t["layers.3.attn.attn_sink"] == 0)
    assert t["layers.3.hc_ffn_fn"].std().item() == pytest.approx(1e-2, rel=0.1)


def test_writer_is_deterministic_in_seed(tiny_cfg, tiny_dir, tmp_path):
    again, other = tmp_path / "again", tmp_path / "other"
    write_random_checkpoint(tiny_cfg, str(again), seed=7, max_shard_bytes=1 << 20)
    write_random_checkpoint(tiny_cfg, str(other), seed=8, max_shard_bytes=1 << 20)
    shard = sorted(p for p in os.listdir(tiny_dir) if p.endswith(".safetensors"))[0]
    assert filecmp.cmp(tiny_dir / shard, again / shard, shallow=False)
    assert not filecmp.cmp(tiny_dir / shard, other / shard, shallow=False)


def test_writer_ships_config_and_tokenizer(tiny_dir):
    assert (tiny_dir / "tokenizer.json").exists()
    assert load_checkpoint(str(tiny_dir)).tokenizer_path == str(tiny_dir / "tokenizer.json")


def test_load_without_index(tiny_dir):
    os.remove(tiny_dir / INDEX_FILE)
    ck = load_checkpoint(str(tiny_dir))
    assert len(ck.tensors) == len(manifest(ck.cfg))


# ----------------------------------------------------------------------------- validation
def _edit_shard_of(ck_dir, name: str, edit) -> None:
    """Apply edit(tensors) to the shard holding `name`; drop the index to avoid a stale map."""
    with open(ck_dir / INDEX_FILE) as f:
        shard = ck_dir / json.load(f)["weight_map"][name]
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard))
    os.remove(ck_dir / INDEX_FILE)


def _load_error(ck_dir) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(ck_dir))
    return str(info.value)


def test_missing_tensor_is_named(tiny_dir):
    name = "layers.6.attn.compressor.wkv.weight"
    _edit_shard_of(tiny_dir, name, lambda t: t.pop(name))
    msg = _load_error(tiny_dir)
    assert name in msg and "missing" in msg and "BF16" in msg


def test_unexpected_tensor_is_named(tiny_dir):
    name = "layers.6.attn.compressor.wkv.weight"
    extra = "layers.6.attn.compressor.wgate.weight"  # ratio-1 layer: no gate
    _edit_shard_of(tiny_dir, name, lambda t: t.__setitem__(extra, t[name].clone()))
    msg = _load_error(tiny_dir)
    assert extra in msg and "unexpected" in msg


def test_misshaped_tensor_is_named(tiny_dir):
    name = "layers.2.attn.kv_norm.weight"
    _edit_shard_of(tiny_dir, name, lambda t: t.__setitem__(name, t[name][:32].clone()))
    msg = _load_error(tiny_dir)
    assert name in msg and "[32]" in msg and "[64]" in msg


def test_wrong_dtype_is_named(tiny_dir):
    name = "layers.2.attn.wq_a.scale"
    _edit_shard_of(tiny_dir, name, lambda t: t.__setitem__(name, t[name].view(torch.uint8)))
    msg = _load_error(tiny_dir)
    assert name in msg and "F8_E8M0" in msg


def test_every_offence_is_reported_at_once(tiny_dir):
    a, b = "layers.2.attn.kv_norm.weight", "layers.2.attn.q_norm.weight"
    _edit_shard_of(tiny_dir, a, lambda t: (t.pop(a), t.pop(b)))
    msg = _load_error(tiny_dir)
    assert a in msg and b in msg


def test_ignored_prefixes_are_skipped(tiny_dir):
    name = "norm.weight"
    extra = {  # mtp.* is the drafter, validated like the backbone (test_dspark_checkpoint.py)
        "vision.x": torch.ones(2),
        "aligner.y": torch.ones(2),
        "image_newline": torch.ones(2),
    }
    _edit_shard_of(tiny_dir, name, lambda t: t.update(extra))
    ck = load_checkpoint(str(tiny_dir))
    assert not set(extra) & set(ck.tensors)


def test_index_pointing_at_a_missing_shard_fails(tiny_dir):
    second = sorted(p for p in os.listdir(tiny_dir) if p.endswith(".safetensors"))[1]
    os.remove(tiny_dir / second)
    assert second in _load_error(tiny_dir)
