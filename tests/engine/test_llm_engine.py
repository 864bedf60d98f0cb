"""LLMEngine end to end on the tiny preset (FP32, CPU): batching, prefix hits, preemption."""

from __future__ import annotations

import pytest
import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(
    engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams, sequential: bool = False
) -> dict[str, dict]:
    out: dict[str, dict] = {}
    todo = list(prompts.items())
    if not sequential:
        for rid, p in todo:
            engine.add_request(rid, p, params)
        todo = []
    while todo or engine.has_unfinished():
        if todo and not engine.has_unfinished():
            rid, p = todo.pop(0)
            engine.add_request(rid, p, params)
        for o in engine.step():
            r = out.setdefault(o.request_id, {"ids": [], "cached": 0})
            r["ids"].extend(o.new_token_ids)
            if o.finished:
                r["cached"], r["reason"] = o.cached_tokens, o.finish_reason
    return out


def _reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    state = model.new_state()
    logits, out = model.run(state, prompt), []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = model.run(state, [out[-1]])
    return out


def test_greedy_alone_equals_batched_and_reference(model_f32):
    prompts = {"a": _prompt(150, 1), "b": _prompt(20, 2), "c": _prompt(131, 3)}
    params = SamplingParams(max_tokens=5)
    cfg = EngineConfig(swa_bounded_replay=False, max_num_batched_tokens=128, num_blocks=64)
    batched = _run(LLMEngine(model_f32, cfg), prompts, params)
    for rid, p in prompts.items():
        alone = _run(LLMEngine(model_f32, cfg), {rid: p}, params)
        assert batched[rid]["ids"] == alone[rid]["ids"]
    assert batched["b"]["ids"] == _reference_greedy(model_f32, prompts["b"], 5)


def test_prefix_hit_without_replay_is_bit_identical_to_cold_run(model_f32):
    base = _prompt(300, 4)
    follow = base + _prompt(40, 5)
    params = SamplingParams(max_tokens=4, logprobs=1)
    cfg = EngineConfig(swa_bounded_replay=False, num_blocks=64)
    cold = _run(LLMEngine(model_f32, cfg), {"f": follow}, params)
    engine = LLMEngine(model_f32, cfg)
    warm = _run(engine, {"b": base, "f": follow}, params, sequential=True)
    assert warm["f"]["ids"] == cold["f"]["ids"]
    # exact replay needs W + (L-1)(W-1) = 1271 rows on tiny: a 256-token hit gives no credit
    assert warm["f"]["cached"] == 0


def test_bounded_replay_credits_usable_prefix(model_f32):
    base = _prompt(300, 6)
    follow = base + _prompt(40, 7)
    engine = LLMEngine(model_f32, EngineConfig(num_blocks=64))
    res = _run(engine, {"b": base, "f": follow}, SamplingParams(max_tokens=3), sequential=True)
    # 300 + 3 outputs -> chunks 0,1 cached (256 tokens); usable = 256 - 128
    assert res["f"]["cached"] == 128


def test_preemption_and_resume_give_same_greedy_output(model_f32):
    prompts = {f"r{i}": _prompt(100, 10 + i) for i in range(3)}
    params = SamplingParams(max_tokens=40)
    roomy = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64)), prompts, params)
    tight_engine = LLMEngine(model_f32, EngineConfig(num_blocks=3, num_slots=3))
    tight = _run(tight_engine, prompts, params)
    assert tight_engine.scheduler.num_preemptions > 0
    for rid in prompts:
        assert tight[rid]["ids"] == roomy[rid]["ids"]


def test_seeded_sampling_reproducible(model_f32):
    p = {"s": _prompt(30, 20)}
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    a = _run(LLMEngine(model_f32, EngineConfig(num_blocks=16)), p, params)
    b = _run(LLMEngine(model_f32, EngineConfig(num_blocks=16)), p, params)
    assert a["s"]["ids"] == b["s"]["ids"]


def test_bad_token_id_names_the_field(model_f32):
    engine = LLMEngine(model_f32, EngineConfig(num_blocks=8))
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request("x", [1, 99999], SamplingParams())


def test_no_block_leaks_after_abort(model_f32):
    engine = LLMEngine(model_f32, EngineConfig(num_blocks=16))
    engine.add_request("a", _prompt(200, 30), SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.abort("a")
    usage = engine.usage()
    assert usage["blocks_free"] + usage["blocks_cached"] == usage["blocks_total"]
    assert usage["slots_free"] == 16 or usage["slots_free"] == engine.config.num_slots


def test_exact_replay_credit_is_bit_identical_to_cold_run(model_f32):
    # A hit of 11 chunks (1408 tokens) leaves credit after the exact replay of
    # W + (L-1)(W-1) = 1271 rows: usable = 1408 - 1271 = 137 tokens.
    base = _prompt(1408, 40)
    follow = base + _prompt(30, 41)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    cfg = EngineConfig(swa_bounded_replay=False, num_blocks=64, max_num_batched_tokens=4096)
    cold = _run(LLMEngine(model_f32, cfg), {"f": follow}, params)
    warm = _run(LLMEngine(model_f32, cfg), {"b": base, "f": follow}, params, sequential=True)
    assert warm["f"]["cached"] == 137
    assert warm["f"]["ids"] == cold["f"]["ids"]


def test_stops_at_the_first_stop_token_id(model_f32):
    prompt = _prompt(20, 50)
    free = _run(
        LLMEngine(model_f32, EngineConfig(num_blocks=16)), {"f": prompt}, SamplingParams(max_tokens=6, ignore_eos=True)
    )["f"]["ids"]
    stop_id = free[2]
    out = _run(
        LLMEngine(model_f32, EngineConfig(num_blocks=16)),
        {"s": prompt},
        SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=(stop_id,)),
    )["s"]
    assert out["ids"] == free[: free.index(stop_id) + 1] and out["reason"] == "stop"


def test_fp8_compressed_kv_engine_matches_its_reference(ckpt_dir):
    from flashpd.model.model import load_model

    model = load_model(ckpt_dir, torch.float32, compressed_kv_format="fp8")
    prompt = _prompt(140, 70)
    eng = LLMEngine(model, EngineConfig(num_blocks=16, kv_format="fp8", swa_bounded_replay=False))
    out = _run(eng, {"f": prompt}, SamplingParams(max_tokens=4))
    assert out["f"]["ids"] == _reference_greedy(model, prompt, 4)
    with pytest.raises(ValueError, match="kv_format"):
        LLMEngine(model, EngineConfig(num_blocks=16))  # nvfp4 pools for an fp8 model
