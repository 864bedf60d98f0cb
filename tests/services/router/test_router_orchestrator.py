"""The orchestrator with in-process fake workers at the seam and a real Redis index."""

import asyncio

import pytest
from router_fakes import ActorDiedError, FakeDecode, FakePrefill, collect, greedy_chain, request, router_stack, text_ids

from flashpd.services.api import (
    Cancelled,
    DeadlineExceeded,
    FinalEvent,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TokenEvent,
    TransferFailed,
    Unavailable,
)
from flashpd.services.router.orchestrator import OrchestratorConfig

pytestmark = pytest.mark.net
PROMPT = tuple(range(1, 200)) * 2  # 398 tokens: 3 full chunks + a partial one


def run_async(coro):
    asyncio.run(asyncio.wait_for(coro, 30))


def tokens_of(events):
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


def test_happy_path_streams_tokens_then_final_with_usage_and_timeline(redis_url):
    p, d = FakePrefill("p0", cached_tokens=128), FakeDecode("d0")

    async def main():
        async with router_stack(redis_url, [p], [d]) as s:
            events = await collect(s.orchestrator, s.orchestrator.open(request(PROMPT)))
            final = events[-1]
            assert tokens_of(events) == list(text_ids("abcde"))
            assert "".join(e.text for e in events[:-1]) + final.text == "abcde"
            assert isinstance(final, FinalEvent) and final.finish_reason == "length"
            assert (final.prefill_worker, final.decode_worker) == ("p0", "d0")
            u = final.usage
            assert (u.prompt_tokens, u.completion_tokens) == (398, 5)
            assert (u.cached_tokens, u.cached_tokens_prefill, u.cached_tokens_decode) == (128, 128, 0)
            t = final.timeline
            assert (t.prefill_queue_ms, t.prefill_ms, t.transfer_ms, t.replay_ms) == (0.5, 2.0, 0.25, 1.5)
            assert 0 < t.first_token_ms <= t.e2e_ms and t.route_ms > 0
            assert d.calls == [("reserve", "r1"), ("generate", "r1")]
            assert p.calls == [("run", "r1")] and p.tickets[0].dst_block_ids == (100, 101, 102, 103)
            assert p.started == ["r1"]  # the head start went out alongside the reserve
            assert d.aborted == [] and p.aborted == []

    run_async(main())


def test_session_turns_stay_on_their_pair(redis_url):
    ps, ds = [FakePrefill(f"p{i}") for i in range(3)], [FakeDecode(f"d{i}") for i in range(3)]

    async def main():
        async with router_stack(redis_url, ps, ds) as s:
            first = (await collect(s.orchestrator, s.orchestrator.open(request(PROMPT, rid="t1", session="sess"))))[-1]
            binding = (await s.index.lookup([], [], "sess")).session
            assert (binding.prefill.worker_id, binding.decode.worker_id) == (first.prefill_worker, first.decode_worker)
            for turn in range(2, 5):
                final = (
                    await collect(
                        s.orchestrator,
                        s.orchestrator.open(request(PROMPT + (7,) * turn, rid=f"t{turn}", session="sess")),
                    )
                )[-1]
                assert (final.prefill_worker, final.decode_worker) == (first.prefill_worker, first.decode_worker)

    run_async(main())


def test_prefix_hit_picks_the_worker_holding_it(redis_url):
    ps, ds = [FakePrefill("p0"), FakePrefill("p1")], [FakeDecode("d0"), FakeDecode("d1")]

    async def main():
        async with router_stack(redis_url, ps, ds) as s:
            await s.cache(ps[1], PROMPT)
            await s.cache(ds[0], PROMPT)
            final = (await collect(s.orchestrator, s.orchestrator.open(request(PROMPT))))[-1]
            assert (final.prefill_worker, final.decode_worker) == ("p1", "d0")

    run_async(main())


def test_decode_holding_every_chunk_skips_prefill(redis_url):
    prompt = tuple(range(1, 129)) * 2  # exactly 2 chunks
    p, d = FakePrefill("p0"), FakeDecode("d0", cached_chunks=2)

    async def main():
        async with router_stack(redis_url, [p], [d]) as s:
            final = (await collect(s.orchestrator, s.orchestrator.open(request(prompt))))[-1]
            assert final.prefill_worker == ""
            assert final.usage.cached_tokens_decode == 256
            assert final.usage.cached_tokens == 128  # D replays the last chunk itself
        assert p.started == ["r1"] and p.calls == [("abort", "r1")]  # the head start, ended (in the background)

    run_async(main())


def test_reserve_unavailable_retries_on_another_decode(redis_url):
    p = FakePrefill("p0")
    bad, good = FakeDecode("d0", reserve_error=Unavailable("draining")), FakeDecode("d1")

    async def main():
        async with router_stack(redis_url, [p], [bad, good], routing="round_robin") as s:
            final = (await collect(s.orchestrator, s.orchestrator.open(request(PROMPT))))[-1]
            assert final.decode_worker == "d1"
            assert ("abort", "r1") in bad.calls  # the failed attempt's legs were released
            assert b'flashpd:request_retries_total{code="UNAVAILABLE"' in s.metrics.exposition()

    run_async(main())


def test_prefill_failure_aborts_the_reservation_and_moves_on(redis_url):
    bad, good = FakePrefill("p0", error=TransferFailed("NIXL write failed")), FakePrefill("p1")
    d = FakeDecode("d0")

    async def main():
        async with router_stack(redis_url, [bad, good], [d], routing="round_robin") as s:
            final = (await collect(s.orchestrator, s.orchestrator.open(request(PROMPT))))[-1]
            assert final.prefill_worker == "p1"
            assert d.calls[:2] == [("reserve", "r1"), ("abort", "r1")]
            assert bad.aborted == ["r1"]
            assert b"flashpd:kv_transfer_failures_total" in s.metrics.exposition()

    run_async(main())


def test_decode_dying_before_the_first_token_is_retried(redis_url):
    p = FakePrefill("p0")
    bad, good = FakeDecode("d0", generate_error=Unavailable("actor died")), FakeDecode("d1")

    async def main():
        async with router_stack(redis_url, [p], [bad, good], routing="round_robin") as s:
            events = await collect(s.orchestrator, s.orchestrator.open(request(PROMPT)))
            assert events[-1].decode_worker == "d1" and tokens_of(events) == list(b"abcde")

    run_async(main())


def test_decode_death_after_tokens_continues_on_another_decode_with_identical_output(redis_url):
    p = FakePrefill("p0")
    d0 = FakeDecode("d0", follow_prompt=True, fail_after_tokens=(2, ActorDiedError("the actor died")))
    d1 = FakeDecode("d1", follow_prompt=True)
    expected = list(greedy_chain(PROMPT[-1], 6))  # what an unbroken greedy run gives

    async def main():
        async with router_stack(redis_url, [p], [d0, d1], routing="round_robin") as s:
            events = await collect(s.orchestrator, s.orchestrator.open(request(PROMPT, max_tokens=6)))
            final = events[-1]
            assert tokens_of(events) == expected
            offsets = [e.index for e in events[:-1]]
            assert offsets == [sum(len(e.token_ids) for e in events[:i]) for i in range(len(offsets))]
            assert final.decode_worker == "d1" and final.usage.completion_tokens == 6
            assert final.finish_reason == "length"
            # the continuation: its own id, prompt + the 2 tokens released, 4 tokens to go
            cont = d1.seen[0]
            assert cont.request_id == "r1@1"
            assert cont.prompt_ids == PROMPT + tuple(expected[:2])
            assert cont.sampling.max_tokens == 4
            # its KV: the original prompt's, at the original prefill's credit (cold: 0)
            assert cont.kv_prompt_tokens == len(PROMPT)
            assert cont.kv_prompt_ids == PROMPT and cont.max_prefill_credit_tokens == 0
            # the first event tells a client that may continue the stream itself
            assert events[0].prefill_credit_tokens == 0
            assert all(e.prefill_credit_tokens is None for e in events[1:-1])
            assert d0.aborted == ["r1"] and p.aborted[0] == "r1"

    run_async(main())


def test_prefill_death_is_re_prefilled_elsewhere_under_a_fresh_attempt_id(redis_url):
    dead = FakePrefill("p0", error=ActorDiedError("the actor died"))
    good, d = FakePrefill("p1"), FakeDecode("d0")

    async def main():
        async with router_stack(redis_url, [dead, good], [d], routing="round_robin") as s:
            events = await collect(s.orchestrator, s.orchestrator.open(request(PROMPT)))
            assert events[-1].prefill_worker == "p1" and tokens_of(events) == list(b"abcde")
            # D dropped the first attempt before the second reserved under its own id
            assert d.calls[:3] == [("reserve", "r1"), ("abort", "r1"), ("reserve", "r1@1")]
            assert good.calls == [("run", "r1@1")]
            assert events[-1].request_id == "r1"

    run_async(main())


def test_run_waits_for_a_replacement_when_its_only_prefill_died(redis_url):
    dead = FakePrefill("p0", error=ActorDiedError("the actor died"))
    replacement, d = FakePrefill("p9"), FakeDecode("d0")

    async def main():
        config = OrchestratorConfig(wait_poll_s=0.02, resume_grace_s=0.2)
        async with router_stack(redis_url, [dead], [d], config=config) as s:
            run = s.orchestrator.open(request(PROMPT, deadline_s=20))
            while not dead.calls:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert not run.done  # waiting, not failed
            s.directory_add_prefill(replacement)
            await s.publisher.register(replacement.stats())
            events = await collect(s.orchestrator, run)
            assert events[-1].prefill_worker == "p9" and tokens_of(events) == list(b"abcde")

    run_async(main())


def test_resume_of_a_run_that_broke_after_tokens_continues_it(redis_url):
    p = FakePrefill("p0")
    d0 = FakeDecode("d0", follow_prompt=True, fail_after_tokens=(3, Unavailable("died")))

    async def main():
        config = OrchestratorConfig(max_attempts=1, resume_grace_s=5.0)
        async with router_stack(redis_url, [p], [d0], config=config) as s:
            req = request(PROMPT, max_tokens=8)
            run = s.orchestrator.open(req, resumable=True, fingerprint="f")
            first = []
            with pytest.raises(Unavailable):
                async for e in s.orchestrator.stream(run):
                    first.append(e)
            assert len(tokens_of(first)) == 3
            d0.fail_after_tokens = None  # the next attempt's worker is healthy
            again = s.orchestrator.open(req, resumable=True, fingerprint="f", resume_from_token=3)
            rest = await collect(s.orchestrator, again, from_token=3)
            assert tokens_of(first) + tokens_of(rest) == list(greedy_chain(PROMPT[-1], 8))
            assert d0.seen[-1].request_id == "r1@1" and d0.seen[-1].sampling.max_tokens == 5

    run_async(main())


def test_all_decode_workers_full_is_resource_exhausted(redis_url):
    ds = [FakeDecode(f"d{i}", reserve_error=ResourceExhausted("KV full")) for i in range(2)]

    async def main():
        async with router_stack(redis_url, [FakePrefill("p0")], ds) as s:
            with pytest.raises(ResourceExhausted):
                await collect(s.orchestrator, s.orchestrator.open(request(PROMPT)))
            assert sum(c[0] == "reserve" for d in ds for c in d.calls) == 2

    run_async(main())


def test_no_workers_is_unavailable(redis_url):
    async def main():
        async with router_stack(redis_url, [], [FakeDecode("d0")]) as s:
            with pytest.raises(Unavailable, match="prefill"):
                await collect(s.orchestrator, s.orchestrator.open(request(PROMPT)))

    run_async(main())


def test_deadline_aborts_both_legs(redis_url):
    p, d = FakePrefill("p0", delay_s=5.0), FakeDecode("d0")

    async def main():
        async with router_stack(redis_url, [p], [d]) as s:
            run = s.orchestrator.open(request(PROMPT, deadline_s=0.3))
            assert run.request.deadline_unix_s is not None
            with pytest.raises(DeadlineExceeded):
                await collect(s.orchestrator, run)
            assert p.aborted == ["r1"] and d.aborted == ["r1"]
            assert d.seen[0].deadline_unix_s == run.request.deadline_unix_s  # propagated

    run_async(main())


def test_abort_mid_stream_aborts_both_legs(redis_url):
    p, d = FakePrefill("p0"), FakeDecode("d0", token_delay_s=0.05)

    async def main():
        async with router_stack(redis_url, [p], [d]) as s:
            run = s.orchestrator.open(request(PROMPT, max_tokens=20))
            stream = s.orchestrator.stream(run)
            assert isinstance(await anext(stream), TokenEvent)
            assert await s.orchestrator.abort("r1") is True
            with pytest.raises(Cancelled):
                async for _ in stream:
                    continue
            assert p.aborted == ["r1"] and d.aborted == ["r1"] and d.closed_streams == 1
            assert await s.orchestrator.abort("r1") is False

    run_async(main())


def test_consumer_leaving_a_plain_request_aborts_it(redis_url):
    p, d = FakePrefill("p0"), FakeDecode("d0", token_delay_s=0.05)

    async def main():
        async with router_stack(redis_url, [p], [d]) as s:
            run = s.orchestrator.open(request(PROMPT, max_tokens=20))
            stream = s.orchestrator.stream(run)
            await anext(stream)
            await stream.aclose()
            await asyncio.wait({run.task}, timeout=5)
            assert isinstance(run.error, Cancelled)
            assert p.aborted == ["r1"] and d.aborted == ["r1"]

    run_async(main())


def test_resumable_run_survives_a_disconnect_and_resumes_at_an_offset(redis_url):
    p, d = FakePrefill("p0"), FakeDecode("d0", token_delay_s=0.02)

    async def main():
        async with router_stack(redis_url, [p], [d], config=OrchestratorConfig(resume_grace_s=5.0)) as s:
            req = request(PROMPT, max_tokens=10)
            run = s.orchestrator.open(req, resumable=True, fingerprint="f")
            stream = s.orchestrator.stream(run)
            first = [await anext(stream), await anext(stream)]
            await stream.aclose()  # the connection broke after 2 tokens
            received = len(tokens_of(first))  # >= 2: a lagging consumer gets merged chunks
            again = s.orchestrator.open(req, resumable=True, fingerprint="f", resume_from_token=received)
            assert again is run
            rest = await collect(s.orchestrator, again, from_token=received)
            assert tokens_of(first) + tokens_of(rest) == list(b"abcdefghij")
            assert d.aborted == []

    run_async(main())


def test_detached_resumable_run_is_aborted_after_the_grace(redis_url):
    p, d = FakePrefill("p0"), FakeDecode("d0", token_delay_s=0.05)

    async def main():
        async with router_stack(redis_url, [p], [d], config=OrchestratorConfig(resume_grace_s=0.1)) as s:
            run = s.orchestrator.open(request(PROMPT, max_tokens=50), resumable=True)
            stream = s.orchestrator.stream(run)
            await anext(stream)
            await stream.aclose()
            await asyncio.wait({run.task}, timeout=5)
            assert isinstance(run.error, Cancelled) and d.aborted == ["r1"]

    run_async(main())


def test_request_id_reuse_and_unknown_resume_are_rejected(redis_url):
    async def main():
        async with router_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as s:
            run = s.orchestrator.open(request(PROMPT), resumable=True, fingerprint="a")
            with pytest.raises(InvalidArgument) as info:
                s.orchestrator.open(request(PROMPT), resumable=True, fingerprint="b")
            assert info.value.field == "request_id"
            with pytest.raises(NotFound):
                s.orchestrator.open(request(PROMPT, rid="r2"), resumable=True, resume_from_token=3)
            await collect(s.orchestrator, run)
            with pytest.raises(InvalidArgument, match="chunk boundary"):
                await collect(s.orchestrator, run, from_token=99)

    run_async(main())


def test_stop_string_cuts_text_and_stops_decode(redis_url):
    p, d = FakePrefill("p0"), FakeDecode("d0")

    async def main():
        async with router_stack(redis_url, [p], [d]) as s:
            events = await collect(s.orchestrator, s.orchestrator.open(request(PROMPT, max_tokens=20, stop=("def",))))
            final = events[-1]
            assert "".join(e.text for e in events[:-1]) + final.text == "abc"
            assert final.finish_reason == "stop" and final.usage.completion_tokens == 6
            assert d.aborted == ["r1"]

    run_async(main())


def test_metrics_count_cache_tiers_once(redis_url):
    p, d = FakePrefill("p0", cached_tokens=256), FakeDecode("d0", cached_chunks=1)

    async def main():
        async with router_stack(redis_url, [p], [d]) as s:
            await collect(s.orchestrator, s.orchestrator.open(request(PROMPT)))
            text = s.metrics.exposition().decode()
            assert 'flashpd:prefix_cache_hits_total{model_name="flash-tiny",tier="prefill"} 1.0' in text
            assert 'flashpd:prefix_cache_hits_total{model_name="flash-tiny",tier="decode"} 1.0' in text
            assert 'tier="none"' not in text
            assert "flashpd:time_to_first_token_seconds_count" in text
            assert 'flashpd:kv_transfer_bytes_total{model_name="flash-tiny"} 341760.0' in text

    run_async(main())


def test_a_continued_guided_run_replays_its_tokens_into_the_grammar(redis_url):
    """Structured output that breaks after 2 tokens continues on another decode worker whose
    grammar first accepts those 2 tokens (GuidedDecoding.replay_tokens)."""
    from flashpd.engine.sampling_params import GuidedDecoding

    p = FakePrefill("p0")
    d0 = FakeDecode("d0", follow_prompt=True, fail_after_tokens=(2, ActorDiedError("the actor died")))
    d1 = FakeDecode("d1", follow_prompt=True)

    async def main():
        async with router_stack(redis_url, [p], [d0, d1], routing="round_robin") as s:
            await collect(
                s.orchestrator, s.orchestrator.open(request(PROMPT, max_tokens=6, guided=GuidedDecoding("json_object")))
            )

    run_async(main())
    assert d0.seen[0].sampling.guided.replay_tokens == 0
    cont = d1.seen[0]
    assert cont.sampling.guided.replay_tokens == 2 and cont.prompt_ids[:-2] == PROMPT
