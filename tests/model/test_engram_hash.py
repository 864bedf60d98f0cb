"""Engram hashing (model_spec §8.1-§8.4): vocabulary, multipliers, primes and row ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from flashpd.model import engram
from flashpd.model.presets import preset_config, preset_hf, tokenizer_path

SPEC_PRIMES_L1 = [
    16000057,
    16000079,
    16000081,
    16000097,
    16000121,
    16000129,
    16000133,
    16000183,
    16000189,
    16000207,
    16000211,
    16000253,
    16000277,
    16000289,
    16000307,
    16000321,
    16000339,
    16000381,
    16000393,
    16000399,
    16000403,
    16000409,
    16000447,
    16000463,
]
SPEC_PRIMES_L14 = [
    16000477,
    16000487,
    16000499,
    16000507,
    16000511,
    16000573,
    16000609,
    16000627,
    16000667,
    16000669,
    16000693,
    16000697,
    16000711,
    16000729,
    16000759,
    16000769,
    16000781,
    16000799,
    16000813,
    16000819,
    16000841,
    16000877,
    16000879,
    16000889,
]


@pytest.fixture(scope="module")
def released():
    return preset_config("released")


@pytest.fixture(scope="module")
def tiny():
    return preset_config("tiny")


@pytest.fixture(scope="module")
def tiny_hasher(tiny):
    return engram.EngramHasher.from_tokenizer(tiny, tokenizer_path("tiny"))


# ----------------------------------------------------------------------------- §8.2, §8.3
def test_multipliers_match_the_spec():
    assert engram.multiplier_bound(99092) == 46539438283891
    assert engram.multipliers(1, 99092).tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert engram.multipliers(14, 99092).tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]


def test_released_primes_match_the_spec(released):
    primes = engram.layer_primes(released)
    assert primes == [SPEC_PRIMES_L1, SPEC_PRIMES_L14]
    assert [sum(p) for p in primes] == [384006168, 384016682]
    assert [sum(p) for p in primes] == list(released.engram_num_embeddings)


def test_column_offsets_are_running_sums():
    assert engram.column_offsets([5, 7, 11]) == [0, 5, 12]


# ----------------------------------------------------------------------------- §8.1
def _word_tokenizer(words: list[str]) -> Tokenizer:
    return Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))


def test_normalisation_merges_case_accents_compat_and_whitespace():
    words = ["<unk>", "Hello", "hello", "HÉLLO", " hello ", "ﬁ", "fi", " ", "\t", "\n\n", "é"]
    c = engram.compressed_vocab(_word_tokenizer(words)).tolist()
    # case + accent + surrounding spaces merge; NFKC ligature; whitespace runs -> one kept
    # space (sentinel rule); "é" -> "e"; ids in first-appearance order
    assert c == [0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 4]


def test_empty_normalisation_keeps_the_original_text():
    words = ["<unk>", "\u0301", "\u0300"]  # lone combining marks normalise to ""
    c = engram.compressed_vocab(_word_tokenizer(words)).tolist()
    assert c == [0, 1, 2]


def test_partial_utf8_byte_tokens_keep_distinct_raw_keys():
    tok = Tokenizer.from_file(tokenizer_path("tiny"))
    c = engram.compressed_vocab(tok)
    byte_tokens = [t for t in range(tok.get_vocab_size()) if "\ufffd" in tok.decode([t], skip_special_tokens=False)]
    assert len(byte_tokens) >= 64  # continuation / lead bytes decode to U+FFFD alone
    assert len({int(c[t]) for t in byte_tokens}) == len(byte_tokens)


def test_tiny_tokenizer_shape():
    tok = Tokenizer.from_file(tokenizer_path("tiny"))
    assert tok.get_vocab_size(with_added_tokens=True) == 512
    assert tok.id_to_token(2) == "<|pad|>"
    for special in ("<|begin_of_sentence|>", "<|end_of_sentence|>", "<|User|>", "<|Assistant|>"):
        assert tok.token_to_id(special) is not None
    text = "Ünïcode ✓ 日本語 🙂\x00"
    assert tok.decode(tok.encode(text).ids) == text


def test_fill_derived_fields_for_tiny(tiny):
    hf = preset_hf("tiny")
    engram.fill_derived_fields(hf, tokenizer_path("tiny"))
    t = hf["text_config"]
    assert t["engram_num_embeddings"] == [sum(p) for p in engram.layer_primes(tiny)]
    tok = Tokenizer.from_file(tokenizer_path("tiny"))
    assert t["engram_compressed_vocab_size"] == int(engram.compressed_vocab(tok).max()) + 1


def test_fill_derived_fields_without_tokenizer_uses_vocab_size():
    hf = preset_hf("bench")
    engram.fill_derived_fields(hf, None)
    assert hf["text_config"]["engram_compressed_vocab_size"] == 129280


# ----------------------------------------------------------------------------- §8.4
def _reference_ids(hasher: engram.EngramHasher, index: int, seq: list[int]) -> list[list[int]]:
    """Python-int transcription of §8.4 for every position of `seq` (history from the start)."""
    cfg = hasher.cfg
    cmap = hasher.compressed_map.tolist()
    mu = [int(m) for m in hasher.multipliers[index]]
    primes = engram.layer_primes(cfg)[index]
    offsets = engram.column_offsets(primes)
    out = []
    for p in range(len(seq)):
        t = [cmap[seq[p - k]] if p - k >= 0 else hasher.pad_id for k in range(4)]
        assert all(tk * m < 2**63 for tk, m in zip(t, mu, strict=True))
        r, row = t[0] * mu[0], []
        for n in range(2, cfg.engram_max_ngram_size + 1):
            r ^= t[n - 1] * mu[n - 1]
            for h in range(cfg.engram_n_heads):
                col = (n - 2) * cfg.engram_n_heads + h
                row.append(r % primes[col] + offsets[col])
        out.append(row)
    return out


def test_hash_ids_match_the_python_transcription(tiny_hasher):
    seq = [0, 17, 300, 2, 511, 17, 300, 9]
    for index in (0, 1):
        got = tiny_hasher.hash_ids(index, torch.tensor(seq), [])
        assert got.dtype == torch.int64 and got.shape == (8, 6)
        assert got.tolist() == _reference_ids(tiny_hasher, index, seq)


def test_sequence_start_pads_with_the_compressed_pad_id(tiny_hasher):
    assert tiny_hasher.pad_id == int(tiny_hasher.compressed_map[2])
    with_pad_history = tiny_hasher.hash_ids(0, torch.tensor([40]), [2, 2, 2])
    at_start = tiny_hasher.hash_ids(0, torch.tensor([40]), [])
    assert torch.equal(with_pad_history, at_start)


def test_chunked_calls_with_history_equal_one_call(tiny_hasher):
    seq = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(3))
    whole = tiny_hasher.hash_ids(1, seq, [])
    parts = [
        tiny_hasher.hash_ids(1, seq[:1], []),
        tiny_hasher.hash_ids(1, seq[1:2], seq[:1].tolist()),
        tiny_hasher.hash_ids(1, seq[2:9], seq[:2].tolist()),
        tiny_hasher.hash_ids(1, seq[9:], seq[6:9].tolist()),
    ]
    assert torch.equal(torch.cat(parts), whole)


def test_ids_fall_inside_each_columns_table_slice(tiny, tiny_hasher):
    seq = torch.arange(512)
    ids = tiny_hasher.hash_ids(0, seq, [])
    primes = engram.layer_primes(tiny)[0]
    offsets = engram.column_offsets(primes)
    for col in range(ids.shape[1]):
        assert ids[:, col].min() >= offsets[col]
        assert ids[:, col].max() < offsets[col] + primes[col]
    assert ids.max() < tiny.engram_num_embeddings[0]


def test_released_sized_vocabulary_does_not_overflow(released):
    cmap = np.minimum(np.arange(released.vocab_size), 99091).astype(np.int64)
    hasher = engram.EngramHasher(released, cmap)
    seq = [129279, 99091, 5, 129000, 0]
    got = hasher.hash_ids(1, torch.tensor(seq), [99091, 99090])
    full = [99091, 99090, *seq]
    assert got.tolist() == _reference_ids(hasher, 1, full)[2:]


def test_released_refuses_a_different_compressed_vocabulary(released):
    with pytest.raises(ValueError, match="99092"):
        engram.EngramHasher.from_tokenizer(released, tokenizer_path("tiny"))
    with pytest.raises(ValueError, match="99092"):
        engram.EngramHasher(released, np.arange(released.vocab_size, dtype=np.int64))


def test_bench_uses_the_identity_map():
    bench = preset_config("bench")
    hasher = engram.EngramHasher.from_tokenizer(bench, None)
    assert torch.equal(hasher.compressed_map, torch.arange(bench.vocab_size))
    assert hasher.hash_ids(0, torch.tensor([129279, 1]), []).shape == (2, 24)


def test_rejects_long_history_and_bad_ids(tiny_hasher):
    with pytest.raises(ValueError, match="history"):
        tiny_hasher.hash_ids(0, torch.tensor([1]), [1, 2, 3, 4])
    with pytest.raises(ValueError, match="token id"):
        tiny_hasher.hash_ids(0, torch.tensor([512]), [])


def test_hashing_several_layers_at_once_equals_one_layer_at_a_time(tiny, tiny_hasher):
    hasher = tiny_hasher
    layers = sorted({spec.engram_index for spec in tiny.layers if spec.has_engram})
    assert layers
    ids = torch.randint(0, hasher.num_token_ids, (37,), generator=torch.Generator().manual_seed(4))
    for history in ([], [5], [1, 2, 3]):
        together = hasher.hash_ids_layers(layers * 2, ids, history)
        assert len(together) == 2 * len(layers)
        for index, rows in zip(layers * 2, together, strict=True):
            assert torch.equal(rows, hasher.hash_ids(index, ids, history))
