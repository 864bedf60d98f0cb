"""warm_up: synthetic serving-shaped requests through the engine, in each role, leaving nothing
behind (tiny preset, FP32, CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.warmup import BUCKETS, PREFIX, WarmupPlan, default_plan, warm_up
from flashpd.model.presets import preset_config

PLAN = WarmupPlan(long_tokens=300, short_tokens=40, batches=(1, 2, 4), decode_steps=2)
# one hit + turn per turn-graph bucket: 2, then 4, 8, ... up to the sliding window
TURNS = 1 + sum(1 for b in BUCKETS if 4 <= b <= preset_config("tiny").sliding_window)


def _engine(model, role="colocated", **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(role=role, num_blocks=64, num_slots=8, max_num_batched_tokens=128, **kw))


def _generate(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    engine.add_request("real", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    ids: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            ids.extend(o.new_token_ids)
    return ids


def _assert_clean(engine: LLMEngine, before: dict) -> None:
    assert not engine.has_unfinished()
    assert engine.kv.usage() == dict(before, blocks_free=before["blocks_total"], blocks_cached=0)
    assert engine.drain_cache_events() == []  # nothing of the warm-up reaches the cache index
    assert not [r for r in engine.stats if r.startswith(PREFIX)]
    engine.kv.check_consistency()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_colocated_warm_up_runs_every_bucket_and_changes_no_output(model_f32, async_scheduling):
    prompt = torch.randint(3, 500, (170,), generator=torch.Generator().manual_seed(7)).tolist()
    fresh = _generate(_engine(model_f32, async_scheduling=async_scheduling), prompt, 6)
    engine = _engine(model_f32, async_scheduling=async_scheduling)
    before = engine.kv.usage()
    steps_before = engine.num_steps
    done = warm_up(engine, PLAN)
    # a long prompt, then per context 1 + 1 + 2 sequences (buckets 1, 2, 4), then 4 at once,
    # then a hit + turn per turn-graph bucket (2 .. W rows) on the long and the short prompt
    assert done["requests"] == 1 + 2 * 4 + 4 + 2 * TURNS and done["batches"] == [1, 2, 4]
    assert done["steps"] >= engine.num_steps - steps_before > 2 * 3 * PLAN.decode_steps
    _assert_clean(engine, before)
    assert engine.kv.lookup(list(range(10, 400))).hit_tokens == 0
    assert _generate(engine, prompt, 6) == fresh  # greedy: same tokens as a fresh engine


def test_every_bucket_decodes_with_a_full_batch_at_both_contexts(model_f32):
    engine = _engine(model_f32)
    seen: list[tuple[int, int]] = []  # (sequences, longest context) of each all-decode forward
    forward = engine.model.forward

    def spy(token_ids, seqs, *args, **kwargs):
        if all(inp.num_tokens == 1 for inp in seqs):
            seen.append((len(seqs), max(inp.start_pos for inp in seqs)))
        return forward(token_ids, seqs, *args, **kwargs)

    engine.model.forward = spy
    try:
        warm_up(engine, PLAN)
    finally:
        del engine.model.forward
    for b in PLAN.batches:
        assert any(n == b and ctx > PLAN.long_tokens for n, ctx in seen)
        assert any(n == b and PLAN.short_tokens < ctx < PLAN.long_tokens for n, ctx in seen)


def test_decode_role_warm_up_admits_as_the_router_does(model_f32):
    engine = _engine(model_f32, role="decode")
    before = engine.kv.usage()
    done = warm_up(engine, PLAN)
    assert done["requests"] == 13 + 2 * TURNS
    _assert_clean(engine, before)


def test_prefill_role_warm_up_runs_prompts_only(model_f32):
    engine = _engine(model_f32, role="prefill")
    before = engine.kv.usage()
    done = warm_up(engine, PLAN)
    assert done["requests"] == 3 + TURNS and done["batches"] == [1, 2, 4]
    _assert_clean(engine, before)


def test_default_plan_fits_the_pool_positions_and_batch_limits(model_f32):
    engine = _engine(model_f32, max_num_seqs=6)
    plan = default_plan(engine)
    assert plan.long_tokens <= 64 * 128 // 4
    assert plan.long_tokens <= model_f32.cfg.max_position_embeddings // 2
    assert plan.batches == (1, 2, 4) and plan.short_tokens <= plan.long_tokens
    big = LLMEngine(
        model_f32,
        dataclasses.replace(
            engine.config, num_blocks=4096, num_slots=300, max_num_seqs=256, max_num_batched_tokens=8192
        ),
    )
    plan = default_plan(big)
    assert plan.long_tokens == min(16384 + 129, model_f32.cfg.max_position_embeddings // 2)
    assert plan.batches[-1] == 256


def test_a_warm_up_that_cannot_finish_raises_and_still_cleans_up(model_f32):
    engine = _engine(model_f32)
    before = engine.kv.usage()
    with pytest.raises(RuntimeError, match="did not finish"):
        warm_up(engine, dataclasses.replace(PLAN, max_steps=3))
    _assert_clean(engine, before)


def test_a_long_prompt_past_512_adds_an_aligned_prompt_of_other_tokens(model_f32):
    engine = _engine(model_f32, role="prefill")
    before = engine.kv.usage()
    done = warm_up(engine, dataclasses.replace(PLAN, long_tokens=600))
    assert done["requests"] == 4 + TURNS  # long, aligned (512 tokens), hit + turn, short, turns
    _assert_clean(engine, before)


def test_at_load_a_failing_warm_up_is_logged_and_the_engine_serves(model_f32, caplog):
    from flashpd.engine.warmup import warm_up_at_load

    engine = _engine(model_f32)
    before = engine.kv.usage()
    with caplog.at_level("ERROR"):
        assert warm_up_at_load(engine, dataclasses.replace(PLAN, max_steps=3)) is None
    assert "engine warm-up failed" in caplog.text
    _assert_clean(engine, before)
    assert len(_generate(engine, list(range(20, 60)), 3)) == 3


def test_at_load_the_switch_skips_it(model_f32, monkeypatch):
    from flashpd.engine.warmup import warm_up_at_load

    engine = _engine(model_f32)
    monkeypatch.setenv("FLASHPD_ENGINE_WARMUP", "0")
    assert warm_up_at_load(engine, PLAN) is None and engine.num_steps == 0
    monkeypatch.setenv("FLASHPD_ENGINE_WARMUP", "1")
    assert warm_up_at_load(engine, PLAN)["requests"] == 13 + 2 * TURNS and engine.num_steps > 0


def test_wide_turn_rows_span_w_to_the_chunk_on_and_off_divisibility_by_16():
    from flashpd.engine.warmup import wide_turn_rows

    rows = wide_turn_rows(128, 8192)
    assert rows[0] == 129 and max(rows) < 8192 and list(rows) == sorted(set(rows))
    assert 328 // 1.6 < max(r for r in rows if r <= 328)  # the H200's 328-row turn: a near count
    assert any(r % 16 == 0 for r in rows) and any(r % 16 for r in rows)
    assert all(b / a <= 1.6 + 1e-9 for a, b in zip(rows, rows[1:], strict=False))
    assert wide_turn_rows(128, 129) == () and wide_turn_rows(8, 20) == (9, 14)


def test_default_plan_adds_wide_turns_on_a_gpu_only_and_never_for_the_decode_role(model_f32):
    from flashpd.engine.warmup import wide_turn_rows

    engine = _engine(model_f32, role="prefill")
    engine.config = dataclasses.replace(engine.config, max_num_batched_tokens=8192)  # read by default_plan only
    assert default_plan(engine).wide_turns == ()  # CPU: nothing compiles
    engine.config = dataclasses.replace(engine.config, device="cuda")
    want = wide_turn_rows(model_f32.cfg.sliding_window, 8192)
    assert want and default_plan(engine).wide_turns == want
    engine.config = dataclasses.replace(engine.config, role="decode")
    assert default_plan(engine).wide_turns == ()


@pytest.mark.parametrize("role", ["prefill", "colocated"])
def test_wide_turns_run_as_hits_of_their_row_counts_and_leave_nothing(model_f32, role, monkeypatch):
    plain = warm_up(_engine(model_f32, role=role), PLAN)["requests"]
    engine = _engine(model_f32, role=role)
    before = engine.kv.usage()
    lengths: list[int] = []
    add = engine.add_request

    def recording(rid, ids, *args, **kw):
        lengths.append(len(ids))
        return add(rid, ids, *args, **kw)

    monkeypatch.setattr(engine, "add_request", recording)
    done = warm_up(engine, dataclasses.replace(PLAN, wide_turns=(20, 33)))
    assert done["requests"] == plain + 2
    assert lengths[-2:] == [PLAN.short_tokens + 20, PLAN.short_tokens + 33]  # after a hit on the short prompt
    _assert_clean(engine, before)
