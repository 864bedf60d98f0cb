"""The speculative step end to end on the tiny preset (FP32, CPU): greedy outputs are token-
identical to non-speculative decoding for many prompts and batch compositions (bounded replay on
and off, prefix hits, a request that opts out, stop ids and max_tokens inside accepted drafts);
the scheduler's and the KV manager's books stay consistent and no block hash is published for a
token that was not accepted."""

from __future__ import annotations

import pytest
import torch

from flashpd.engine.hashing import next_chunk_hash, root_hash
from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.speculative import NgramDrafter, Proposal, SpeculativeConfig


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class OracleDrafter:
    """A test drafter at the seam: proposes the known greedy continuation with a wrong token
    at a position that cycles per call (0 .. k: every acceptance length occurs)."""

    uses_tap = False

    def __init__(self, k: int, reference: dict[tuple[int, ...], list[int]], vocab: int):
        self.num_tokens, self.reference, self.vocab, self.calls = k, reference, vocab, 0

    def new_state(self, token_ids):
        return token_ids

    def release(self, state):
        return None

    def warm_up(self, max_batch):
        return 0

    def observe(self, states, positions, taps):
        return None

    def propose(self, states, anchors, anchor_positions, choose):
        out = []
        for tokens, pos in zip(states, anchor_positions, strict=True):
            self.calls += 1
            full = next((v for k, v in self.reference.items() if list(tokens[: len(k)]) == list(k)), None)
            if full is None:
                out.append([])
                continue
            prompt_len = len(full[0])
            cont = full[1][pos + 1 - prompt_len : pos + 1 - prompt_len + self.num_tokens]
            wrong = self.calls % (self.num_tokens + 2)
            if wrong < len(cont):
                cont = cont[:wrong] + [(cont[wrong] + 1) % self.vocab] + cont[wrong + 1 :]
            out.append(cont)
        return Proposal(out, None)


def _run(
    engine: LLMEngine, prompts: dict, params: dict | SamplingParams, sequential: bool = False
) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    todo = list(prompts.items())
    par = (lambda rid: params[rid]) if isinstance(params, dict) else (lambda rid: params)
    if not sequential:
        for rid, p in todo:
            engine.add_request(rid, p, par(rid))
        todo = []
    while todo or engine.has_unfinished():
        if todo and not engine.has_unfinished():
            rid, p = todo.pop(0)
            engine.add_request(rid, p, par(rid))
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert o.finish_reason != "error", o.error
    engine.kv.check_consistency()
    return out


PROMPTS = {
    "a": _prompt(20, 1),
    "b": _prompt(127, 2),
    "c": _prompt(128, 3),
    "d": _prompt(141, 4),
    "e": _prompt(300, 5),
    "f": _prompt(3, 6),
}


def _spec_engine(model, cfg_kw, reference, k=5, max_batch=64, **spec_kw):
    spec = SpeculativeConfig(method="ngram", num_tokens=k, max_batch=max_batch, **spec_kw)
    engine = LLMEngine(model, EngineConfig(num_blocks=64, speculative=spec, **cfg_kw))
    keyed = {tuple(PROMPTS[r]): (PROMPTS[r], ids) for r, ids in reference.items()}
    engine.drafter = OracleDrafter(k, keyed, model.cfg.vocab_size)
    return engine


@pytest.mark.parametrize("cfg_kw", [{}, {"swa_bounded_replay": False}, {"max_num_batched_tokens": 64}])
def test_greedy_speculation_is_token_identical(model_f32, cfg_kw):
    params = SamplingParams(max_tokens=23)
    reference = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64, **cfg_kw)), PROMPTS, params)
    engine = _spec_engine(model_f32, cfg_kw, reference)
    assert _run(engine, PROMPTS, params) == reference
    stats = engine.spec_stats
    assert stats.verifies > 0 and 0 < stats.accepted < stats.drafted
    assert len(stats.length_counts) >= 4  # acceptance differs per sequence and step


def test_sequential_prefix_hits_and_opt_out_stay_identical(model_f32):
    base = PROMPTS["e"]
    prompts = {"e": base, "g": base + _prompt(30, 9), "a": PROMPTS["a"]}
    params = {
        "e": SamplingParams(max_tokens=9),
        "a": SamplingParams(max_tokens=9),
        "g": SamplingParams(max_tokens=9, speculative="off"),
    }
    reference = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64)), prompts, params, sequential=True)
    PROMPTS_G = dict(PROMPTS, g=prompts["g"])
    engine = _spec_engine(model_f32, {}, {r: reference[r] for r in ("e", "a")})
    engine.drafter.reference[tuple(PROMPTS_G["g"])] = (prompts["g"], reference["g"])
    got = _run(engine, prompts, params, sequential=True)
    assert got == reference
    assert engine.stats  # ran
    before = engine.spec_stats.verifies
    assert before > 0


def test_policy_switches_off_above_max_batch(model_f32):
    params = {rid: SamplingParams(max_tokens=14 if rid in "ef" else 4) for rid in PROMPTS}
    reference = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64)), PROMPTS, params)
    engine = _spec_engine(model_f32, {}, reference, max_batch=2)
    seen = []
    propose = engine.drafter.propose
    engine.drafter.propose = lambda states, *a: seen.append(engine.scheduler.num_running) or propose(states, *a)
    assert _run(engine, PROMPTS, params) == reference
    assert seen and max(seen) <= 2  # drafted only once the batch fell to max_batch
    assert engine.spec_stats.verifies > 0


def test_policy_switches_off_above_max_context_tokens(model_f32):
    """A step whose decode rows' contexts add up to more than the bound does not speculate (a
    verify row reads its whole context): here only once the four short requests have ended."""
    params = {rid: SamplingParams(max_tokens=14 if rid in "ef" else 4) for rid in PROMPTS}
    reference = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64)), PROMPTS, params)

    def contexts_when_drafting(bound):
        engine = _spec_engine(model_f32, {}, reference, max_context_tokens=bound)
        seen = []
        propose = engine.drafter.propose
        engine.drafter.propose = lambda states, anchors, positions, *a: (
            seen.append(sum(p + 1 for p in positions)) or propose(states, anchors, positions, *a)
        )
        assert _run(engine, PROMPTS, params) == reference
        assert engine.spec_stats.verifies > 0
        return seen

    assert max(contexts_when_drafting(None)) > 400  # unbounded: drafts with every row running
    assert max(contexts_when_drafting(400)) <= 400
    with pytest.raises(ValueError, match="max_context_tokens"):
        SpeculativeConfig(max_context_tokens=-1)


def test_stops_inside_accepted_drafts_emit_nothing_after(model_f32):
    params = SamplingParams(max_tokens=30)
    reference = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64)), PROMPTS, params)
    stop = {rid: ids[7] for rid, ids in reference.items()}
    per = {rid: SamplingParams(max_tokens=30, stop_token_ids=(stop[rid],)) for rid in PROMPTS}
    want = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64)), PROMPTS, per)
    engine = _spec_engine(model_f32, {}, reference)
    assert _run(engine, PROMPTS, per) == want
    for rid, ids in want.items():
        assert ids[-1] == stop[rid] and stop[rid] not in ids[:-1]
    short = SamplingParams(max_tokens=4)
    engine = _spec_engine(model_f32, {}, reference)
    got = _run(engine, PROMPTS, short)
    assert got == {rid: ids[:4] for rid, ids in reference.items()}


def test_no_hash_for_unaccepted_tokens(model_f32):
    """Block hashes published while speculating are exactly the chained hashes of the
    accepted tokens' full chunks (the engine's own outputs), never of a rejected draft."""
    prompt = _prompt(120, 11)
    params = SamplingParams(max_tokens=60)
    reference = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64)), {"a": prompt}, params)
    spec = SpeculativeConfig(num_tokens=5)
    engine = LLMEngine(model_f32, EngineConfig(num_blocks=64, speculative=spec))
    engine.drafter = OracleDrafter(5, {tuple(prompt): (prompt, reference["a"])}, 512)
    got = _run(engine, {"a": prompt}, params)
    assert got == reference
    stored = [h for e in engine.drain_cache_events() for h in getattr(e, "block_hashes", ())]
    tokens = prompt + got["a"]
    parent, want = root_hash(engine.kv.namespace), []
    for i in range(len(tokens) // 128):
        parent = next_chunk_hash(parent, tokens[i * 128 : (i + 1) * 128])
        want.append(parent)
    assert stored and set(stored) <= set(want)


def test_ngram_drafter_lookup_and_engine(model_f32):
    d = NgramDrafter(3, 1, 3)
    st = d.new_state([1, 2, 3, 4, 9, 1, 2, 3])
    assert d.propose([st], [4], [8], None).tokens == [[9, 1, 2]]  # "2 3 4" -> "9 1 2"
    assert d.propose([st], [7], [8], None).tokens == [[]]
    prompts = {"r": [5, 6, 7, 8] * 30, "s": _prompt(50, 3)}
    params = SamplingParams(max_tokens=12)
    reference = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64)), prompts, params)
    engine = LLMEngine(model_f32, EngineConfig(num_blocks=64, speculative={"method": "ngram"}))
    assert _run(engine, prompts, params) == reference
    assert engine.spec_stats.drafted > 0


def test_forced_acceptance_is_refused_without_the_bench_env(monkeypatch):
    from flashpd.engine.speculative import BENCH_ENV

    monkeypatch.delenv(BENCH_ENV, raising=False)
    with pytest.raises(ValueError, match=BENCH_ENV):
        SpeculativeConfig(bench_forced_acceptance_length=3.5)
    monkeypatch.setenv(BENCH_ENV, "yes")  # only "1" enables it
    with pytest.raises(ValueError, match=BENCH_ENV):
        EngineConfig(speculative={"bench_forced_acceptance_length": 3.5})


def test_forced_acceptance_follows_the_schedule_and_is_reported(model_f32, monkeypatch, caplog):
    from flashpd.engine.speculative import BENCH_ENV

    monkeypatch.setenv(BENCH_ENV, "1")
    spec = {"method": "ngram", "num_tokens": 5, "bench_forced_acceptance_length": 3.5}
    with caplog.at_level("WARNING"):
        engine = LLMEngine(model_f32, EngineConfig(num_blocks=64, speculative=spec))
    assert "BENCHMARK MODE" in caplog.text
    prompts = {"a": _prompt(30, 1), "b": _prompt(60, 2)}
    outs = []
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=33, ignore_eos=True))
    while engine.has_unfinished():
        outs += engine.step()
    finals = {o.request_id: o for o in outs if o.finished}
    assert set(finals) == {"a", "b"}
    for o in finals.values():
        assert o.output_tokens == 33
        assert o.forced_acceptance_length == 3.5
        # 1 prefill token, verifies of 3, 4, 3, 4, ... tokens (accepted 2, 3, ...: mean 2.5) up
        # to 32, then one plain decode (no room left for a draft): 1 + 28 + 3 + 1
        assert o.draft_steps == 9 and o.accepted_draft_tokens == 4 * (2 + 3) + 2
    assert all(o.forced_acceptance_length == 3.5 for o in outs)


def test_decode_worker_drafts_after_the_handoff(model_f32):
    """P/D: a prefill engine computes the prompt's KV, a decode engine receives its blocks,
    replays the last 128 rows (windows, open rows; the drafter's context, bounded replay) and
    drafts from its first decode step: greedy output equals the decode engine without drafts."""
    from tests.engine.test_continuation import _decode, _engine, _prefill

    prompt = _prompt(300, 21)
    outs = {}
    for spec in (None, {"method": "ngram", "num_tokens": 4}):
        p = _engine(model_f32, "prefill")
        d = _engine(model_f32, "decode", speculative=spec)
        ready = _prefill(p, "a", prompt)
        if spec is not None:
            keyed = {tuple(prompt): (prompt, outs[None])}
            d.drafter = OracleDrafter(4, keyed, 512)
        outs[None if spec is None else "spec"] = _decode(d, "a", prompt, 24, p, ready.kv_block_ids)
        if spec is not None:
            assert d.spec_stats.verifies > 0 and d.spec_stats.accepted > 0
    assert outs["spec"] == outs[None]
    with pytest.raises(ValueError, match="prefill"):
        _engine(model_f32, "prefill", speculative={"method": "ngram"})


def test_opted_out_and_logprob_rows_ride_in_the_verify_batch(model_f32):
    params = {rid: SamplingParams(max_tokens=12) for rid in PROMPTS}
    params["a"] = SamplingParams(max_tokens=12, speculative="off")
    params["b"] = SamplingParams(max_tokens=12, logprobs=2)
    reference = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64)), PROMPTS, params)
    engine = _spec_engine(model_f32, {}, reference)
    mixed = []
    execute = engine.runner.execute

    def spy(plan, known, fed=None, verify=frozenset()):
        if verify:
            mixed.append((len(plan.chunks), set(verify)))
        return execute(plan, known, fed, verify)

    engine.runner.execute = spy
    assert _run(engine, PROMPTS, params) == reference
    assert mixed and all(not {"a", "b"} & v for _, v in mixed)
    assert any(n > len(v) for n, v in mixed)  # 1-row segments in a verify step


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_inside_accepted_drafts(model_f32, ignore_eos):
    prompts = {"a": PROMPTS["a"], "d": PROMPTS["d"]}
    params = SamplingParams(max_tokens=16, ignore_eos=ignore_eos)
    free = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64)), prompts, SamplingParams(max_tokens=16))
    eos = free["a"][6]
    reference = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64), eos_token_id=eos), prompts, params)
    spec = SpeculativeConfig(num_tokens=5)
    engine = LLMEngine(model_f32, EngineConfig(num_blocks=64, speculative=spec), eos_token_id=eos)
    keyed = {tuple(p): (p, free[r]) for r, p in prompts.items()}
    engine.drafter = OracleDrafter(5, keyed, 512)
    got = _run(engine, prompts, params)
    assert got == reference
    assert (got["a"][-1] == eos and len(got["a"]) == 7) != ignore_eos


def test_a_failing_drafter_costs_drafts_not_requests(model_f32):
    prompts = {"a": PROMPTS["a"], "d": PROMPTS["d"]}
    params = SamplingParams(max_tokens=10)
    reference = _run(LLMEngine(model_f32, EngineConfig(num_blocks=64)), prompts, params)
    engine = _spec_engine(model_f32, {}, {r: reference[r] for r in prompts})
    propose, calls = engine.drafter.propose, []

    def flaky(*args):
        calls.append(1)
        if len(calls) % 2:
            raise RuntimeError("drafter broke")
        return propose(*args)

    engine.drafter.propose = flaky
    assert _run(engine, prompts, params) == reference
    assert len(calls) > 2 and engine.spec_stats.verifies > 0
