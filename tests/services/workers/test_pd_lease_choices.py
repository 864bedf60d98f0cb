"""n > 1 choices whose KV leases expire while their prefill queues, through the real
orchestrator over real prefill and decode workers (local transfer backend) and a real Redis.

The queue is a seam in front of the prefill worker (as Ray Serve's handle queue is): each
request's first prefill call is held until its ticket's lease has passed, so the real prefill
worker refuses it (UNAVAILABLE, "the ticket's lease ... passed before prefill started") and the
real decode worker gives the reservation up. The router must place every choice again on the
same pair, and the client must see every choice complete with the greedy output of an
undisturbed run; nothing may stay reserved."""

from __future__ import annotations

import asyncio
import contextlib
import time

import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.services.api import FinalEvent, InternalRequest, SamplingParams, TokenEvent
from flashpd.services.decode.server import DecodeWorker
from flashpd.services.prefill.server import PrefillWorker
from flashpd.services.router import choices
from flashpd.services.router.endpoints import WorkerDirectory
from flashpd.services.router.index import IndexPublisher, PrefixIndex, router_redis
from flashpd.services.router.metrics import RouterMetrics
from flashpd.services.router.orchestrator import Orchestrator
from flashpd.services.router.placement import Placement
from flashpd.services.router.policy import make_policy
from flashpd.services.worker.common import WorkerConfig, new_worker_ref

MODEL_ID = "flashpd-tiny"
LEASE_S = 3.0  # long enough for one unqueued prefill on a loaded machine
N, MAX_TOKENS = 3, 6


def _worker(model, role: str):
    ec = EngineConfig(role=role, num_blocks=48, num_slots=8, model_id=MODEL_ID)
    wc = WorkerConfig("unused", MODEL_ID, ec, transfer_backend="local", lease_s=LEASE_S, transfer_timeout_s=1.0)
    cls = PrefillWorker if role == "prefill" else DecodeWorker
    return cls(LLMEngine(model, ec), wc, new_worker_ref(role))


class _QueuedPrefill:
    """The prefill endpoint behind a queue that holds each request's first call until its
    ticket's lease has passed (then the real worker decides)."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker, self.held, self.calls = worker, 0, []

    async def run(self, req: InternalRequest, ticket):
        base = req.request_id.split("@")[0]
        first = base not in {c.split("@")[0] for c in self.calls}
        self.calls.append(req.request_id)
        if first and base.startswith("q"):
            self.held += 1
            while time.time() < ticket.lease_deadline_unix_s:  # a condition, not a tolerance
                await asyncio.sleep(0.01)
        return await self.worker.run(req, ticket)

    def __getattr__(self, name):
        return getattr(self.worker, name)


class _Directory(WorkerDirectory):
    def __init__(self, prefill: _QueuedPrefill, decode: DecodeWorker) -> None:
        self.p, self.d = prefill, decode

    def prefill(self, worker):
        return self.p

    def decode(self, worker):
        return self.d


@contextlib.asynccontextmanager
async def _stack(redis_url: str, p: PrefillWorker, d: DecodeWorker):
    redis = router_redis(redis_url)
    await redis.flushdb()
    publisher = IndexPublisher(redis, MODEL_ID)

    async def heartbeats():
        while True:
            for w in (p, d):
                await publisher.heartbeat(w.stats_now())
            await asyncio.sleep(0.2)

    beat = asyncio.create_task(heartbeats())
    queued = _QueuedPrefill(p)
    placement = Placement(PrefixIndex(redis, MODEL_ID), make_policy("round_robin"), model=MODEL_ID, view_refresh_s=0.0)
    orch = Orchestrator({MODEL_ID: placement}, _Directory(queued, d), _Tokenizer(), metrics=RouterMetrics(MODEL_ID))
    try:
        yield orch, queued
    finally:
        beat.cancel()
        await orch.close()
        for w in (p, d):
            await w.close()
        await redis.aclose()


class _Tokenizer:
    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return ""


def _request(rid: str) -> InternalRequest:
    prompt = torch.randint(3, 500, (200,), generator=torch.Generator().manual_seed(7)).tolist()
    return InternalRequest(rid, MODEL_ID, tuple(prompt), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


async def _choices(orch: Orchestrator, rid: str) -> dict[int, tuple[list[int], FinalEvent]]:
    out: dict[int, tuple[list[int], FinalEvent | None]] = {i: ([], None) for i in range(N)}
    async with contextlib.aclosing(choices.fan_out(orch, _request(rid), N)) as events:
        async for item in events:
            ids, _ = out[item.index]
            if isinstance(item.event, TokenEvent):
                assert item.event.index == len(ids)
                ids.extend(item.event.token_ids)
            else:
                out[item.index] = (ids, item.event)
    return out


def test_n_choices_complete_when_their_leases_expire_in_the_prefill_queue(model_f32, redis_url):
    async def main():
        p, d = _worker(model_f32, "prefill"), _worker(model_f32, "decode")
        async with _stack(redis_url, p, d) as (orch, queued):
            reference = await _choices(orch, "ref")  # nothing held
            outs = await _choices(orch, "q")
            assert queued.held == N  # every choice's first prefill outlived its lease
            assert sum(c.startswith("q") for c in queued.calls) == 2 * N
            for i in range(N):
                ids, final = outs[i]
                assert final is not None and final.finish_reason == "length"
                assert ids == reference[i][0] == reference[0][0]  # greedy, undisturbed
            for _ in range(2000):  # the expired reservations are freed (lease + transfer bound)
                if d.stats_now().kv_blocks_used == 0 and d.stats_now().running == 0:
                    break
                await asyncio.sleep(0.01)
            assert d.stats_now().running == 0 and d.stats_now().kv_blocks_used == 0

    asyncio.run(asyncio.wait_for(main(), 600))
