"""bench/gpu_step.py: the whole-step benchmark runs end to end on tiny shapes (interpreter),
and its byte / FLOP laws hold on the bench preset."""

import json

import pytest

from flashpd.bench import gpu_step
from flashpd.model.presets import preset_config


def test_smoke_run_writes_every_section(tmp_path):
    payload = gpu_step.run(gpu_step.SMOKE_PLAN, str(tmp_path), log=lambda m: None)
    saved = json.loads((tmp_path / "step.json").read_text())
    assert saved["errors"] == {}
    roles = saved["decode"][0]["roles"]
    assert set(roles) == set(gpu_step.ROLE_LAYERS)
    assert all(e["eager_ms"] > 0 and e["floor_bytes"] > 0 for e in roles.values())
    assert saved["decode"][0]["composed_eager_ms"] > 0
    assert payload["prefill"]["tokens_per_s"] > 0
    assert [r["prefix_tokens"] for r in saved["ttft"]] == list(gpu_step.SMOKE_PLAN.replay_prefixes)
    md = (tmp_path / "step.md").read_text()
    assert "## Encoder-path prefill" in md and "## TTFT proxy" in md


def test_expected_experts_grows_to_all():
    cfg = preset_config("bench")
    assert gpu_step.expected_experts(cfg, 1) == pytest.approx(6)
    assert gpu_step.expected_experts(cfg, 64) == pytest.approx(64 * (1 - (58 / 64) ** 64))


def test_encoder_active_params_near_8b():
    flops = gpu_step.encoder_prefill_flops(preset_config("bench"), 256)
    assert 7.5e9 < flops["active_params_per_token"] < 8.3e9  # model_spec §11.2: ~7.9 B


def test_compose_counts_each_layer_once():
    cfg = preset_config("bench")
    ones = {role: 1.0 for role in gpu_step.ROLE_LAYERS}
    assert gpu_step.compose_layers(cfg, ones) == cfg.num_layers
