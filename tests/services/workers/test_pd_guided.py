"""Guided decoding through real prefill and decode workers in one process (local transfer):
the decode worker samples every token under P/D, the first included, so it holds the grammar;
a continued attempt resumes the grammar state; an uncompilable schema is refused at reserve."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from flashpd.engine.grammar import GrammarBackend
from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.loading import EOS_TOKEN, load_tokenizer
from flashpd.engine.sampling_params import GuidedDecoding
from flashpd.services.api import InternalRequest, InvalidArgument, SamplingParams, TokenEvent
from flashpd.services.decode.server import DecodeWorker
from flashpd.services.prefill.server import PrefillWorker
from flashpd.services.worker.common import WorkerConfig, new_worker_ref

MODEL_ID = "flashpd-tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "enum": ["x", "y"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(ckpt_dir):
    return load_tokenizer(ckpt_dir)


def _workers(model, tokenizer):
    eos = tokenizer.token_to_id(EOS_TOKEN)

    def cfg(role):
        ec = EngineConfig(role=role, num_blocks=32, num_slots=8, model_id=MODEL_ID)
        grammar = GrammarBackend.from_tokenizer(tokenizer, model.cfg.vocab_size, eos) if role == "decode" else None
        return LLMEngine(model, ec, eos, grammar), WorkerConfig(
            "unused", MODEL_ID, ec, transfer_backend="local", transfer_timeout_s=30.0
        )

    pe, pc = cfg("prefill")
    de, dc = cfg("decode")
    return (PrefillWorker(pe, pc, new_worker_ref("prefill")), DecodeWorker(de, dc, new_worker_ref("decode")))


async def _generate(p, d, rid: str, prompt: list[int], guided: GuidedDecoding):
    req = InternalRequest(
        rid, MODEL_ID, tuple(prompt), SamplingParams(max_tokens=200, temperature=1.0, seed=3, guided=guided)
    )
    ticket = await d.reserve(req)
    if ticket.needs_prefill:
        await p.run(req, ticket)
    ids, final = [], None
    async for ev in d.generate(req):
        if isinstance(ev, TokenEvent):
            ids.extend(ev.token_ids)
        else:
            final = ev
    return ids, final


def test_json_schema_through_prefill_and_decode(model_f32, tokenizer):
    async def main():
        p, d = _workers(model_f32, tokenizer)
        try:
            guided = GuidedDecoding("json_schema", json.dumps(SCHEMA))
            prompt = list(range(5, 205))  # two chunks: a real transfer
            ids, final = await _generate(p, d, "g1", prompt, guided)
            assert final.finish_reason == "stop"
            jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMA)
            # a continued attempt (prompt + the first k tokens, replayed into the grammar)
            k = len(ids) // 2
            rest, final2 = await _generate(
                p, d, "g1@1", prompt + ids[:k], GuidedDecoding("json_schema", guided.spec, replay_tokens=k)
            )
            assert final2.finish_reason == "stop"
            jsonschema.validate(json.loads(tokenizer.decode(ids[:k] + rest)), SCHEMA)
        finally:
            await p.close()
            await d.close()

    asyncio.run(asyncio.wait_for(main(), 600))


def test_uncompilable_schema_is_refused_at_reserve(model_f32, tokenizer):
    async def main():
        p, d = _workers(model_f32, tokenizer)
        try:
            req = InternalRequest(
                "bad",
                MODEL_ID,
                (5, 6, 7),
                SamplingParams(
                    guided=GuidedDecoding(
                        "json_schema", '{"$ref": "#/$defs/missing"}', field="response_format.json_schema.schema"
                    )
                ),
            )
            with pytest.raises(InvalidArgument) as err:
                await d.reserve(req)
            assert err.value.field == "response_format.json_schema.schema"
            assert (await d.stats()).kv_blocks_used == 0  # nothing reserved
        finally:
            await p.close()
            await d.close()

    asyncio.run(asyncio.wait_for(main(), 120))
