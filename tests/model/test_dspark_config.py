"""DSpark drafter keys in ModelConfig: released values, presets, strict errors naming the key."""

from __future__ import annotations

import copy

import pytest

from flashpd.model.config import DSparkConfig, ModelConfig
from flashpd.model.presets import preset_config, released_hf


def _released_text() -> dict:
    return copy.deepcopy(released_hf())


def test_released_drafter_keys():
    cfg = ModelConfig.from_hf(released_hf(), name="released")
    assert cfg.dspark == DSparkConfig(
        num_layers=3,
        block_size=5,
        noise_token_id=128799,
        target_layer_ids=(37, 38, 39),
        markov_rank=256,
        n_routed_experts=128,
        num_experts_per_tok=3,
        compress_ratios=(0, 0, 0),
    )
    assert len(cfg.compress_ratios) == 40  # the backbone keeps its own 40 entries


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_presets_have_a_drafter_on_their_last_three_layers(name):
    cfg = preset_config(name)
    assert cfg.dspark is not None
    assert cfg.dspark.target_layer_ids == tuple(range(cfg.num_layers - 3, cfg.num_layers))
    assert cfg.dspark.num_experts_per_tok < cfg.dspark.n_routed_experts


def test_no_drafter_when_num_nextn_is_zero_or_absent():
    hf = _released_text()
    hf["text_config"]["num_nextn_predict_layers"] = 0
    assert ModelConfig.from_hf(hf).dspark is None
    del hf["text_config"]["num_nextn_predict_layers"]
    assert ModelConfig.from_hf(hf).dspark is None


def test_round_trip_keeps_the_compress_ratio_tail():
    cfg = preset_config("tiny")
    t = cfg.to_hf()["text_config"]
    assert t["compress_ratios"][cfg.num_layers :] == [0, 0, 0]
    assert t["dspark_target_layer_ids"] == [7, 8, 9]
    assert ModelConfig.from_hf(cfg.to_hf(), name="tiny") == cfg


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("dspark_target_layer_ids", [37, 38, 40], "dspark_target_layer_ids"),
        ("dspark_target_layer_ids", [-1, 38, 39], "dspark_target_layer_ids"),
        ("dspark_target_layer_ids", [39, 38, 37], "strictly ascending"),
        ("dspark_target_layer_ids", [], "dspark_target_layer_ids is empty"),
        ("dspark_target_layer_ids", "37", "dspark_target_layer_ids"),
        ("dspark_noise_token_id", 129280, "dspark_noise_token_id"),
        ("dspark_noise_token_id", -1, "dspark_noise_token_id"),
        ("dspark_block_size", 0, "dspark_block_size"),
        ("dspark_block_size", "5", "dspark_block_size must be an integer"),
        ("dspark_markov_rank", 0, "dspark_markov_rank"),
        ("dspark_n_routed_experts", 0, "dspark_n_routed_experts"),
        ("dspark_num_experts_per_tok", 129, "dspark_num_experts_per_tok"),
        ("dspark_num_experts_per_tok", 0, "dspark_num_experts_per_tok"),
        ("num_nextn_predict_layers", -1, "num_nextn_predict_layers"),
        ("num_nextn_predict_layers", 2, "compress_ratios"),
    ],
)
def test_bad_drafter_keys_name_the_key(key, value, match):
    hf = _released_text()
    hf["text_config"][key] = value
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize(
    "key",
    [
        "dspark_block_size",
        "dspark_noise_token_id",
        "dspark_target_layer_ids",
        "dspark_markov_rank",
        "dspark_n_routed_experts",
        "dspark_num_experts_per_tok",
    ],
)
def test_missing_drafter_key_is_named(key):
    hf = _released_text()
    del hf["text_config"][key]
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf(hf)


def test_drafter_layers_must_be_swa_only():
    hf = _released_text()
    hf["text_config"]["compress_ratios"][-1] = 1
    with pytest.raises(ValueError, match="compress_ratios"):
        ModelConfig.from_hf(hf)


def test_replace_revalidates_the_drafter_against_the_backbone():
    with pytest.raises(ValueError, match="dspark_target_layer_ids"):
        preset_config("tiny").replace(
            num_layers=6,
            compress_ratios=(0, 0, 2, 2, 1, 1),
            kv_source_layer_ids=(2, 4),
            index_source_layer_ids=(2, 4, 5),
            candidate_source_layer_id=4,
            engram_layer_ids=(1,),
            engram_num_embeddings=(7,),
        )
