"""The orchestrator in colocated mode: fake colocated workers at the seam, a real Redis index."""

import asyncio

import pytest
from router_fakes import (
    ActorDiedError,
    FakeColocated,
    FakeDecode,
    FakePrefill,
    collect,
    greedy_chain,
    request,
    router_stack,
    text_ids,
)

from flashpd.services.api import Cancelled, DeadlineExceeded, FinalEvent, ResourceExhausted, TokenEvent, Unavailable

pytestmark = pytest.mark.net
PROMPT = tuple(range(1, 200)) * 2  # 398 tokens: 3 full chunks + a partial one


def run_async(coro):
    asyncio.run(asyncio.wait_for(coro, 30))


def tokens_of(events):
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


def test_one_generate_call_streams_with_the_workers_credit_as_cached_tokens(redis_url):
    c = FakeColocated("c0", credit_tokens=256)

    async def main():
        async with router_stack(redis_url, [], [], colocated=[c]) as s:
            events = await collect(s.orchestrator, s.orchestrator.open(request(PROMPT)))
            final = events[-1]
            assert tokens_of(events) == list(text_ids("abcde"))
            assert isinstance(final, FinalEvent) and final.finish_reason == "length"
            assert (final.prefill_worker, final.decode_worker) == ("", "c0")
            u = final.usage
            assert (u.prompt_tokens, u.completion_tokens) == (398, 5)
            assert (u.cached_tokens, u.cached_tokens_prefill, u.cached_tokens_decode) == (256, 256, 0)
            t = final.timeline
            assert (t.prefill_queue_ms, t.prefill_ms, t.transfer_ms, t.reserve_ms) == (0.75, 3.0, 0.0, 0.0)
            assert 0 < t.first_token_ms <= t.e2e_ms and t.route_ms > 0
            assert events[0].prefill_credit_tokens == 256  # a client continuing the stream itself
            assert c.calls == [("generate", "r1")] and c.aborted == []
            assert b'flashpd:prefix_cache_hits_total{model_name="flash-tiny",tier="prefill"} 1.0' in (
                s.metrics.exposition()
            )

    run_async(main())


def test_workers_of_the_other_mode_are_never_placed_on(redis_url):
    p, d, c = FakePrefill("p0"), FakeDecode("d0"), FakeColocated("c0")

    async def main():
        async with router_stack(redis_url, [p], [d], colocated=[c]) as s:
            for i in range(4):
                final = (await collect(s.orchestrator, s.orchestrator.open(request(PROMPT, rid=f"r{i}"))))[-1]
                assert final.decode_worker == "c0"
            assert p.calls == [] and d.calls == []
            assert (await s.orchestrator.serving_status())[0] is True

    run_async(main())


def test_no_colocated_worker_is_unavailable_and_not_serving(redis_url):
    async def main():
        async with router_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")], colocated=[]) as s:
            serving, why = await s.orchestrator.serving_status()
            assert serving is False and "colocated" in why
            with pytest.raises(Unavailable, match="colocated"):
                await collect(s.orchestrator, s.orchestrator.open(request(PROMPT)))

    run_async(main())


def test_session_turns_stay_on_their_worker_and_bind_it_as_decode_without_prefill(redis_url):
    cs = [FakeColocated(f"c{i}") for i in range(3)]

    async def main():
        async with router_stack(redis_url, [], [], colocated=cs) as s:
            first = (await collect(s.orchestrator, s.orchestrator.open(request(PROMPT, rid="t1", session="sess"))))[-1]
            binding = (await s.index.lookup([], [], "sess")).session
            assert binding.prefill is None and binding.decode.worker_id == first.decode_worker
            for turn in range(2, 5):
                req = request(PROMPT + (7,) * turn, rid=f"t{turn}", session="sess")
                final = (await collect(s.orchestrator, s.orchestrator.open(req)))[-1]
                assert final.decode_worker == first.decode_worker

    run_async(main())


def test_prefix_hit_picks_the_worker_holding_it(redis_url):
    cs = [FakeColocated("c0"), FakeColocated("c1"), FakeColocated("c2")]

    async def main():
        async with router_stack(redis_url, [], [], colocated=cs) as s:
            await s.cache(cs[2], PROMPT)
            for i in range(3):
                final = (await collect(s.orchestrator, s.orchestrator.open(request(PROMPT, rid=f"r{i}"))))[-1]
                assert final.decode_worker == "c2"

    run_async(main())


def test_death_before_the_first_token_is_retried_on_another_worker(redis_url):
    bad, good = FakeColocated("c0", generate_error=ActorDiedError("the actor died")), FakeColocated("c1")

    async def main():
        async with router_stack(redis_url, [], [], routing="round_robin", colocated=[bad, good]) as s:
            events = await collect(s.orchestrator, s.orchestrator.open(request(PROMPT)))
            assert events[-1].decode_worker == "c1" and tokens_of(events) == list(b"abcde")
            assert good.calls == [("generate", "r1@1")]

    run_async(main())


def test_death_after_tokens_continues_from_the_released_tokens_at_the_same_credit(redis_url):
    c0 = FakeColocated("c0", follow_prompt=True, credit_tokens=128, fail_after_tokens=(2, ActorDiedError("died")))
    c1 = FakeColocated("c1", follow_prompt=True, credit_tokens=128)
    expected = list(greedy_chain(PROMPT[-1], 6))

    async def main():
        async with router_stack(redis_url, [], [], routing="round_robin", colocated=[c0, c1]) as s:
            events = await collect(s.orchestrator, s.orchestrator.open(request(PROMPT, max_tokens=6)))
            final = events[-1]
            assert tokens_of(events) == expected and final.decode_worker == "c1"
            cont = c1.seen[0]
            assert cont.request_id == "r1@1" and cont.prompt_ids == PROMPT + tuple(expected[:2])
            assert cont.sampling.max_tokens == 4 and cont.max_prefill_credit_tokens == 128
            assert final.usage.completion_tokens == 6 and final.usage.prompt_tokens == len(PROMPT)
            assert c0.aborted == ["r1"]

    run_async(main())


def test_a_full_admission_queue_moves_to_another_worker(redis_url):
    full = FakeColocated("c0", generate_error=ResourceExhausted("queue full"))
    good = FakeColocated("c1")

    async def main():
        async with router_stack(redis_url, [], [], routing="round_robin", colocated=[full, good]) as s:
            final = (await collect(s.orchestrator, s.orchestrator.open(request(PROMPT))))[-1]
            assert final.decode_worker == "c1" and full.calls == [("generate", "r1"), ("abort", "r1")]

    run_async(main())


def test_every_worker_full_is_resource_exhausted(redis_url):
    full = FakeColocated("c0", generate_error=ResourceExhausted("queue full"))

    async def main():
        async with router_stack(redis_url, [], [], colocated=[full]) as s:
            with pytest.raises(ResourceExhausted):
                await collect(s.orchestrator, s.orchestrator.open(request(PROMPT)))

    run_async(main())


def test_abort_mid_stream_aborts_the_worker(redis_url):
    c = FakeColocated("c0", token_delay_s=0.05)

    async def main():
        async with router_stack(redis_url, [], [], colocated=[c]) as s:
            run = s.orchestrator.open(request(PROMPT, max_tokens=20))
            stream = s.orchestrator.stream(run)
            assert isinstance(await anext(stream), TokenEvent)
            assert await s.orchestrator.abort("r1") is True
            with pytest.raises(Cancelled):
                async for _ in stream:
                    continue
            assert c.aborted == ["r1"] and c.closed_streams == 1

    run_async(main())


def test_deadline_aborts_the_worker(redis_url):
    c = FakeColocated("c0", token_delay_s=1.0)

    async def main():
        async with router_stack(redis_url, [], [], colocated=[c]) as s:
            run = s.orchestrator.open(request(PROMPT, deadline_s=0.3))
            with pytest.raises(DeadlineExceeded):
                await collect(s.orchestrator, run)
            assert c.aborted == ["r1"] and c.seen[0].deadline_unix_s == run.request.deadline_unix_s

    run_async(main())


def test_stop_string_ends_the_run_with_the_credit_as_cached_tokens(redis_url):
    c = FakeColocated("c0", credit_tokens=128)

    async def main():
        async with router_stack(redis_url, [], [], colocated=[c]) as s:
            events = await collect(s.orchestrator, s.orchestrator.open(request(PROMPT, max_tokens=20, stop=("def",))))
            final = events[-1]
            assert final.finish_reason == "stop" and final.usage.cached_tokens == 128
            assert c.aborted == ["r1"]

    run_async(main())
