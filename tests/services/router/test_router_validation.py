"""The edge validation model (services/router/validation.py) through the OpenAI request parsers:
every hostile value is an InvalidArgument naming its field; tiny temperatures and top_p clamp to
greedy; bodies are bounded before parsing and before tokenizing."""

import json

import pytest
from router_fakes import SERVED, ByteTokenizer

from flashpd.services.api import Internal, InvalidArgument, Unavailable
from flashpd.services.router import validation as v
from flashpd.services.router.convert import ModelTable
from flashpd.services.router.openai_compat import chat_request, completion_request, error_body

MODELS = ModelTable([SERVED])  # context 2048, vocab 256
TOK = ByteTokenizer()
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}
NAN, INF = float("nan"), float("inf")


def chat(body, headers=None):
    return chat_request(body, headers or {}, MODELS, TOK)


def completion(body, headers=None):
    return completion_request(body, headers or {}, MODELS, TOK)


def refused(parse, body, headers=None) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        parse(body, headers)
    return info.value


HOSTILE = [
    *[("temperature", x) for x in (NAN, INF, -INF, -1e-300, -1.0, 2.5, 1e300, 10**400, "1", True, [])],
    *[("top_p", x) for x in (NAN, INF, -1e-300, -0.5, 1.0000001, "0.5", False)],
    *[("min_p", x) for x in (NAN, -INF, -0.1, 1.5, "0")],
    *[("seed", x) for x in (-1, 2**63, 2**64, 2**64 + 1, 10**30, 1.5, "7", True)],
    *[("top_k", x) for x in (10**20, 2**31, 257, -2, -(2**63), 1.5, "3")],
    *[("stop_token_ids", x) for x in ([-1], [256], [2**63], [2**64], [10**30], [1.5], ["1"], [True], 3, [1] * 257)],
    *[("stop", x) for x in ([""], ["x" * 257], ["x"] * 17, [None], 5, {"a": 1}, ["a\ud800"])],
    *[("max_tokens", x) for x in (0, -1, 2**31, 2**64, 10**30, 2047, "2", 2.0, True)],
    *[("max_completion_tokens", x) for x in (0, -5, 2**63, 1.5)],
    *[("stream", x) for x in (1, "true", [])],
    *[("ignore_eos", x) for x in (0, "no")],
    *[("model", x) for x in (1, [], {"id": "x"})],
    *[
        (name, value)
        for name, value in (
            ("response_format", "json"),
            ("n", 0),
            ("n", 17),
            ("n", True),
            ("n", 1.0),
            ("best_of", 2),
            ("logit_bias", {"1": 5}),
            ("presence_penalty", 0.5),
            ("frequency_penalty", NAN),
            ("tools", {}),
            ("tool_choice", "required"),
            ("functions", [{}]),
            ("function_call", "auto"),
            ("audio", {}),
            ("modalities", ["audio"]),
            ("prediction", {}),
            ("user", 5),
            ("metadata", "x"),
            ("store", "yes"),
        )
    ],
]


@pytest.mark.parametrize("field,value", HOSTILE, ids=lambda x: repr(x)[:30])
def test_hostile_chat_field_is_refused_naming_it(field, value):
    error = refused(chat, {**CHAT, field: value})
    assert error.field == field and field in str(error)


@pytest.mark.parametrize(
    "field,value",
    [
        *[(f, x) for f, x in HOSTILE if f not in ("max_completion_tokens",)],
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 2**63),
        ("logprobs", True),
        ("echo", True),
        ("suffix", "x"),
    ],
)
def test_hostile_completion_field_is_refused_naming_it(field, value):
    error = refused(completion, {**COMPLETION, field: value})
    assert error.field == field


@pytest.mark.parametrize("value", [-1, 21, 2**31, 1.5, True])
def test_top_logprobs_range(value):
    error = refused(chat, {**CHAT, "logprobs": True, "top_logprobs": value})
    assert error.field == "top_logprobs"


def test_top_logprobs_needs_logprobs():
    assert refused(chat, {**CHAT, "top_logprobs": 2}).field == "top_logprobs"


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("tiny", [1e-300, 5e-324, 1e-45, 1e-38, 1e-7, 0.0])
def test_tiny_temperature_or_top_p_is_greedy(field, tiny):
    sampling = chat({**CHAT, "temperature": 0.8, "top_p": 0.9, field: tiny}).request.sampling
    assert sampling.temperature == 0.0 and sampling.top_p == 1.0


def test_sampling_limits_accepted_at_their_edges():
    sampling = chat(
        {
            **CHAT,
            "temperature": 2.0,
            "top_p": 1.0,
            "min_p": 1.0,
            "top_k": 256,
            "seed": 2**63 - 1,
            "stop_token_ids": [0, 255],
            "stop": ["x" * 256] * 16,
            "max_tokens": 100,
        }
    ).request.sampling
    assert (sampling.temperature, sampling.top_k, sampling.seed) == (2.0, 256, 2**63 - 1)
    assert sampling.stop_token_ids == (0, 255) and len(sampling.stop) == 16
    assert chat({**CHAT, "top_k": -1}).request.sampling.top_k == 0  # vLLM's "off"
    assert chat({**CHAT, "temperature": v.GREEDY_TEMPERATURE}).request.sampling.temperature == v.GREEDY_TEMPERATURE


def test_neutral_values_of_unsupported_fields_are_accepted():
    req = chat(
        {
            **CHAT,
            "response_format": {"type": "text"},
            "n": 1,
            "tool_choice": "none",
            "tools": [],
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "user": "u",
            "modalities": ["text"],
            "logit_bias": {},
            "store": False,
        }
    )
    assert req.request.sampling.max_tokens == 2


def test_max_completion_tokens_wins_and_names_itself():
    assert chat({**CHAT, "max_completion_tokens": 5}).request.sampling.max_tokens == 5
    error = refused(chat, {**CHAT, "max_completion_tokens": 2048})
    assert error.field == "max_completion_tokens"


def test_developer_role_is_accepted():
    req = chat({"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    sys_req = chat({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    assert req.request.prompt_ids == sys_req.request.prompt_ids


@pytest.mark.parametrize(
    "prompt,field",
    [
        ("a\ud800", "prompt"),
        (["\udfff"], "prompt[0]"),
        ("", "prompt"),
        ([], "prompt"),
        ([256], "prompt"),
        ([-1], "prompt"),
        ([2**64], "prompt"),
        ([True], "prompt"),
        ([1] * 2049, "prompt"),
        ("x" * (2048 * v.MAX_CHARS_PER_TOKEN + 1), "prompt"),
        ({"a": 1}, "prompt"),
        (["a", "b"], "prompt"),
        (None, "prompt"),
    ],
)
def test_bad_prompts_name_the_prompt(prompt, field):
    assert refused(completion, {"prompt": prompt}).field == field


def test_text_beyond_the_context_is_refused_before_tokenizing():
    class CountingTokenizer(ByteTokenizer):
        calls = 0

        def encode(self, text):
            CountingTokenizer.calls += 1
            return super().encode(text)

        def apply_chat_template(self, messages):
            CountingTokenizer.calls += 1
            return super().apply_chat_template(messages)

    tok = CountingTokenizer()
    huge = "x" * (2048 * v.MAX_CHARS_PER_TOKEN + 1)
    with pytest.raises(InvalidArgument, match="cannot fit"):
        completion_request({"prompt": huge}, {}, MODELS, tok)
    with pytest.raises(InvalidArgument, match="cannot fit"):
        chat_request({"messages": [{"role": "user", "content": huge}]}, {}, MODELS, tok)
    assert CountingTokenizer.calls == 0


@pytest.mark.parametrize("header", ["x-session-id", "x-request-id", "x-parent-session-id"])
@pytest.mark.parametrize("value", ["caf\xe9", "\xff\xfe", "a b", "x" * 129, "a\tb", "\x00"])
def test_bad_header_values_name_the_header(header, value):
    assert refused(chat, CHAT, {header: value}).field == header


@pytest.mark.parametrize(
    "raw,field",
    [
        (b"x" * (v.MAX_BODY_BYTES + 1), "body"),
        (b'{"prompt": "caf\xe9"}', "body"),
        (b"\xff{}", "body"),
        (b'{"prompt": "\xed\xa0\x80"}', "body"),
        (b"[" * 100_000 + b"]" * 100_000, "body"),
        (b'{"a":' * 5000 + b"1" + b"}" * 5000, "body"),
        (b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}", "prompt"),
        (b'{"messages": [{"content": ' + b"[" * 40 + b"]" * 40 + b"}]}", "messages"),
        (b'{"prompt": "\\ud800"}', "prompt"),
        (b'{"messages": [{"role": "user", "content": "\\udc00x"}]}', "messages[0].content"),
        (b'{"\\ud800": 1}', "body"),
        (b'{"max_tokens": 1' + b"0" * 5000 + b"}", "body"),
        (b"", "body"),
        (b"null", "body"),
        (b"[]", "body"),
        (b"{", "body"),
        (b"NaN", "body"),
    ],
)
def test_json_body_checks_name_the_field(raw, field):
    with pytest.raises(InvalidArgument) as info:
        v.parse_json_body(raw)
    assert info.value.field == field


def test_body_over_the_limit_is_413():
    with pytest.raises(v.PayloadTooLarge) as info:
        v.parse_json_body(json.dumps({"prompt": "x" * 100}).encode(), max_bytes=50)
    assert info.value.http_status == 413 and info.value.field == "body"


def test_deep_but_allowed_nesting_parses():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    assert v.parse_json_body(json.dumps(body).encode()) == body


@pytest.mark.parametrize(
    "exc",
    [
        Internal('RayTaskError(ValueError): ray::DecodeServer.generate()\n  File "x.py"'),
        Unavailable("worker unavailable (ActorDiedError: The actor died unexpectedly)"),
        Internal("KeyError: 'x'"),
        Unavailable("x" * 1000),
    ],
)
def test_error_bodies_never_carry_internals(exc):
    body = error_body(exc, "rid-1")["error"]
    assert "Error" not in body["message"] and "File" not in body["message"]
    assert "ray::" not in body["message"] and "rid-1" in body["message"]
    assert body["code"] == exc.code.lower()


def test_client_errors_keep_their_message():
    body = error_body(InvalidArgument("must be >= 1, got -3", field="max_tokens"))["error"]
    assert body == {
        "message": "max_tokens: must be >= 1, got -3",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": "invalid_argument",
    }


def test_nesting_limit_counts_scalars_in_lists():
    """A scalar one level past the limit is refused whatever its type (ints are not walked one
    by one below the limit: a token-id prompt is thousands of them)."""
    deep_list = "[" * v.MAX_JSON_DEPTH + "1" + "]" * v.MAX_JSON_DEPTH
    with pytest.raises(InvalidArgument) as info:
        v.parse_json_body(f'{{"prompt": {deep_list}}}'.encode()[: 10**6])
    assert "nesting" in str(info.value)
    ok_list = "[" * (v.MAX_JSON_DEPTH - 2) + "1" + "]" * (v.MAX_JSON_DEPTH - 2)
    assert v.parse_json_body(f'{{"prompt": {ok_list}}}'.encode())["prompt"]
    body = {"prompt": list(range(8192)), "stop": ["a", "\ud800"]}
    with pytest.raises(InvalidArgument) as info:
        v.parse_json_body(json.dumps(body).encode())
    assert info.value.field == "stop[1]"
