"""OpenAI-compatible request parsing and response shapes for `/v1/completions` and
`/v1/chat/completions` (streaming as SSE chunks, usage with `prompt_tokens_details.cached_tokens`).

Requests are validated field by field through the edge validation model (`validation.py`, shared
with gRPC); each error names the field (the OpenAI `param`). Parameters flashpd does not
implement are refused when set to anything but their neutral value (`response_format` `{"type":
"text"}`, `n` 1, ...) rather than silently ignored; other unknown fields are ignored, as vLLM
does. Defaults follow OpenAI here (temperature 1.0; chat max_tokens = the rest of the context),
unlike the gRPC API (greedy, 16 tokens). Roles: system, developer (OpenAI's successor of system,
treated as system), user, assistant. Extensions follow vLLM's names (`top_k`, `min_p`,
`stop_token_ids`, `ignore_eos`); the final response/chunk carries a `flashpd` object with the
timeline, workers and per-tier cached tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from flashpd.services.api import FinalEvent, InternalRequest, InvalidArgument, ServiceError, TokenEvent, Usage
from flashpd.services.router import dsml
from flashpd.services.router import validation as v
from flashpd.services.router.agent_fields import AgentOptions, agent_options
from flashpd.services.router.convert import (
    DEFAULT_MAX_TOKENS,
    ModelTable,
    ServedModel,
    check_context,
    check_prompt_ids,
    deepseek_chat_prompt,
    new_request_id,
)
from flashpd.services.router.text import Tokenizer

log = logging.getLogger(__name__)

Kind = Literal["completion", "chat"]
SESSION_HEADER = "x-session-id"
PARENT_SESSION_HEADER = "x-parent-session-id"
REQUEST_ID_HEADER = "x-request-id"
OPENAI_ERROR_TYPES = {
    "INVALID_ARGUMENT": "invalid_request_error",
    "NOT_FOUND": "not_found_error",
    "RESOURCE_EXHAUSTED": "rate_limit_error",
    "DEADLINE_EXCEEDED": "timeout_error",
    "UNAVAILABLE": "service_unavailable_error",
    "CANCELLED": "cancelled_error",
    "UNAUTHENTICATED": "authentication_error",
    "INTERNAL": "internal_error",
}


def _zero(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == 0


# parameter -> is the value neutral (i.e. flashpd does what OpenAI would do with it)
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "n": lambda x: x == 1 and type(x) is int,
    "best_of": lambda x: x == 1 and type(x) is int,
    "echo": lambda x: x is False,
    "suffix": lambda x: x == "",
    "presence_penalty": _zero,
    "frequency_penalty": _zero,
    "logit_bias": lambda x: x == {},
    "tools": lambda x: x == [],
    "functions": lambda x: x == [],
    "function_call": lambda x: x == "none",
    "tool_choice": lambda x: x in ("none", "auto"),
    "response_format": lambda x: x == {"type": "text"},
    "modalities": lambda x: x == ["text"],
    "audio": lambda x: False,
    "prediction": lambda x: False,
}
# Implemented (agent_fields.py): for chat all of them, for completions only n.
AGENT_FIELDS = {"chat": frozenset({"n", "tools", "tool_choice", "response_format"}), "completion": frozenset({"n"})}
# Fields accepted and ignored, with their type checked.
IGNORED: dict[str, Callable[[Any], bool]] = {
    "user": lambda x: isinstance(x, str),
    "metadata": lambda x: isinstance(x, dict),
    "store": lambda x: isinstance(x, bool),
    "service_tier": lambda x: isinstance(x, str),
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
    agent: AgentOptions = AgentOptions()  # tools, response_format, n


def parse_json(raw: bytes, max_bytes: int = v.MAX_BODY_BYTES) -> dict:
    return v.parse_json_body(raw, max_bytes=max_bytes)


def request_id_from(headers: Mapping[str, str]) -> str:
    """The client's `x-request-id` (checked) or a new id."""
    return v.as_id(headers.get(REQUEST_ID_HEADER), REQUEST_ID_HEADER) or new_request_id()


def completion_request(
    body: Mapping, headers: Mapping[str, str], models: ModelTable, tokenizer: Tokenizer, request_id: str | None = None
) -> OpenAIRequest:
    model = _model(body, models)
    _check_unsupported(body, AGENT_FIELDS["completion"])
    if body.get("parallel_tool_calls") is not None:
        raise InvalidArgument("is only supported on chat completions", field="parallel_tool_calls")
    agent = agent_options(body, chat=False)
    prompt_ids = _completion_prompt(body.get("prompt"), model, tokenizer)
    logprobs = _opt(body, "logprobs", 0, v.as_logprobs)
    max_tokens = _opt(body, "max_tokens", DEFAULT_MAX_TOKENS, _max_tokens)
    check_context(model, len(prompt_ids), max_tokens, "prompt")
    sampling = _sampling(body, model, max_tokens, logprobs)
    return _request("completion", body, headers, model, prompt_ids, sampling, logprobs, logprobs > 0, request_id, agent)


def chat_request(
    body: Mapping, headers: Mapping[str, str], models: ModelTable, tokenizer: Tokenizer, request_id: str | None = None
) -> OpenAIRequest:
    model = _model(body, models)
    _check_unsupported(body, AGENT_FIELDS["chat"])
    agent = agent_options(body, chat=True)
    messages = _messages(body, model)
    prompt_ids = check_prompt_ids(_chat_prompt_ids(messages, agent, tokenizer), model, "messages")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _opt(body, field, None, _max_tokens)
    if max_tokens is None:
        max_tokens = max(1, model.context_tokens - len(prompt_ids))
    check_context(model, len(prompt_ids), max_tokens, "messages", max_tokens_field=field)
    want, top = _chat_logprobs(body)
    sampling = dataclasses.replace(_sampling(body, model, max_tokens, max(top, 1) if want else 0), guided=agent.guided)
    return _request("chat", body, headers, model, prompt_ids, sampling, top, want, request_id, agent)


def _messages(body: Mapping, model: ServedModel) -> list:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("must be a non-empty list of messages", field="messages")
    if len(messages) > v.MAX_MESSAGES:
        raise InvalidArgument(f"must hold at most {v.MAX_MESSAGES} messages, got {len(messages)}", field="messages")
    v.check_text_budget(_content_chars(messages), model.context_tokens, "messages")
    return messages


def _chat_prompt_ids(messages: list, agent: AgentOptions, tokenizer: Tokenizer) -> list[int]:
    """Agent turns, tools or a response format: the DSML template (`convert.py`); else the
    tokenizer's own chat template."""
    if agent.prompt_tools or agent.response_schema is not None or _has_agent_turns(messages):
        return tokenizer.encode(deepseek_chat_prompt(messages, agent.prompt_tools, agent.response_schema))
    return tokenizer.apply_chat_template(messages)


def _chat_logprobs(body: Mapping) -> tuple[bool, int]:
    """(logprobs wanted, top_logprobs)."""
    want = _opt(body, "logprobs", False, v.as_bool)
    top = _opt(body, "top_logprobs", 0, v.as_logprobs)
    if top and not want:
        raise InvalidArgument("requires logprobs=true", field="top_logprobs")
    return want, top


def _has_agent_turns(messages: list) -> bool:
    return any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages)


def _request(
    kind: Kind,
    body: Mapping,
    headers: Mapping[str, str],
    model: ServedModel,
    prompt_ids: tuple[int, ...],
    sampling,
    top_logprobs: int,
    want_logprobs: bool,
    request_id: str | None,
    agent: AgentOptions,
) -> OpenAIRequest:
    stream = _opt(body, "stream", False, v.as_bool)
    include_usage = _include_usage(body)
    request = InternalRequest(
        request_id=request_id or request_id_from(headers),
        model=model.name,
        prompt_ids=prompt_ids,
        sampling=sampling,
        session_id=v.as_id(headers.get(SESSION_HEADER), SESSION_HEADER),
        parent_session_id=v.as_id(headers.get(PARENT_SESSION_HEADER), PARENT_SESSION_HEADER),
        arrival_unix_s=time.time(),
    )
    return OpenAIRequest(kind, request, model.name, stream, include_usage, top_logprobs, want_logprobs, agent)


def _include_usage(body: Mapping) -> bool:
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidArgument("must be an object", field="stream_options")
    return _opt(options or {}, "include_usage", False, lambda x, _: v.as_bool(x, "stream_options.include_usage"))


def _model(body: Mapping, models: ModelTable) -> ServedModel:
    name = _opt(body, "model", "", lambda x, f: v.as_text(x, f, max_chars=256))
    return models.resolve(name)


def _check_unsupported(body: Mapping, implemented: frozenset[str]) -> None:
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if name in implemented:
            continue
        if value is not None and not neutral(value):
            raise InvalidArgument(f"is not supported by this server (got {v.show(value)})", field=name)
    for name, ok in IGNORED.items():
        value = body.get(name)
        if value is not None and not ok(value):
            raise InvalidArgument(f"has the wrong type (got {v.show(value)})", field=name)


def _content_chars(messages: list) -> int:
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(
                len(p.get("text", "")) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    return total


def _completion_prompt(prompt: Any, model: ServedModel, tokenizer: Tokenizer) -> tuple[int, ...]:
    field = "prompt"
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt, field = prompt[0], "prompt[0]"  # a batch of one
    if isinstance(prompt, str):
        v.as_text(prompt, field, empty_ok=False)
        v.check_text_budget(len(prompt), model.context_tokens, "prompt")
        return check_prompt_ids(tokenizer.encode(prompt), model, "prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if len(prompt) > model.context_tokens:
            raise InvalidArgument(
                f"{len(prompt)} tokens exceed the context limit of {model.context_tokens} tokens", field="prompt"
            )
        return v.token_ids(prompt, "prompt", model.vocab_size)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise InvalidArgument("batched prompts are not supported; send one per request", field="prompt")
    raise InvalidArgument("must be a string or a list of token ids", field="prompt")


def _sampling(body: Mapping, model: ServedModel, max_tokens: int, logprobs: int):
    return v.sampling_params(
        body.get,
        max_tokens=max_tokens,
        logprobs=logprobs,
        vocab_size=model.vocab_size,
        defaults=v.OPENAI_DEFAULTS,
        ignore_eos=_opt(body, "ignore_eos", False, v.as_bool),
    )


def _max_tokens(value: Any, field: str) -> int:
    return v.as_int(value, field, 1, v.MAX_TOKENS)


def _opt(body: Mapping, name: str, default: Any, check: Callable[[Any, str], Any]) -> Any:
    value = body.get(name)
    return default if value is None else check(value, name)


# ------------------------------------------------------------------------------- responses


class ResponseShaper:
    """Turns orchestrator events into OpenAI JSON objects for one request (one choice; `n`
    choices are merged by `merge_choices`). Chat with tools parses DSML tool calls out of the
    text (`dsml.py`): `message.tool_calls` / `delta.tool_calls` and finish_reason "tool_calls";
    malformed markup stays content."""

    def __init__(self, req: OpenAIRequest, tokenizer: Tokenizer, index: int = 0) -> None:
        self.req, self._tok, self.index = req, tokenizer, index
        prefix, self._object = (
            ("cmpl-", "text_completion") if req.kind == "completion" else ("chatcmpl-", "chat.completion")
        )
        self._id = prefix + req.request.request_id
        self._created = int(req.request.arrival_unix_s)
        self._text_offset = 0
        self._calls = dsml.StreamParser() if self._parses_calls else None
        self._num_calls = 0

    @property
    def _parses_calls(self) -> bool:
        return self.req.kind == "chat" and self.req.agent.parses_calls

    def chunks(self, event: TokenEvent | FinalEvent, *, first: bool) -> list[dict]:
        """SSE payloads for one event (the usage chunk comes last when asked for)."""
        if isinstance(event, TokenEvent):
            return [self._chunk(event.text, self._logprobs(event), None, first)]
        if self._calls is not None:
            out = self._call_chunks(event)
        else:
            out = [self._chunk(event.text, None, event.finish_reason, first)]
        out[-1]["flashpd"] = flashpd_extension(event)
        if self.req.include_usage:
            out.append({**self._envelope(chunk=True), "choices": [], "usage": usage(event)})
        return out

    def usage_chunk(self, total: Usage) -> dict:
        """The stream's last chunk when `stream_options.include_usage` is set (n > 1: the
        choices' usage, summed as OpenAI counts it)."""
        return {**self._envelope(chunk=True), "choices": [], "usage": usage_dict(total)}

    def response(self, tokens: Sequence[TokenEvent], final: FinalEvent) -> dict:
        return {
            **self._envelope(chunk=False),
            "choices": [self.choice(tokens, final)],
            "usage": usage(final),
            "flashpd": flashpd_extension(final),
        }

    def choice(self, tokens: Sequence[TokenEvent], final: FinalEvent) -> dict:
        text = "".join(e.text for e in tokens) + final.text
        logprobs = self._merge_logprobs([self._logprobs(e) for e in tokens])
        reason: str = final.finish_reason
        if self.req.kind == "completion":
            choice = {"index": self.index, "text": text, "logprobs": logprobs}
        else:
            message: dict = {"role": "assistant", "content": text}
            calls = None
            if self._parses_calls:
                content, calls = dsml.parse(text)
            if calls:
                calls = calls if self.req.agent.parallel_tool_calls else calls[:1]
                message = {
                    "role": "assistant",
                    "content": content or None,
                    "tool_calls": [c.as_openai() for c in calls],
                }
                reason = "tool_calls" if reason == "stop" else reason
            choice = {"index": self.index, "message": message, "logprobs": logprobs}
        choice["finish_reason"] = reason
        return choice

    def _call_chunks(self, final: FinalEvent) -> list[dict]:
        """The end of a streamed chat whose text is parsed for tool calls."""
        assert self._calls is not None
        content, calls = self._calls.push(final.text)
        more, rest = self._calls.finish()
        out = [self._delta_chunk(content + more, calls + rest)]
        reason: str = final.finish_reason
        if self._num_calls and reason == "stop":
            reason = "tool_calls"
        out.append(
            {
                **self._envelope(chunk=True),
                "choices": [{"index": self.index, "delta": {}, "logprobs": None, "finish_reason": reason}],
            }
        )
        return out

    def _envelope(self, *, chunk: bool) -> dict:
        obj = self._object + (".chunk" if chunk and self.req.kind == "chat" else "")
        return {"id": self._id, "object": obj, "created": self._created, "model": self.req.model}

    def _chunk(self, text: str, logprobs: dict | None, finish: str | None, first: bool) -> dict:
        if self.req.kind == "completion":
            choice = {"index": self.index, "text": text, "logprobs": logprobs}
        elif self._calls is not None and finish is None:
            content, calls = self._calls.push(text)
            chunk = self._delta_chunk(content, calls, first=first)
            chunk["choices"][0]["logprobs"] = logprobs
            return chunk
        else:
            delta = (
                {"role": "assistant", "content": text}
                if first
                else ({"content": text} if text or finish is None else {})
            )
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs}
        choice["finish_reason"] = finish
        return {**self._envelope(chunk=True), "choices": [choice]}

    def _delta_chunk(self, content: str, calls: list[dsml.ToolCall], first: bool = False) -> dict:
        if not self.req.agent.parallel_tool_calls:
            calls = calls[: max(0, 1 - self._num_calls)]
        delta: dict = {"role": "assistant"} if first else {}
        if content or not calls:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": self._num_calls + k, **c.as_openai()} for k, c in enumerate(calls)]
            self._num_calls += len(calls)
        return {
            **self._envelope(chunk=True),
            "choices": [{"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}],
        }

    def _logprobs(self, event: TokenEvent) -> dict | None:
        if not self.req.want_logprobs or not event.logprobs:
            return None
        pieces = [self._tok.decode([t]) for t in event.token_ids]
        if self.req.kind == "chat":
            return {
                "content": [
                    {
                        **_token_entry(piece, lp.logprob),
                        "top_logprobs": [
                            _token_entry(self._tok.decode([t]), v) for t, v in lp.top[: self.req.top_logprobs]
                        ],
                    }
                    for piece, lp in zip(pieces, event.logprobs, strict=True)
                ]
            }
        offsets = []
        for piece in pieces:
            offsets.append(self._text_offset)
            self._text_offset += len(piece)
        return {
            "tokens": pieces,
            "token_logprobs": [lp.logprob for lp in event.logprobs],
            "top_logprobs": [{self._tok.decode([t]): v for t, v in lp.top} for lp in event.logprobs],
            "text_offset": offsets,
        }

    def _merge_logprobs(self, parts: list[dict | None]) -> dict | None:
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        return {key: [x for p in parts for x in p[key]] for key in parts[0]}


def merge_choices(
    shapers: Sequence[ResponseShaper], results: Sequence[tuple[Sequence[TokenEvent], FinalEvent]]
) -> dict:
    """One response of `n` choices. Usage as OpenAI counts it: the prompt once (choice 0's
    cached tokens), the completion tokens of every choice."""
    first = shapers[0].response(*results[0])
    first["choices"] = [s.choice(*r) for s, r in zip(shapers, results, strict=True)]
    completion = sum(final.usage.completion_tokens for _, final in results)
    first["usage"]["completion_tokens"] = completion
    first["usage"]["total_tokens"] = first["usage"]["prompt_tokens"] + completion
    first["flashpd"]["choices"] = [flashpd_extension(final) for _, final in results]
    return first


def _token_entry(piece: str, logprob: float) -> dict:
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}


def usage(final: FinalEvent) -> dict:
    return usage_dict(final.usage)


def usage_dict(u: Usage) -> dict:
    out = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    if u.draft_steps:  # OpenAI's predicted-output counters, filled by speculative decoding
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": u.accepted_draft_tokens,
            "rejected_prediction_tokens": u.draft_tokens - u.accepted_draft_tokens,
        }
    return out


def flashpd_extension(final: FinalEvent) -> dict:
    return {
        "request_id": final.request_id,
        "prefill_worker": final.prefill_worker,
        "decode_worker": final.decode_worker,
        "cached_tokens_prefill": final.usage.cached_tokens_prefill,
        "cached_tokens_decode": final.usage.cached_tokens_decode,
        "speculative": speculative_usage(final),
        "timeline": final.timeline.as_dict(),
    }


def speculative_usage(final: FinalEvent) -> dict:
    """flashpd's speculative-decoding usage: drafts verified and accepted, verify steps, the
    mean acceptance length (tokens per verify, 1 + accepted / steps; 0 without a verify) and,
    only in a benchmark run, the forced acceptance length (its outputs are not the model's)."""
    u = final.usage
    out = {
        "draft_tokens": u.draft_tokens,
        "accepted_draft_tokens": u.accepted_draft_tokens,
        "draft_steps": u.draft_steps,
        "acceptance_length": 1 + u.accepted_draft_tokens / u.draft_steps if u.draft_steps else 0.0,
    }
    if u.forced_acceptance_length:
        out["forced_acceptance_length"] = u.forced_acceptance_length
    return out


def error_body(exc: ServiceError, request_id: str | None = None) -> dict:
    """OpenAI's error shape; the message is safe to show (see `validation.public_message`)."""
    code = exc.code.lower()
    if isinstance(exc, v.ModelNotFound):
        code = "model_not_found"
    elif exc.code == "UNAUTHENTICATED":
        code = "invalid_api_key"
    error_type = OPENAI_ERROR_TYPES.get(exc.code, "internal_error")
    if exc.http_status in (404, 413):
        error_type = "invalid_request_error"
    return {
        "error": {"message": v.public_message(exc, request_id), "type": error_type, "param": exc.field, "code": code}
    }


def route_error_body(status: int, method: str, path: str) -> dict:
    """Unknown routes (404) and wrong methods (405), in OpenAI's error shape."""
    if status == 405:
        message, code = f"method {method} is not allowed on {_clip(path)}", "method_not_allowed"
    elif status == 404:
        message, code = f"no route {method} {_clip(path)}", "not_found"
    else:
        message, code = f"HTTP {status}", f"http_{status}"
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


def _clip(path: str) -> str:
    safe = re.sub(r"[^\x21-\x7e]", "?", path)
    return safe if len(safe) <= 80 else safe[:77] + "..."
