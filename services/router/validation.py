"""Edge validation: one model of every request field, shared by the OpenAI HTTP frontend and the
gRPC frontend. Each refusal is an `InvalidArgument` naming the field (HTTP 4xx with the OpenAI
error shape, gRPC INVALID_ARGUMENT with the field in `flashpd-field`).

Limits (the sampler's real limits; the engine never sees a value outside them):

    field              accepted                                   note
    body               <= MAX_BODY_BYTES (HTTP body, gRPC msg)    413 / RESOURCE_EXHAUSTED
    JSON               UTF-8, nesting <= MAX_JSON_DEPTH           checked before anything else
    text               str without lone surrogates                prompt, messages, stop, ids
    prompt text        <= context_tokens * MAX_CHARS_PER_TOKEN    refused before tokenizing
    max_tokens         int, 1 .. context - prompt tokens
    temperature        finite, 0 .. MAX_TEMPERATURE               < GREEDY_TEMPERATURE -> 0 (greedy)
    top_p              finite, 0 .. 1                             < MIN_TOP_P -> greedy (only the
                                                                  top token could be kept)
    top_k              int, -1 (off) or 0 (off) .. vocab_size
    min_p              finite, 0 .. 1
    seed               int, 0 .. 2**63 - 1
    stop               <= MAX_STOP strings of 1 .. MAX_STOP_CHARS characters
    stop_token_ids     <= MAX_STOP_TOKEN_IDS ids in [0, vocab_size)
    logprobs           completions: int 0 .. 20; chat: bool, with top_logprobs int 0 .. 20
    messages           1 .. MAX_MESSAGES; roles system, developer, user, assistant; text only
    model              a served model's name (<= 256 characters); unknown: HTTP 404
    ids and headers    request/session ids: 1 .. 128 printable ASCII characters, no spaces
                       (also checked in front of Serve's proxy: `http_guard.py`)

Tiny temperatures are clamped rather than refused: below GREEDY_TEMPERATURE = 1e-5 the
distribution is a point mass on the argmax for any logits the model produces (a logit gap of
1e-3 already gives e^100 odds), so greedy is what the client asked for, and dividing logits by
1e-300 would overflow to inf/NaN. Tiny top_p likewise keeps only the top token, which is greedy.
Neither clamp changes a request that samples meaningfully.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flashpd.engine.sampling_params import GREEDY_TEMPERATURE, MAX_LOGPROBS, MAX_SEED, SPECULATIVE_MODES, SamplingParams
from flashpd.services.api import InvalidArgument

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_JSON_DEPTH = 32
MAX_CHARS_PER_TOKEN = 64  # no tokenizer token decodes to more; bounds the text before tokenizing
MAX_TEMPERATURE = 2.0  # OpenAI's range
MIN_TOP_P = 1e-6
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_ID_CHARS = 128
MAX_TOKENS = 2**31 - 1  # the wire's int32; the context bounds it further
MAX_MESSAGES = 4096


class PayloadTooLarge(InvalidArgument):
    http_status = 413


class ModelNotFound(InvalidArgument):
    """An unknown model: HTTP 404 `model_not_found` (OpenAI), gRPC INVALID_ARGUMENT."""

    http_status = 404


# ---------------------------------------------------------------------------------- scalars


def as_int(value: Any, field: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"must be an integer, got {show(value)}", field=field)
    if not lo <= value <= hi:
        raise InvalidArgument(f"must be in [{lo}, {hi}], got {show(value)}", field=field)
    return value


def as_number(value: Any, field: str, lo: float, hi: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidArgument(f"must be a number, got {show(value)}", field=field)
    try:
        x = float(value)
    except OverflowError:  # an int beyond float range
        raise InvalidArgument(f"must be in [{lo}, {hi}]", field=field) from None
    if not math.isfinite(x):
        raise InvalidArgument(f"must be a finite number, got {x}", field=field)
    if not lo <= x <= hi:
        raise InvalidArgument(f"must be in [{lo}, {hi}], got {x:g}", field=field)
    return x


def as_bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"must be true or false, got {show(value)}", field=field)
    return value


def as_text(value: Any, field: str, *, max_chars: int | None = None, empty_ok: bool = True) -> str:
    """A string that is valid Unicode (no lone surrogates), optionally bounded."""
    if not isinstance(value, str):
        raise InvalidArgument(f"must be a string, got {_type_name(value)}", field=field)
    if not empty_ok and not value:
        raise InvalidArgument("must not be empty", field=field)
    if max_chars is not None and len(value) > max_chars:
        raise InvalidArgument(f"must be at most {max_chars} characters, got {len(value)}", field=field)
    check_unicode(value, field)
    return value


def check_unicode(value: str, field: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument("must be valid Unicode text (it holds a lone UTF-16 surrogate)", field=field) from None


def as_id(value: Any, field: str) -> str | None:
    """Request/session ids (also from headers): printable ASCII without spaces; "" -> None."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InvalidArgument(f"must be a string, got {_type_name(value)}", field=field)
    if len(value) > MAX_ID_CHARS or not all(33 <= ord(c) < 127 for c in value):
        raise InvalidArgument(f"must be at most {MAX_ID_CHARS} printable ASCII characters without spaces", field=field)
    return value


def token_ids(
    value: Any, field: str, vocab_size: int, *, max_count: int | None = None, empty_ok: bool = False
) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise InvalidArgument("must be a list of token ids", field=field)
    if not value and not empty_ok:
        raise InvalidArgument("must not be empty", field=field)
    if max_count is not None and len(value) > max_count:
        raise InvalidArgument(f"must hold at most {max_count} token ids, got {len(value)}", field=field)
    for t in value:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidArgument(f"token ids must be integers in [0, {vocab_size}), got {show(t)}", field=field)
    return tuple(value)


def check_text_budget(num_chars: int, context_tokens: int, field: str) -> None:
    """Refuse text that cannot fit the context before paying for tokenizing it."""
    limit = context_tokens * MAX_CHARS_PER_TOKEN
    if num_chars > limit:
        raise InvalidArgument(f"{num_chars} characters cannot fit the context of {context_tokens} tokens", field=field)


# ---------------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float


OPENAI_DEFAULTS = SamplingDefaults(temperature=1.0)  # OpenAI samples by default
GRPC_DEFAULTS = SamplingDefaults(temperature=0.0)  # the gRPC API is greedy by default


def sampling_params(
    get: Callable[[str], Any],
    *,
    max_tokens: int,
    logprobs: int,
    vocab_size: int,
    defaults: SamplingDefaults,
    ignore_eos: bool = False,
) -> SamplingParams:
    """The engine's sampling parameters from the client's fields. `get(name)` returns the value
    sent, or None when the field is absent; `max_tokens` and `logprobs` are checked by the
    caller (their names and defaults differ between the APIs)."""
    temperature = _opt(get, "temperature", defaults.temperature, lambda v, f: as_number(v, f, 0.0, MAX_TEMPERATURE))
    top_p = _opt(get, "top_p", 1.0, lambda v, f: as_number(v, f, 0.0, 1.0))
    top_k = _opt(get, "top_k", 0, lambda v, f: as_int(v, f, -1, vocab_size))
    min_p = _opt(get, "min_p", 0.0, lambda v, f: as_number(v, f, 0.0, 1.0))
    seed = _opt(get, "seed", None, lambda v, f: as_int(v, f, 0, MAX_SEED))
    stop = _opt(get, "stop", (), _stop_strings)
    stop_ids = _opt(get, "stop_token_ids", (), lambda v, f: _stop_token_ids(v, f, vocab_size))
    speculative = _opt(get, "speculative", "auto", as_speculative)
    if temperature < GREEDY_TEMPERATURE or top_p < MIN_TOP_P:
        temperature, top_p = 0.0, 1.0  # greedy (see the module docstring)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=max(top_k, 0),
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        stop_token_ids=stop_ids,
        stop=stop,
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        speculative=speculative,
    )


def _stop_token_ids(value: Any, field: str, vocab_size: int) -> tuple[int, ...]:
    ids = list(value) if isinstance(value, tuple) else value
    return token_ids(ids, field, vocab_size, max_count=MAX_STOP_TOKEN_IDS, empty_ok=True)


def as_speculative(value: Any, field: str) -> str:
    """The per-request speculative mode: "auto" (the server's policy) or "off"; "" = auto."""
    if value == "":
        return "auto"
    if not isinstance(value, str) or value not in SPECULATIVE_MODES:
        raise InvalidArgument(f"must be one of {list(SPECULATIVE_MODES)}, got {value!r}", field=field)
    return value


def as_logprobs(value: Any, field: str) -> int:
    return as_int(value, field, 0, MAX_LOGPROBS)


def _stop_strings(value: Any, field: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise InvalidArgument("must be a string or a list of strings", field=field)
    if len(items) > MAX_STOP:
        raise InvalidArgument(f"must hold at most {MAX_STOP} strings, got {len(items)}", field=field)
    return tuple(as_text(s, field, max_chars=MAX_STOP_CHARS, empty_ok=False) for s in items)


def _opt(get: Callable[[str], Any], name: str, default: Any, check: Callable[[Any, str], Any]):
    value = get(name)
    return default if value is None else check(value, name)


# ---------------------------------------------------------------------------------- JSON body


def parse_json_body(raw: bytes, *, max_bytes: int = MAX_BODY_BYTES) -> dict:
    """A request body as a JSON object: bounded size, UTF-8, bounded nesting, no lone surrogates
    in any string (keys included)."""
    if len(raw) > max_bytes:
        raise PayloadTooLarge(f"request body of {len(raw)} bytes exceeds {max_bytes} bytes", field="body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"is not valid UTF-8 (byte {exc.start})", field="body") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise InvalidArgument(f"JSON nesting exceeds {MAX_JSON_DEPTH} levels", field="body") from None
    except ValueError as exc:  # JSONDecodeError, or an integer literal beyond Python's limit
        raise InvalidArgument(f"malformed JSON ({_first_line(exc)})", field="body") from None
    if not isinstance(body, dict):
        raise InvalidArgument("must be a JSON object", field="body")
    check_json_tree(body)
    return body


def check_json_tree(body: dict) -> None:
    """Iterative walk (no recursion): depth <= MAX_JSON_DEPTH, valid Unicode everywhere. The
    field named in a refusal is the path to the value (`messages[0].content`)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:  # named by its top-level field (the path is long)
            raise InvalidArgument(
                f"JSON nesting exceeds {MAX_JSON_DEPTH} levels", field=re.split(r"[.\[]", path, maxsplit=1)[0] or "body"
            )
        if isinstance(node, dict):
            for key, value in node.items():
                check_unicode(key, path or "body")
                stack.append((value, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(node, list):  # scalars other than strings need no check (nor a path):
            for i, v in enumerate(node):  # a token-id prompt is thousands of ints
                if isinstance(v, str | list | dict) or depth >= MAX_JSON_DEPTH:  # (refused when popped)
                    stack.append((v, f"{path}[{i}]", depth + 1))
        elif isinstance(node, str):
            check_unicode(node, path)


def content_length(headers: Mapping[str, str]) -> int | None:
    value = headers.get("content-length")
    if value is None:
        return None
    if not value.isascii() or not value.isdigit():
        raise InvalidArgument("must be a non-negative integer", field="content-length")
    return int(value)


# ---------------------------------------------------------------------------------- helpers


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_name(value: Any) -> str:
    return {
        dict: "an object",
        list: "a list",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(value), "another type")


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else "invalid"


# ------------------------------------------------------------------------------ public errors

# Text that must not reach a client: exception class names, tracebacks, Ray task traces, paths.
_INTERNALS = re.compile(
    r"Traceback|File \"|\b[A-Z][A-Za-z0-9]*(Error|Exception|Exit)\b|ray::|"
    r"\bRay[A-Z]|\.py\b|<class |object at 0x|\n"
)
_GENERIC = {
    "INVALID_ARGUMENT": "invalid request",
    "NOT_FOUND": "not found",
    "RESOURCE_EXHAUSTED": "the server is at capacity; retry later",
    "DEADLINE_EXCEEDED": "the deadline passed before the request finished",
    "UNAVAILABLE": "no worker could serve the request right now; retry",
    "CANCELLED": "the request was cancelled",
    "UNAUTHENTICATED": "missing or invalid API key",
}
MAX_MESSAGE_CHARS = 500


def public_message(exc: Exception, request_id: str | None = None) -> str:
    """The message a client may see for `exc`. Internal errors and messages that carry
    internals become a generic message with the request id (the details go to the log)."""
    code = getattr(exc, "code", "INTERNAL")
    message = str(exc)
    if code in _GENERIC and len(message) <= MAX_MESSAGE_CHARS and not _INTERNALS.search(message):
        return message.encode("utf-8", "backslashreplace").decode("utf-8")  # no lone surrogate
    where = f" (request id {request_id})" if request_id else ""
    log.warning("request %s: %s answered with a generic message: %r", request_id or "-", code, message)
    return _GENERIC.get(code, "internal server error") + where
