"""Prefill and decode workers wired in one process (local transfer backend): the disaggregated
path gives the colocated engine's greedy output, moves only what decode lacks, frees on abort."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams as EngineSampling
from flashpd.services.api import InternalRequest, SamplingParams, TokenEvent
from flashpd.services.decode.server import DecodeWorker
from flashpd.services.prefill.server import PrefillWorker
from flashpd.services.worker.common import WorkerConfig, new_worker_ref

MODEL_ID = "flashpd-tiny"


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _workers(model, replay: bool):
    def cfg(role):
        ec = EngineConfig(role=role, num_blocks=32, num_slots=8, swa_bounded_replay=replay, model_id=MODEL_ID)
        return LLMEngine(model, ec), WorkerConfig(
            "unused", MODEL_ID, ec, transfer_backend="local", transfer_timeout_s=30.0
        )

    pe, pc = cfg("prefill")
    de, dc = cfg("decode")
    return (PrefillWorker(pe, pc, new_worker_ref("prefill")), DecodeWorker(de, dc, new_worker_ref("decode")))


async def _turn(p: PrefillWorker, d: DecodeWorker, rid: str, prompt: list[int], n: int):
    req = InternalRequest(rid, MODEL_ID, tuple(prompt), SamplingParams(max_tokens=n))
    ticket = await d.reserve(req)
    pushed = 0
    if ticket.needs_prefill:
        pushed = (await p.run(req, ticket)).pushed_bytes
    ids, final = [], None
    async for ev in d.generate(req):
        if isinstance(ev, TokenEvent):
            ids.extend(ev.token_ids)
        else:
            final = ev
    return ids, final, ticket, pushed


def _colocated(model, prompt, n):
    eng = LLMEngine(model, EngineConfig(num_blocks=32, swa_bounded_replay=False, model_id=MODEL_ID))
    eng.add_request("c", prompt, EngineSampling(max_tokens=n))
    out = []
    while eng.has_unfinished():
        for o in eng.step():
            out.extend(o.new_token_ids)
    return out


def test_disaggregated_equals_colocated_and_moves_only_the_tail(model_f32):
    async def main():
        p, d = _workers(model_f32, replay=False)
        try:
            turn1 = _prompt(200, 1)
            ids1, fin1, t1, bytes1 = await _turn(p, d, "t1", turn1, 6)
            assert ids1 == _colocated(model_f32, turn1, 6)
            assert fin1.finish_reason == "length" and t1.first_block_index == 0
            block = sum(p.contract.group(g.name).block_bytes for g in p.contract.groups)
            assert bytes1 == 2 * block  # two chunks (one partial) of global KV
            turn2 = turn1 + ids1 + _prompt(150, 2)  # 356 tokens; decode holds chunk 0 (+ its tail)
            ids2, fin2, t2, bytes2 = await _turn(p, d, "t2", turn2, 4)
            assert ids2 == _colocated(model_f32, turn2, 4)
            assert t2.decode_cached_tokens == 128 and t2.first_block_index == 1
            assert bytes2 == 2 * block  # only chunks 1..2 travel
            assert fin2.usage.cached_tokens_decode == 128
        finally:
            await p.close()
            await d.close()

    asyncio.run(main())


def test_abort_before_kv_arrives_holds_blocks_until_the_late_write_lands(model_f32):
    async def main():
        p, d = _workers(model_f32, replay=True)
        try:
            idle = await d.stats()
            req = InternalRequest("x", MODEL_ID, tuple(_prompt(300, 3)), SamplingParams(max_tokens=4))
            ticket = await d.reserve(req)
            assert (await d.stats()).kv_blocks_used == len(ticket.dst_block_ids)
            assert await d.abort("x")
            # the KV may still be in flight: blocks stay held until no write can land
            assert (await d.stats()).kv_blocks_used == len(ticket.dst_block_ids)
            late = await p.run(req, ticket)  # a late push lands in the drained blocks
            assert late.pushed_bytes > 0
            for _ in range(1000):  # its completion notice frees them (polled on D's loop)
                if (await d.stats()).kv_blocks_used == idle.kv_blocks_used:
                    break
                await asyncio.sleep(0.005)
            assert (await d.stats()).kv_blocks_used == idle.kv_blocks_used
            assert d.receiver.rejection_counts().get("cancelled", 0) == 1
            assert not await d.abort("x")
        finally:
            await p.close()
            await d.close()

    asyncio.run(main())


def test_unknown_model_is_invalid_argument(model_f32):
    from flashpd.services.api import InvalidArgument

    async def main():
        p, d = _workers(model_f32, replay=True)
        try:
            req = InternalRequest("y", "other-model", (1, 2, 3), SamplingParams(max_tokens=2))
            with pytest.raises(InvalidArgument) as err:
                await d.reserve(req)
            assert err.value.field == "model"
        finally:
            await p.close()
            await d.close()

    asyncio.run(main())


def test_transfer_contract_mismatch_fails_at_handshake(model_f32):
    import dataclasses

    from flashpd.services.api import Internal

    async def main():
        p, d = _workers(model_f32, replay=True)
        # a decode worker built for another model id advertises another contract
        d.receiver.contract = dataclasses.replace(d.receiver.contract, model_id="other-model")
        try:
            req = InternalRequest("z", MODEL_ID, tuple(_prompt(150, 9)), SamplingParams(max_tokens=2))
            ticket = await d.reserve(req)
            with pytest.raises(Internal, match="model_id"):
                await p.run(req, ticket)
            assert (await p.stats()).kv_blocks_used == 0  # nothing computed or held
        finally:
            await p.close()
            await d.close()

    asyncio.run(main())


def test_each_push_records_where_its_time_went(model_f32):
    async def main():
        p, d = _workers(model_f32, replay=True)
        try:
            _, _, _, pushed = await _turn(p, d, "r", _prompt(200, 5), 2)
            (record,) = p.push_records
            assert record["request_id"] == "r" and record["bytes"] == pushed
            assert min(record["hop_ms"], record["post_ms"], record["wire_ms"]) >= 0
            # wire_ms runs from inside the post (send's clock) to completion: it overlaps post_ms
            assert record["hop_ms"] + record["post_ms"] <= record["total_ms"]
            assert record["hop_ms"] + record["wire_ms"] <= record["total_ms"]
            # the local copy completes in the post: seen by the event loop's own polls
            assert record["inline"] is True and record["phases"]["polls"] == 1
            assert {"check_ms", "notice_ms", "done_ms"} <= set(record["phases"])
        finally:
            await p.close()
            await d.close()

    asyncio.run(main())


def test_replay_ms_counts_the_replay_that_ran_before_generate_was_called(model_f32):
    """The router calls generate only after the prefill returned; the decode replay starts when
    the KV arrives. replay_ms runs from the arrival to the engine's first token, so a replay
    that finished before generate was called still counts whole (it was ~0 before)."""

    async def main():
        p, d = _workers(model_f32, replay=True)
        engine = d.engine.engine
        starts: list[float] = []
        step = engine.step

        def timed_step():
            starts.append(time.monotonic())
            return step()

        engine.step = timed_step
        try:
            req = InternalRequest("late", MODEL_ID, tuple(_prompt(300, 9)), SamplingParams(max_tokens=2))
            await p.run(req, await d.reserve(req))
            (stats,) = [s for rid, s in engine.stats.items() if rid.startswith("late@")]
            while stats.first_token_s is None:  # the replay runs before anyone asks for tokens
                await asyncio.sleep(0.01)
            replay_start = max(s for s in starts if s <= stats.first_token_s)
            final = [ev async for ev in d.generate(req) if not isinstance(ev, TokenEvent)][0]
            assert final.timeline.replay_ms >= 1e3 * (stats.first_token_s - replay_start) > 0
        finally:
            await p.close()
            await d.close()

    asyncio.run(main())
