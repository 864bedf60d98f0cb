"""Nothing a request carries stops the engine: hostile sampling values are sampled safely, and a
failure inside a step fails that request alone while the next request on the same engine runs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flashpd.engine.async_engine import AsyncLLMEngine, RequestFailed
from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import Sampler, SamplingError, SamplingParams

HOSTILE = [
    ("temperature", 1e-300),
    ("temperature", 5e-324),
    ("temperature", 1e-45),
    ("top_p", 1e-300),
    ("top_p", 5e-324),
    ("top_p", 1e-45),
    ("seed", 0),
    ("seed", 2**63 - 1),
]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: LLMEngine, rid: str, prompt, params) -> list:
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize("field,value", HOSTILE)
def test_hostile_sampling_value_samples_and_the_engine_goes_on(model_f32, field, value):
    engine = LLMEngine(model_f32, EngineConfig(num_blocks=16, num_slots=4))
    params = {"temperature": 0.7, field: value} if field != "temperature" else {field: value}
    outs = _run(engine, "hostile", _prompt(20, 1), SamplingParams(max_tokens=3, ignore_eos=True, **params))
    assert outs[-1].finish_reason == "length" and outs[-1].error is None
    assert all(0 <= t < model_f32.cfg.vocab_size for o in outs for t in o.new_token_ids)
    after = _run(engine, "after", _prompt(20, 2), SamplingParams(max_tokens=2, ignore_eos=True))
    assert after[-1].finish_reason == "length"


@pytest.mark.parametrize("value", [1e-300, 5e-324, 1e-45, 1e-6])
def test_tiny_temperature_is_greedy(value):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    got = Sampler(0).sample(logits, ["a", "b", "c"], [SamplingParams(temperature=value)] * 3)
    assert [s.token_id for s in got] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("value", [1e-300, 5e-324, 1e-45])
def test_tiny_top_p_keeps_only_the_best_token(value):
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, top_p=value, seed=s) for s in (1, 2)]
    got = Sampler(0).sample(logits, ["a", "b"], params)
    assert [s.token_id for s in got] == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("seed", 1.5),
        ("seed", True),
        ("stop_token_ids", ("x",)),
        ("seed", 2**63),
        ("seed", 2**200),
        ("seed", -(2**70)),
    ],
)
def test_non_numbers_and_out_of_range_seeds_are_refused_naming_the_field(field, value):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**{field: value})


def test_non_finite_logits_fall_back_to_argmax():
    logits = torch.full((1, 10), float("nan"))
    logits[0, 4] = 3.0
    got = Sampler(0).sample(logits, ["a"], [SamplingParams(temperature=0.9)])
    assert got[0].token_id == 4


class _FailingSampler(Sampler):
    """A fault at the sampler seam: sampling for one request id raises."""

    def __init__(self, bad: str):
        super().__init__(0)
        self.bad = bad

    def launch(self, logits, request_ids, params, bitmask=None):  # `sample` goes through it
        if self.bad in request_ids:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return super().launch(logits, request_ids, params, bitmask)


def test_sampling_failure_fails_only_that_request(model_f32):
    engine = LLMEngine(model_f32, EngineConfig(num_blocks=16, num_slots=4))
    engine.sampler = _FailingSampler("bad")
    engine.add_request("bad", _prompt(20, 3), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("good", _prompt(20, 4), SamplingParams(max_tokens=4, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    bad = [o for o in outs if o.request_id == "bad"]
    good = [o for o in outs if o.request_id == "good"]
    assert len(bad) == 1 and bad[0].finish_reason == "error" and "inf, nan" in bad[0].error
    assert good[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in good) == 4
    usage = engine.usage()
    assert usage["blocks_free"] + usage["blocks_cached"] == usage["blocks_total"]


def test_forward_failure_fails_its_batch_and_the_engine_goes_on(model_f32):
    engine = LLMEngine(model_f32, EngineConfig(num_blocks=16, num_slots=4))
    real = engine.runner.execute
    calls = {"n": 0}

    def execute_failing_once(plan, known, *fed):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward fault")
        return real(plan, known, *fed)

    engine.runner.execute = execute_failing_once
    outs = _run(engine, "first", _prompt(20, 5), SamplingParams(max_tokens=3, ignore_eos=True))
    assert outs[-1].finish_reason == "error" and "injected forward fault" in outs[-1].error
    after = _run(engine, "second", _prompt(20, 6), SamplingParams(max_tokens=3, ignore_eos=True))
    assert after[-1].finish_reason == "length"
    usage = engine.usage()
    assert usage["blocks_free"] + usage["blocks_cached"] == usage["blocks_total"]


def test_async_stream_raises_request_failed_and_the_loop_goes_on(model_f32):
    async def main():
        eng = AsyncLLMEngine(LLMEngine(model_f32, EngineConfig(num_blocks=16, num_slots=4)))
        eng.engine.sampler = _FailingSampler("bad")
        try:
            with pytest.raises(RequestFailed, match="bad"):
                async for _ in eng.generate("bad", _prompt(20, 7), SamplingParams(max_tokens=3)):
                    pass
            outs = [o async for o in eng.generate("ok", _prompt(20, 8), SamplingParams(max_tokens=3, ignore_eos=True))]
            assert outs[-1].finish_reason == "length"
            assert eng.health_error() is None
        finally:
            eng.shutdown()

    asyncio.run(main())


def test_a_hook_failing_every_iteration_makes_the_engine_unhealthy_not_dead(model_f32):
    async def main():
        eng = AsyncLLMEngine(LLMEngine(model_f32, EngineConfig(num_blocks=16, num_slots=4)), idle_wait_s=0.0)
        state = {"fail": True}

        def flaky(_engine):
            if state["fail"]:
                raise RuntimeError("transfer progress broken")

        eng.hooks.append(flaky)
        try:
            while eng.health_error() is None:
                await asyncio.sleep(0.001)
            assert "transfer progress broken" in eng.health_error()
            assert (await eng.call(lambda e: e.usage()))["running"] == 0  # loop still answers
            state["fail"] = False
            while eng.health_error() is not None:
                await asyncio.sleep(0.001)
        finally:
            eng.shutdown()

    asyncio.run(main())
