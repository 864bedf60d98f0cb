"""The orchestrator's head start (`overlap_reserve`): P.start goes out with D.reserve, P.run
follows once both answered; every way an attempt ends releases the head start."""

import asyncio
from dataclasses import dataclass, field

import pytest
from router_fakes import FakeDecode, FakePrefill, collect, request, router_stack

from flashpd.services.api import Cancelled, InternalRequest, TransferFailed, Unavailable, WorkerStats
from flashpd.services.router.orchestrator import OrchestratorConfig

pytestmark = pytest.mark.net
PROMPT = tuple(range(1, 200)) * 2  # 398 tokens: 4 chunks to push


def run_async(coro):
    asyncio.run(asyncio.wait_for(coro, 30))


@dataclass
class GatedDecode(FakeDecode):
    """Its reserve answers only once `gate` opens (the test opens it)."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def reserve(self, req: InternalRequest):
        await self.gate.wait()
        return await super().reserve(req)


@dataclass
class SlowStart(FakePrefill):
    """Its start answers only once `gate` opens; `order` logs start's answer and run's call."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    order: list[str] = field(default_factory=list)

    async def start(self, req: InternalRequest) -> bool:
        started = await super().start(req)
        await self.gate.wait()
        self.order.append("started")
        return started

    async def run(self, req, ticket):
        self.order.append("run")
        return await super().run(req, ticket)


def test_the_prefill_starts_while_the_decode_reserves(redis_url):
    p, d = FakePrefill("p0"), GatedDecode("d0")

    async def main():
        async with router_stack(redis_url, [p], [d]) as s:
            run = s.orchestrator.open(request(PROMPT))
            while not p.started:  # the reserve has not answered, the prefill already started
                await asyncio.sleep(0.001)
            assert p.started == ["r1"] and p.calls == []
            d.gate.set()
            final = (await collect(s.orchestrator, run))[-1]
            assert final.prefill_worker == "p0" and p.calls == [("run", "r1")] and not p.aborted

    run_async(main())


def test_run_never_overtakes_its_start(redis_url):
    p, d = SlowStart("p0"), FakeDecode("d0")

    async def main():
        async with router_stack(redis_url, [p], [d]) as s:
            run = s.orchestrator.open(request(PROMPT))
            while d.calls != [("reserve", "r1")]:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.01)  # the ticket is in: only the start's answer is missing
            assert p.order == []
            p.gate.set()
            await collect(s.orchestrator, run)
            assert p.order == ["started", "run"]

    run_async(main())


def test_switched_off_no_start_is_sent(redis_url):
    p, d = FakePrefill("p0"), FakeDecode("d0")

    async def main():
        config = OrchestratorConfig(resume_grace_s=0.2, overlap_reserve=False)
        async with router_stack(redis_url, [p], [d], config=config) as s:
            final = (await collect(s.orchestrator, s.orchestrator.open(request(PROMPT))))[-1]
            assert final.prefill_worker == "p0" and p.started == [] and p.calls == [("run", "r1")]

    run_async(main())


@dataclass
class QueueingDecode(FakeDecode):
    """Its heartbeat says reserves are waiting in its admission queue."""

    def stats(self) -> WorkerStats:
        return WorkerStats(self.worker_id, "i0", "decode", kv_blocks_total=1000, queued=3, queue_limit=64)


def test_no_head_start_while_the_decode_worker_queues_reserves(redis_url):
    p, d = FakePrefill("p0"), QueueingDecode("d0")

    async def main():
        async with router_stack(redis_url, [p], [d]) as s:
            final = (await collect(s.orchestrator, s.orchestrator.open(request(PROMPT))))[-1]
            assert final.prefill_worker == "p0" and p.started == [] and p.calls == [("run", "r1")]

    run_async(main())


def test_a_failed_start_changes_nothing(redis_url):
    p, d = FakePrefill("p0", start_error=Unavailable("draining")), FakeDecode("d0")

    async def main():
        async with router_stack(redis_url, [p], [d]) as s:
            final = (await collect(s.orchestrator, s.orchestrator.open(request(PROMPT))))[-1]
            assert final.prefill_worker == "p0" and p.calls == [("run", "r1")] and not p.aborted

    run_async(main())


def test_reserve_failure_aborts_the_head_start_then_retries(redis_url):
    p = FakePrefill("p0")
    bad, good = GatedDecode("d0", reserve_error=Unavailable("draining")), FakeDecode("d1")

    async def main():
        async with router_stack(redis_url, [p], [bad, good], routing="round_robin") as s:
            run = s.orchestrator.open(request(PROMPT))
            while not p.started:  # the reserve fails once the prefill is computing
                await asyncio.sleep(0.001)
            bad.gate.set()
            final = (await collect(s.orchestrator, run))[-1]
            assert final.decode_worker == "d1"
            assert p.started == ["r1", "r1@1"]
            assert p.calls == [("abort", "r1"), ("run", "r1@1")]  # the failed attempt's head start ended
            assert ("abort", "r1") in bad.calls

    run_async(main())


def test_prefill_failure_aborts_the_decode_leg(redis_url):
    bad, good = FakePrefill("p0", error=TransferFailed("NIXL write failed")), FakePrefill("p1")
    d = FakeDecode("d0")

    async def main():
        async with router_stack(redis_url, [bad, good], [d], routing="round_robin") as s:
            final = (await collect(s.orchestrator, s.orchestrator.open(request(PROMPT))))[-1]
            assert final.prefill_worker == "p1"
            assert d.calls[:3] == [("reserve", "r1"), ("abort", "r1"), ("reserve", "r1@1")]
            assert bad.started == ["r1"] and good.started == ["r1@1"]

    run_async(main())


def test_cancel_during_the_reserve_aborts_both_legs(redis_url):
    p, d = FakePrefill("p0"), GatedDecode("d0")

    async def main():
        async with router_stack(redis_url, [p], [d]) as s:
            run = s.orchestrator.open(request(PROMPT))
            while not p.started:
                await asyncio.sleep(0.001)
            assert await s.orchestrator.abort("r1")
            assert isinstance(run.error, Cancelled)
            assert p.aborted == ["r1"] and d.aborted == ["r1"] and p.calls == [("abort", "r1")]

    run_async(main())
