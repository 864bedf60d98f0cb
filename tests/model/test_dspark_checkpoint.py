"""The drafter's `mtp.*` tensors: names and formats (dspark.md §2.5), random writer, loader."""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashpd.model.checkpoint import (
    CheckpointError,
    TensorSpec,
    drafter_manifest,
    is_scale,
    load_checkpoint,
    logical_shape,
    manifest,
    write_random_checkpoint,
)
from flashpd.model.presets import preset_config
from flashpd.model.presets.small import checkpoint_path
from flashpd.model.weights import load_drafter_weights


@pytest.fixture(scope="module")
def tiny_cfg():
    return preset_config("tiny")


@pytest.fixture
def tiny_dir(tiny_cfg, tmp_path):
    out = tmp_path / "tiny"
    write_random_checkpoint(tiny_cfg, str(out), seed=5, max_shard_bytes=1 << 20)
    return out


def test_released_drafter_manifest_matches_the_table():
    m = drafter_manifest(preset_config("released"))
    expect = {
        "mtp.0.main_proj.weight": ("F8_E4M3", (5120, 15360)),
        "mtp.0.main_proj.scale": ("F8_E8M0", (160, 480)),
        "mtp.0.main_norm.weight": ("BF16", (5120,)),
        "mtp.1.attn.wq_a.weight": ("F8_E4M3", (1280, 5120)),
        "mtp.1.attn.wq_b.weight": ("F8_E4M3", (32768, 1280)),
        "mtp.1.attn.wkv.weight": ("F8_E4M3", (512, 5120)),
        "mtp.1.attn.wo_a.weight": ("F8_E4M3", (8192, 4096)),
        "mtp.1.attn.wo_b.weight": ("F8_E4M3", (5120, 8192)),
        "mtp.2.attn.q_norm.weight": ("BF16", (1280,)),
        "mtp.2.attn.kv_norm.weight": ("BF16", (512,)),
        "mtp.0.attn.attn_sink": ("F32", (64,)),
        "mtp.0.attn_norm.weight": ("BF16", (5120,)),
        "mtp.0.hc_attn_fn": ("F32", (24, 20480)),
        "mtp.0.hc_ffn_base": ("F32", (24,)),
        "mtp.0.hc_ffn_scale": ("F32", (3,)),
        "mtp.1.ffn.gate.weight": ("BF16", (128, 5120)),
        "mtp.1.ffn.gate.bias": ("F32", (128,)),
        "mtp.1.ffn.gate.bias_vl": ("F32", (128,)),
        "mtp.1.ffn.shared_experts.w1.weight": ("F8_E4M3", (2304, 5120)),
        "mtp.1.ffn.shared_experts.w2.weight": ("F8_E4M3", (5120, 2304)),
        "mtp.2.ffn.experts.127.w1.weight": ("I8", (2304, 2560)),
        "mtp.2.ffn.experts.127.w1.scale": ("F8_E8M0", (2304, 160)),
        "mtp.2.ffn.experts.0.w2.weight": ("I8", (5120, 1152)),
        "mtp.2.ffn.experts.0.w2.scale": ("F8_E8M0", (5120, 72)),
        "mtp.2.norm.weight": ("BF16", (5120,)),
        "mtp.2.markov_head.embed.weight": ("BF16", (129280, 256)),
        "mtp.2.markov_head.head.weight": ("BF16", (129280, 256)),
        "mtp.2.confidence_head.proj.weight": ("BF16", (1, 5376)),
    }
    for name, (dtype, shape) in expect.items():
        assert m[name] == TensorSpec(dtype, shape), name
    # no hc_head in V4.1; main_* only on stage 0, heads only on the last stage; no compressor
    assert not any("hc_head" in n or "compressor" in n or "indexer" in n or "engram" in n for n in m)
    assert "mtp.1.main_proj.weight" not in m and "mtp.0.norm.weight" not in m
    assert "mtp.128" not in {n.rsplit(".", 3)[0] for n in m}
    assert len(m) == 2401  # dspark.md §2.5 totals: ~2,401 tensors, ~14.2B params, ~7.9 GB
    params = sum(math.prod(logical_shape(s)) for s in m.values() if not is_scale(s))
    assert round(params / 1e9, 1) == 14.2
    assert round(sum(s.nbytes for s in m.values()) / 1e9, 1) == 7.9


def test_backbone_manifest_has_no_drafter_tensor(tiny_cfg):
    assert not any(n.startswith("mtp.") for n in manifest(tiny_cfg))
    assert drafter_manifest(tiny_cfg.replace(dspark=None)) == {}


def test_random_drafter_round_trips_bit_exact(tiny_cfg, tiny_dir):
    ck = load_checkpoint(str(tiny_dir))
    assert ck.cfg == tiny_cfg
    specs = drafter_manifest(tiny_cfg)
    assert set(ck.drafter_tensors) == set(specs)
    assert not set(ck.tensors) & set(specs)
    stored = {}
    for f in os.listdir(tiny_dir):
        if f.endswith(".safetensors"):
            stored.update(load_file(str(tiny_dir / f)))
    for name, spec in specs.items():
        got = ck.drafter_tensors[name]
        assert tuple(got.shape) == spec.shape, name
        assert torch.equal(got.view(torch.uint8), stored[name].view(torch.uint8)), name


def test_drafter_tensors_load_in_their_raw_formats(tiny_dir):
    t = load_checkpoint(str(tiny_dir)).drafter_tensors
    assert t["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["mtp.0.main_proj.scale"].dtype == torch.uint8
    assert t["mtp.1.ffn.experts.3.w2.weight"].dtype == torch.uint8  # packed MXFP4
    assert t["mtp.2.markov_head.embed.weight"].dtype == torch.bfloat16
    assert t["mtp.0.hc_attn_fn"].dtype == torch.float32


def test_drafter_weights_dequantise_to_the_documented_shapes(tiny_cfg, tiny_dir):
    ck = load_checkpoint(str(tiny_dir))
    w = load_drafter_weights(ck.cfg, ck.drafter_tensors, torch.float32)
    d, ds = tiny_cfg.hidden_size, tiny_cfg.dspark
    assert w.main_proj.shape == (d, 3 * d) and w.main_proj.dtype == torch.float32
    assert len(w.layers) == 3
    assert w.layers[0].moe.experts.w1.shape == (ds.n_routed_experts, tiny_cfg.moe_intermediate_size, d)
    assert w.markov_embed.shape == (tiny_cfg.vocab_size, ds.markov_rank)
    assert w.markov_head.dtype == torch.float32
    assert w.confidence.shape == (d + ds.markov_rank,)


def _rewrite(tiny_dir, edit) -> None:
    """Apply `edit(name -> tensor dict)` to every shard (index updated for removed names)."""
    import json

    index_path = tiny_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for f in sorted(os.listdir(tiny_dir)):
        if f.endswith(".safetensors"):
            tensors = load_file(str(tiny_dir / f))
            edit(tensors)
            save_file(tensors, str(tiny_dir / f), metadata={"format": "pt"})
            for name in [n for n, file in index["weight_map"].items() if file == f]:
                if name not in tensors:
                    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))


def test_checkpoint_without_mtp_tensors_has_no_drafter(tiny_dir):
    def drop_mtp(t):
        for n in [n for n in t if n.startswith("mtp.")]:
            del t[n]

    _rewrite(tiny_dir, drop_mtp)
    ck = load_checkpoint(str(tiny_dir))
    assert ck.cfg.dspark is None and ck.drafter_tensors == {}


def test_shipped_small_checkpoint_carries_its_trained_drafter():
    ck = load_checkpoint(checkpoint_path())
    assert ck.cfg.dspark is not None and ck.cfg.dspark.block_size == 5
    assert ck.drafter_tensors and all(n.startswith("mtp.") for n in ck.drafter_tensors)


def test_partial_drafter_names_the_missing_tensor(tiny_dir):
    _rewrite(tiny_dir, lambda t: t.pop("mtp.1.attn.wkv.weight", None))
    with pytest.raises(CheckpointError, match=r"mtp\.1\.attn\.wkv\.weight: missing"):
        load_checkpoint(str(tiny_dir))


def test_misshaped_drafter_tensor_is_named(tiny_dir):
    def bad(t):
        if "mtp.2.markov_head.head.weight" in t:
            t["mtp.2.markov_head.head.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)

    _rewrite(tiny_dir, bad)
    with pytest.raises(CheckpointError, match=r"mtp\.2\.markov_head\.head\.weight: shape"):
        load_checkpoint(str(tiny_dir))
