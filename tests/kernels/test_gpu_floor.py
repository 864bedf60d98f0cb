"""bench/gpu_floor.py: the byte / FLOP laws beside the GPU engine benchmark."""

import pytest

from flashpd.bench import gpu_floor
from flashpd.model.presets import preset_config


def test_expected_experts_grows_to_all():
    cfg = preset_config("bench")
    assert gpu_floor.expected_experts(cfg, 1) == pytest.approx(6)
    assert gpu_floor.expected_experts(cfg, 64) == pytest.approx(64 * (1 - (58 / 64) ** 64))


def test_encoder_active_params_near_8b():
    flops = gpu_floor.encoder_prefill_flops(preset_config("bench"), 256)
    assert 7.5e9 < flops["active_params_per_token"] < 8.3e9  # model_spec §11.2: ~7.9 B


def test_decode_bytes_grow_with_batch_and_context():
    cfg = preset_config("bench")
    one = gpu_floor.decode_step_bytes(cfg, 1, 8192)
    assert gpu_floor.decode_step_bytes(cfg, 8, 8192)["weights"] > one["weights"]
    assert gpu_floor.decode_step_bytes(cfg, 1, 32768)["kv"] > one["kv"]
