"""A stream continued on a second decode engine (`PrefixPolicy`): with the 128-token bounded
replay, greedy output equals the unbroken run when the continuation rebuilds its windows from
the original prompt boundary and recomputes the streamed outputs teacher-forced (tiny, FP32)."""

from __future__ import annotations

import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.request import PrefixPolicy
from flashpd.engine.sampling import SamplingParams

PROMPT_TOKENS = 300
MAX_TOKENS = 24


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model, role: str, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(role=role, num_blocks=64, num_slots=8, **kw))


def _prefill(p: LLMEngine, rid: str, ids: list[int], prefix: PrefixPolicy | None = None):
    p.add_request(rid, ids, SamplingParams(max_tokens=1), prefix=prefix)
    while True:
        for out in p.step():
            if out.request_id == rid and out.finished:
                assert out.finish_reason == "kv_ready"
                return out


def _copy(src: LLMEngine, src_ids, dst: LLMEngine, dst_ids) -> None:
    """What a KV transfer does: the global groups' bytes of the given blocks."""
    s, d = src.pools.transfer_groups(), dst.pools.transfer_groups()
    for name, tensor in s.items():
        d[name][list(dst_ids)] = tensor[list(src_ids)]


def _decode(
    d: LLMEngine,
    rid: str,
    ids: list[int],
    max_tokens: int,
    src: LLMEngine,
    src_blocks,
    prefix: PrefixPolicy | None = None,
) -> list[int]:
    r = d.reserve(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), prefix=prefix)
    assert r is not None
    missing = r.missing_block_ids
    _copy(src, src_blocks[r.num_cached_blocks : r.num_cached_blocks + len(missing)], d, missing)
    d.kv_arrived(rid)
    out: list[int] = []
    while d.has_unfinished():
        for o in d.step():
            out.extend(o.new_token_ids)
    return out


def _unbroken(model, prompt: list[int]) -> list[int]:
    p, d = _engine(model, "prefill"), _engine(model, "decode")
    ready = _prefill(p, "a", prompt)
    return _decode(d, "a", prompt, MAX_TOKENS, p, ready.kv_block_ids)


def test_continuation_from_the_prompt_boundary_is_identical_under_bounded_replay(model_f32):
    prompt = _prompt(PROMPT_TOKENS, 1)
    unbroken = _unbroken(model_f32, prompt)
    for streamed in (1, 9, 23):  # tokens the first decode worker sent before it died
        p2, d2 = _engine(model_f32, "prefill"), _engine(model_f32, "decode")
        ready = _prefill(p2, "b", prompt, PrefixPolicy(max_credit_tokens=0))
        rest = _decode(
            d2,
            "b",
            prompt + unbroken[:streamed],
            MAX_TOKENS - streamed,
            p2,
            ready.kv_block_ids,
            PrefixPolicy(kv_tokens=len(prompt)),
        )
        assert unbroken[:streamed] + rest == unbroken, streamed


def test_reservation_transfers_only_the_original_prompt_chunks(model_f32):
    d = _engine(model_f32, "decode")
    ids = _prompt(PROMPT_TOKENS + 40, 2)  # 300 prompt tokens + 40 streamed outputs
    r = d.reserve("c", ids, SamplingParams(max_tokens=8), prefix=PrefixPolicy(kv_tokens=PROMPT_TOKENS))
    assert len(r.block_ids) == 3 and len(r.missing_block_ids) == 3  # 340 tokens: 3 chunks
    r2 = d.reserve("d", ids, SamplingParams(max_tokens=8), prefix=PrefixPolicy(kv_tokens=200))
    assert len(r2.missing_block_ids) == 2  # chunks 0-1 hold [0, 200); chunk 2 is computed here


def test_prefill_credit_cap_limits_the_prefix_hit(model_f32):
    p = _engine(model_f32, "prefill")
    base = _prompt(520, 3)
    first = _prefill(p, "x", base)
    p.release_kv("x")
    assert first.cached_tokens == 0
    capped = _prefill(p, "y", base + [5, 6], PrefixPolicy(max_credit_tokens=128))
    p.release_kv("y")
    free = _prefill(p, "z", base + [5, 6])
    assert capped.cached_tokens == 128  # hit 256 -> credit 128 (the cap)
    assert free.cached_tokens == 384  # hit 512 -> credit 384


def test_replaying_from_the_continuations_own_end_diverges(model_f32):
    """What the boundary fixes: re-prefilling prompt + outputs and replaying its last 128
    tokens rebuilds other windows, and greedy output drifts (this prompt: from token 1)."""
    prompt = _prompt(PROMPT_TOKENS, 1)
    unbroken = _unbroken(model_f32, prompt)
    p2, d2 = _engine(model_f32, "prefill"), _engine(model_f32, "decode")
    ids = prompt + unbroken[:9]
    ready = _prefill(p2, "b", ids)
    rest = _decode(d2, "b", ids, MAX_TOKENS - 9, p2, ready.kv_block_ids)
    assert unbroken[:9] + rest != unbroken


def _run_until(d: LLMEngine, rid: str, n: int) -> list[int]:
    """Step until `rid` has `n` outputs (async scheduling may have launched one step more)."""
    out: list[int] = []
    while len(out) < n:
        for o in d.step():
            if o.request_id == rid:
                out.extend(o.new_token_ids)
    return out


def _admitted(model, prompt: list[int], rid: str) -> tuple[LLMEngine, LLMEngine]:
    p, d = _engine(model, "prefill"), _engine(model, "decode")
    ready = _prefill(p, rid, prompt)
    r = d.reserve(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    _copy(p, ready.kv_block_ids, d, r.missing_block_ids)
    d.kv_arrived(rid)
    return p, d


def test_paused_request_migrates_to_another_decode_engine_identically(model_f32):
    prompt = _prompt(PROMPT_TOKENS, 1)
    unbroken = _unbroken(model_f32, prompt)
    _, d1 = _admitted(model_f32, prompt, "m")
    before = _run_until(d1, "m", 5)
    paused = d1.pause("m")
    assert paused is not None and paused.kv_tokens == PROMPT_TOKENS
    assert len(paused.kv_block_ids) == 3 and paused.token_ids == tuple(prompt + before)
    d1.step()  # a step launched ahead for it completes; its token is dropped
    d2 = _engine(model_f32, "decode")
    rest = _decode(
        d2,
        "m",
        list(paused.token_ids),
        MAX_TOKENS - len(before),
        d1,
        paused.kv_block_ids,
        PrefixPolicy(kv_tokens=PROMPT_TOKENS),
    )
    assert before + rest == unbroken
    assert (
        d1.abort("m") and d1.kv.usage()["blocks_free"] + d1.kv.usage()["blocks_cached"] == d1.kv.usage()["blocks_total"]
    )


def test_paused_request_resumed_in_place_is_identical(model_f32):
    prompt = _prompt(PROMPT_TOKENS, 1)
    unbroken = _unbroken(model_f32, prompt)
    _, d = _admitted(model_f32, prompt, "s")
    before = _run_until(d, "s", 6)
    assert d.pause("s") is not None and d.pause("s") is None  # not running any more
    d.step()
    d.kv_arrived("s")
    rest = []
    while d.has_unfinished():
        for o in d.step():
            rest.extend(o.new_token_ids)
    assert before + rest == unbroken
