"""The agent API over gRPC with the SDK (real grpc.aio server, fake workers): chat input with
tools -> typed tool calls, response_format -> the grammar sent to the decode worker, refusals
naming the field."""

from __future__ import annotations

import asyncio

import pytest
import router_fakes
from router_fakes import EOS_ID, FakeDecode, FakePrefill, grpc_stack, text_ids

from flashpd.services.router import dsml
from flashpd_sdk import AsyncClient, InvalidArgument, ResponseFormat, Tool

pytestmark = pytest.mark.net
WEATHER = Tool(
    "get_weather",
    "Weather of a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
OUTPUT = text_ids("Sure." + dsml.CALLS_PREFIX + dsml.render_calls([("get_weather", {"city": "Oslo"})])) + (EOS_ID,)


@pytest.fixture(autouse=True)
def _eos_is_special(monkeypatch):
    decode = router_fakes.ByteTokenizer.decode
    monkeypatch.setattr(
        router_fakes.ByteTokenizer, "decode", lambda self, ids: decode(self, [t for t in ids if t != EOS_ID])
    )


def run_async(coro):
    asyncio.run(asyncio.wait_for(coro, 180))  # a hang guard, not a tolerance


def test_chat_with_tools_returns_typed_tool_calls(redis_url):
    d = FakeDecode("d0", output=OUTPUT)

    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [d]) as (_, target):
            async with AsyncClient(target) as client:
                result = await client.generate(
                    messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=600
                ).final()
        assert result.finish_reason == "tool_calls" and result.content == "Sure."
        (call,) = result.tool_calls
        assert call.name == "get_weather" and call.parsed_arguments() == {"city": "Oslo"}
        assert call.id.startswith("call_")

    run_async(main())
    assert d.seen[0].sampling.guided.kind == "structural_tag"
    assert "<｜DSML｜ invoke name=" in bytes(d.seen[0].prompt_ids).decode()  # tools described


def test_response_format_reaches_the_decode_worker(redis_url):
    d = FakeDecode("d0", output=text_ids('{"a": 1}') + (EOS_ID,))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [d]) as (_, target):
            async with AsyncClient(target) as client:
                result = await client.generate(
                    messages=ASK, response_format=ResponseFormat.json_schema(schema), max_tokens=20
                ).final()
        assert result.json() == {"a": 1} and result.tool_calls == ()

    run_async(main())
    guided = d.seen[0].sampling.guided
    assert guided.kind == "json_schema" and guided.strict


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"messages": ASK, "tools": [WEATHER], "tool_choice": "nope"}, "tool_choice.function.name"),
        ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
        ({"prompt": "x", "tools": [WEATHER]}, "chat"),
        ({"messages": ASK, "response_format": ResponseFormat("yaml")}, "response_format.type"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ],
)
def test_bad_agent_requests_name_the_field(redis_url, kwargs, field):
    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as (_, target):
            async with AsyncClient(target) as client:
                with pytest.raises(InvalidArgument) as info:
                    await client.generate(max_tokens=4, **kwargs).final()
        assert info.value.field == field

    run_async(main())


# ------------------------------------------------------------------------------------- n > 1


def _by_choice(chunks) -> dict[int, list]:
    out: dict[int, list] = {}
    for chunk in chunks:
        out.setdefault(chunk.choice_index, []).append(chunk)
    return out


def test_n_choices_stream_with_their_index_and_share_the_first_choice_pair(redis_url):
    """One request, three choices: the chunks carry their choice's index (each choice's token
    offsets count from 0), one typed result per choice, usage as OpenAI counts it, and every
    choice ran on choice 0's prefill/decode pair (pinned) with seed + i."""
    decodes = [FakeDecode("d0", token_delay_s=0.001), FakeDecode("d1", token_delay_s=0.001)]

    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], decodes) as (_, target):
            async with AsyncClient(target) as client:
                stream = client.generate(prompt="hello there", n=3, max_tokens=4, seed=5, temperature=1.0)
                chunks = [c async for c in stream]
                return chunks, stream.choices, stream.usage, stream.result

    chunks, choices, usage, result = asyncio.run(asyncio.wait_for(main(), 180))
    by_choice = _by_choice(chunks)
    assert sorted(by_choice) == [0, 1, 2]
    for i, own in by_choice.items():
        assert [c.index for c in own] == list(range(len(own)))  # per-choice offsets
        assert choices[i].output_ids == tuple(t for c in own for t in c.token_ids)
    assert [c.choice_index for c in choices] == [0, 1, 2] and result == choices[0]
    assert all(c.text == "abcd" and c.finish_reason == "length" for c in choices)
    assert usage.completion_tokens == 12 and usage.prompt_tokens == len("hello there")
    assert all(c.usage.completion_tokens == 4 for c in choices)
    served = [d for d in decodes if d.seen]
    assert len(served) == 1 and len(served[0].seen) == 3
    first, *siblings = sorted(served[0].seen, key=lambda r: r.request_id)
    assert first.pin == () and all([w.worker_id for w in r.pin] == ["p0", served[0].worker_id] for r in siblings)
    assert sorted(r.sampling.seed for r in served[0].seen) == [5, 6, 7]


def test_n_choices_with_tools_stream_typed_tool_calls_per_choice(redis_url):
    """n = 2 with tools, streamed: the chunks carry the raw markup, and each choice's result
    holds its own parsed, typed tool calls (sync client)."""
    from flashpd_sdk import Client

    d = FakeDecode("d0", output=OUTPUT)

    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [d]) as (_, target):

            def call():
                with Client(target) as client:
                    stream = client.generate(messages=ASK, tools=[WEATHER], n=2, tool_choice="required", max_tokens=600)
                    return list(stream), stream.choices, stream.usage

            return await asyncio.to_thread(call)

    chunks, choices, usage = asyncio.run(asyncio.wait_for(main(), 180))
    assert sorted(_by_choice(chunks)) == [0, 1]
    assert len(choices) == 2
    for i, choice in enumerate(choices):
        assert choice.choice_index == i and choice.finish_reason == "tool_calls"
        (call,) = choice.tool_calls
        assert call.name == "get_weather" and call.parsed_arguments() == {"city": "Oslo"}
        assert choice.content == "Sure."
    assert choices[0].tool_calls[0].id != choices[1].tool_calls[0].id
    assert usage.completion_tokens == 2 * len(OUTPUT)


def test_streamed_tool_calls_round_trip_typed(redis_url):
    """n = 1, streamed chunk by chunk: the text carries the DSML markup as generated, the
    result the typed calls (the same as a non-streaming call)."""
    d = FakeDecode("d0", output=OUTPUT, token_delay_s=0.001)

    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [d]) as (_, target):
            async with AsyncClient(target) as client:
                stream = client.generate(messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=600)
                chunks = [c async for c in stream]
                return chunks, stream.result

    chunks, result = asyncio.run(asyncio.wait_for(main(), 180))
    assert len(chunks) > 1 and all(c.choice_index == 0 for c in chunks)
    assert "<｜DSML｜ invoke" in "".join(c.text for c in chunks) + result.text
    assert result.finish_reason == "tool_calls"
    assert [(c.name, c.parsed_arguments()) for c in result.tool_calls] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("n", [0, -1, 17, 2**31 - 1])
def test_bad_n_is_invalid_argument_naming_n(redis_url, n):
    d = FakeDecode("d0")

    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [d]) as (_, target):
            async with AsyncClient(target) as client:
                with pytest.raises(InvalidArgument) as info:
                    await client.generate(prompt="x", n=n, max_tokens=4).final()
        assert info.value.field == "n"

    run_async(main())
    assert d.calls == []  # refused at the edge: nothing reached a worker


@pytest.mark.parametrize(
    "extra, field",
    [({"resume_from_token": 2}, "resume_from_token"), ({"continue_ids": {"ids": [1, 2]}}, "continue_ids")],
)
def test_n_choices_cannot_be_resumed(redis_url, extra, field):
    """Raw stub (the SDK never sends these with n > 1): INVALID_ARGUMENT naming the field."""
    import grpc
    from google.protobuf import json_format

    from flashpd_sdk._gen import flashpd_pb2 as pb
    from flashpd_sdk._gen import flashpd_pb2_grpc as pb_grpc

    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as (_, target):
            async with grpc.aio.insecure_channel(target) as channel:
                msg = json_format.ParseDict(
                    {"prompt": "x", "n": 2, "maxTokens": 4, "requestId": "nres", **extra}, pb.GenerateRequest()
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in pb_grpc.GenerationStub(channel).Generate(msg):
                        pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(field)

    run_async(main())
