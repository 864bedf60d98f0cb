"""AsyncLLMEngine: streaming, abort, consumer cancellation, and a dead loop never hangs callers."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flashpd.engine.async_engine import AsyncLLMEngine, EngineDead
from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine(model, EngineConfig(num_blocks=16, num_slots=4)))


def test_two_streams_run_concurrently_to_completion(model_f32):
    async def main():
        eng = _engine(model_f32)
        try:

            async def collect(rid, seed):
                outs = [
                    o async for o in eng.generate(rid, _prompt(40, seed), SamplingParams(max_tokens=5, ignore_eos=True))
                ]
                return outs

            a, b = await asyncio.gather(collect("a", 1), collect("b", 2))
            for outs in (a, b):
                assert sum(len(o.new_token_ids) for o in outs) == 5
                assert outs[-1].finished and outs[-1].finish_reason == "length"
        finally:
            eng.shutdown()

    asyncio.run(main())


def test_consumer_leaving_early_aborts_and_frees(model_f32):
    async def main():
        eng = _engine(model_f32)
        try:
            stream = eng.generate("x", _prompt(40, 3), SamplingParams(max_tokens=200, ignore_eos=True))
            async for _ in stream:
                break
            await stream.aclose()
            usage = await eng.call(lambda e: e.usage())
            assert usage["blocks_free"] + usage["blocks_cached"] == usage["blocks_total"]
            assert not await eng.call(lambda e: e.has_unfinished())
        finally:
            eng.shutdown()

    asyncio.run(main())


def test_loop_death_reaches_waiting_streams_and_new_calls(model_f32):
    async def main():
        eng = _engine(model_f32)

        def boom():
            raise RuntimeError("injected scheduler bookkeeping failure")

        stream = eng.generate("y", _prompt(20, 4), SamplingParams(max_tokens=50, ignore_eos=True))
        first = await stream.__anext__()
        assert first.new_token_ids
        eng.engine.step = boom  # a fault outside any one request's work: the loop stops
        with pytest.raises(EngineDead):
            async for _ in stream:
                pass
        assert isinstance(eng.error, RuntimeError)
        with pytest.raises(EngineDead):
            await eng.call(lambda e: e.usage())

    asyncio.run(main())


class _SlowStepEngine:
    """An LLMEngine stand-in whose step blocks until released (a multi-second forward)."""

    def __init__(self) -> None:
        import threading

        self.in_step, self.release = threading.Event(), threading.Event()
        self.running, self.events = 0, []

    def usage(self) -> dict[str, int]:
        return {"running": self.running}

    def drain_cache_events(self) -> list:
        out, self.events = self.events, []
        return out

    def has_unfinished(self) -> bool:
        return self.running > 0

    def step(self) -> list:
        self.in_step.set()
        self.release.wait(30)
        self.running = 0
        self.events.append("stored-after-step")
        return []


def test_usage_and_cache_events_are_read_without_waiting_for_a_step():
    """A heartbeat reads the worker's load while its engine sits in a long forward (it used to
    wait for the loop, time out, and the router reaped the live worker)."""
    slow = _SlowStepEngine()
    eng = AsyncLLMEngine(slow)  # type: ignore[arg-type]
    try:

        def admit(e):
            e.running = 2
            e.events.append("stored-at-admission")

        eng.call_sync(admit, 10)
        assert slow.in_step.wait(10)  # the loop is inside step() now
        # a command would wait for the step; the views answer at once
        assert eng.usage_now() == {"running": 2}
        assert eng.take_cache_events() == ["stored-at-admission"]
        slow.release.set()
        eng.call_sync(lambda e: None, 10)  # one iteration after the step
        assert eng.usage_now() == {"running": 0}
        assert eng.take_cache_events() == ["stored-after-step"]
        assert eng.take_cache_events() == []
    finally:
        slow.release.set()
        eng.shutdown()


def test_output_hooks_see_each_finished_output_on_the_loop_thread_before_its_consumer(model_f32):
    """A hook runs on the engine's loop thread with the finished output before it is delivered;
    one that raises is logged and the output still arrives."""
    import threading

    async def main():
        eng = _engine(model_f32)
        seen: list[tuple[str, str, bool]] = []
        delivered: list[str] = []

        def hook(out):
            seen.append((out.request_id, threading.current_thread().name, out.request_id in delivered))

        def broken(out):
            raise RuntimeError("hook bug")

        eng.output_hooks.extend([broken, hook])
        try:
            outs = [o async for o in eng.generate("a", _prompt(30, 3), SamplingParams(max_tokens=3, ignore_eos=True))]
            delivered.append("a")
            assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 3
            assert len(seen) == 1 and seen[0][0] == "a" and not seen[0][2]
            assert seen[0][1] != threading.current_thread().name  # the loop thread, not the caller's
        finally:
            eng.shutdown()

    asyncio.run(main())
