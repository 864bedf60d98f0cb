"""Parameter accounting (model/params.py) against a hand transcription of the released shapes."""

from __future__ import annotations

import pytest

from flashpd.model.params import param_counts
from flashpd.model.presets import preset_config

D, V, I, E, TOPK = 5120, 129280, 2304, 384, 6

LAYER_DENSE = (
    2 * D  # attn_norm, ffn_norm
    + 2 * (24 * 4 * D + 24 + 3)  # hc_{attn,ffn}_{fn,base,scale}
    + 1280 * D
    + 1280
    + 32768 * 1280  # wq_a, q_norm, wq_b
    + 512 * D
    + 512  # wkv, kv_norm
    + 8192 * 4096
    + D * 8192
    + 64  # wo_a, wo_b, attn_sink
    + E * D
    + 2 * E  # router weight, bias, bias_vl
    + 3 * I * D  # shared expert
)
EXPERT = 3 * I * D
COMPRESSOR_AND_KEYS = 512 * D + 512 + 128 * 512 + 128  # compressor.wkv, norm, indexer.wk, k_norm
WGATE = 512 * D
INDEX_QUERY = 4096 * 1280 + 32 * D
ENGRAM_DENSE = 25600 * 6144 + 2 * 4 * D
ENGRAM_ROWS = (384006168, 384016682)


def _active_layer(layer: int) -> int:
    n = LAYER_DENSE + TOPK * EXPERT
    if layer in (2, 8, 14, 20):
        n += COMPRESSOR_AND_KEYS + (WGATE if layer < 20 else 0)
    if layer in (2, 8, 14, 20, 24, 28, 32, 36):
        n += INDEX_QUERY
    if layer in (1, 14):
        n += ENGRAM_DENSE + 24 * 256  # 24 looked-up rows of 256
    return n


@pytest.fixture(scope="module")
def released_counts():
    return param_counts(preset_config("released"))


def test_released_decode_active(released_counts):
    expected = sum(_active_layer(layer) for layer in range(40)) + D + D + V * D
    assert released_counts["active_params_decode"] == expected
    assert 15.9e9 < expected < 16.3e9


def test_released_prefill_active(released_counts):
    seam = D + COMPRESSOR_AND_KEYS  # layer 20: attn_norm + compressor + index keys
    expected = sum(_active_layer(layer) for layer in range(20)) + seam + D
    assert released_counts["active_params_prefill"] == expected
    assert 7.8e9 < expected < 8.0e9


def test_released_total(released_counts):
    full_layers = 40 * (LAYER_DENSE + E * EXPERT) + 4 * COMPRESSOR_AND_KEYS + 3 * WGATE
    full_layers += 8 * INDEX_QUERY + 2 * ENGRAM_DENSE + sum(ENGRAM_ROWS) * 256
    assert released_counts["total_params"] == full_layers + 2 * V * D + D


def test_tiny_ordering():
    counts = param_counts(preset_config("tiny"))
    assert 0 < counts["active_params_prefill"] < counts["active_params_decode"]
    assert counts["active_params_decode"] < counts["total_params"]
