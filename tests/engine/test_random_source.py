"""`random:<preset>[:<seed>]` checkpoints: the spec, the padded tokenizer, the CPU refusal."""

import pytest

from flashpd.engine.llm_engine import EngineConfig
from flashpd.engine.loading import RandomWeights, load_engine, load_tokenizer, random_source


def test_spec_names_preset_and_seed():
    assert random_source("random:bench:7") == RandomWeights("bench", 7)
    assert random_source("random:tiny") == RandomWeights("tiny", 0)
    assert random_source("/mnt/models/flashpd-bench") is None


@pytest.mark.parametrize("bad", ["random:", "random:huge", "random:bench:-1", "random:bench:x"])
def test_malformed_spec_raises(bad):
    with pytest.raises(ValueError, match="random:<preset>"):
        random_source(bad)


def test_bench_tokenizer_decodes_every_model_id():
    tok = load_tokenizer("random:bench")
    assert tok.get_vocab_size() == 129280
    assert tok.decode([129279], skip_special_tokens=True) == "<t129279>"
    assert tok.token_to_id("<|end_of_sentence|>") == 1
    assert tok.encode("hello <t7000>", add_special_tokens=False).ids[-1] == 7000


def test_random_weights_are_not_generated_on_the_cpu():
    config = EngineConfig(role="colocated", dtype="bfloat16", device="cpu")
    with pytest.raises(ValueError, match="generated on the GPU"):
        load_engine("random:tiny", config)
