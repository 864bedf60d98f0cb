"""OpenAI-compatible request parsing and response shapes for `/v1/completions` and
`/v1/chat/completions` (streaming as SSE chunks, usage with `prompt_tokens_details.cached_tokens`).

Requests are validated field by field; each error names the field (the OpenAI `param`).
Parameters flashpd does not implement are rejected when set to a non-default value rather than
silently ignored. Defaults follow OpenAI here (temperature 1.0; chat max_tokens = the rest of the
context), unlike the gRPC API (greedy, 16 tokens). Extensions follow vLLM's names (`top_k`, `min_p`, `stop_token_ids`,
`ignore_eos`); the final response/chunk carries a `flashpd` object with the timeline, workers and
per-tier cached tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from flashpd.services.api import (
    FinalEvent,
    InternalRequest,
    InvalidArgument,
    SamplingParams,
    ServiceError,
    TokenEvent,
)
from flashpd.services.router.convert import (
    DEFAULT_MAX_TOKENS,
    ModelTable,
    ServedModel,
    check_context,
    check_id,
    check_prompt_ids,
    new_request_id,
)
from flashpd.services.router.text import Tokenizer

Kind = Literal["completion", "chat"]
SESSION_HEADER = "x-session-id"
PARENT_SESSION_HEADER = "x-parent-session-id"
REQUEST_ID_HEADER = "x-request-id"
OPENAI_ERROR_TYPES = {
    "INVALID_ARGUMENT": "invalid_request_error", "NOT_FOUND": "not_found_error",
    "RESOURCE_EXHAUSTED": "rate_limit_error", "DEADLINE_EXCEEDED": "timeout_error",
    "UNAVAILABLE": "service_unavailable_error", "CANCELLED": "cancelled_error",
    "INTERNAL": "internal_error",
}
# parameter -> the only accepted value (None = absent)
UNSUPPORTED_UNLESS = {
    "n": 1, "best_of": 1, "echo": False, "suffix": "", "presence_penalty": 0,
    "frequency_penalty": 0, "logit_bias": {}, "tools": [], "functions": [],
}


@dataclass(frozen=True)
class OpenAIRequest:
    kind: Kind
    request: InternalRequest
    model: str
    stream: bool
    include_usage: bool  # stream_options.include_usage
    top_logprobs: int  # how many alternatives to show (chat) / logprobs (completions)
    want_logprobs: bool


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"malformed JSON ({exc})", field="body") from None
    if not isinstance(body, dict):
        raise InvalidArgument("must be a JSON object", field="body")
    return body


def completion_request(body: Mapping, headers: Mapping[str, str], models: ModelTable,
                       tokenizer: Tokenizer) -> OpenAIRequest:
    model = models.resolve(_str(body, "model", ""))
    prompt_ids = _completion_prompt(body.get("prompt"), model, tokenizer)
    logprobs = _int(body, "logprobs", 0)
    sampling = _sampling(body, _int(body, "max_tokens", DEFAULT_MAX_TOKENS), logprobs)
    return _request("completion", body, headers, model, prompt_ids, sampling, logprobs,
                    logprobs > 0)


def chat_request(body: Mapping, headers: Mapping[str, str], models: ModelTable,
                 tokenizer: Tokenizer) -> OpenAIRequest:
    model = models.resolve(_str(body, "model", ""))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("must be a non-empty list of messages", field="messages")
    prompt_ids = check_prompt_ids(tokenizer.apply_chat_template(messages), model, "messages")
    default_max = max(1, model.context_tokens - len(prompt_ids))
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", default_max)
    want = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0)
    if top and not want:
        raise InvalidArgument("requires logprobs=true", field="top_logprobs")
    sampling = _sampling(body, max_tokens, max(top, 1) if want else 0)
    return _request("chat", body, headers, model, prompt_ids, sampling, top, want)


def _request(kind: Kind, body: Mapping, headers: Mapping[str, str], model: ServedModel,
             prompt_ids: tuple[int, ...], sampling: SamplingParams, top_logprobs: int,
             want_logprobs: bool) -> OpenAIRequest:
    for name, accepted in UNSUPPORTED_UNLESS.items():
        if body.get(name) not in (None, accepted):
            raise InvalidArgument(f"only {accepted!r} is supported", field=name)
    check_context(model, len(prompt_ids), sampling.max_tokens,
                  "prompt" if kind == "completion" else "messages")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidArgument("must be an object", field="stream_options")
    now = time.time()
    request = InternalRequest(
        request_id=check_id(headers.get(REQUEST_ID_HEADER, ""), REQUEST_ID_HEADER)
        or new_request_id(),
        model=model.name, prompt_ids=prompt_ids, sampling=sampling,
        session_id=check_id(headers.get(SESSION_HEADER, ""), SESSION_HEADER),
        parent_session_id=check_id(headers.get(PARENT_SESSION_HEADER, ""), PARENT_SESSION_HEADER),
        arrival_unix_s=now)
    return OpenAIRequest(kind, request, model.name, stream,
                         bool(options.get("include_usage", False)), top_logprobs, want_logprobs)


def _completion_prompt(prompt: Any, model: ServedModel, tokenizer: Tokenizer) -> tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgument("must not be empty", field="prompt")
        return check_prompt_ids(tokenizer.encode(prompt), model, "prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return check_prompt_ids(prompt, model, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise InvalidArgument("batched prompts are not supported; send one per request",
                              field="prompt")
    raise InvalidArgument("must be a string or a list of token ids", field="prompt")


def _sampling(body: Mapping, max_tokens: int, logprobs: int) -> SamplingParams:
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list | tuple)
                                 and all(isinstance(s, str) for s in stop)):
        raise InvalidArgument("must be a string or a list of strings", field="stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
        raise InvalidArgument("must be a list of token ids", field="stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens, temperature=_float(body, "temperature", 1.0),
        top_k=_top_k(body), top_p=_float(body, "top_p", 1.0), min_p=_float(body, "min_p", 0.0),
        seed=_int(body, "seed", None), stop_token_ids=tuple(stop_ids), stop=tuple(stop or ()),
        ignore_eos=_bool(body, "ignore_eos", False), logprobs=logprobs)


def _top_k(body: Mapping) -> int:
    top_k = _int(body, "top_k", 0)
    return 0 if top_k == -1 else top_k  # vLLM spells "off" as -1


def _int(body: Mapping, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"must be an integer, got {value!r}", field=name)
    return value


def _float(body: Mapping, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidArgument(f"must be a number, got {value!r}", field=name)
    return float(value)


def _bool(body: Mapping, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(f"must be true or false, got {value!r}", field=name)
    return value


def _str(body: Mapping, name: str, default: str) -> str:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise InvalidArgument(f"must be a string, got {value!r}", field=name)
    return value


# ------------------------------------------------------------------------------- responses


class ResponseShaper:
    """Turns orchestrator events into OpenAI JSON objects for one request."""

    def __init__(self, req: OpenAIRequest, tokenizer: Tokenizer) -> None:
        self.req, self._tok = req, tokenizer
        prefix, self._object = (("cmpl-", "text_completion") if req.kind == "completion"
                                else ("chatcmpl-", "chat.completion"))
        self._id = prefix + req.request.request_id
        self._created = int(req.request.arrival_unix_s)
        self._text_offset = 0

    def chunks(self, event: TokenEvent | FinalEvent, *, first: bool) -> list[dict]:
        """SSE payloads for one event (the usage chunk comes last when asked for)."""
        if isinstance(event, TokenEvent):
            return [self._chunk(event.text, self._logprobs(event), None, first)]
        out = [self._chunk(event.text, None, event.finish_reason, first)]
        out[-1]["flashpd"] = flashpd_extension(event)
        if self.req.include_usage:
            out.append({**self._envelope(chunk=True), "choices": [], "usage": usage(event)})
        return out

    def response(self, tokens: Sequence[TokenEvent], final: FinalEvent) -> dict:
        text = "".join(e.text for e in tokens) + final.text
        logprobs = self._merge_logprobs([self._logprobs(e) for e in tokens])
        if self.req.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": logprobs}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs}
        choice["finish_reason"] = final.finish_reason
        return {**self._envelope(chunk=False), "choices": [choice], "usage": usage(final),
                "flashpd": flashpd_extension(final)}

    def _envelope(self, *, chunk: bool) -> dict:
        obj = self._object + (".chunk" if chunk and self.req.kind == "chat" else "")
        return {"id": self._id, "object": obj, "created": self._created, "model": self.req.model}

    def _chunk(self, text: str, logprobs: dict | None, finish: str | None, first: bool) -> dict:
        if self.req.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": logprobs}
        else:
            delta = {"role": "assistant", "content": text} if first else (
                {"content": text} if text or finish is None else {})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs}
        choice["finish_reason"] = finish
        return {**self._envelope(chunk=True), "choices": [choice]}

    def _logprobs(self, event: TokenEvent) -> dict | None:
        if not self.req.want_logprobs or not event.logprobs:
            return None
        pieces = [self._tok.decode([t]) for t in event.token_ids]
        if self.req.kind == "chat":
            return {"content": [
                {**_token_entry(piece, lp.logprob), "top_logprobs": [
                    _token_entry(self._tok.decode([t]), v) for t, v in lp.top[: self.req.top_logprobs]]}
                for piece, lp in zip(pieces, event.logprobs, strict=True)]}
        offsets = []
        for piece in pieces:
            offsets.append(self._text_offset)
            self._text_offset += len(piece)
        return {"tokens": pieces, "token_logprobs": [lp.logprob for lp in event.logprobs],
                "top_logprobs": [{self._tok.decode([t]): v for t, v in lp.top}
                                 for lp in event.logprobs],
                "text_offset": offsets}

    def _merge_logprobs(self, parts: list[dict | None]) -> dict | None:
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        return {key: [x for p in parts for x in p[key]] for key in parts[0]}


def _token_entry(piece: str, logprob: float) -> dict:
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}


def usage(final: FinalEvent) -> dict:
    u = final.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def flashpd_extension(final: FinalEvent) -> dict:
    return {"request_id": final.request_id, "prefill_worker": final.prefill_worker,
            "decode_worker": final.decode_worker,
            "cached_tokens_prefill": final.usage.cached_tokens_prefill,
            "cached_tokens_decode": final.usage.cached_tokens_decode,
            "timeline": final.timeline.as_dict()}


def error_body(exc: ServiceError) -> dict:
    return {"error": {"message": str(exc), "type": OPENAI_ERROR_TYPES[exc.code],
                      "param": exc.field, "code": exc.code.lower()}}
