"""A stream continued on other workers after its decode worker died (local transfer backend,
bounded replay): the continuation's prefill computes only the original prompt's KV at the
original credit, the new decode worker recomputes the streamed outputs, and greedy output
equals the unbroken run's."""

from __future__ import annotations

import asyncio

import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.services.api import InternalRequest, SamplingParams, TokenEvent
from flashpd.services.decode.server import DecodeWorker
from flashpd.services.prefill.server import PrefillWorker
from flashpd.services.worker.common import WorkerConfig, new_worker_ref

MODEL_ID = "flashpd-tiny"


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _worker(model, role: str):
    ec = EngineConfig(role=role, num_blocks=32, num_slots=8, model_id=MODEL_ID)
    wc = WorkerConfig("unused", MODEL_ID, ec, transfer_backend="local")
    cls = PrefillWorker if role == "prefill" else DecodeWorker
    return cls(LLMEngine(model, ec), wc, new_worker_ref(role))


async def _turn(p, d, req: InternalRequest) -> list[int]:
    ticket = await d.reserve(req)
    if ticket.needs_prefill:
        await p.run(req, ticket)
    ids = []
    async for ev in d.generate(req):
        if isinstance(ev, TokenEvent):
            ids.extend(ev.token_ids)
    return ids


def test_continuation_on_fresh_workers_is_identical_under_bounded_replay(model_f32):
    prompt = tuple(_prompt(300, 11))
    streamed = 7

    async def main():
        p1, d1 = _worker(model_f32, "prefill"), _worker(model_f32, "decode")
        unbroken = await _turn(p1, d1, InternalRequest("a", MODEL_ID, prompt, SamplingParams(max_tokens=20)))
        p2, d2 = _worker(model_f32, "prefill"), _worker(model_f32, "decode")
        cont = InternalRequest(
            "a@1",
            MODEL_ID,
            prompt + tuple(unbroken[:streamed]),
            SamplingParams(max_tokens=20 - streamed),
            kv_prompt_tokens=len(prompt),
            max_prefill_credit_tokens=0,
        )
        ticket = await d2.reserve(cont)
        assert len(ticket.dst_block_ids) == 3  # the original prompt's 3 chunks only
        result = await p2.run(cont, ticket)
        assert result.computed_tokens == len(prompt)
        rest = []
        async for ev in d2.generate(cont):
            if isinstance(ev, TokenEvent):
                rest.extend(ev.token_ids)
        assert unbroken[:streamed] + rest == unbroken
        for w in (p1, d1, p2, d2):
            await w.close()

    asyncio.run(main())
