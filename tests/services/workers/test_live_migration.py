"""Live decode migration in one process: the real orchestrator over real prefill and decode
workers (local transfer backend, bounded replay) and a real Redis. A decode worker told to
drain moves every stream to the other decode worker: no error, no prefill, no token lost or
repeated, greedy output identical to an undisturbed run; with nowhere to go it finishes them."""

from __future__ import annotations

import asyncio
import contextlib

import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.services.api import FinalEvent, InternalRequest, SamplingParams, TokenEvent
from flashpd.services.decode.server import DecodeWorker
from flashpd.services.prefill.server import PrefillWorker
from flashpd.services.router.endpoints import WorkerDirectory
from flashpd.services.router.index import IndexPublisher, PrefixIndex, router_redis
from flashpd.services.router.metrics import RouterMetrics
from flashpd.services.router.orchestrator import Orchestrator
from flashpd.services.router.placement import Placement
from flashpd.services.router.policy import make_policy
from flashpd.services.worker.common import WorkerConfig, new_worker_ref

MODEL_ID = "flashpd-tiny-migration"  # no other test's workers publish under it
STREAMS, PROMPT_TOKENS, MAX_TOKENS = 4, 200, 16


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def _worker(model, role: str, num_slots: int = 8):
    ec = EngineConfig(role=role, num_blocks=48, num_slots=num_slots, model_id=MODEL_ID)
    wc = WorkerConfig("unused", MODEL_ID, ec, transfer_backend="local")
    cls = PrefillWorker if role == "prefill" else DecodeWorker
    return cls(LLMEngine(model, ec), wc, new_worker_ref(role))


class _Directory(WorkerDirectory):
    def __init__(self, workers) -> None:
        self.workers = {w.ref.worker_id: w for w in workers}

    def prefill(self, worker):
        return self.workers[worker.worker_id]

    def decode(self, worker):
        return self.workers[worker.worker_id]


class _Tokenizer:
    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return ""


@contextlib.asynccontextmanager
async def _stack(redis_url: str, workers):
    redis = router_redis(redis_url)
    # no worker may drop out of the router's view on a late heartbeat: on a loaded 2-core CI
    # machine the event loop running the beats and the engines' threads can stall for seconds
    # (a CI run saw "no healthy prefill worker" mid-drain); liveness is not what this file tests
    publisher = IndexPublisher(redis, MODEL_ID, heartbeat_ttl_s=3600.0)
    await redis.flushdb()

    async def heartbeats():
        while True:
            for w in workers:
                await publisher.heartbeat(w.stats_now())
            await asyncio.sleep(0.2)

    beat = asyncio.create_task(heartbeats())
    placement = Placement(PrefixIndex(redis, MODEL_ID), make_policy("round_robin"), model=MODEL_ID, view_refresh_s=0.0)
    orch = Orchestrator({MODEL_ID: placement}, _Directory(workers), _Tokenizer(), metrics=RouterMetrics(MODEL_ID))
    try:
        yield orch, publisher
    finally:
        beat.cancel()
        await orch.close()
        for w in workers:
            await w.close()
        await redis.aclose()


async def _follow(orch: Orchestrator, run, progress: list[int], i: int):
    ids, final = [], None
    async with contextlib.aclosing(orch.stream(run)) as events:
        async for ev in events:
            if isinstance(ev, TokenEvent):
                assert ev.index == len(ids)  # no token lost or repeated
                ids.extend(ev.token_ids)
                progress[i] = len(ids)
            else:
                assert isinstance(ev, FinalEvent)
                final = ev
    return ids, final


def _requests(tag: str):
    return [
        InternalRequest(
            f"{tag}{i}",
            MODEL_ID,
            _prompt(PROMPT_TOKENS, 40 + i),
            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        for i in range(STREAMS)
    ]


async def _streams_with_drain(orch, victim: DecodeWorker, tag: str, after_tokens: int = 3):
    progress = [0] * STREAMS
    runs = [orch.open(r) for r in _requests(tag)]
    tasks = [asyncio.create_task(_follow(orch, run, progress, i)) for i, run in enumerate(runs)]
    while min(progress) < after_tokens:
        await asyncio.sleep(0.01)
    paused = await victim.drain(30.0)
    return paused, await asyncio.gather(*tasks)


def test_drain_moves_every_stream_to_the_other_decode_worker(model_f32, redis_url):
    async def main():
        p, d0, d1 = (_worker(model_f32, "prefill"), _worker(model_f32, "decode"), _worker(model_f32, "decode"))
        async with _stack(redis_url, [p, d0, d1]) as (orch, _):
            reference = [await _follow(orch, orch.open(r), [0], 0) for r in _requests("ref")]
            paused, outs = await _streams_with_drain(orch, d0, "run")
            assert paused > 0
            for (ids, final), (ref_ids, _) in zip(outs, reference, strict=True):
                assert ids == ref_ids and final.finish_reason == "length"
            moved = [f for _, f in outs if f.decode_worker == d1.ref.worker_id]
            assert len(moved) == STREAMS  # d0's streams moved, d1's stayed on d1
            metrics = orch.metrics
            assert metrics.migrations.labels(model_name=MODEL_ID, outcome="moved")._value.get() == paused
            prefills = metrics.prefills.labels(model_name=MODEL_ID)._value.get()
            assert prefills == 2 * STREAMS  # the references' and the streams' first: none more
            assert d0.stats_now().kv_blocks_used == 0 and d0.stats_now().running == 0

    asyncio.run(main())


def test_streams_with_nowhere_to_go_finish_in_place(model_f32, redis_url):
    async def main():
        p, d0 = _worker(model_f32, "prefill"), _worker(model_f32, "decode")
        async with _stack(redis_url, [p, d0]) as (orch, _):
            reference = [await _follow(orch, orch.open(r), [0], 0) for r in _requests("ref")]
            paused, outs = await _streams_with_drain(orch, d0, "run")
            assert paused > 0
            assert [ids for ids, _ in outs] == [ids for ids, _ in reference]
            assert all(f.decode_worker == d0.ref.worker_id for _, f in outs)
            assert orch.metrics.migrations.labels(model_name=MODEL_ID, outcome="stayed")._value.get() == paused

    asyncio.run(main())
