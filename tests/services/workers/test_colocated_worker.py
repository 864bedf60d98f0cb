"""The colocated worker in one process over the real engine (tiny model): greedy output equals
the engine's own, prefix credit is reported, cancel and abort free the blocks, bad input is a
clear INVALID_ARGUMENT that leaves the engine loop serving, a full admission queue refuses."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import pytest
import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams as EngineSampling
from flashpd.services.api import (
    DeadlineExceeded,
    FinalEvent,
    InternalRequest,
    InvalidArgument,
    SamplingParams,
    TokenEvent,
)
from flashpd.services.colocated.server import ColocatedWorker
from flashpd.services.worker.admission import WorkerFull
from flashpd.services.worker.common import WorkerConfig, new_worker_ref

MODEL_ID = "flashpd-tiny"


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine_config(**kw) -> EngineConfig:
    return EngineConfig(**{"role": "colocated", "num_blocks": 32, "num_slots": 8, "model_id": MODEL_ID, **kw})


@contextlib.asynccontextmanager
async def _worker(model, *, max_queued: int = 16, **kw):
    ec = _engine_config(**kw)
    w = ColocatedWorker(
        LLMEngine(model, ec),
        WorkerConfig("unused", MODEL_ID, ec, max_queued_requests=max_queued),
        new_worker_ref("colocated"),
    )
    try:
        yield w
    finally:
        await w.close()


def _req(rid: str, prompt, n: int, **kw) -> InternalRequest:
    # ignore_eos: random weights may sample EOS; a request must run as long as a test needs
    return InternalRequest(rid, MODEL_ID, tuple(prompt), SamplingParams(max_tokens=n, ignore_eos=True), **kw)


async def _collect(w: ColocatedWorker, req: InternalRequest):
    events = [e async for e in w.generate(req)]
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids], events


def _engine_greedy(model, prompt, n: int) -> list[int]:
    eng = LLMEngine(model, _engine_config())
    eng.add_request("ref", prompt, EngineSampling(max_tokens=n))
    out = []
    while eng.has_unfinished():
        for o in eng.step():
            out.extend(o.new_token_ids)
    return out


async def _engine_waiting(w: ColocatedWorker, n: int) -> None:
    """Until the engine's scheduler has `n` requests waiting (read on the loop thread)."""
    while await w.engine.call(lambda e: e.scheduler.num_waiting) < n:
        await asyncio.sleep(0.01)


async def _idle(w: ColocatedWorker) -> None:
    """Until the engine holds no block for a request (cached ones are free to reuse)."""
    for _ in range(500):
        s = await w.stats()
        if s.kv_blocks_used == 0 and s.running == 0 and s.waiting == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks still held: {await w.stats()}")


def test_greedy_output_equals_the_engines_and_the_second_turn_reports_its_credit(model_f32):
    turn1 = _prompt(300, 1)

    async def main():
        async with _worker(model_f32) as w:
            ids1, events1 = await _collect(w, _req("t1", turn1, 6))
            assert ids1 == _engine_greedy(model_f32, turn1, 6)
            final = events1[-1]
            assert isinstance(final, FinalEvent) and final.usage.cached_tokens == 0
            assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (300, 6)
            assert events1[0].prefill_credit_tokens == 0
            turn2 = turn1 + ids1 + _prompt(40, 2)
            ids2, events2 = await _collect(w, _req("t2", turn2, 4))
            assert ids2 == _engine_greedy(model_f32, turn2, 4)  # bounded replay on the hit
            credit = 256 - 128  # two whole chunks cached, less the 128-token replay
            assert events2[0].prefill_credit_tokens == credit and events2[-1].usage.cached_tokens == credit
            await _idle(w)

    asyncio.run(main())


def test_a_consumer_leaving_mid_stream_frees_the_blocks(model_f32):
    async def main():
        async with _worker(model_f32) as w:
            gen = w.generate(_req("r1", _prompt(200, 3), 200))
            assert isinstance(await anext(gen), TokenEvent)
            assert (await w.stats()).kv_blocks_used > 0
            await gen.aclose()
            await _idle(w)
            assert await w.abort("r1") is False  # idempotent: nothing left

    asyncio.run(main())


def test_abort_ends_the_stream_and_frees_the_blocks(model_f32):
    async def main():
        async with _worker(model_f32) as w:
            gen = w.generate(_req("r1", _prompt(200, 4), 200))
            await anext(gen)
            assert await w.abort("r1") is True
            with pytest.raises(asyncio.CancelledError):
                async for _ in gen:
                    continue
            await _idle(w)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"prompt_ids": (5, 10**9)}, "prompt"),  # outside the vocabulary
        ({"model": "other"}, "model"),
        ({"sampling": SamplingParams(max_tokens=10**9)}, "prompt"),  # past the context limit
    ],
)
def test_bad_input_is_invalid_argument_and_the_engine_keeps_serving(model_f32, change, field):
    async def main():
        async with _worker(model_f32) as w:
            bad = dataclasses.replace(_req("bad", _prompt(50, 5), 3), **change)
            with pytest.raises(InvalidArgument) as err:
                await _collect(w, bad)
            assert err.value.field == field
            ids, _ = await _collect(w, _req("ok", _prompt(50, 5), 3))
            assert len(ids) == 3 and w.health_error() is None
            await _idle(w)

    asyncio.run(main())


def test_a_prompt_larger_than_the_pool_is_invalid_argument(model_f32):
    async def main():
        async with _worker(model_f32, num_blocks=4) as w:
            with pytest.raises(InvalidArgument, match="blocks") as err:
                await _collect(w, _req("big", _prompt(600, 6), 3))
            assert err.value.field == "prompt" and w.health_error() is None

    asyncio.run(main())


def test_beyond_capacity_requests_queue_then_a_full_queue_refuses_and_deadlines_apply(model_f32):
    async def main():
        async with _worker(model_f32, max_queued=1, max_num_seqs=1) as w:
            first = w.generate(_req("r1", _prompt(60, 7), 300))
            await anext(first)  # running: the only batch slot
            second = asyncio.ensure_future(_collect(w, _req("r2", _prompt(60, 8), 2)))
            await _engine_waiting(w, 1)  # r2 in the engine's waiting queue
            third = asyncio.ensure_future(_collect(w, _req("r3", _prompt(60, 9), 2)))
            while w.admission.num_waiting < 1:  # in the worker's admission queue
                await asyncio.sleep(0.01)
            with pytest.raises(WorkerFull):
                await _collect(w, _req("r4", _prompt(60, 10), 2))
            await first.aclose()  # room: the queued requests run in order
            assert len((await second)[0]) == 2 and len((await third)[0]) == 2
            late = _req("r5", _prompt(60, 11), 300)
            blocker = w.generate(late)
            await anext(blocker)
            filler = asyncio.ensure_future(_collect(w, _req("r6", _prompt(60, 12), 2)))
            await _engine_waiting(w, 1)
            with pytest.raises(DeadlineExceeded):
                await _collect(w, _req("r7", _prompt(60, 13), 2, deadline_unix_s=time.time() + 0.2))
            await blocker.aclose()
            await filler
            await _idle(w)

    asyncio.run(main())
