"""The shipped `small` checkpoint's trained DSpark drafter (model/presets/small_checkpoint,
drafter-00001-of-00001.safetensors; bench/results/quality.md): loaded through `load_engine` like a
served checkpoint, greedy output with speculation is token-identical to plain decoding, and its
drafts are accepted on real text (a random drafter's almost never are)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from flashpd.engine.llm_engine import EngineConfig
from flashpd.engine.loading import load_engine
from flashpd.engine.sampling import SamplingParams
from flashpd.model.presets.small import checkpoint_path

PROMPTS = (
    "<|begin_of_sentence|><|User|>How do I read a CSV file in Python and print the first rows?<|Assistant|>",
    "<|begin_of_sentence|><|User|>Write a short poem about the sea at night.<|Assistant|>",
)


def _run(spec: dict | None) -> tuple[dict[str, list[int]], object]:
    engine = load_engine(
        checkpoint_path(), EngineConfig(num_blocks=64, dtype="float32", device="cpu", speculative=spec)
    )
    tok = Tokenizer.from_file(f"{checkpoint_path()}/tokenizer.json")
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    for i, text in enumerate(PROMPTS):
        engine.add_request(f"r{i}", tok.encode(text, add_special_tokens=False).ids, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.finish_reason != "error", o.error
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out, engine.spec_stats


@pytest.mark.slow
def test_shipped_drafter_is_exact_and_accepted():
    plain, _ = _run(None)
    spec, stats = _run({"method": "dspark", "num_tokens": 5})
    assert spec == plain
    assert stats.verifies > 0 and stats.acceptance_length > 1.5, stats.snapshot()
