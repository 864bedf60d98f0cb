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
WEATHER = Tool("get_weather", "Weather of a city", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
OUTPUT = text_ids("Sure." + dsml.CALLS_PREFIX + dsml.render_calls(
    [("get_weather", {"city": "Oslo"})])) + (EOS_ID,)


@pytest.fixture(autouse=True)
def _eos_is_special(monkeypatch):
    decode = router_fakes.ByteTokenizer.decode
    monkeypatch.setattr(router_fakes.ByteTokenizer, "decode",
                        lambda self, ids: decode(self, [t for t in ids if t != EOS_ID]))


def run_async(coro):
    asyncio.run(asyncio.wait_for(coro, 180))  # a hang guard, not a tolerance


def test_chat_with_tools_returns_typed_tool_calls(redis_url):
    d = FakeDecode("d0", output=OUTPUT)

    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [d]) as (_, target):
            async with AsyncClient(target) as client:
                result = await client.generate(messages=ASK, tools=[WEATHER],
                                               tool_choice="required", max_tokens=600).final()
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
                    messages=ASK, response_format=ResponseFormat.json_schema(schema),
                    max_tokens=20).final()
        assert result.json() == {"a": 1} and result.tool_calls == ()
    run_async(main())
    guided = d.seen[0].sampling.guided
    assert guided.kind == "json_schema" and guided.strict


@pytest.mark.parametrize("kwargs, field", [
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": "nope"}, "tool_choice.function.name"),
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
    ({"prompt": "x", "tools": [WEATHER]}, "chat"),
    ({"messages": ASK, "response_format": ResponseFormat("yaml")}, "response_format.type"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
])
def test_bad_agent_requests_name_the_field(redis_url, kwargs, field):
    async def main():
        async with grpc_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as (_, target):
            async with AsyncClient(target) as client:
                with pytest.raises(InvalidArgument) as info:
                    await client.generate(max_tokens=4, **kwargs).final()
        assert info.value.field == field
    run_async(main())
