"""The `small` preset: a valid config with every V4.1 layer role; its tokenizer and chat tokens."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from flashpd.model import train_data
from flashpd.model.checkpoint import manifest
from flashpd.model.config import LayerRole, ModelConfig
from flashpd.model.params import param_counts
from flashpd.model.presets import PRESET_NAMES, preset_config, tokenizer_path


@pytest.fixture(scope="module")
def cfg():
    return preset_config("small")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(tokenizer_path("small"))


def test_small_is_a_preset_and_round_trips_through_hf(cfg):
    assert "small" in PRESET_NAMES
    again = ModelConfig.from_hf(cfg.to_hf(), name="small")
    assert again == cfg


def test_small_has_every_layer_role(cfg):
    layers = cfg.layers
    roles = {spec.role for spec in layers}
    assert roles == set(LayerRole)
    assert {spec.ratio for spec in layers} == {0, 1, 2}
    assert any(s.is_encoder for s in layers) and any(not s.is_encoder for s in layers)
    assert [s.is_candidate_source for s in layers].count(True) == 1
    assert any(s.uses_candidates for s in layers)
    assert sum(s.has_engram for s in layers) == 2
    assert cfg.n_shared_experts == 1 and cfg.num_experts_per_tok < cfg.n_routed_experts
    assert cfg.hc_mult > 1
    assert cfg.index_topk < cfg.candidate_topk_blocks * cfg.candidate_block_size
    assert cfg.sliding_window == 128
    # the encoder holds both ratio-2 kv sources; the global KV comes from every kv source
    assert all(cfg.layers[s].is_encoder for s in cfg.kv_source_layer_ids[:-1])
    assert cfg.global_kv_bytes_per_token > 0


def test_small_size(cfg):
    counts = param_counts(cfg)
    assert 10e6 < counts["total_params"] < 100e6  # tens of millions
    assert counts["active_params_decode"] < counts["total_params"]
    assert sum(s.nbytes for s in manifest(cfg).values()) < 40e6  # ships in the repo


def test_tokenizer_has_the_chat_special_tokens(cfg, tok):
    assert tok.get_vocab_size(with_added_tokens=True) == cfg.vocab_size
    for i, special in enumerate(train_data.SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i
    assert cfg.engram_pad_token_id == train_data.PAD_TOKEN_ID


@pytest.mark.parametrize(
    "text",
    [
        "Hello! Can you tell me about prefill and decode?",
        "def f(x):\n    return x ** 2  # squares\n\tédition naïve, 東京, emoji 🙂",
        "",
    ],
)
def test_tokenizer_round_trips(tok, text):
    conv = train_data.Conversation("t_0", (("user", text), ("assistant", "Sure.")))
    chat = train_data.chat_text(conv)
    ids = tok.encode(chat, add_special_tokens=False).ids
    assert ids[0] == 0 and ids[1] == 3  # BOS, <|User|>
    assert tok.token_to_id(train_data.ASSISTANT) in ids and ids[-1] == 1  # ... EOS
    assert tok.decode(ids, skip_special_tokens=False) == chat


def test_tokenizer_compresses_english(tok):
    text = "The quick brown fox jumps over the lazy dog, and then it writes a Python function."
    assert len(tok.encode(text).ids) < len(text) / 3
