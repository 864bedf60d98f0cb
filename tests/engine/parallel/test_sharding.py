"""Sharding rules and shard_tensor / load_shard on raw tiny checkpoints, scales included."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from flashpd.engine.parallel import sharding
from flashpd.engine.parallel.plan import ParallelPlan
from flashpd.engine.parallel.sharding import (
    ShardError,
    Split,
    holds,
    load_shard,
    rank_manifest,
    shard_tensor,
    tensor_rule,
)
from flashpd.kernels.quant import ref as quant
from flashpd.model.checkpoint import INDEX_FILE, manifest
from flashpd.model.presets import preset_config

from .conftest import tp4_config

TP2, TP4, EP2 = (ParallelPlan.from_name(n) for n in ("tp2", "tp4", "dp2ep2"))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes-exact comparable form (float8 has no torch.equal on CPU)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_raw(a), _raw(b))


@pytest.mark.parametrize(
    "leaf, split",
    [
        ("embed.weight", Split.REPLICATED),
        ("head.weight", Split.VOCAB),
        ("layers.2.attn.wq_a.scale", Split.REPLICATED),
        ("layers.2.attn.wq_b.weight", Split.COLUMN),
        ("layers.2.attn.wq_b.scale", Split.COLUMN),
        ("layers.2.attn.wkv.weight", Split.REPLICATED),
        ("layers.2.attn.kv_norm.weight", Split.REPLICATED),
        ("layers.2.attn.wo_a.weight", Split.COLUMN),
        ("layers.2.attn.wo_b.scale", Split.ROW),
        ("layers.2.attn.attn_sink", Split.COLUMN),
        ("layers.2.attn.compressor.wgate.weight", Split.REPLICATED),
        ("layers.2.attn.indexer.wq_b.weight", Split.REPLICATED),
        ("layers.2.ffn.gate.weight", Split.REPLICATED),
        ("layers.2.ffn.shared_experts.w3.weight", Split.COLUMN),
        ("layers.2.ffn.shared_experts.w2.scale", Split.ROW),
        ("layers.2.ffn.experts.7.w1.weight", Split.COLUMN),
        ("layers.2.ffn.experts.7.w2.scale", Split.ROW),
        ("layers.1.engram.embed.weight", Split.REPLICATED),
        ("layers.1.hc_ffn_fn", Split.REPLICATED),
    ],
)
def test_rule_table(leaf, split):
    assert tensor_rule(leaf).split is split


def test_every_tiny_and_released_tensor_has_a_rule():
    for preset in ("tiny", "released"):
        for name in manifest(preset_config(preset)):
            tensor_rule(name)
    assert tensor_rule("layers.3.ffn.experts.5.w3.scale").expert_id == 5
    with pytest.raises(ShardError, match="no sharding rule"):
        tensor_rule("layers.0.attn.mystery.weight")


def _round_trip(tensors, plan, cfg):
    """Every tensor's parts, put back together along the split dim, give the tensor."""
    for name, full in tensors.items():
        parts = [shard_tensor(name, full, plan, r, cfg.weight_block_size) for r in range(plan.world_size)]
        split = tensor_rule(name).split
        if split is Split.REPLICATED or split is Split.VOCAB:
            assert all(p is full for p in parts), name
            continue
        dim = 0 if split is Split.COLUMN else 1
        assert all(p.shape[dim] * plan.tp_size == full.shape[dim] for p in parts), name
        assert _same(torch.cat(parts, dim), full), name


def test_tp2_parts_reassemble_every_tiny_tensor(tiny_tensors):
    _round_trip(tiny_tensors, TP2, preset_config("tiny"))


def test_tp4_parts_reassemble_every_tensor(tp4_tensors):
    _round_trip(tp4_tensors, TP4, tp4_config())


def _expected_part(full: torch.Tensor, name: str, plan: ParallelPlan, rank: int) -> torch.Tensor:
    """The rank's part of a dequantised [out, in] weight, cut by hand from the rule table."""
    dim = {Split.COLUMN: 0, Split.ROW: 1}.get(tensor_rule(name).split)
    if dim is None:
        return full
    size = full.shape[dim] // plan.tp_size
    return full.narrow(dim, plan.tp_rank(rank) * size, size)


def _dequant_commutes(tensors, plan):
    """dequantise(shard) == shard(dequantise) for every FP8 tile and MXFP4 weight."""
    checked = 0
    for name, w in tensors.items():
        quantised = w.dtype in (torch.float8_e4m3fn, torch.uint8)
        if not name.endswith(".weight") or not quantised or "engram.embed" in name:
            continue  # Engram rows (1x32 scales) are replicated
        scale_name = name[: -len(".weight")] + ".scale"
        s = tensors[scale_name]
        deq = quant.dequantize_mxfp4_weight if w.dtype == torch.uint8 else quant.dequantize_fp8_blockwise
        full = deq(w, s, torch.float32)
        for r in range(plan.world_size):
            got = deq(shard_tensor(name, w, plan, r), shard_tensor(scale_name, s, plan, r), torch.float32)
            assert torch.equal(got, _expected_part(full, name, plan, r)), f"{name} rank {r}"
        checked += 1
    assert checked > 0


def test_tp2_dequantise_commutes_with_shard(tiny_tensors):
    _dequant_commutes(tiny_tensors, TP2)


def test_tp4_dequantise_commutes_with_shard(tp4_tensors):
    _dequant_commutes(tp4_tensors, TP4)


def test_split_inside_an_fp8_tile_raises():
    w, _ = quant.quantize_fp8_blockwise(torch.randn(96, 64))
    with pytest.raises(ShardError, match="falls inside a 32-element"):
        shard_tensor("layers.0.attn.wq_b.weight", w, TP2, 0)


def test_split_inside_an_mxfp4_k_block_raises():
    packed, scale = quant.quantize_mxfp4_weight(torch.randn(128, 64))  # K = 64: 32 bytes
    with pytest.raises(ShardError, match="falls inside a 16-element"):
        shard_tensor("layers.0.ffn.experts.0.w2.weight", packed, TP4, 0)  # 8 bytes each
    assert shard_tensor("layers.0.ffn.experts.0.w2.scale", scale, TP2, 1).shape == (128, 1)


def test_indivisible_dim_raises():
    with pytest.raises(ShardError, match="not divisible by tp_size=4"):
        shard_tensor("layers.0.attn.attn_sink", torch.zeros(6), TP4, 0)


def test_ep_ranks_hold_only_their_experts():
    cfg = preset_config("tiny")
    assert holds("layers.0.ffn.experts.3.w1.weight", cfg, EP2, 0)
    assert not holds("layers.0.ffn.experts.4.w1.weight", cfg, EP2, 0)
    assert holds("layers.0.ffn.experts.4.w1.weight", cfg, EP2, 1)
    assert holds("layers.0.ffn.shared_experts.w1.weight", cfg, EP2, 1)
    assert holds("layers.0.ffn.experts.4.w1.weight", cfg, TP2, 0)


@pytest.mark.parametrize("plan_name", ["tp2", "dp2ep2"])
def test_load_shard_equals_shard_of_full(ckpt_dir, tiny_tensors, plan_name):
    plan = ParallelPlan.from_name(plan_name)
    cfg = preset_config("tiny")
    for rank in range(plan.world_size):
        shard = load_shard(ckpt_dir, plan, rank)
        want = {n: t for n, t in tiny_tensors.items() if holds(n, cfg, plan, rank)}
        assert set(shard.tensors) == set(want)
        for name, t in want.items():
            assert _same(shard.tensors[name], shard_tensor(name, t, plan, rank)), name
        specs = rank_manifest(cfg, plan, rank)
        assert {n: tuple(t.shape) for n, t in shard.tensors.items()} == {n: s.shape for n, s in specs.items()}
        assert shard.nbytes == sum(s.nbytes for s in specs.values())


def test_ep_rank_loads_half_the_routed_experts(ckpt_dir):
    shard = load_shard(ckpt_dir, EP2, 1)
    experts = {n.split(".")[4] for n in shard.tensors if ".ffn.experts." in n}
    assert experts == {"4", "5", "6", "7"}


def test_tp4_load_shard_equals_shard_of_full(tp4_ckpt_dir, tp4_tensors):
    shard = load_shard(tp4_ckpt_dir, TP4, 3)
    assert set(shard.tensors) == set(tp4_tensors)
    for name, t in tp4_tensors.items():
        assert _same(shard.tensors[name], shard_tensor(name, t, TP4, 3)), name


def test_single_plan_loads_the_whole_checkpoint(ckpt_dir, tiny_tensors):
    shard = load_shard(ckpt_dir, ParallelPlan(), 0)
    assert set(shard.tensors) == set(tiny_tensors)
    assert all(_same(shard.tensors[n], t) for n, t in tiny_tensors.items())


def test_load_shard_reads_slices_only(ckpt_dir, monkeypatch):
    """Split tensors are read through a slice of the rank's range, never whole."""
    reads: dict[str, object] = {}
    real_open = sharding.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_slice(self, name):
            stored = self.handle.get_slice(name)

            class Sliced:
                def get_dtype(self):
                    return stored.get_dtype()

                def get_shape(self):
                    return stored.get_shape()

                def __getitem__(self, index):
                    reads[name] = index
                    return stored[index]

            return Sliced()

    monkeypatch.setattr(sharding, "safe_open", Spy)
    load_shard(ckpt_dir, TP2, 1)
    assert reads["layers.2.attn.wq_b.weight"] == slice(128, 256)  # heads 2, 3 of 4 x 64 rows
    assert reads["layers.2.attn.wq_b.scale"] == slice(4, 8)
    assert reads["layers.2.attn.wo_b.weight"] == (slice(None), slice(32, 64))
    assert reads["layers.2.ffn.experts.0.w2.weight"] == (slice(None), slice(16, 32))  # K bytes
    assert reads["layers.2.ffn.experts.0.w2.scale"] == (slice(None), slice(1, 2))
    assert reads["layers.2.attn.wkv.weight"] == slice(None)


def test_load_shard_without_index_file(ckpt_dir, tmp_path):
    for file in os.listdir(ckpt_dir):
        if file != INDEX_FILE:
            shutil.copy(os.path.join(ckpt_dir, file), tmp_path / file)
    shard = load_shard(str(tmp_path), TP2, 0)
    assert shard.tensors["layers.2.attn.wq_b.weight"].shape == (128, 64)


def test_load_shard_rejects_a_checkpoint_of_another_config(ckpt_dir, tmp_path):
    for file in os.listdir(ckpt_dir):
        shutil.copy(os.path.join(ckpt_dir, file), tmp_path / file)
    config_path = tmp_path / "config.json"
    hf = json.loads(config_path.read_text())
    hf["text_config"]["q_lora_rank"] = 96
    config_path.write_text(json.dumps(hf))
    with pytest.raises(ShardError, match=r"attn.wq_a.weight: stored F8_E4M3 \[64, 128\]"):
        load_shard(str(tmp_path), TP2, 0)
