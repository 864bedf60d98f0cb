"""Tool calls, structured-output requests and n > 1 through the OpenAI HTTP frontend (uvicorn +
httpx) with fake workers: the parsed `tool_calls` (whole and streamed), the grammar sent to the
decode worker, and n choices pinned to the first choice's workers with OpenAI's usage."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import router_fakes
from router_fakes import EOS_ID, FakeDecode, FakePrefill, http_stack, text_ids

from flashpd.services.router import dsml

pytestmark = pytest.mark.net
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
OUTPUT = text_ids("Checking." + dsml.CALLS_PREFIX + dsml.render_calls(CALLS)) + (EOS_ID,)
CHAT = {"messages": [{"role": "user", "content": "Weather in Paris and Rome?"}], "tools": TOOLS, "max_tokens": 600}


@pytest.fixture(autouse=True)
def _eos_is_special(monkeypatch):
    """Like the real tokenizer, EOS decodes to no text."""
    decode = router_fakes.ByteTokenizer.decode
    monkeypatch.setattr(
        router_fakes.ByteTokenizer, "decode", lambda self, ids: decode(self, [t for t in ids if t != EOS_ID])
    )


def run_async(coro):
    asyncio.run(asyncio.wait_for(coro, 180))  # a hang guard, not a tolerance


async def _post(decode: FakeDecode, body: dict) -> httpx.Response:
    async with http_stack(router_fakes.REDIS_URL, [FakePrefill("p0")], [decode]) as (_, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return await http.post("/v1/chat/completions", json=body)


@pytest.fixture(autouse=True)
def _redis(redis_url, monkeypatch):
    monkeypatch.setattr(router_fakes, "REDIS_URL", redis_url, raising=False)


def test_tool_calls_are_parsed_into_the_message():
    async def main():
        r = await _post(FakeDecode("d0", output=OUTPUT), CHAT)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        msg = choice["message"]
        assert msg["content"] == "Checking."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == CALLS
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in msg["tool_calls"])

    run_async(main())


def test_parallel_tool_calls_false_returns_one_call():
    async def main():
        r = await _post(FakeDecode("d0", output=OUTPUT), {**CHAT, "parallel_tool_calls": False})
        assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 1

    run_async(main())


def test_streamed_tool_calls_come_as_delta_tool_calls():
    async def main():
        r = await _post(FakeDecode("d0", output=OUTPUT), {**CHAT, "stream": True})
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        content = "".join(d.get("content") or "" for d in deltas)
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert content == "Checking."
        assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            (0, *CALLS[0]),
            (1, *CALLS[1]),
        ]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    run_async(main())


def test_malformed_markup_is_returned_as_content():
    bad = text_ids("Checking." + dsml.CALLS_PREFIX + dsml.CALLS_OPEN + "\n<oops>") + (EOS_ID,)

    async def main():
        r = await _post(FakeDecode("d0", output=bad), CHAT)
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and choice["finish_reason"] == "stop"
        assert "tool_calls" not in choice["message"]
        assert choice["message"]["content"].endswith("<oops>")

    run_async(main())


def test_required_tool_choice_sends_the_grammar_to_the_decode_worker():
    d = FakeDecode("d0", output=OUTPUT)

    async def main():
        r = await _post(d, {**CHAT, "tool_choice": "required"})
        assert r.status_code == 200

    run_async(main())
    guided = d.seen[0].sampling.guided
    assert guided.kind == "structural_tag" and "get_weather" in guided.spec


def test_tool_results_next_turn_reach_the_prompt():
    d = FakeDecode("d0", output=text_ids("It is sunny.") + (EOS_ID,))
    messages = CHAT["messages"] + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]

    async def main():
        r = await _post(d, {**CHAT, "messages": messages})
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}

    run_async(main())
    prompt = bytes(d.seen[0].prompt_ids).decode()
    assert prompt.endswith("<tool_result>sunny, 21 C</tool_result><|Assistant|>")


def test_n_choices_follow_the_first_choice_workers_and_sum_usage():
    decodes = [FakeDecode("d0"), FakeDecode("d1")]

    async def main():
        async with http_stack(router_fakes.REDIS_URL, [FakePrefill("p0")], decodes) as (_, url):
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                r = await http.post(
                    "/v1/chat/completions",
                    json={"messages": CHAT["messages"], "n": 3, "max_tokens": 4, "seed": 5, "temperature": 1.0},
                )
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert body["usage"]["completion_tokens"] == 12
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 12

    run_async(main())
    served = [d for d in decodes if d.seen]
    assert len(served) == 1 and len(served[0].seen) == 3  # every choice on choice 0's worker
    first, *siblings = sorted(served[0].seen, key=lambda r: r.request_id)
    assert first.pin == () and all([w.worker_id for w in r.pin] == ["p0", served[0].worker_id] for r in siblings)
    assert sorted(r.sampling.seed for r in served[0].seen) == [5, 6, 7]


def _sse_payloads(text: str) -> list:
    lines = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_n_choices_stream_with_tools_index_calls_and_one_usage_chunk():
    """n = 2 + stream + tools: every chunk carries its choice's index, each choice streams its
    own delta.tool_calls (indexes from 0) and finish_reason tool_calls, and the one usage chunk
    (include_usage) counts the prompt once and the completions summed."""
    d = FakeDecode("d0", output=OUTPUT)

    async def main():
        r = await _post(d, {**CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        return _sse_payloads(r.text)

    payloads = asyncio.run(asyncio.wait_for(main(), 180))
    *chunks, last = payloads
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * len(OUTPUT)
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 2 * len(OUTPUT)
    assert all("usage" not in c for c in chunks)
    for i in (0, 1):
        own = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert own[0]["delta"].get("role") == "assistant"
        calls = [tc for c in own for tc in c["delta"].get("tool_calls") or ()]
        assert [tc["index"] for tc in calls] == [0, 1]
        assert [(tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in calls] == CALLS
        assert [c["finish_reason"] for c in own if c["finish_reason"]] == ["tool_calls"]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}


def test_n_choices_stream_text_without_usage():
    async def main():
        r = await _post(FakeDecode("d0"), {"messages": CHAT["messages"], "n": 3, "stream": True, "max_tokens": 3})
        assert r.status_code == 200, r.text
        return _sse_payloads(r.text)

    chunks = asyncio.run(asyncio.wait_for(main(), 180))
    for i in range(3):
        own = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content") or "" for c in own) == "abc"
        assert own[-1]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)


# ---------------------------------------------------------------- tool_choice, mode by mode

LOOKUP = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}},
}


def _served(output, body):
    d = FakeDecode("d0", output=output)

    async def main():
        r = await _post(d, body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    choice = asyncio.run(asyncio.wait_for(main(), 180))
    return choice, d.seen[0], bytes(d.seen[0].prompt_ids).decode()


@pytest.mark.parametrize("output, reason", [(text_ids("It is sunny.") + (EOS_ID,), "stop"), (OUTPUT, "tool_calls")])
def test_tool_choice_auto_leaves_the_model_free(output, reason):
    """auto: the tools are described, no grammar constrains the output; a text answer is
    content, a calls block is parsed into tool_calls."""
    choice, req, prompt = _served(output, {**CHAT, "tools": TOOLS + [LOOKUP], "tool_choice": "auto"})
    assert req.sampling.guided is None
    assert "## Tools" in prompt and '"name": "lookup"' in prompt
    assert choice["finish_reason"] == reason
    assert (choice["message"].get("tool_calls") is not None) == (reason == "tool_calls")


def test_tool_choice_none_offers_no_call():
    """none: the tools are not described (the prompt is the plain chat prompt), nothing is
    enforced, and markup the model writes anyway stays content."""
    choice, req, prompt = _served(OUTPUT, {**CHAT, "tool_choice": "none"})
    assert req.sampling.guided is None
    assert "## Tools" not in prompt and "get_weather" not in prompt
    assert choice["finish_reason"] == "stop" and choice["message"].get("tool_calls") is None
    assert "<｜DSML｜ invoke" in choice["message"]["content"]


def test_tool_choice_required_forces_a_call_of_any_tool():
    choice, req, prompt = _served(OUTPUT, {**CHAT, "tools": TOOLS + [LOOKUP], "tool_choice": "required"})
    guided = req.sampling.guided
    assert guided.kind == "structural_tag"
    assert 'name=\\"get_weather\\"' in guided.spec and 'name=\\"lookup\\"' in guided.spec
    assert choice["finish_reason"] == "tool_calls"


def test_named_tool_choice_forces_that_tool_only():
    choice, req, prompt = _served(
        OUTPUT,
        {**CHAT, "tools": TOOLS + [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    )
    guided = req.sampling.guided
    assert guided.kind == "structural_tag"
    assert 'name=\\"get_weather\\"' in guided.spec and "lookup" not in guided.spec
    assert '"name": "lookup"' in prompt  # still described: only the call is constrained
    assert choice["finish_reason"] == "tool_calls"
