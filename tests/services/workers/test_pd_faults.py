"""Prefill and decode workers in one process (local transfer backend) under cancellation, retries
and load: blocks come back as soon as no write can land in them (never after a fixed quarantine),
a retried request id supersedes its old attempt, and requests beyond capacity queue instead of
being refused. Lease and transfer timeout are long (60 s) here, so only the notices (completion,
abandon, abandon_all) can explain blocks coming back quickly."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.services.api import (
    Cancelled,
    DeadlineExceeded,
    FinalEvent,
    InternalRequest,
    SamplingParams,
    ServiceError,
    TokenEvent,
)
from flashpd.services.decode.server import DecodeWorker
from flashpd.services.prefill.server import PrefillWorker
from flashpd.services.worker.admission import WorkerFull
from flashpd.services.worker.common import WorkerConfig, new_worker_ref

MODEL_ID = "flashpd-tiny"
LONG_S = 60.0
SETTLE_S = 5.0  # the bound for the workers to be idle again after a storm


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _workers(model, decode_blocks: int = 64, max_queued: int = 1024, max_seqs: int = 16):
    def make(role, blocks):
        ec = EngineConfig(role=role, num_blocks=blocks, num_slots=max_seqs, model_id=MODEL_ID, max_num_seqs=max_seqs)
        wc = WorkerConfig(
            "unused",
            MODEL_ID,
            ec,
            transfer_backend="local",
            lease_s=LONG_S,
            transfer_timeout_s=LONG_S,
            max_queued_requests=max_queued,
        )
        return LLMEngine(model, ec), wc

    pe, pc = make("prefill", 64)
    de, dc = make("decode", decode_blocks)
    return (PrefillWorker(pe, pc, new_worker_ref("prefill")), DecodeWorker(de, dc, new_worker_ref("decode")))


def _req(rid: str, n: int, seed: int, max_tokens: int = 3, deadline_s: float | None = None):
    deadline = None if deadline_s is None else time.time() + deadline_s
    return InternalRequest(
        rid,
        MODEL_ID,
        tuple(_prompt(n, seed)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        deadline_unix_s=deadline,
    )


async def _turn(p: PrefillWorker, d: DecodeWorker, req: InternalRequest) -> list[int]:
    ticket = await d.reserve(req)
    if ticket.needs_prefill:
        await p.run(req, ticket)
    ids = []
    async for ev in d.generate(req):
        if isinstance(ev, TokenEvent):
            ids.extend(ev.token_ids)
        else:
            assert isinstance(ev, FinalEvent)
    return ids


async def _abort_legs(p: PrefillWorker, d: DecodeWorker, rid: str) -> None:
    """What the router does on cancel: abort both legs concurrently."""
    await asyncio.gather(p.abort(rid), d.abort(rid))


async def _idle(p: PrefillWorker, d: DecodeWorker, timeout_s: float = SETTLE_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ps, ds = await p.stats(), await d.stats()
        if ps.kv_blocks_used == 0 and ds.kv_blocks_used == 0 and not d.receiver.num_draining:
            return True
        await asyncio.sleep(0.01)
    return False


def _run(coro):
    return asyncio.run(coro)


class _SlowPush:
    """The prefill's sender with its writes still moving after the event loop's inline polls:
    PROC until `landed` is set (the local copy itself happened in the post); an abort of an
    unfinished write is recorded (a local write cannot really be cancelled)."""

    def __init__(self, sender):
        self.landed = threading.Event()
        self.aborted: list = []
        self.polls = 0
        poll = sender._poll

        def slow_poll(xfer):
            self.polls += 1
            return poll(xfer) if self.landed.is_set() else "PROC"

        sender._poll = slow_poll
        sender._abort = self.aborted.append

    async def handed_off(self) -> None:
        """Once the loop runs this again, the inline polls are over: a push thread waits."""
        while not self.polls:
            await asyncio.sleep(0.001)


def test_a_push_still_moving_after_the_inline_polls_completes_on_a_push_thread(model_f32):
    async def main():
        p, d = _workers(model_f32)
        slow = _SlowPush(p.sender)
        try:
            turn = asyncio.create_task(_turn(p, d, _req("s", 300, 7)))
            await slow.handed_off()
            slow.landed.set()
            assert len(await turn) == 3
            (record,) = p.push_records
            assert record["inline"] is False and record["phases"]["polls"] > 1
            assert not slow.aborted and await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_abort_while_a_push_thread_waits_cancels_the_write_and_frees_both_sides(model_f32):
    async def main():
        p, d = _workers(model_f32)
        slow = _SlowPush(p.sender)
        try:
            req = _req("w", 300, 8)
            ticket = await d.reserve(req)
            run = asyncio.create_task(p.run(req, ticket))
            await slow.handed_off()
            await _abort_legs(p, d, "w")
            with pytest.raises(Cancelled):
                await run
            assert len(slow.aborted) == 1  # the transfer was cancelled, then abandoned
            assert await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_abort_between_reserve_and_run_frees_decode_blocks_without_waiting(model_f32):
    async def main():
        p, d = _workers(model_f32)
        try:
            await _turn(p, d, _req("warm", 150, 0))  # connects P to D
            assert await _idle(p, d)
            req = _req("x", 300, 1)
            ticket = await d.reserve(req)
            assert (await d.stats()).kv_blocks_used == len(ticket.dst_block_ids)
            await _abort_legs(p, d, "x")  # P never saw the run: tombstone + abandon_all
            assert await _idle(p, d)
            with pytest.raises(Cancelled):  # the run arriving late is refused
                await p.run(req, ticket)
            assert await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_abort_during_prefill_frees_both_sides_on_the_abandon_notice(model_f32):
    async def main():
        p, d = _workers(model_f32)
        try:
            req = _req("y", 600, 2)
            ticket = await d.reserve(req)
            run = asyncio.create_task(p.run(req, ticket))
            while not p.queued_prefill_tokens():
                await asyncio.sleep(0.001)
            await _abort_legs(p, d, "y")
            with pytest.raises(ServiceError):
                await run
            assert await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_decode_abort_first_then_a_late_write_lands_and_frees(model_f32):
    async def main():
        p, d = _workers(model_f32)
        try:
            req = _req("z", 300, 3)
            ticket = await d.reserve(req)
            assert await d.abort("z")
            held = (await d.stats()).kv_blocks_used
            assert held == len(ticket.dst_block_ids)  # a write may still come: blocks kept
            await p.run(req, ticket)  # the late write lands in the drained blocks, then frees
            assert await _idle(p, d)
            assert d.receiver.rejection_counts().get("cancelled", 0) == 1
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_retry_of_a_held_request_id_supersedes_the_old_attempt(model_f32):
    async def main():
        p, d = _workers(model_f32)
        try:
            req = _req("r", 300, 4, max_tokens=4)
            old = await d.reserve(req)  # its prefill "died": no run, no abort reached P
            new = await d.reserve(req)  # the router's retry on the same decode worker
            assert new.incarnation != old.incarnation
            ids = []
            await p.run(req, new)
            async for ev in d.generate(req):
                if isinstance(ev, TokenEvent):
                    ids.extend(ev.token_ids)
            assert len(ids) == 4
            await p.abort("r")  # the router aborts the dead attempt's prefill leg: abandon_all
            assert await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_retry_after_abort_of_the_first_attempt_proceeds(model_f32):
    async def main():
        p, d = _workers(model_f32)
        try:
            req = _req("s", 300, 5, max_tokens=3)
            await d.reserve(req)
            await _abort_legs(p, d, "s")  # first attempt given up
            ids = await _turn(p, d, req)  # the retry, same request id, same workers
            assert len(ids) == 3
            assert await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


@pytest.mark.slow
def test_cancel_storm_of_200_leaks_nothing_and_serves_afterwards(model_f32):
    async def main():
        p, d = _workers(model_f32)
        rng = random.Random(0)
        sem = asyncio.Semaphore(8)
        outcomes = {"done": 0, "cancelled": 0}

        async def one(i: int):
            async with sem:
                req = _req(f"c{i}", rng.choice([60, 200, 300]), i, max_tokens=6)
                point = rng.choice(["reserve", "run", "ran", "generate", "none"])
                task = asyncio.create_task(_turn_until(p, d, req, point))
                try:
                    await task
                    outcomes["done"] += 1
                except (ServiceError, asyncio.CancelledError, _Cut):
                    outcomes["cancelled"] += 1
                    await _abort_legs(p, d, req.request_id)

        try:
            await asyncio.gather(*(one(i) for i in range(200)))
            assert outcomes["done"] + outcomes["cancelled"] == 200 and outcomes["cancelled"] > 100
            settle_t0 = time.monotonic()
            assert await _idle(p, d)
            print(f"cancel storm: {outcomes}; idle {time.monotonic() - settle_t0:.3f} s after")
            assert (await d.stats()).queued == 0
            assert len(await _turn(p, d, _req("after", 200, 999))) == 3
        finally:
            await p.close()
            await d.close()

    _run(main())


class _Cut(Exception):
    """The client went away at the chosen point."""


async def _turn_until(p, d, req, point: str) -> None:
    ticket = await d.reserve(req)
    if point == "reserve":
        raise _Cut
    if ticket.needs_prefill:
        run = asyncio.create_task(p.run(req, ticket))
        if point == "run":
            await asyncio.sleep(0)
            run.cancel()
            try:
                await run
            except asyncio.CancelledError:
                pass
            raise _Cut
        await run
    if point == "ran":
        raise _Cut
    async for ev in d.generate(req):
        if point == "generate" and isinstance(ev, TokenEvent):
            raise _Cut


def test_requests_beyond_capacity_queue_and_all_complete(model_f32):
    async def main():
        # 12 decode blocks; each request needs 3 (300-token prompt): 4 fit at once
        p, d = _workers(model_f32, decode_blocks=12)
        try:
            peak = {"queued": 0}

            async def watch():
                while True:
                    peak["queued"] = max(peak["queued"], (await d.stats()).queued)
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            results = await asyncio.gather(*(_turn(p, d, _req(f"q{i}", 300, 100 + i, 4)) for i in range(16)))
            watcher.cancel()
            assert all(len(ids) == 4 for ids in results)
            assert peak["queued"] > 0
            assert await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_full_queue_refuses_with_retry_after_and_queued_deadline_frees(model_f32):
    async def main():
        p, d = _workers(model_f32, decode_blocks=6, max_queued=1)
        try:
            await _turn(p, d, _req("warm", 150, 0))  # connects P to D (for abandon_all)
            holders = [await d.reserve(_req(f"h{i}", 300, 200 + i)) for i in range(2)]
            assert len(holders) == 2 and (await d.stats()).kv_blocks_used == 6
            queued = asyncio.create_task(d.reserve(_req("w", 300, 300, deadline_s=0.5)))
            while (await d.stats()).queued == 0:
                await asyncio.sleep(0.001)
            with pytest.raises(WorkerFull) as full:
                await d.reserve(_req("over", 300, 301))
            assert full.value.code == "RESOURCE_EXHAUSTED" and full.value.retry_after_s > 0
            with pytest.raises(DeadlineExceeded):
                await queued
            stats = await d.stats()
            assert stats.queued == 0 and stats.kv_blocks_used == 6  # only the holders' blocks
            for i in range(2):
                await _abort_legs(p, d, f"h{i}")
            assert await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_worker_full_survives_pickling_with_its_hint():
    import pickle

    err = pickle.loads(pickle.dumps(WorkerFull("full", retry_after_s=2.5)))
    assert isinstance(err, WorkerFull) and err.retry_after_s == 2.5 and err.message == "full"


async def _concurrent_streams(model, n: int) -> tuple[list[float], object, object]:
    """n concurrent turns (200-token prompts, 16 tokens out) on one prefill and one decode
    worker whose pools hold far fewer: every one completes (queued, not refused)."""
    p, d = _workers(model, decode_blocks=48, max_seqs=16)
    ttfts: list[float] = []

    async def one(i: int) -> int:
        req = _req(f"l{i}", 200, 1000 + i, max_tokens=16)
        t0 = time.monotonic()
        ticket = await d.reserve(req)
        await p.run(req, ticket)
        count = 0
        async for ev in d.generate(req):
            if isinstance(ev, TokenEvent):
                if not count:
                    ttfts.append(time.monotonic() - t0)
                count += len(ev.token_ids)
        return count

    try:
        counts = await asyncio.gather(*(one(i) for i in range(n)))
        assert counts == [16] * n
        assert await _idle(p, d)
        return sorted(ttfts), await p.stats(), await d.stats()
    finally:
        await p.close()
        await d.close()


@pytest.mark.slow
def test_100_concurrent_streams_all_complete(model_f32):
    ttfts, p_stats, d_stats = _run(_concurrent_streams(model_f32, 100))
    assert len(ttfts) == 100 and p_stats.kv_blocks_used == d_stats.kv_blocks_used == 0
    print(f"100 streams: TTFT p50 {ttfts[49]:.2f} s, p99 {ttfts[98]:.2f} s")


@pytest.mark.soak  # ~10 min on the 2-core machine: the second test command (README)
@pytest.mark.timeout(3600)
def test_500_concurrent_streams_all_complete(model_f32):
    ttfts, p_stats, d_stats = _run(_concurrent_streams(model_f32, 500))
    assert len(ttfts) == 500 and p_stats.kv_blocks_used == d_stats.kv_blocks_used == 0
    print(f"500 streams: TTFT p50 {ttfts[249]:.2f} s, p99 {ttfts[494]:.2f} s")


def test_prefill_frees_its_blocks_on_transfer_failure_and_deadline(model_f32):
    from flashpd.services.api import TransferFailed

    async def main():
        p, d = _workers(model_f32)
        try:
            req = _req("tf", 300, 7)
            ticket = await d.reserve(req)
            p._connect(ticket.transfer_descriptor)  # connected, then the receiver goes away
            d.receiver.close()
            with pytest.raises(TransferFailed):
                await p.run(req, ticket)
            assert (await p.stats()).kv_blocks_used == 0 and p.transfer_failures == 1
            late = _req("dl", 600, 8, deadline_s=-1.0)  # already passed
            with pytest.raises(DeadlineExceeded):
                await p.run(late, ticket)
            assert (await p.stats()).kv_blocks_used == 0
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_expired_lease_is_retryable_unavailable_not_a_client_error(model_f32):
    """Under load a reservation can outlive its lease while every worker is alive (a queued
    prefill): the attempt is lost, not the request, so generate answers UNAVAILABLE (the
    router places it again) instead of NOT_FOUND / DEADLINE_EXCEEDED reaching the client."""
    from flashpd.services.api import Unavailable

    async def main():
        ec = EngineConfig(role="decode", num_blocks=16, num_slots=4, model_id=MODEL_ID)
        wc = WorkerConfig("unused", MODEL_ID, ec, transfer_backend="local", lease_s=0.05, transfer_timeout_s=0.05)
        d = DecodeWorker(LLMEngine(model_f32, ec), wc, new_worker_ref("decode"))
        try:
            req = _req("slow", 200, 9)
            await d.reserve(req)
            for _ in range(2000):  # polled: the engine loop expires it after lease + grace
                if "slow" in d._expired:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(Unavailable, match="did not arrive within its lease"):
                async for _ in d.generate(req):
                    pass
            for _ in range(2000):  # no write can land after lease + transfer timeout + margin
                if (await d.stats()).kv_blocks_used == 0:
                    break
                await asyncio.sleep(0.01)
            assert (await d.stats()).kv_blocks_used == 0
        finally:
            await d.close()

    _run(main())
