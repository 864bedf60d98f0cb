"""Redis paused (SIGSTOP) or killed and restarted empty under the router: no request fails,
sessions keep their workers, health stays SERVING while workers are known, and the index is
used again (prefix hits) once Redis answers and the workers re-register."""

import asyncio
import contextlib

import pytest
from router_fakes import FakeDecode, FakePrefill, collect, request, router_stack

from flashpd.services.api import FinalEvent
from flashpd.services.redis_local import LocalRedis

pytestmark = pytest.mark.net
PROMPT = tuple(range(1, 200)) * 2  # 398 tokens


def run_async(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


@pytest.fixture
def own_redis():
    with LocalRedis() as server:
        yield server


@contextlib.asynccontextmanager
async def heartbeats(s, workers):
    """The workers' heartbeat loop (a worker keeps beating through a Redis outage)."""

    async def beat():
        while True:
            for w in workers:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(s.publisher.heartbeat(w.stats()), 0.2)
            await asyncio.sleep(0.3)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def _serve(s, rid: str, session: str | None = None, prompt=PROMPT) -> FinalEvent:
    events = await collect(s.orchestrator, s.orchestrator.open(request(prompt, rid=rid, session=session)))
    return events[-1]


def test_paused_redis_fails_no_request_and_keeps_sessions(own_redis):
    ps = [FakePrefill("p0"), FakePrefill("p1")]
    ds = [FakeDecode("d0"), FakeDecode("d1")]

    async def main():
        async with router_stack(own_redis.url, ps, ds) as s, heartbeats(s, [*ps, *ds]):
            bound = (await _serve(s, "warm", session="chat")).decode_worker
            placement = s.orchestrator.placements["flash-tiny"]
            own_redis.pause()
            try:
                finals = [await _serve(s, f"r{i}", session="chat") for i in range(6)]
                assert all(f.finish_reason == "length" for f in finals)
                assert {f.decode_worker for f in finals} == {bound}  # local binding
                assert placement.breaker.trips == 1 and not placement.redis_ok
                assert await s.orchestrator.ready()  # workers still known
            finally:
                own_redis.resume()
            await _until(lambda: _serve_and_check(s, placement))

    run_async(main())


async def _serve_and_check(s, placement) -> bool:
    await _serve(s, f"probe-{id(s)}-{placement.breaker.trips}-{asyncio.get_running_loop().time()}")
    return placement.redis_ok


def test_redis_killed_and_restarted_empty_serves_throughout_and_prefix_hits_return(own_redis):
    ps = [FakePrefill("p0"), FakePrefill("p1")]
    ds = [FakeDecode("d0"), FakeDecode("d1")]

    async def main():
        async with router_stack(own_redis.url, ps, ds) as s, heartbeats(s, [*ps, *ds]):
            await _serve(s, "warm")
            own_redis.kill()
            finals = [await _serve(s, f"down{i}") for i in range(4)]
            assert all(f.finish_reason == "length" for f in finals)
            assert await s.orchestrator.ready()
            own_redis.restart()  # empty: no workers, no chunks
            assert (await _serve(s, "after")).finish_reason == "length"  # known workers
            # the heartbeats re-register the workers; they re-publish what they hold
            ds[1].cached_chunks = 3
            await s.cache(ds[1], PROMPT)
            placement = s.orchestrator.placements["flash-tiny"]

            async def index_back() -> bool:  # one probe per breaker_open_s closes the circuit
                return await _decode_hit(s, ds[1]) and placement.redis_ok

            await _until(index_back)
            for i in range(3):  # placed by prefix from now on, whatever the request id
                assert await _decode_hit(s, ds[1]), i

    run_async(main())


async def _decode_hit(s, worker) -> bool:
    final = await _serve(s, f"hit-{asyncio.get_running_loop().time()}")
    return final.decode_worker == worker.worker_id and final.usage.cached_tokens_decode > 0


def test_health_is_not_serving_without_any_known_worker(own_redis):
    async def main():
        async with router_stack(own_redis.url, [], []) as s:
            serving, why = await s.orchestrator.serving_status()
            assert not serving and "prefill" in why and "decode" in why

    run_async(main())
