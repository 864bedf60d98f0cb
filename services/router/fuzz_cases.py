"""Hostile requests for the router's edges (HTTP OpenAI API and gRPC), and the verdict on each
answer. Reused by the router tests (in-process, fake workers) and the fault suite (real stack).

    cases = hostile_requests(seed=0)            # >= 500, deterministic for a seed
    for case in cases:
        if case.protocol == "http":
            r = httpx.request(case.method, base_url + case.path, headers=list(case.headers),
                              content=case.body)
            problem = http_verdict(case, r.status_code, r.content)
        else:
            code, details = <call case.grpc_method with case.grpc_payload as raw bytes>
            problem = grpc_verdict(case, code_name, details)
        assert problem is None, problem

Categories (issue 15): numbers at and beyond the sampler's limits (tiny/negative/NaN/inf
temperature and top_p, seeds beyond 2**63, top_k/stop_token_ids/top_logprobs out of range), wrong
types, text that is not valid Unicode, JSON nesting and body size, header bytes, messages and
roles, unsupported OpenAI fields, unknown routes and methods, and gRPC messages that do not parse.
Every answer must be a success or a client error (HTTP < 500; gRPC not INTERNAL/UNKNOWN), and no
error body may carry internals (exception class names, tracebacks, Ray traces).

Requests that may succeed (a clamped tiny temperature, say) ask for at most 2 tokens, so a run
against a real model stays cheap. The HTTP paths start at `/v1`: prepend the app's route prefix.
"""

from __future__ import annotations

import json
import random
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from flashpd_sdk._gen import flashpd_pb2 as pb

GENERATE = "/flashpd.v1.Generation/Generate"
LIST_MODELS = "/flashpd.v1.Generation/ListModels"
ABORT = "/flashpd.v1.Generation/Abort"
GRPC_SERVER_FAULTS = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS", "UNIMPLEMENTED"})
# What an error body must never show: exception class names, tracebacks, Ray task traces.
INTERNALS = re.compile(
    r"Traceback|File \"|\b[A-Z][A-Za-z]*(Error|Exception)\b|ray::|RayTaskError|\.py\b|"
    r"<class |object at 0x"
)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
Outcome = Literal["refused", "any"]


@dataclass(frozen=True)
class HostileRequest:
    protocol: Literal["http", "grpc"]
    category: str
    name: str
    expect: Outcome = "refused"  # "refused": must be a 4xx naming `field`; "any": < 500
    field: str | None = None  # the field a refusal must name (None: not checked)
    # HTTP
    method: str = "POST"
    path: str = CHAT
    headers: tuple[tuple[bytes, bytes], ...] = ((b"content-type", b"application/json"),)
    body: bytes = b""
    # gRPC
    grpc_method: str = GENERATE
    grpc_payload: bytes = b""  # the serialized request, sent as raw bytes (may not parse)


def hostile_requests(seed: int, *, vocab_size: int = 512) -> list[HostileRequest]:
    """At least 500 hostile requests, HTTP and gRPC, in a fixed order for a given seed.
    `vocab_size` is the served model's (token ids at and beyond it are refused)."""
    rng = random.Random(seed)
    cases = [
        *_http_numbers(vocab_size),
        *_http_types(),
        *_http_text(),
        *_http_structure(),
        *_http_headers(),
        *_http_messages(),
        *_http_unsupported(),
        *_http_routes(),
        *_grpc_numbers(vocab_size),
        *_grpc_text(),
        *_grpc_unparsable(rng),
    ]
    cases += _http_random(rng, 600 - len(cases) if len(cases) < 600 else 40)
    return cases


# ----------------------------------------------------------------------------------- verdicts


def http_verdict(case: HostileRequest, status: int, body: bytes) -> str | None:
    """None when the answer is acceptable, else what is wrong with it."""
    where = f"{case.category}/{case.name}: HTTP {status}"
    if status >= 500:
        return f"{where} (server error) {body[:200]!r}"
    text = body.decode("utf-8", errors="replace")
    if status >= 400:
        if INTERNALS.search(text):
            return f"{where} leaks internals: {text[:200]}"
        try:
            error = json.loads(text)["error"]
            message, param = error["message"], error["param"]
        except (ValueError, KeyError, TypeError):
            return f"{where} body is not the OpenAI error shape: {text[:200]}"
        if case.field is not None and param != case.field and case.field not in message:
            return f"{where} names {param!r}, expected {case.field!r}: {message}"
    elif case.expect == "refused":
        return f"{where} accepted a request that must be refused"
    return None


def grpc_verdict(case: HostileRequest, code: str, details: str, field: str | None = None) -> str | None:
    """`code` is the grpc.StatusCode name ("OK" for success), `field` the `flashpd-field`
    trailing metadata when present."""
    where = f"{case.category}/{case.name}: {code}"
    if code in GRPC_SERVER_FAULTS:
        return f"{where} (server fault) {details[:200]}"
    if code != "OK" and INTERNALS.search(details or ""):
        return f"{where} leaks internals: {details[:200]}"
    if code == "OK" and case.expect == "refused":
        return f"{where} accepted a request that must be refused"
    if (
        code == "INVALID_ARGUMENT"
        and case.field is not None
        and field != case.field
        and case.field not in (details or "")
    ):
        return f"{where} names {field!r}, expected {case.field!r}: {details}"
    return None


# ------------------------------------------------------------------------------- HTTP cases

CHAT_BASE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION_BASE = {"prompt": "hi", "max_tokens": 2}
NAN, INF = float("nan"), float("inf")


def _http(
    category: str,
    name: str,
    body: dict | bytes,
    *,
    path: str = CHAT,
    expect: Outcome = "refused",
    field: str | None = None,
    method: str = "POST",
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> HostileRequest:
    raw = body if isinstance(body, bytes) else _dumps(body)
    return HostileRequest(
        "http", category, name, expect, field, method, path, ((b"content-type", b"application/json"), *headers), raw
    )


def _dumps(body: dict) -> bytes:
    """JSON with NaN/Infinity literals allowed and lone surrogates kept as \\u escapes."""
    return json.dumps(body, allow_nan=True, ensure_ascii=True).encode()


def _both(category: str, name: str, extra: dict, **kw) -> Iterator[HostileRequest]:
    yield _http(category, f"chat {name}", {**CHAT_BASE, **extra}, path=CHAT, **kw)
    yield _http(category, f"completion {name}", {**COMPLETION_BASE, **extra}, path=COMPLETIONS, **kw)


TINY = (1e-300, 5e-324, 1e-45, 1e-38, 1e-7)  # clamped to greedy: accepted
BAD_REAL = (NAN, INF, -INF, -1e-300, -1.0, 1e300, 10**400)


def _http_numbers(vocab: int) -> Iterator[HostileRequest]:
    yield from _sampler_reals()
    yield from _integer_limits(vocab)
    yield from _token_counts()
    yield _http("numbers", "huge integer literal", b'{"max_tokens": 1' + b"0" * 5000 + b"}", field="body")


def _sampler_reals() -> Iterator[HostileRequest]:
    for field in ("temperature", "top_p"):
        for v in TINY:
            yield from _both("numbers", f"{field}={v!r}", {field: v}, expect="any", field=field)
        for v in BAD_REAL:
            yield from _both("numbers", f"{field}={v!r}", {field: v}, field=field)
    for v in (*BAD_REAL, 1.5, 2.0000001):
        yield from _both("numbers", f"min_p={v!r}", {"min_p": v}, field="min_p")
    for v in (2.5, 1e10):
        yield from _both("numbers", f"temperature={v!r}", {"temperature": v}, field="temperature")


def _integer_limits(vocab: int) -> Iterator[HostileRequest]:
    for v in (-1, -(2**63), 2**63, 2**64, 2**64 + 1, 10**30, 10**300):
        yield from _both("numbers", f"seed={v}", {"seed": v}, field="seed")
    yield from _both("numbers", "seed=2**63-1", {"seed": 2**63 - 1, "temperature": 0.5}, expect="any")
    for v in (10**20, 2**31, 2**63, -2, -(2**63), vocab + 1):
        yield from _both("numbers", f"top_k={v}", {"top_k": v}, field="top_k")
    for v in (-1, vocab, 2**31, 2**63, 2**64, 10**30):
        yield from _both("numbers", f"stop_token_ids=[{v}]", {"stop_token_ids": [v]}, field="stop_token_ids")
    yield from _both("numbers", "stop_token_ids x10000", {"stop_token_ids": [1] * 10_000}, field="stop_token_ids")


def _token_counts() -> Iterator[HostileRequest]:
    for v in (-1, 21, 2**31, 10**30):
        yield _http(
            "numbers", f"top_logprobs={v}", {**CHAT_BASE, "logprobs": True, "top_logprobs": v}, field="top_logprobs"
        )
        yield _http("numbers", f"logprobs={v}", {**COMPLETION_BASE, "logprobs": v}, path=COMPLETIONS, field="logprobs")
    for field in ("max_tokens", "max_completion_tokens"):
        for v in (0, -1, -(2**63), 2**31, 2**63, 2**64, 10**30):
            yield _http("numbers", f"{field}={v}", {**CHAT_BASE, field: v}, field=field)
    for v in (0, -1, 2**64, 10**30):
        yield _http(
            "numbers",
            f"completion max_tokens={v}",
            {**COMPLETION_BASE, "max_tokens": v},
            path=COMPLETIONS,
            field="max_tokens",
        )


WRONG_TYPES = ("1", True, None, [], {}, [1], {"a": 1}, 1.5)
_NOT_NUMBER = ("1", True, [], {}, [1], {"a": 1})
_NOT_INT = (*_NOT_NUMBER, 1.5)
_NOT_BOOL = ("1", "true", 1, 0, [], {}, 1.5)
TYPE_CASES = {
    "temperature": _NOT_NUMBER,
    "top_p": _NOT_NUMBER,
    "min_p": _NOT_NUMBER,
    "top_k": _NOT_INT,
    "seed": _NOT_INT,
    "max_tokens": _NOT_INT,
    "n": _NOT_INT,
    "stream": _NOT_BOOL,
    "ignore_eos": _NOT_BOOL,
    "logprobs": _NOT_BOOL,
    "stop": (True, {}, [1], {"a": 1}, 1.5, 1, [None]),
    "stop_token_ids": ("1", True, {}, {"a": 1}, 1.5, [1.5], ["1"], [True]),
    "stream_options": ("1", True, [], [1], 1.5, {"include_usage": "yes"}),
    "model": (True, [], {}, [1], 1.5, 1),
    "user": (True, [], {}, 1),
}


def _http_types() -> Iterator[HostileRequest]:
    for field, values in TYPE_CASES.items():
        for v in values:
            yield _http("types", f"{field}={v!r}", {**CHAT_BASE, field: v}, field=field)
    for v in ("1", True, [], 1.5):
        yield _http(
            "types",
            f"completion logprobs={v!r}",
            {**COMPLETION_BASE, "logprobs": v},
            path=COMPLETIONS,
            field="logprobs",
        )
    for v in (1, True, [None], [[1, "a"]], [1.5], {"a": 1}, [1, "x"]):
        yield _http("types", f"prompt={v!r}", {"prompt": v}, path=COMPLETIONS, field="prompt")


SURROGATES = ("\ud800", "\udfff", "a\ud83d", "\ude00b", "x" * 100 + "\udc80")


def _http_text() -> Iterator[HostileRequest]:
    for i, s in enumerate(SURROGATES):
        yield from _surrogate_in_every_field(i, s)
    yield from _undecodable_bodies()
    yield from _odd_strings()


def _surrogate_in_every_field(i: int, s: str) -> Iterator[HostileRequest]:
    yield _http(
        "text", f"surrogate {i} in content", {"messages": [{"role": "user", "content": s}]}, field="messages[0].content"
    )
    yield _http(
        "text",
        f"surrogate {i} in content part",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": s}]}]},
        field="messages[0].content[0].text",
    )
    yield _http("text", f"surrogate {i} in prompt", {"prompt": s}, path=COMPLETIONS, field="prompt")
    yield _http("text", f"surrogate {i} in prompt list", {"prompt": [s]}, path=COMPLETIONS, field="prompt[0]")
    yield _http("text", f"surrogate {i} in stop", {**CHAT_BASE, "stop": [s]}, field="stop[0]")
    yield _http("text", f"surrogate {i} in model", {**CHAT_BASE, "model": s}, field="model")
    yield _http("text", f"surrogate {i} in key", {**CHAT_BASE, s: 1}, field="body")
    yield _http(
        "text",
        f"surrogate {i} in system",
        {"messages": [{"role": "system", "content": s}, {"role": "user", "content": "x"}]},
        field="messages[0].content",
    )


UNDECODABLE_BODIES = (
    ("latin-1 byte", b'{"prompt": "caf\xe9"}'),
    ("overlong utf-8", b'{"prompt": "\xc0\xaf"}'),
    ("utf-8 surrogate bytes", b'{"prompt": "\xed\xa0\x80"}'),
    ("truncated utf-8", b'{"prompt": "\xe2\x82"}'),
    ("0xff byte", b'\xff{"prompt": "x"}'),
    ("utf-16 body", '{"prompt": "x"}'.encode("utf-16")),
)


def _undecodable_bodies() -> Iterator[HostileRequest]:
    for name, raw in UNDECODABLE_BODIES:
        yield _http("text", name, raw, path=COMPLETIONS, field="body")


def _odd_strings() -> Iterator[HostileRequest]:
    yield _http("text", "NUL in prompt", {"prompt": "a\x00b", "max_tokens": 2}, path=COMPLETIONS, expect="any")
    yield _http("text", "empty prompt", {"prompt": ""}, path=COMPLETIONS, field="prompt")
    yield _http("text", "stop empty string", {**CHAT_BASE, "stop": [""]}, field="stop")
    yield _http("text", "stop too long", {**CHAT_BASE, "stop": ["x" * 10_000]}, field="stop")
    yield _http("text", "stop too many", {**CHAT_BASE, "stop": ["x"] * 1000}, field="stop")


def _nested(depth: int, open_: str, close: str, inner: str = "1") -> bytes:
    return ('{"prompt": ' + open_ * depth + inner + close * depth + "}").encode()


def _http_structure() -> Iterator[HostileRequest]:
    yield from _deep_nesting()
    yield from _malformed_json()
    yield from _oversized_bodies()


def _deep_nesting() -> Iterator[HostileRequest]:
    for depth in (33, 100, 1000, 5000, 100_000):
        field = "body" if depth > 900 else None  # the field is checked only past the parser's recursion limit
        for kind, open_, close in (("arrays", "[", "]"), ("objects", '{"a":', "}")):
            yield _http("structure", f"{kind} x{depth}", _nested(depth, open_, close), path=COMPLETIONS, field=field)
    yield _http(
        "structure",
        "messages nested deep",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "x", "extra": json.loads("[" * 40 + "]" * 40)}]}
            ]
        },
    )


MALFORMED_JSON = (
    ("empty body", b""),
    ("null", b"null"),
    ("array", b"[]"),
    ("number", b"1"),
    ("string", b'"x"'),
    ("truncated", b'{"prompt": "x"'),
    ("trailing garbage", b'{"prompt": "x"} x'),
    ("NaN literal", b"NaN"),
    ("single quotes", b"{'prompt': 'x'}"),
    ("duplicate keys", b'{"prompt": 1, "prompt": "x"}'),
)


def _malformed_json() -> Iterator[HostileRequest]:
    for name, raw in MALFORMED_JSON:
        yield _http(
            "structure",
            name,
            raw,
            path=COMPLETIONS,
            expect="any" if name == "duplicate keys" else "refused",
            field=None if name == "duplicate keys" else "body",
        )


def _oversized_bodies() -> Iterator[HostileRequest]:
    yield _http("structure", "10 MB prompt", _dumps({"prompt": "x" * 10_000_000}), path=COMPLETIONS, field="body")
    yield _http("structure", "1 MB prompt", _dumps({"prompt": "hello " * 200_000}), path=COMPLETIONS, field="prompt")
    yield _http(
        "structure",
        "1 MB message",
        _dumps({"messages": [{"role": "user", "content": "hello " * 200_000}]}),
        field="messages",
    )
    yield _http(
        "structure",
        "100k messages",
        _dumps({"messages": [{"role": "user", "content": "x"}] * 100_000}),
        field="messages",
    )
    yield _http("structure", "prompt 100k token ids", {"prompt": [1] * 100_000}, path=COMPLETIONS, field="prompt")


HEADER_VALUES = (
    (b"latin-1", b"caf\xe9"),
    (b"high bytes", b"\xff\xfe"),
    (b"space", b"a b"),
    (b"long", b"x" * 5000),
    (b"utf-8", "s\u00e9ssion".encode()),
    (b"tab", b"a\tb"),
    (b"unicode emoji", "\U0001f600".encode()),
)


def _http_headers() -> Iterator[HostileRequest]:
    for header in (b"x-session-id", b"x-request-id", b"x-parent-session-id"):
        for name, value in HEADER_VALUES:
            yield from _bad_session_header(header, name, value)
    yield from _tolerated_headers()


def _bad_session_header(header: bytes, name: bytes, value: bytes) -> Iterator[HostileRequest]:
    yield _http(
        "headers",
        f"{header.decode()} {name.decode()}",
        dict(CHAT_BASE),
        headers=((header, value),),
        field=header.decode(),
    )
    yield _http(
        "headers",
        f"{header.decode()} {name.decode()} (completion)",
        dict(COMPLETION_BASE),
        path=COMPLETIONS,
        headers=((header, value),),
        field=header.decode(),
    )


def _tolerated_headers() -> Iterator[HostileRequest]:
    yield _http(
        "headers",
        "authorization latin-1",
        dict(CHAT_BASE),
        headers=((b"authorization", b"Bearer caf\xe9"),),
        expect="any",
    )
    yield _http(
        "headers",
        "content-type text",
        dict(CHAT_BASE),
        headers=((b"content-type", b"text/plain; charset=\xe9"),),
        expect="any",
    )


_CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}


BAD_MESSAGES = [  # (case name, body, the field a refusal must name)
    ("no messages", {"max_tokens": 2}, "messages"),
    ("empty list", {"messages": []}, "messages"),
    ("messages object", {"messages": {"role": "user"}}, "messages"),
    ("messages string", {"messages": "hi"}, "messages"),
    ("message string", {"messages": ["hi"]}, "messages[0]"),
    ("message null", {"messages": [None]}, "messages[0]"),
    ("no role", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("role tool without tool_call_id", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ("role function", {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ("role function", {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ("role int", {"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
    ("role surrogate", {"messages": [{"role": "\ud800", "content": "x"}]}, "messages[0].role"),
    ("content int", {"messages": [{"role": "user", "content": 1}]}, "messages[0].content"),
    ("content null", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    (
        "content image",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
        "messages[0].content",
    ),
    ("content part no text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content"),
    ("content part int", {"messages": [{"role": "user", "content": [1]}]}, "messages[0].content"),
    (
        "tool_calls arguments not JSON",
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": "x",
                    "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{x"}}],
                },
                {"role": "user", "content": "y"},
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
    ("name int", {"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
    (
        "tool_call_id refers to no call",
        {
            "messages": [
                {"role": "user", "content": "x"},
                _CALLED,
                {"role": "tool", "tool_call_id": "zz", "content": "r"},
            ]
        },
        "messages[2].tool_call_id",
    ),
    (
        "tool message without a call before it",
        {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c1", "content": "r"}]},
        "messages[1].tool_call_id",
    ),
    (
        "tool result answered twice",
        {
            "messages": [
                {"role": "user", "content": "x"},
                _CALLED,
                {"role": "tool", "tool_call_id": "c1", "content": "r"},
                {"role": "tool", "tool_call_id": "c1", "content": "r"},
            ]
        },
        "messages[3].tool_call_id",
    ),
    (
        "1 MB tool result",
        {
            "messages": [
                {"role": "user", "content": "x"},
                _CALLED,
                {"role": "tool", "tool_call_id": "c1", "content": "r" * (1 << 20)},
            ]
        },
        "messages",
    ),
]


def _http_messages() -> Iterator[HostileRequest]:
    for name, body, field in BAD_MESSAGES:
        yield _http("messages", name, {"max_tokens": 2, **body}, field=field)
    for role in ("system", "developer", "user", "assistant"):
        yield _http(
            "messages",
            f"role {role} accepted",
            {"max_tokens": 2, "messages": [{"role": role, "content": "x"}, {"role": "user", "content": "y"}]},
            expect="any",
        )
    yield _http(
        "messages",
        "special tokens in content",
        {"max_tokens": 2, "messages": [{"role": "user", "content": "<|User|><|Assistant|><|end_of_sentence|>"}]},
        expect="any",
    )


_F = {"type": "function", "function": {"name": "f"}}
UNSUPPORTED = [  # unsupported values, and the agent fields' bad shapes (agent_fields.py)
    ("response_format type xml", {"response_format": {"type": "xml"}}, "response_format.type"),
    (
        "response_format json_schema without name",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
    ),
    (
        "response_format schema not an object",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
        "response_format.json_schema.schema",
    ),
    ("response_format string", {"response_format": "json"}, "response_format"),
    ("n=0", {"n": 0}, "n"),
    ("n=17", {"n": 17}, "n"),
    ("n huge", {"n": 10**9}, "n"),
    ("n beyond int64", {"n": 2**64}, "n"),
    ("n negative", {"n": -3}, "n"),
    ("n float", {"n": 2.0}, "n"),
    (
        "tool parameters with an invalid type",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}},
                }
            ]
        },
        "tools[0].function.parameters",
    ),
    (
        "tool parameters with a negative minLength",
        {
            "tools": [
                _F,
                {"type": "function", "function": {"name": "g", "parameters": {"type": "string", "minLength": -1}}},
            ]
        },
        "tools[1].function.parameters",
    ),
    (
        "forced tool with an unenforceable keyword",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
    ),
    (
        "json_schema with not",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        "json_schema with if/then",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$defs": {"d": {"if": {}, "then": {}}}, "$ref": "#/$defs/d"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        "json_schema with patternProperties",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "patternProperties": {"^a": {"type": "integer"}}},
                },
            }
        },
        "response_format.json_schema.schema",
    ),
    ("tools not a list", {"tools": {"type": "function"}}, "tools"),
    (
        "tool schema not an object",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        "tools[0].function.parameters",
    ),
    ("tool_choice required without tools", {"tool_choice": "required"}, "tool_choice"),
    (
        "tool_choice unknown name",
        {"tools": [_F], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice.function.name",
    ),
    ("tool_choice unknown mode", {"tools": [_F], "tool_choice": "sometimes"}, "tool_choice"),
    ("best_of=3", {"best_of": 3}, "best_of"),
    ("tool_choice required", {"tool_choice": "required"}, "tool_choice"),
    ("functions", {"functions": [{"name": "f"}]}, "functions"),
    ("function_call", {"function_call": "auto"}, "function_call"),
    ("logit_bias", {"logit_bias": {"1": 100}}, "logit_bias"),
    ("presence_penalty", {"presence_penalty": 1.0}, "presence_penalty"),
    ("frequency_penalty", {"frequency_penalty": NAN}, "frequency_penalty"),
    ("audio", {"audio": {"voice": "x"}}, "audio"),
    ("modalities audio", {"modalities": ["audio"]}, "modalities"),
    ("prediction", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("echo", {"echo": True}, "echo"),
    ("suffix", {"suffix": "x"}, "suffix"),
]


def _http_unsupported() -> Iterator[HostileRequest]:
    for name, extra, field in UNSUPPORTED:
        yield _http("unsupported", name, {**CHAT_BASE, **extra}, field=field)
    for name, extra in ACCEPTED_FIELDS:
        yield _http("unsupported", name, {**CHAT_BASE, **extra}, expect="any")


ACCEPTED_FIELDS = (  # OpenAI fields and values the router serves (or ignores): never refused
    ("response_format text", {"response_format": {"type": "text"}}),
    ("n=1", {"n": 1}),
    ("tool_choice none", {"tool_choice": "none"}),
    ("response_format json_object", {"response_format": {"type": "json_object"}}),
    ("tools auto", {"tools": [_F]}),
    ("n=2", {"n": 2}),
    ("n=2 streamed with tools", {"n": 2, "stream": True, "tools": [_F]}),
    ("n=16", {"n": 16}),
    (
        "tool result answers its call",
        {
            "tools": [_F],
            "messages": [
                {"role": "user", "content": "x"},
                _CALLED,
                {"role": "tool", "tool_call_id": "c1", "content": "r"},
            ],
        },
    ),
    (
        "json_schema with oneOf and format",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"oneOf": [{"type": "string", "format": "email"}, {"type": "integer"}]},
                },
            }
        },
    ),
    ("modalities text", {"modalities": ["text"]}),
    ("user", {"user": "u"}),
)


BAD_ROUTES = (
    ("GET", CHAT),
    ("PUT", CHAT),
    ("DELETE", COMPLETIONS),
    ("PATCH", "/v1/models"),
    ("POST", "/v1/models"),
    ("POST", "/v1/embeddings"),
    ("GET", "/v1/nope"),
    ("POST", "/nope"),
    ("GET", "/v1/models/nope"),
    ("GET", "/v1/models/" + "x" * 5000),
    ("GET", "/v1/models/caf%C3%A9"),
    ("GET", "/v1/models/%ff%fe"),
    ("GET", "/v1/models/%00"),
    ("POST", "/v1/chat/completions/x"),
)


def _http_routes() -> Iterator[HostileRequest]:
    for method, path in BAD_ROUTES:
        yield _http("routes", f"{method} {path[:40]}", b"", method=method, path=path)
    for model in ("nope", "", " ", "x" * 10_000):
        yield _http(
            "routes",
            f"chat model {model[:10]!r}",
            {**CHAT_BASE, "model": model},
            expect="any" if model == "" else "refused",
            field=None if model == "" else "model",
        )


def _http_random(rng: random.Random, count: int) -> list[HostileRequest]:
    """Seeded random mutations of valid bodies: a field set to a value drawn from all the
    hostile values above, or random bytes."""
    out = []
    for i in range(count):
        if rng.random() < 0.1:
            raw = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
            out.append(_http("random", f"{i} random bytes", raw, path=rng.choice((CHAT, COMPLETIONS)), field="body"))
        else:
            out.append(_random_fields(rng, i))
    return out


def _random_fields(rng: random.Random, i: int) -> HostileRequest:
    """A valid body with one to three fields set to values drawn from RANDOM_VALUES."""
    base, path = rng.choice(((CHAT_BASE, CHAT), (COMPLETION_BASE, COMPLETIONS)))
    body = dict(base)
    for _ in range(rng.randint(1, 3)):
        body[rng.choice(RANDOM_FIELDS)] = rng.choice(RANDOM_VALUES)
    body.setdefault("max_tokens", 2)
    return _http("random", f"{i} {sorted(body)}", body, path=path, expect="any")


RANDOM_FIELDS = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "logprobs",
    "top_logprobs",
    "stream",
    "n",
    "model",
    "stream_options",
    "ignore_eos",
    "max_completion_tokens",
    "response_format",
]
RANDOM_VALUES = [
    *TINY,
    *BAD_REAL,
    *WRONG_TYPES,
    *SURROGATES,
    0,
    -1,
    2**63,
    2**64,
    10**30,
    "",
    [NAN],
    {"include_usage": "yes"},
    {"type": "json_object"},
]


# ------------------------------------------------------------------------------- gRPC cases


def _grpc(
    category: str,
    name: str,
    payload: bytes,
    *,
    expect: Outcome = "refused",
    field: str | None = None,
    method: str = GENERATE,
) -> HostileRequest:
    return HostileRequest("grpc", category, name, expect, field, grpc_method=method, grpc_payload=payload)


def _msg(**fields) -> bytes:
    msg = pb.GenerateRequest(prompt="hi", max_tokens=2)
    for key, value in fields.items():
        if key == "prompt_ids":
            msg.prompt_ids.ids[:] = value
        elif isinstance(value, list):
            getattr(msg, key)[:] = value
        else:
            setattr(msg, key, value)
    return msg.SerializeToString()


def _f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _grpc_numbers(vocab: int) -> Iterator[HostileRequest]:
    yield from _grpc_sampler_reals()
    yield from _grpc_integer_limits(vocab)


def _grpc_sampler_reals() -> Iterator[HostileRequest]:
    for field in ("temperature", "top_p"):
        for v in (1e-45, 1e-38, 1e-7, 1.4e-45):
            yield _grpc("numbers", f"{field}={v!r}", _msg(**{field: _f32(v)}), expect="any")
        for v in (NAN, INF, -INF, -1e-38, -1.0, 3.4e38):
            yield _grpc("numbers", f"{field}={v!r}", _msg(**{field: v}), field=field)
    for v in (NAN, INF, -1.0, 1.5):
        yield _grpc("numbers", f"min_p={v!r}", _msg(min_p=v), field="min_p")


def _grpc_integer_limits(vocab: int) -> Iterator[HostileRequest]:
    for v in (2**63, 2**63 + 1, 2**64 - 1):
        yield _grpc("numbers", f"seed={v}", _msg(seed=v), field="seed")
    yield _grpc("numbers", "seed=2**63-1", _msg(seed=2**63 - 1, temperature=0.5), expect="any")
    for v in (-2, -(2**31), 2**31 - 1, vocab + 1):
        yield _grpc("numbers", f"top_k={v}", _msg(top_k=v), field="top_k")
    for v in (vocab, 2**31, 2**32 - 1):
        yield _grpc("numbers", f"stop_token_ids=[{v}]", _msg(stop_token_ids=[v]), field="stop_token_ids")
        yield _grpc("numbers", f"prompt_ids=[{v}]", _msg(prompt_ids=[1, v]), field="prompt_ids")
    yield _grpc("numbers", "stop_token_ids x10000", _msg(stop_token_ids=[1] * 10_000), field="stop_token_ids")
    for v in (21, 2**31, 2**32 - 1):
        yield _grpc("numbers", f"logprobs={v}", _msg(logprobs=v), field="logprobs")
    for v in (0, -1, -(2**31), 2**31 - 1):
        yield _grpc("numbers", f"max_tokens={v}", _msg(max_tokens=v), field="max_tokens")
    yield _grpc(
        "numbers", "resume_from_token huge", _msg(resume_from_token=2**32 - 1, request_id="r-unknown"), expect="any"
    )
    yield _grpc("numbers", "prompt_ids empty", _msg(prompt_ids=[]), field="prompt_ids")
    yield _grpc("numbers", "prompt_ids 100k", _msg(prompt_ids=[1] * 100_000), field="prompt_ids")


def _grpc_text() -> Iterator[HostileRequest]:
    yield from _grpc_ids_and_model()
    yield from _grpc_prompt_and_stop()
    yield from _grpc_abort_ids()


def _grpc_ids_and_model() -> Iterator[HostileRequest]:
    for field in ("request_id", "session_id", "parent_session_id"):
        for value in ("a b", "caf\u00e9", "x" * 5000, "\x00", "\U0001f600", "a\nb"):
            yield _grpc("text", f"{field}={value[:10]!r}", _msg(**{field: value}), field=field)
    for value in ("", " ", "nope", "x" * 5000):
        yield _grpc(
            "text",
            f"model={value[:10]!r}",
            _msg(model=value),
            expect="any" if value == "" else "refused",
            field=None if value == "" else "model",
        )


def _grpc_prompt_and_stop() -> Iterator[HostileRequest]:
    yield _grpc("text", "prompt empty", _msg(prompt=""), field="prompt")
    yield _grpc("text", "prompt 10 MB", _msg(prompt="x" * 10_000_000))
    yield _grpc("text", "prompt 1 MB", _msg(prompt="hello " * 200_000), field="prompt")
    yield _grpc("text", "stop empty", _msg(stop=[""]), field="stop")
    yield _grpc("text", "stop x1000", _msg(stop=["x"] * 1000), field="stop")
    yield _grpc("text", "stop 10k chars", _msg(stop=["x" * 10_000]), field="stop")
    yield _grpc("text", "no input", pb.GenerateRequest(max_tokens=2).SerializeToString(), field="prompt")


def _grpc_abort_ids() -> Iterator[HostileRequest]:
    yield _grpc("text", "abort empty id", pb.AbortRequest().SerializeToString(), method=ABORT, field="request_id")
    yield _grpc(
        "text",
        "abort id with space",
        pb.AbortRequest(request_id="a b").SerializeToString(),
        method=ABORT,
        field="request_id",
    )


def _grpc_unparsable(rng: random.Random) -> Iterator[HostileRequest]:
    valid = _msg()
    for name, payload in _malformed_wire(valid):
        method = ABORT if name.startswith("abort") else GENERATE
        yield _grpc("unparsable", name, payload, method=method)
    yield _grpc("unparsable", "list models garbage", b"\xff\xff", method=LIST_MODELS)
    for i in range(40):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.getrandbits(8)
        yield _grpc("unparsable", f"mutated {i}", bytes(data), expect="any")
    for i in range(20):
        payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 48)))
        yield _grpc("unparsable", f"random bytes {i}", payload, expect="any")


def _malformed_wire(valid: bytes) -> list[tuple[str, bytes]]:
    """Protobuf wire bytes that do not parse: bad UTF-8 in string fields, broken framing.
    `valid` is a serialized GenerateRequest that some cases extend with a bad field."""
    return [
        ("invalid utf-8 in prompt", b"\x12\x02\xc3\x28"),
        ("latin-1 in prompt", b"\x12\x04caf\xe9"),
        ("surrogate bytes in prompt", b"\x12\x03\xed\xa0\x80"),
        ("invalid utf-8 in session_id", valid + b"\x72\x02\xff\xfe"),
        ("invalid utf-8 in stop", valid + b"\x52\x01\xff"),
        ("truncated varint", b"\x20\xff\xff"),
        ("length beyond end", b"\x12\x7fabc"),
        ("bad wire type", b"\x27"),
        ("field number 0", b"\x00\x01"),
        ("random 0xff", b"\xff" * 16),
        ("huge length", b"\x12\xff\xff\xff\xff\x0f"),
        ("end group without start", b"\x0c"),
        ("nested prompt_ids garbage", b"\x1a\x03\x0a\xff\xff"),
        ("abort invalid utf-8", b"\x0a\x02\xff\xfe"),
    ]
