"""Guided decoding on the tiny preset: the grammar mask in the sampler, the compile cache, and a
continued stream resuming the grammar state (`engine/grammar.py`)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from flashpd.engine.grammar import GrammarBackend, GrammarError, allowed_from_bitmask
from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.loading import EOS_TOKEN, load_tokenizer
from flashpd.engine.sampling import Sampler
from flashpd.engine.sampling_params import GuidedDecoding, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(ckpt_dir):
    return load_tokenizer(ckpt_dir)


@pytest.fixture(scope="module")
def backend(tokenizer, model_f32):
    return GrammarBackend.from_tokenizer(tokenizer, model_f32.cfg.vocab_size, tokenizer.token_to_id(EOS_TOKEN))


def _schema(schema=SCHEMA) -> GuidedDecoding:
    return GuidedDecoding("json_schema", json.dumps(schema))


def _generate(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams):
    engine.add_request(rid, prompt, params)
    ids, reason = [], None
    while engine.has_unfinished():
        for o in engine.step():
            ids.extend(o.new_token_ids)
            reason = o.finish_reason if o.finished else reason
    return ids, reason


def _engine(model, backend, eos) -> LLMEngine:
    return LLMEngine(model, EngineConfig(num_blocks=64), eos_token_id=eos, grammar=backend)


def test_uncompilable_schema_names_the_field(backend):
    with pytest.raises(GrammarError) as err:
        backend.compile(GuidedDecoding("json_schema", '{"type": "strin"}'))
    assert err.value.field == "response_format" and "strin" in err.value.message


def test_compiled_grammar_is_cached(backend):
    before = backend.num_compiles
    g = GuidedDecoding("json_schema", json.dumps({"type": "object", "title": "cache"}))
    backend.compile(g)
    backend.compile(GuidedDecoding("json_schema", g.spec, replay_tokens=0))
    assert backend.num_compiles == before + 1 and backend.is_compiled(g)


def test_bitmask_masks_disallowed_tokens_in_the_sampler(backend, model_f32):
    m = backend.matcher(GuidedDecoding("json_object"))
    bitmask = backend.fill_bitmask([m, None])
    allowed = allowed_from_bitmask(bitmask, model_f32.cfg.vocab_size)
    assert allowed[1].all() and 0 < int(allowed[0].sum()) < model_f32.cfg.vocab_size
    logits = torch.zeros(2, model_f32.cfg.vocab_size)
    logits[:, ~allowed[0]] = 50.0  # the model prefers what the grammar forbids
    outs = Sampler().sample(logits, ["g", "f"], [SamplingParams()] * 2, bitmask)
    assert allowed[0, outs[0].token_id] and not allowed[0, outs[1].token_id]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_output_validates_against_the_schema(model_f32, backend, tokenizer, seed):
    eos = tokenizer.token_to_id(EOS_TOKEN)
    params = SamplingParams(max_tokens=400, temperature=1.0, seed=seed, guided=_schema())
    ids, reason = _generate(_engine(model_f32, backend, eos), "j", [5, 6, 7, 8], params)
    assert reason == "stop" and ids[-1] == eos
    jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMA)


def test_continued_stream_resumes_the_grammar_state(model_f32, backend, tokenizer):
    """An attempt that continues after k tokens (prompt + those tokens, replay_tokens=k) ends
    the same object instead of starting a new one."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    prompt = [5, 6, 7, 8]
    full, _ = _generate(_engine(model_f32, backend, eos), "a", prompt, SamplingParams(max_tokens=400, guided=_schema()))
    k = len(full) // 2
    rest, reason = _generate(
        _engine(model_f32, backend, eos),
        "a@1",
        prompt + full[:k],
        SamplingParams(max_tokens=400, guided=GuidedDecoding("json_schema", _schema().spec, replay_tokens=k)),
    )
    assert reason == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(full[:k] + rest)), SCHEMA)


def test_replayed_tokens_that_break_the_grammar_are_refused(model_f32, backend, tokenizer):
    eos = tokenizer.token_to_id(EOS_TOKEN)
    bad = tokenizer.encode("]]", add_special_tokens=False).ids
    engine = _engine(model_f32, backend, eos)
    with pytest.raises(GrammarError):
        engine.add_request("x", [5] + bad, SamplingParams(guided=GuidedDecoding("json_object", replay_tokens=len(bad))))
    assert not engine.has_unfinished()
