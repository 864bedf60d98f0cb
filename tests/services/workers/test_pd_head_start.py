"""The prefill's head start (`PrefillWorker.start`) with real workers in one process (local
transfer): the compute begins before the ticket exists and `run(req, ticket)` takes it over,
whenever the ticket comes; an abort or a run that never comes frees the blocks on both sides;
duplicate, late and retried calls never compute twice or collide."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.services.api import Cancelled, DeadlineExceeded, FinalEvent, InternalRequest, SamplingParams, TokenEvent
from flashpd.services.decode.server import DecodeWorker
from flashpd.services.prefill.server import PrefillWorker
from flashpd.services.worker.common import WorkerConfig, new_worker_ref

MODEL_ID = "flashpd-tiny"
LONG_S = 60.0  # lease and transfer timeout: only the notices can free blocks quickly
SETTLE_S = 5.0  # bound for the workers to be idle again


def _workers(model, prefill_lease_s: float = LONG_S, max_seqs: int = 16) -> tuple[PrefillWorker, DecodeWorker]:
    def make(role, lease_s):
        ec = EngineConfig(role=role, num_blocks=64, num_slots=16, model_id=MODEL_ID, max_num_seqs=max_seqs)
        wc = WorkerConfig("unused", MODEL_ID, ec, transfer_backend="local", lease_s=lease_s, transfer_timeout_s=LONG_S)
        return LLMEngine(model, ec), wc

    (pe, pc), (de, dc) = make("prefill", prefill_lease_s), make("decode", LONG_S)
    return PrefillWorker(pe, pc, new_worker_ref("prefill")), DecodeWorker(de, dc, new_worker_ref("decode"))


def _req(rid: str, n: int, seed: int, max_tokens: int = 3, deadline_s: float | None = None) -> InternalRequest:
    prompt = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    deadline = None if deadline_s is None else time.time() + deadline_s
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return InternalRequest(rid, MODEL_ID, tuple(prompt), params, deadline_unix_s=deadline)


async def _idle(p: PrefillWorker, d: DecodeWorker) -> bool:
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        ps, ds = await p.stats(), await d.stats()
        if ps.kv_blocks_used == 0 and ds.kv_blocks_used == 0 and not d.receiver.num_draining:
            return True
        await asyncio.sleep(0.01)
    return False


async def _turn(p: PrefillWorker, d: DecodeWorker, req: InternalRequest) -> list[int]:
    """The sequential path: reserve, then run."""
    ticket = await d.reserve(req)
    await p.run(req, ticket)
    return await _tokens(d, req)


def _run(coro):
    return asyncio.run(coro)


class _Engine:
    """Counts the prefills P's engine runs (by engine id); each waits for `gate` first."""

    def __init__(self, p: PrefillWorker) -> None:
        self.ids: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.ended = asyncio.Event()
        prefill = p.engine.prefill

        async def counted(engine_id, prompt_ids, prefix=None):
            self.ids.append(engine_id)
            await self.gate.wait()
            try:
                return await prefill(engine_id, prompt_ids, prefix)
            finally:
                self.ended.set()

        p.engine.prefill = counted


async def _tokens(d, req) -> list[int]:
    ids = []
    async for ev in d.generate(req):
        if isinstance(ev, TokenEvent):
            ids.extend(ev.token_ids)
        else:
            assert isinstance(ev, FinalEvent)
    return ids


async def _reference(model, req) -> list[int]:
    """The request's tokens through the sequential path (reserve, then run) on fresh workers."""
    p, d = _workers(model)
    try:
        return await _turn(p, d, req)
    finally:
        await p.close()
        await d.close()


async def _taken_over(p: PrefillWorker, rid: str) -> None:
    while rid in p._heads:
        await asyncio.sleep(0.001)


def test_ticket_before_the_compute_ends_pushes_the_head_start_s_kv(model_f32):
    async def main():
        req = _req("a", 600, 1, max_tokens=4)
        expected = await _reference(model_f32, req)
        p, d = _workers(model_f32)
        engine = _Engine(p)
        engine.gate.clear()  # the compute cannot end before the run has the ticket
        try:
            assert await p.start(req)
            ticket = await d.reserve(req)
            run = asyncio.create_task(p.run(req, ticket))
            await _taken_over(p, "a")
            engine.gate.set()
            result = await run
            assert engine.ids == ["a@p0"] and result.pushed_bytes > 0
            push = p.push_records[-1]
            assert push["engine_post"] and push["hop_ms"] == 0  # posted by the engine thread at kv_ready
            # ... built before the last chunk's kernels were waited for: only the post was left
            assert push["prepared"] and push["phases"]["prepared_ahead"] == 1
            assert 0 <= push["transfer_ms"] <= push["total_ms"]
            assert await _tokens(d, req) == expected
            assert await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_ticket_after_the_compute_ended_pushes_at_once(model_f32):
    async def main():
        req = _req("b", 600, 2, max_tokens=4)
        expected = await _reference(model_f32, req)
        p, d = _workers(model_f32)
        engine = _Engine(p)
        try:
            assert await p.start(req)
            await engine.ended.wait()
            assert p.queued_prefill_tokens() == 600  # computed, holding its blocks for the push
            ticket = await d.reserve(req)
            await p.run(req, ticket)
            assert not p.push_records[-1]["engine_post"]  # kv_ready came before the ticket: the loop posts
            assert len(engine.ids) == 1 and await _tokens(d, req) == expected
            assert await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


@pytest.mark.parametrize("computed", [False, True])
def test_abort_before_the_ticket_frees_the_blocks_and_refuses_the_late_run(model_f32, computed):
    """The router aborts the prefill leg when the reserve failed or its ticket needs no
    prefill: the head start ends (mid-compute or waiting with its KV) and a run that still
    arrives with a ticket issued before the abort is refused; its decode worker is told."""

    async def main():
        p, d = _workers(model_f32)
        engine = _Engine(p)
        try:
            await _turn(p, d, _req("warm", 150, 0))  # connects P to D
            req = _req("c", 600, 3)
            engine.gate.clear()
            assert await p.start(req)
            ticket = await d.reserve(req)
            if computed:
                engine.gate.set()
                await engine.ended.wait()
            assert await p.abort("c")
            assert not p.queued_prefill_tokens()
            engine.gate.set()
            with pytest.raises(Cancelled):
                await p.run(req, ticket)
            assert len(engine.ids) == 2  # the warm-up and the head start, nothing more
            assert await d.abort("c")
            assert await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_a_head_start_no_run_takes_over_frees_its_blocks_after_the_lease(model_f32):
    async def main():
        p, d = _workers(model_f32, prefill_lease_s=0.05)
        engine = _Engine(p)
        try:
            req = _req("e", 600, 4)
            assert await p.start(req)
            await engine.ended.wait()
            while p._heads:
                await asyncio.sleep(0.001)
            assert await _idle(p, d)
            ticket = await d.reserve(req)  # a run that comes after all computes afresh
            await p.run(req, ticket)
            assert engine.ids == ["e@p0", "e@p1"]
            assert len(await _tokens(d, req)) == 3 and await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_duplicate_and_late_starts_compute_nothing(model_f32):
    async def main():
        p, d = _workers(model_f32)
        engine = _Engine(p)
        try:
            req = _req("f", 300, 5)
            assert await p.start(req)
            assert not await p.start(req)  # a duplicate
            ticket = await d.reserve(req)
            await p.run(req, ticket)
            assert engine.ids == ["f@p0"]
            await _tokens(d, req)
            aborted = _req("g", 300, 6)
            await p.abort("g")
            assert not await p.start(aborted)  # its abort overtook it
            assert engine.ids == ["f@p0"] and await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_head_starts_hold_at_most_half_the_engine_s_sequences(model_f32):
    async def main():
        p, d = _workers(model_f32, max_seqs=4)
        try:
            reqs = [_req(f"k{i}", 150, 20 + i) for i in range(3)]
            assert [await p.start(r) for r in reqs] == [True, True, False]
            for r in reqs:  # the third computes in its run, as without a head start
                await _turn(p, d, r)
            assert not p._heads and await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_a_head_start_past_its_deadline_fails_the_run_and_abandons_the_ticket(model_f32):
    async def main():
        p, d = _workers(model_f32)
        try:
            req = _req("h", 300, 7, deadline_s=-1.0)
            assert await p.start(req)
            ticket = await d.reserve(dataclasses.replace(req, deadline_unix_s=None))
            with pytest.raises(DeadlineExceeded):
                await p.run(req, ticket)
            assert await d.abort("h")
            assert await _idle(p, d)  # the abandon notice freed D's blocks
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_a_retry_of_the_request_id_never_collides_with_its_head_start(model_f32):
    """A run of the same id for another prompt (a continuation) drops the head start and
    computes its own; a new start after an abort is a new attempt."""

    async def main():
        p, d = _workers(model_f32)
        engine = _Engine(p)
        try:
            first = _req("r", 300, 8)
            engine.gate.clear()
            assert await p.start(first)
            longer = dataclasses.replace(first, prompt_ids=first.prompt_ids + (9, 9))
            ticket = await d.reserve(longer)
            run = asyncio.create_task(p.run(longer, ticket))
            engine.gate.set()
            await run
            assert engine.ids == ["r@p0", "r@p1"]
            assert len(await _tokens(d, longer)) == 3 and await _idle(p, d)
            await p.abort("r")
            retry = _req("r", 300, 8)  # arrives after the abort
            assert await p.start(retry)
            ticket = await d.reserve(retry)
            await p.run(retry, ticket)
            assert engine.ids == ["r@p0", "r@p1", "r@p2"]
            assert len(await _tokens(d, retry)) == 3 and await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_a_lease_that_passed_at_kv_ready_refuses_the_engine_s_post(model_f32):
    """The engine thread checks the ticket's lease at kv_ready as the event loop did: no write
    after it, the run fails Unavailable (the router places it again), the prefill's blocks freed."""

    async def main():
        from flashpd.services.api import Unavailable

        req = _req("lease", 600, 11)
        p, d = _workers(model_f32)
        engine = _Engine(p)
        engine.gate.clear()
        try:
            ticket = await d.reserve(req)
            ticket = dataclasses.replace(ticket, lease_deadline_unix_s=time.time() + 0.3)
            run = asyncio.create_task(p.run(req, ticket))
            await asyncio.sleep(0.5)  # the lease passes while the compute waits
            engine.gate.set()
            with pytest.raises(Unavailable, match="lease"):
                await run
            assert not p.push_records  # nothing was written
            assert (await p.stats()).kv_blocks_used == 0  # (the decode keeps its reservation to its own lease)
            assert await _turn(p, d, _req("after", 300, 12)) != []  # still serving
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_a_run_cancelled_after_the_engine_posted_waits_for_the_write_before_abandoning(model_f32):
    """The engine thread posted the write, then the run is cancelled before it follows it: the
    cleanup waits until that write ended before the abandon notice, and frees both sides."""

    async def main():
        req = _req("cut", 600, 13)
        p, d = _workers(model_f32)
        loop = asyncio.get_running_loop()
        sent = []
        post = p.sender.post  # the engine thread posts the write it prepared

        def post_then_cancel(*args, **kwargs):
            handle = post(*args, **kwargs)
            sent.append(handle)
            loop.call_soon_threadsafe(run.cancel)  # lands before kv_ready reaches the run
            return handle

        p.sender.post = post_then_cancel
        try:
            ticket = await d.reserve(req)
            run = asyncio.create_task(p.run(req, ticket))
            with pytest.raises((asyncio.CancelledError, Cancelled)):
                await run
            assert len(sent) == 1  # the engine thread did post it
            assert await _idle(p, d)
            p.sender.post = post
            assert await _turn(p, d, _req("after", 300, 14)) != []
        finally:
            await p.close()
            await d.close()

    _run(main())


def _early_workers(model, push_early: bool, budget: int = 200) -> tuple[PrefillWorker, DecodeWorker]:
    """Workers whose prefill computes in `budget`-token chunks (not a multiple of the 128-token
    block: a chunk's first block is shared with the chunk before)."""

    def make(role, **engine):
        ec = EngineConfig(role=role, num_blocks=64, num_slots=16, model_id=MODEL_ID, **engine)
        wc = WorkerConfig("unused", MODEL_ID, ec, transfer_backend="local", lease_s=LONG_S, transfer_timeout_s=LONG_S)
        return LLMEngine(model, ec), dataclasses.replace(wc, push_early=push_early and role == "prefill")

    (pe, pc), (de, dc) = make("prefill", max_num_batched_tokens=budget), make("decode")
    return PrefillWorker(pe, pc, new_worker_ref("prefill")), DecodeWorker(de, dc, new_worker_ref("decode"))


@pytest.mark.parametrize("n", [600, 1000])
def test_an_early_push_writes_the_final_chunks_before_kv_ready_and_decodes_the_same(model_f32, n):
    """push_early: the blocks of the chunks before the last one are written while the last one
    computes; the kv_ready write moves the rest. The decode side's tokens are the same as with
    one push at the end, and every block is freed after."""

    async def main():
        req = _req("e", n, 21, max_tokens=5)
        p0, d0 = _early_workers(model_f32, push_early=False)
        try:
            expected = await _turn(p0, d0, req)
            (whole,) = p0.push_records
        finally:
            await p0.close()
            await d0.close()
        p, d = _early_workers(model_f32, push_early=True)
        try:
            ticket = await d.reserve(req)
            result = await p.run(req, ticket)
            (push,) = p.push_records
            # the last step computes from token 400 (n = 600) / 800 (n = 1000): blocks 0..2 / 0..5 early
            per_block = whole["bytes"] // -(-n // 128)
            assert push["early_bytes"] == (400 // 128 if n == 600 else 800 // 128) * per_block
            assert push["bytes"] == result.pushed_bytes == whole["bytes"]
            assert push["engine_post"] and push["prepared"]
            assert await _tokens(d, req) == expected
            assert await _idle(p, d)
        finally:
            await p.close()
            await d.close()

    _run(main())


def test_a_run_cancelled_after_its_early_write_frees_every_block(model_f32):
    async def main():
        req = _req("ec", 600, 22)
        p, d = _early_workers(model_f32, push_early=True)
        loop = asyncio.get_running_loop()
        early = p._push_early
        written = []

        def early_then_cancel(*args):
            n = early(*args)
            written.append(n)
            loop.call_soon_threadsafe(run.cancel)  # lands before kv_ready reaches the run
            return n

        p._push_early = early_then_cancel
        try:
            ticket = await d.reserve(req)
            run = asyncio.create_task(p.run(req, ticket))
            with pytest.raises((asyncio.CancelledError, Cancelled)):
                await run
            assert written == [3]  # the early write completed before the cancel
            assert await _idle(p, d)
            p._push_early = early
            assert await _turn(p, d, _req("after", 300, 23)) != []
        finally:
            await p.close()
            await d.close()

    _run(main())
