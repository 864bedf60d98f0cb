"""OpenAI API conformance: the official `openai` client against the real server (Ray Serve,
Redis, NIXL, 1 prefill + 1 decode replica of the tiny model): models list and retrieve, chat and
completions (stream and not), stream_options.include_usage, stop, seed, logprobs,
max_completion_tokens, the four roles, and the error codes and `{"error": {...}}` shape for bad
requests, unknown models, routes and methods; hostile bytes through Serve's proxy too."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from .conftest import deploy

pytestmark = [pytest.mark.net, pytest.mark.slow]
APP = "oai"
MODEL = "flashpd-tiny"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
ROLES = [
    {"role": "system", "content": "You are terse."},
    {"role": "developer", "content": "Answer in one word."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
]


@pytest.fixture(scope="module")
def server(ray_serve, ckpt_dir, redis_server):
    args = deploy(APP, ckpt_dir, redis_server.url)
    base = f"http://127.0.0.1:{ray_serve}/{APP}"
    deadline = time.monotonic() + 120
    while httpx.get(f"{base}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the app never became healthy"
        time.sleep(0.5)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    yield {"client": client, "base": base, "grpc": f"127.0.0.1:{args['grpc_port']}"}
    client.close()
    from ray import serve

    serve.delete(APP)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return server["client"]


# -------------------------------------------------------------------------------------- models


def test_models_list_and_retrieve(client):
    listed = client.models.list()
    assert [m.id for m in listed.data] == [MODEL]
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.owned_by == "flashpd"


def test_retrieve_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found"


# ---------------------------------------------------------------------------------------- chat


def test_chat_with_every_role(client):
    out = client.chat.completions.create(model=MODEL, messages=ROLES, max_tokens=4, **GREEDY)
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.model == MODEL
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 4
    assert out.usage.total_tokens == out.usage.prompt_tokens + 4
    assert "<|" not in choice.message.content  # special tokens never reach the reply text


def test_chat_stream_with_usage_matches_the_non_stream_reply(client):
    full = client.chat.completions.create(model=MODEL, messages=ROLES[2:3], max_tokens=6, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ROLES[2:3],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_max_completion_tokens(client):
    out = client.chat.completions.create(model=MODEL, messages=ROLES[2:3], max_completion_tokens=3, **GREEDY)
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_seed_makes_sampling_repeatable(client):
    def sample():
        return (
            client.chat.completions.create(
                model=MODEL,
                messages=ROLES[2:3],
                max_tokens=8,
                temperature=1.0,
                seed=1234,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .message.content
        )

    assert sample() == sample()


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ROLES[2:3], max_tokens=3, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the best


def test_stop_string_cuts_the_reply(client):
    base = (
        client.chat.completions.create(model=MODEL, messages=ROLES[2:3], max_tokens=12, **GREEDY)
        .choices[0]
        .message.content
    )
    stop = next(
        (
            base[i : i + 2]
            for i in range(1, len(base) - 1)
            if base[i : i + 2].strip() and base.index(base[i : i + 2]) == i
        ),
        None,
    )
    if stop is None:
        pytest.fail(f"no usable stop string in the greedy reply {base!r}")
    out = client.chat.completions.create(model=MODEL, messages=ROLES[2:3], max_tokens=12, stop=[stop], **GREEDY)
    assert out.choices[0].message.content == base[: base.index(stop)]
    assert out.choices[0].finish_reason == "stop"


# --------------------------------------------------------------------------------- completions


def test_completion_and_its_stream_agree(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, **GREEDY)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 5
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5


def test_completion_logprobs_and_token_prompt(client):
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=2, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 2
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    assert out.usage.prompt_tokens == 4


# -------------------------------------------------------------------------------------- errors


def _error_shape(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 10**9}, "max_completion_tokens"),
        ({"n": 17}, "n"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
        ({"extra_body": {"top_k": 10**20}}, "top_k"),
    ],
)
def test_bad_chat_requests_are_400_naming_the_param(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ROLES[2:3], **kwargs)
    assert info.value.param == param and info.value.type == "invalid_request_error"


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=ROLES[2:3], max_tokens=2)
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_tiny_temperature_is_greedy(client):
    greedy = (
        client.chat.completions.create(model=MODEL, messages=ROLES[2:3], max_tokens=4, **GREEDY)
        .choices[0]
        .message.content
    )
    tiny = (
        client.chat.completions.create(
            model=MODEL,
            messages=ROLES[2:3],
            max_tokens=4,
            temperature=5e-324,
            top_p=1e-300,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .message.content
    )
    assert tiny == greedy


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("GET", "/v1/nope", 404),
        ("POST", "/v1/embeddings", 404),
        ("GET", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models", 405),
    ],
)
def test_unknown_routes_and_methods(server, method, path, status):
    resp = httpx.request(method, server["base"] + path, timeout=30)
    assert resp.status_code == status
    assert _error_shape(resp)["type"] == "invalid_request_error"


def test_the_client_raises_not_found_for_an_unknown_route(client):
    with pytest.raises(openai.NotFoundError):
        client.get("/nope", cast_to=object)


@pytest.mark.parametrize("header", [b"x-session-id", b"x-request-id"])
def test_non_ascii_header_bytes_are_400_through_the_proxy(server, header):
    resp = httpx.post(
        f"{server['base']}/v1/completions",
        timeout=30,
        headers=[(b"content-type", b"application/json"), (header, b"caf\xe9")],
        content=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    )
    assert resp.status_code == 400
    assert _error_shape(resp)["param"] == header.decode()


@pytest.mark.parametrize(
    "raw,status,param",
    [
        (json.dumps({"prompt": "x" * 10_000_000}).encode(), 413, "body"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "body"),
        (b'{"prompt": "\\ud800"}', 400, "prompt"),
        (b'{"prompt": "caf\xe9"}', 400, "body"),
    ],
)
def test_hostile_bodies_are_client_errors(server, raw, status, param):
    resp = httpx.post(
        f"{server['base']}/v1/completions", content=raw, timeout=60, headers={"content-type": "application/json"}
    )
    assert resp.status_code == status
    assert _error_shape(resp)["param"] == param


# ------------------------------------------------------------ agents: tools, JSON, n (issue 30)
# The tiny model's weights are random: it never calls a tool or writes JSON on its own, so these
# go through the grammar mask (tool_choice required/named, response_format). Sampling is seeded:
# every run draws the same tokens.

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "maxLength": 8}},
            "required": ["key"],
            "additionalProperties": False,
        },
    },
}
ASK = [
    {"role": "system", "content": "You are a weather agent."},
    {"role": "user", "content": "What is the weather in Paris and Rome?"},
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 300}
TOOL_SAMPLED = {**SAMPLED, "max_tokens": 600}  # parallel calls: ~200 tokens per call here


@pytest.fixture
def agent(client) -> openai.OpenAI:
    """The tiny tokenizer spells DSML's fullwidth bars byte by byte: a forced call is ~200
    tokens, decoded step by step (guided steps run synchronously), minutes on a busy 2-core
    machine. A hang guard, not a latency assertion."""
    return client.with_options(timeout=900)


def _check_calls(calls, tools):
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_call_required(agent):
    out = agent.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, LOOKUP], tool_choice="required", **TOOL_SAMPLED
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, [WEATHER, LOOKUP])


def test_tool_call_named_and_not_parallel(agent):
    out = agent.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, LOOKUP],
        parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **TOOL_SAMPLED,
    )
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    _check_calls(calls, [WEATHER])


def test_tool_call_streaming_matches_the_non_streaming_call(agent):
    kwargs = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required", **TOOL_SAMPLED}
    full = agent.chat.completions.create(**kwargs).choices[0]
    chunks = list(agent.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [tc.index for tc in calls] == list(range(len(calls)))
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (tc.function.name, json.loads(tc.function.arguments)) for tc in full.message.tool_calls
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_tool_results_next_turn_hit_the_prefix(agent):
    first = agent.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", **TOOL_SAMPLED
    )
    message = first.choices[0].message
    calls = [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
        },
        {
            "id": "call_b",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'},
        },
    ]
    turn2 = ASK + [
        {"role": "assistant", "content": message.content, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain, 12 C"},
        {"role": "tool", "tool_call_id": "call_a", "content": "sun, 21 C"},
    ]
    out = agent.chat.completions.create(model=MODEL, messages=turn2, tools=[WEATHER], max_tokens=4, **GREEDY)
    assert out.choices[0].finish_reason == "length"  # a text answer (tool_choice auto)
    assert out.usage.prompt_tokens > first.usage.prompt_tokens
    assert out.usage.prompt_tokens_details.cached_tokens >= 128  # the tools + question prefix


def test_tool_choice_auto_with_a_random_model_answers_in_text(agent):
    out = agent.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8, **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str)


def test_tool_choice_none_offers_no_tool(agent):
    """none: the tools are left out of the prompt (fewer prompt tokens than auto's), the
    answer is text."""
    auto = agent.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=4, **GREEDY
    )
    none = agent.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4, **GREEDY
    )
    choice = none.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens


def test_json_mode(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"}, **SAMPLED)
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_json_schema_strict(client):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    for seed in (1, 2, 3):
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, response_format=fmt, **{**SAMPLED, "seed": seed}
        )
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_json_schema_streaming(client):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chunks = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, stream=True, **SAMPLED)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_n_choices_share_one_prompt(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ROLES, n=3, max_tokens=5, temperature=1.0, seed=11, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 15
    assert out.usage.total_tokens == out.usage.prompt_tokens + 15
    assert len({c.message.content for c in out.choices}) > 1  # different seeds per choice


def test_n_choices_stream_with_their_index_and_one_usage_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ROLES,
            n=2,
            max_tokens=4,
            temperature=1.0,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1] and reasons == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_grpc_sdk_n_choices(server):
    """The same stack over gRPC with the SDK: n choices, per-choice results and usage."""
    from flashpd_sdk import Client

    with Client(server["grpc"], default_timeout_s=300) as sdk:
        stream = sdk.generate(messages=ROLES, n=3, max_tokens=4, temperature=1.0, seed=11, ignore_eos=True)
        chunks = list(stream)
        results, usage = stream.choices, stream.usage
    assert {c.choice_index for c in chunks} == {0, 1, 2}
    assert [r.choice_index for r in results] == [0, 1, 2]
    assert all(len(r.output_ids) == 4 and r.finish_reason == "length" for r in results)
    assert usage.completion_tokens == 12 and usage.prompt_tokens == results[0].usage.prompt_tokens


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": WEATHER}, "tools"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {  # valid JSON Schema that the
                        "name": "x",
                        "schema": {"$ref": "#/$defs/missing"},
                    },
                }
            },  # grammar cannot compile
            "response_format.json_schema.schema",
        ),
        ({"n": 0}, "n"),
        ({"n": 10**6}, "n"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {  # refused by the decode
                        "name": "x",
                        "schema": {"type": "string", "pattern": "(?<=a)b"},
                    },
                }
            },  # worker's compiler
            "response_format.json_schema.schema",
        ),
        (
            {
                "messages": ASK
                + [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_9", "content": "x"},
                ],
                "tools": [WEATHER],
            },
            "messages[3].tool_call_id",
        ),
        (
            {
                "messages": ASK
                + [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [  # a 1 MB
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {
                                    "name": "get_weather",  # tool result
                                    "arguments": "{}",
                                },
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": "r" * (1 << 20)},
                ]
            },
            "messages",
        ),
    ],
)
def test_bad_agent_requests_are_400_naming_the_param(client, kwargs, param):
    kwargs = {"messages": ASK, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=4, **kwargs)
    assert info.value.body["param"] == param
