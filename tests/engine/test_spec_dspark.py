"""The engine's speculative step with the checkpoint's DSpark drafter (tiny preset, random
drafter weights): greedy output token-identical to plain decoding, and the drafter is handed
exactly the committed positions' taps (each once, never a rejected draft's), colocated and on a
decode worker whose bounded replay rebuilds the drafter's windows."""

from __future__ import annotations

import pytest
import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams
from flashpd.model.checkpoint import load_checkpoint
from flashpd.model.dspark import DSparkDrafter

SPEC = {"method": "dspark", "num_tokens": 5}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def drafter(ckpt_dir, model_f32):
    d = DSparkDrafter.from_checkpoint(load_checkpoint(ckpt_dir), model_f32)
    assert d is not None, "the tiny preset's random checkpoint carries a drafter"
    return d


def _record(engine: LLMEngine) -> dict[int, list[list[int]]]:
    """Positions handed to the drafter, per drafter state (id)."""
    seen: dict[int, list[list[int]]] = {}
    observe = engine.drafter.observe

    def spy(states, positions, taps):
        assert taps.shape[0] == sum(len(p) for p in positions)
        for st, pos in zip(states, positions, strict=True):
            seen.setdefault(id(st), []).append(list(pos))
        return observe(states, positions, taps)

    engine.drafter.observe = spy
    return seen


def _run(engine, prompts, params):
    out = {}
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    while engine.has_unfinished():
        for o in engine.step():
            assert o.finish_reason != "error", o.error
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_dspark_greedy_identical_and_only_committed_positions(model_f32, drafter):
    prompts = {"a": _prompt(300, 1), "b": _prompt(40, 2), "c": _prompt(129, 3)}
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    reference = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64)), prompts, params)
    engine = LLMEngine(model_f32, EngineConfig(num_blocks=64, speculative=SPEC), dspark=drafter)
    states = {}
    orig = engine._drafter_state

    def state_of(rid):
        states[rid] = orig(rid)
        return states[rid]

    engine._drafter_state = state_of
    seen = _record(engine)
    assert _run(engine, prompts, params) == reference
    assert engine.spec_stats.verifies > 0
    for rid, prompt in prompts.items():
        flat = [p for piece in seen[id(states[rid])] for p in piece]
        n = len(prompt)
        # the prompt's last <= 128 rows (decoder narrowing), then every committed position once
        assert flat == list(range(max(0, n - 128) if n > 128 else 0, n + 20 - 1)), rid


def test_dspark_sampled_runs_and_decode_worker_replay_seeds_the_windows(model_f32, drafter):
    from tests.engine.test_continuation import _copy, _engine, _prefill

    prompt = _prompt(300, 5)
    p = _engine(model_f32, "prefill")
    ready = _prefill(p, "a", prompt)
    d = LLMEngine(model_f32, EngineConfig(role="decode", num_blocks=64, num_slots=8, speculative=SPEC), dspark=drafter)
    seen = _record(d)
    r = d.reserve("a", prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True))
    _copy(p, ready.kv_block_ids[r.num_cached_blocks :], d, r.missing_block_ids)
    d.kv_arrived("a")
    out = []
    while d.has_unfinished():
        for o in d.step():
            out.extend(o.new_token_ids)
    assert len(out) == 12 and d.spec_stats.verifies > 0
    flat = [pos for pieces in seen.values() for piece in pieces for pos in piece]
    assert flat == list(range(300 - 128, 300 + 12 - 1))  # replay rows, then committed ones


def test_dspark_needs_a_drafter(model_f32):
    with pytest.raises(ValueError, match="drafter"):
        LLMEngine(model_f32, EngineConfig(speculative=SPEC))


@pytest.mark.parametrize("graphs", ["off", "static"])
def test_dspark_greedy_identical_through_the_pool_and_the_graph_path(model_f32, drafter, graphs):
    """Eager pooled drafts and the graph path's padded bucket programs (3 sequences: bucket 4)
    give the plain greedy output; every draft took the path asked for, and every pool row is
    back when the requests are done."""
    prompts = {"a": _prompt(200, 11), "b": _prompt(30, 12), "c": _prompt(129, 13)}
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    reference = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64)), prompts, params)
    spec = {**SPEC, "draft_graphs": graphs}
    engine = LLMEngine(model_f32, EngineConfig(num_blocks=64, max_num_seqs=4, speculative=spec), dspark=drafter)
    assert _run(engine, prompts, params) == reference
    c = engine.drafter.counters()
    assert c["proposes"] > 0 and c["graph" if graphs == "static" else "eager_fallback"] == c["proposes"]
    assert engine.drafter.pool.num_free == 4


def test_dspark_mixed_greedy_and_sampled_batch(model_f32, drafter):
    """A sampled request in the batch: the step drafts eagerly with the engine's chooser (its q
    go to the rejection sampler, counted), and the greedy request's output is still plain
    greedy decoding's."""
    prompts = {"g": _prompt(90, 21), "s": _prompt(60, 22)}
    params = {
        "g": SamplingParams(max_tokens=12, ignore_eos=True),
        "s": SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True),
    }

    def run(engine):
        out = {}
        for rid, p in prompts.items():
            engine.add_request(rid, p, params[rid])
        while engine.has_unfinished():
            for o in engine.step():
                assert o.finish_reason != "error", o.error
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    reference = run(LLMEngine(model_f32, EngineConfig(num_blocks=64)))
    spec = {**SPEC, "draft_graphs": "static"}
    engine = LLMEngine(model_f32, EngineConfig(num_blocks=64, max_num_seqs=4, speculative=spec), dspark=drafter)
    out = run(engine)
    assert out["g"] == reference["g"] and len(out["s"]) == 12
    assert engine.drafter.counters()["eager_sampled"] > 0
