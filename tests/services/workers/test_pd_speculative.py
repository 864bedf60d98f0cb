"""Speculative decoding through the in-process P/D workers (local transfer backend): the decode
worker drafts after the handoff and reports its drafts in the final usage, greedy output equals
the same pair's without speculation, and a prefill/decode pair whose speculative configs differ fails at the
handshake naming the field, before any KV moves."""

from __future__ import annotations

import asyncio

import pytest

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.speculative import SpeculativeConfig
from flashpd.services.api import Internal, InternalRequest, SamplingParams, TokenEvent
from flashpd.services.decode.server import DecodeWorker
from flashpd.services.prefill.server import PrefillWorker
from flashpd.services.worker.common import WorkerConfig, new_worker_ref
from tests.services.workers.test_pd_inprocess import MODEL_ID, _prompt

SPEC = SpeculativeConfig(method="ngram", num_tokens=4)


def _workers(model, p_spec: SpeculativeConfig | None, d_spec: SpeculativeConfig | None):
    def make(role, spec):
        ec = EngineConfig(
            role=role, num_blocks=32, num_slots=8, model_id=MODEL_ID, speculative=spec if role == "decode" else None
        )
        wc = WorkerConfig(
            "unused", MODEL_ID, ec, transfer_backend="local", speculative=None if spec is None else spec.handoff()
        )
        return LLMEngine(model, ec), wc

    pe, pc = make("prefill", p_spec)
    de, dc = make("decode", d_spec)
    return (PrefillWorker(pe, pc, new_worker_ref("prefill")), DecodeWorker(de, dc, new_worker_ref("decode")))


async def _turn(p, d, rid, prompt, n):
    req = InternalRequest(rid, MODEL_ID, tuple(prompt), SamplingParams(max_tokens=n))
    ticket = await d.reserve(req)
    await p.run(req, ticket)
    ids, final = [], None
    async for ev in d.generate(req):
        if isinstance(ev, TokenEvent):
            ids.extend(ev.token_ids)
        else:
            final = ev
    return ids, final


def test_decode_worker_drafts_and_reports_usage(model_f32):
    prompt = _prompt(40, 3) * 5  # repeats: prompt lookup finds continuations

    async def main():
        p, d = _workers(model_f32, None, None)  # the same pair without speculation
        try:
            want, plain = await _turn(p, d, "r", prompt, 16)
            assert plain.usage.draft_steps == 0
        finally:
            await p.close()
            await d.close()
        p, d = _workers(model_f32, SPEC, SPEC)
        try:
            ids, final = await _turn(p, d, "s", prompt, 16)
            assert ids == want
            u = final.usage
            assert u.draft_steps > 0 and u.draft_tokens >= u.accepted_draft_tokens >= 0
            assert u.forced_acceptance_length == 0.0
        finally:
            await p.close()
            await d.close()

    asyncio.run(main())


@pytest.mark.parametrize("p_spec", [None, SpeculativeConfig(method="ngram", num_tokens=5)])
def test_speculative_mismatch_fails_at_the_handshake(model_f32, p_spec):
    async def main():
        p, d = _workers(model_f32, p_spec, SPEC)
        try:
            req = InternalRequest("m", MODEL_ID, tuple(_prompt(150, 9)), SamplingParams(max_tokens=2))
            ticket = await d.reserve(req)
            with pytest.raises(Internal, match="speculative"):
                await p.run(req, ticket)
            assert (await p.stats()).kv_blocks_used == 0
        finally:
            await p.close()
            await d.close()

    asyncio.run(main())
