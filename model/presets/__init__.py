"""Preset configurations: `tiny` (CPU tests and demo), `bench` (one H200), `released`.

`tiny` keeps every layer role of the released model at small widths; its window (128) and
top-k (16 of a 32-entry candidate pool) bite on prompts of a few hundred tokens:

    layer  ratio role                 extra
    0      0     SWA-only
    1      0     SWA-only             Engram
    2      2     Full (kv source)
    3      2     Reuse
    4      2     Full (kv source)     Engram
    5      2     Reuse
    6      1     Full, candidate src  (encoder = layers 0..5)
    7      1     Reuse
    8      1     Reindex              candidate-masked
    9      1     Reuse

`small` (model/presets/small.py) has the same layer roles at widths that train on ShareGPT in
minutes on one H200; its trained checkpoint ships in model/presets/small_checkpoint/.

`bench` is the released per-layer geometry (hidden 5120, 64 heads x 512, 40 layers) with 64
routed experts and Engram tables seeded from a 100K prime start, so weights (~55 GB) plus KV fit
one 141 GB H200.
"""

from __future__ import annotations

import copy
import json
import os

from flashpd.model.config import ModelConfig

_HERE = os.path.dirname(__file__)
PRESET_NAMES = ("tiny", "small", "bench", "released")


def released_hf() -> dict:
    with open(os.path.join(_HERE, "released.json")) as f:
        return json.load(f)


def tiny_hf() -> dict:
    hf = released_hf()
    t = hf["text_config"]
    t.update(_tiny_widths())
    t.update(_tiny_layer_layout())
    t.update(_tiny_drafter())
    # Engram table sizes and the compressed vocabulary are derived from the shipped tokenizer
    # and the prime schedule; model/engram.py fills them in (see tiny_config()).
    t["engram_num_embeddings"] = [0, 0]
    t["engram_compressed_vocab_size"] = 0
    hf["image_token_id"] = None
    return hf


def _tiny_widths() -> dict:
    """Widths, expert counts and the position range (YaRN x4 over 4096)."""
    return dict(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=10,
        num_attention_heads=4,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=64,
        o_lora_rank=32,
        o_groups=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        max_position_embeddings=65536,
        rope_scaling={
            "type": "yarn",
            "factor": 4,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 4096,
        },
    )


def _tiny_layer_layout() -> dict:
    """The layer table above: window, ratios, KV/index/candidate sources, Engram layers."""
    return dict(
        sliding_window=128,
        compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
        kv_source_layer_ids=[2, 4, 6],
        index_source_layer_ids=[2, 4, 6, 8],
        index_n_heads=4,
        index_head_dim=32,
        index_topk=16,
        candidate_source_layer_id=6,
        candidate_topk_blocks=8,
        candidate_block_size=4,
        engram_layer_ids=[1, 4],
        engram_max_ngram_size=4,
        engram_n_heads=2,
        engram_head_dim=32,
        engram_vocab_size=1000,
    )


def _tiny_drafter() -> dict:
    """DSpark drafter scaled to the preset (docs/dspark.md): 3 SWA-only layers tapping the
    last 3 backbone layers, 4 routed experts (top 2) + the shared one, Markov rank 16; the
    noise slots embed id 2 (<pad>, never a drafted token; the released model uses
    </think>)."""
    return dict(
        num_nextn_predict_layers=3,
        dspark_block_size=5,
        dspark_noise_token_id=2,
        dspark_target_layer_ids=[7, 8, 9],
        dspark_markov_rank=16,
        dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
    )


def _bench_hf() -> dict:
    hf = released_hf()
    t = hf["text_config"]
    t.update(n_routed_experts=64, engram_vocab_size=100000)
    t["engram_num_embeddings"] = [0, 0]  # derived from the prime schedule (model/engram.py)
    return hf


def preset_hf(name: str) -> dict:
    if name == "released":
        return released_hf()
    if name == "tiny":
        return tiny_hf()
    if name == "bench":
        return _bench_hf()
    if name == "small":
        from flashpd.model.presets.small import small_hf  # local import: small imports this module

        return small_hf()
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")


def preset_config(name: str) -> ModelConfig:
    """The preset's ModelConfig with every derived field filled in."""
    hf = copy.deepcopy(preset_hf(name))
    if name != "released":
        from flashpd.model import engram  # local import: engram imports config

        engram.fill_derived_fields(hf, tokenizer_path=tokenizer_path(name))
    return ModelConfig.from_hf(hf, name=name)


def tokenizer_path(name: str) -> str | None:
    """Path of the tokenizer.json a preset ships, or None."""
    path = os.path.join(_HERE, f"{name}_tokenizer.json")
    return path if os.path.exists(path) else None
