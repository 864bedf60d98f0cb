"""ModelConfig parsing, per-layer roles (model_spec §1.3), byte accounting and `flashpd inspect`."""

from __future__ import annotations

import argparse
import copy
import json
import os

import pytest

from flashpd.cli import main as flashpd_main
from flashpd.kernels.quant import ref as q
from flashpd.model import cli as model_cli
from flashpd.model.config import LayerRole, ModelConfig
from flashpd.model.presets import preset_config, released_hf

FIXTURE = "/work/shared/fixtures/deepseek-v4.1-flash/config.json"
S, F, X, R = LayerRole.SWA_ONLY, LayerRole.FULL, LayerRole.REINDEX, LayerRole.REUSE


def _released_roles() -> list[tuple[int, LayerRole, int | None, int | None]]:
    """(ratio, role, kv_src, idx_src) per layer, transcribed from the §1.3 table."""
    rows = [(0, S, None, None)] * 2
    for src in (2, 8, 14):
        rows += [(2, F, src, src)] + [(2, R, src, src)] * 5
    rows += [(1, F, 20, 20)] + [(1, R, 20, 20)] * 3
    for src in (24, 28, 32, 36):
        rows += [(1, X, 20, src)] + [(1, R, 20, src)] * 3
    return rows


@pytest.fixture(scope="module")
def released():
    if os.path.exists(FIXTURE):
        return ModelConfig.from_file(FIXTURE)
    return ModelConfig.from_hf(released_hf(), name="released")


def test_released_fields(released):
    assert (released.vocab_size, released.hidden_size, released.num_layers) == (129280, 5120, 40)
    assert len(released.compress_ratios) == 40  # DSpark tail dropped
    assert released.engram_pad_token_id == 2
    assert released.rope.yarn_factor == 16 and released.rope.compress_theta == 160000
    assert released.weight_block_size == (32, 32)


def test_released_roles_match_the_table(released):
    got = [(s.ratio, s.role, s.kv_src, s.idx_src) for s in released.layers]
    assert got == _released_roles()


def test_released_role_flags(released):
    layers = released.layers
    assert [s.layer_id for s in layers if s.is_candidate_source] == [20]
    assert [s.layer_id for s in layers if s.uses_candidates] == [24, 28, 32, 36]
    assert released.encoder_layer_ids == tuple(range(20))
    assert [(s.layer_id, s.engram_index) for s in layers if s.has_engram] == [(1, 0), (14, 1)]


def test_released_byte_accounting(released):
    assert released.global_kv_bytes_per_token == 890
    assert released.window_record_bytes == q.window_fp8_record_bytes(512) == 528
    assert released.compressed_entry_bytes == q.nvfp4_record_bytes(512) == 288
    assert released.index_entry_bytes == q.mxfp4_record_bytes(128) == 68


def test_engram_pad_id_alias_and_absence():
    hf = released_hf()
    t = hf["text_config"]
    t["engram_pad_id"] = t.pop("engram_pad_token_id")
    assert ModelConfig.from_hf(hf).engram_pad_token_id == 2
    del t["engram_pad_id"]
    with pytest.raises(ValueError, match="engram_pad"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("name", ["tiny", "bench", "released"])
def test_to_hf_round_trips(name):
    cfg = preset_config(name)
    assert ModelConfig.from_hf(copy.deepcopy(cfg.to_hf()), name=name) == cfg


def test_tiny_roles_match_the_preset_table():
    tiny = preset_config("tiny")
    got = [(s.ratio, s.role, s.kv_src, s.idx_src) for s in tiny.layers]
    assert got == [
        (0, S, None, None),
        (0, S, None, None),
        (2, F, 2, 2),
        (2, R, 2, 2),
        (2, F, 4, 4),
        (2, R, 4, 4),
        (1, F, 6, 6),
        (1, R, 6, 6),
        (1, X, 6, 8),
        (1, R, 6, 8),
    ]
    assert [s.layer_id for s in tiny.layers if s.has_engram] == [1, 4]


# ----------------------------------------------------------------------------- CLI
def _run_cli(capsys, *argv: str) -> dict:
    assert flashpd_main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_register_adds_exactly_make_checkpoint_and_inspect():
    sub = argparse.ArgumentParser().add_subparsers()
    model_cli.register(sub)
    assert set(sub.choices) == {"make-checkpoint", "inspect"}


def test_inspect_released_preset(capsys):
    out = _run_cli(capsys, "inspect", "--preset", "released")
    assert out["global_kv_bytes_per_token"] == 890
    assert out["window_kv_bytes_per_token_per_layer"] == 528
    assert (out["compressed_entry_bytes"], out["index_entry_bytes"]) == (288, 68)
    assert out["role_counts"] == {"full": 4, "reindex": 4, "reuse": 30, "swa_only": 2}
    assert out["checkpoint_tensors"] == 93418
    assert 7.8e9 < out["active_params_prefill"] < 8.0e9
    assert 15.9e9 < out["active_params_decode"] < 16.3e9
    assert out["total_params"] > out["active_params_decode"]


def test_inspect_config_file_equals_preset(capsys):
    if not os.path.exists(FIXTURE):
        pytest.skip("released config fixture not present")
    from_file = _run_cli(capsys, "inspect", "--config", FIXTURE)
    from_preset = _run_cli(capsys, "inspect", "--preset", "released")
    from_file.pop("name"), from_preset.pop("name")
    assert from_file == from_preset


def test_make_checkpoint_then_inspect_the_directory(capsys, tmp_path):
    made = _run_cli(capsys, "make-checkpoint", "--preset", "tiny", "--out", str(tmp_path), "--seed", "5")
    assert made["shards"] == 1
    out = _run_cli(capsys, "inspect", "--config", str(tmp_path))
    assert out["name"] == "tiny"
    assert out["global_kv_bytes_per_token"] == preset_config("tiny").global_kv_bytes_per_token
