"""Shared by the sync and async clients: request building, stream state, retry/resume rules.

Security: `api_key` is sent as gRPC metadata `authorization: Bearer <key>` on every call;
`tls=True` (system roots) or `tls="ca.pem"` opens a TLS channel.

Retry rules (the server's contract, proto/flashpd.proto); nothing but UNAVAILABLE is retried:
- UNAVAILABLE before any token arrived: send the same request again (same request id), up to
  `max_retries` times with exponential backoff;
- UNAVAILABLE after tokens arrived: resume with `resume_from_token` = tokens received, up to
  `max_resumes` times (the router continues the request on a healthy decode worker, re-prefilling
  prompt + the tokens so far);
- NOT_FOUND on such a resume (the router that ran the stream is gone, or another router replica
  answered): the request continues as a fresh request for the same prompt (text or ids) with
  `continue_ids` = the tokens received, the remaining `max_tokens`, and the prefill credit the
  stream's first chunk reported (the server rebuilds the broken stream's state from the prompt
  boundary: greedy output is the same as unbroken); any other refusal of the resume raises the
  error that broke the stream;
- anything else is raised as its typed error.
The overall `timeout_s` covers every attempt.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import grpc

from flashpd_sdk import _health
from flashpd_sdk._gen import flashpd_pb2 as pb
from flashpd_sdk._gen import flashpd_pb2_grpc as pb_grpc
from flashpd_sdk.errors import FlashpdError, InternalError, InvalidArgument, NotFound, Unavailable
from flashpd_sdk.types import GenerateResult, ResponseFormat, TokenChunk, TokenLogprobs, Tool, ToolCall, Usage

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
TIMELINE_FIELDS = tuple(f.name for f in pb.Timeline.DESCRIPTOR.fields)
USAGE_FIELDS = tuple(f.name for f in pb.Usage.DESCRIPTOR.fields)


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3  # repeats before the first token
    max_resumes: int = 3  # resumes after tokens arrived
    backoff_s: float = 0.1  # first pause; doubles per attempt
    max_backoff_s: float = 2.0

    def pause_s(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**attempt)


DEFAULT_RETRY = RetryPolicy()


def build_request(
    *,
    model: str,
    prompt: str | None,
    prompt_ids: Sequence[int] | None,
    max_tokens: int,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    seed: int | None,
    stop: Sequence[str] | None,
    stop_token_ids: Sequence[int] | None,
    ignore_eos: bool,
    logprobs: int,
    session_id: str | None,
    parent_session_id: str | None,
    request_id: str | None,
    messages: Sequence[dict] | None = None,
    tools: Sequence[Tool | dict] | None = None,
    tool_choice: str | None = None,
    parallel_tool_calls: bool | None = None,
    response_format: ResponseFormat | None = None,
    n: int = 1,
) -> pb.GenerateRequest:
    if sum(x is not None for x in (prompt, prompt_ids, messages)) != 1:
        raise InvalidArgument("exactly one of prompt, prompt_ids and messages is required", field="prompt")
    if isinstance(stop, str):
        stop = [stop]
    msg = pb.GenerateRequest(
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
        stop=stop or (),
        stop_token_ids=stop_token_ids or (),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        session_id=session_id or "",
        parent_session_id=parent_session_id or "",
        request_id=request_id or uuid.uuid4().hex,
    )  # a client id makes the stream resumable
    if prompt is not None:
        msg.prompt = prompt
    elif prompt_ids is not None:
        msg.prompt_ids.ids.extend(prompt_ids)
    else:
        msg.chat.messages.extend(_chat_message(m) for m in messages)
    msg.tools.extend(_tool(t) for t in tools or ())
    msg.tool_choice = tool_choice or ""
    if parallel_tool_calls is not None:
        msg.parallel_tool_calls = parallel_tool_calls
    if response_format is not None:
        rf = response_format
        msg.response_format.CopyFrom(
            pb.ResponseFormat(
                type=rf.type,
                name=rf.name,
                strict=rf.strict,
                schema_json=json.dumps(rf.schema) if rf.schema is not None else "",
            )
        )
    for name, value in (("top_p", top_p), ("top_k", top_k), ("min_p", min_p), ("seed", seed)):
        if value is not None:
            setattr(msg, name, value)
    if n != 1:  # the server checks the range (INVALID_ARGUMENT naming n)
        if not isinstance(n, int) or isinstance(n, bool) or not -(2**31) <= n < 2**31:
            raise InvalidArgument(f"must be an integer, got {n!r}", field="n")
        msg.n = n
    return msg


def _chat_message(m: dict) -> pb.ChatMessage:
    """An OpenAI-shaped message (role, content, tool_call_id, tool_calls)."""
    calls = [
        pb.ToolCall(id=c.get("id", ""), name=c["function"]["name"], arguments=c["function"].get("arguments", "{}"))
        if isinstance(c, dict)
        else pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
        for c in m.get("tool_calls") or ()
    ]
    return pb.ChatMessage(
        role=m.get("role", ""),
        content=m.get("content") or "",
        tool_call_id=m.get("tool_call_id", ""),
        name=m.get("name", ""),
        tool_calls=calls,
    )


def _tool(t: Tool | dict) -> pb.Tool:
    if isinstance(t, dict):  # OpenAI's {"type": "function", "function": {...}}
        fn = t.get("function", t)
        t = Tool(fn["name"], fn.get("description", ""), fn.get("parameters"), bool(fn.get("strict", False)))
    return pb.Tool(
        name=t.name,
        description=t.description,
        strict=t.strict,
        parameters_json=json.dumps(t.parameters) if t.parameters is not None else "",
    )


Action = Literal["retry", "resume", "raise"]


class StreamState:
    """What one logical generate call received so far, across retries and resumes."""

    def __init__(self, request: pb.GenerateRequest, policy: RetryPolicy, timeout_s: float | None) -> None:
        self.request, self.policy = request, policy
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.output_ids: list[int] = []
        self.text_parts: list[str] = []
        self.result: GenerateResult | None = None
        self.retries = self.resumes = 0
        self.broken_by: FlashpdError | None = None  # the error a pending resume recovers from
        self.base = 0  # tokens received before the current server-side request began
        self.continuations = 0  # fresh requests for prompt + tokens (the router forgot us)
        self.prefill_credit: int | None = None  # the stream's first chunk said (a continuation
        # sends it back, so the server recomputes the same prompt KV)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def next_request(self) -> pb.GenerateRequest:
        msg = pb.GenerateRequest()
        msg.CopyFrom(self.request)
        if self.base == 0:
            msg.resume_from_token = len(self.output_ids)
            return msg
        # a continuation: the prompt, the tokens received before it began, the rest of the budget
        msg.continue_ids.ids.extend(self.output_ids[: self.base])
        if self.prefill_credit is not None:
            msg.continue_prefill_credit_tokens = self.prefill_credit
        msg.max_tokens = self.request.max_tokens - self.base
        msg.request_id = f"{self.request.request_id}@c{self.continuations}"
        msg.resume_from_token = len(self.output_ids) - self.base
        return msg

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def on_response(self, resp: pb.GenerateResponse) -> TokenChunk | None:
        """A chunk to hand out, or None when the final message arrived."""
        self.broken_by = None
        if resp.WhichOneof("kind") == "chunk":
            chunk = chunk_from_proto(resp.chunk, self.base)
            if not self.output_ids and resp.chunk.HasField("prefill_credit_tokens"):
                self.prefill_credit = resp.chunk.prefill_credit_tokens
            if chunk.index != len(self.output_ids):
                raise InternalError(f"chunk index {chunk.index} != {len(self.output_ids)} tokens received")
            self.output_ids.extend(chunk.token_ids)
            self.text_parts.append(chunk.text)
            return chunk
        if resp.WhichOneof("kind") != "final":
            raise InternalError("empty GenerateResponse")
        self.text_parts.append(resp.final.text)
        self.result = self._result(resp.final)
        return None

    @property
    def done(self) -> bool:
        """Every Final the stream owes arrived."""
        return self.result is not None

    @property
    def choices(self) -> tuple[GenerateResult, ...]:
        return () if self.result is None else (self.result,)

    @property
    def total_usage(self) -> Usage | None:
        return None if self.result is None else self.result.usage

    def on_stream_end(self) -> None:
        if self.result is None:
            raise InternalError("the stream ended without a final message")

    def decide(self, error: FlashpdError) -> Action:
        """What to do about `error` (counts the attempt; sleep `pause_s()` before acting)."""
        if not isinstance(error, Unavailable) or self.remaining_s() == 0.0:
            return "raise"
        if not self.output_ids and self.retries < self.policy.max_retries:
            self.retries += 1
            return "retry"
        if self.output_ids and self.resumes < self.policy.max_resumes:
            self.resumes += 1
            self.broken_by = self.broken_by or error
            return "resume"
        return "raise"

    def decide_refusal(self, error: FlashpdError) -> Action:
        """A resume was refused (`error`): continue as a fresh request when possible."""
        can_continue = (
            isinstance(error, NotFound)
            and self.broken_by is not None
            and self.request.HasField("max_tokens")
            and len(self.output_ids) < self.request.max_tokens
            and self.continuations < self.policy.max_resumes
            and self.remaining_s() != 0.0
        )
        if not can_continue:
            return "raise"
        self.continuations += 1
        self.base = len(self.output_ids)
        return "resume"

    def reported(self, error: FlashpdError) -> FlashpdError:
        """The error to raise: when a resume attempt failed because the server cannot resume
        this request, the error that broke the stream is the one that matters."""
        if self.broken_by is not None and not isinstance(error, Unavailable):
            return self.broken_by
        return error

    def next_action(self, error: FlashpdError) -> Action:
        """Retry, resume or raise after a failed call."""
        action = self.decide(error)
        if action == "raise" and self.broken_by is not None:
            action = self.decide_refusal(error)
        return action

    def pause_s(self) -> float:
        return self.policy.pause_s(max(0, self.retries + self.resumes - 1))

    def _result(
        self, final: pb.Final, output_ids: Sequence[int] | None = None, text_parts: Sequence[str] | None = None
    ) -> GenerateResult:
        output_ids = self.output_ids if output_ids is None else output_ids
        text_parts = self.text_parts if text_parts is None else text_parts
        return GenerateResult(
            request_id=final.request_id or self.request_id,
            output_ids=tuple(output_ids),
            text="".join(text_parts),
            finish_reason=FINISH_REASONS.get(final.finish_reason, "unspecified"),
            usage=Usage(**{f: getattr(final.usage, f) for f in USAGE_FIELDS}),
            timeline={f: getattr(final.timeline, f) for f in TIMELINE_FIELDS},
            prefill_worker=final.prefill_worker,
            decode_worker=final.decode_worker,
            retries=self.retries,
            resumes=self.resumes,
            tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in final.tool_calls),
            content=final.content if final.tool_calls else None,
            choice_index=final.choice_index,
        )


class ChoicesState(StreamState):
    """n > 1 choices in one stream (the server interleaves them, `choice_index`): per-choice
    tokens and text, one GenerateResult per choice, the request's usage from the last Final.
    Such a stream is retried before its first token (under a fresh request id: the server
    forgets a failed n > 1 request's choices) and never resumed after it."""

    def __init__(self, request: pb.GenerateRequest, policy: RetryPolicy, timeout_s: float | None) -> None:
        super().__init__(request, policy, timeout_s)
        self.n = request.n  # checked by the server: storage grows only with what arrives
        self._ids: dict[int, list[int]] = {0: self.output_ids}  # choice 0's: the shared rule
        self._texts: dict[int, list[str]] = {0: self.text_parts}
        self._results: dict[int, GenerateResult] = {}
        self._total: Usage | None = None

    @property
    def choices(self) -> tuple[GenerateResult, ...]:
        if not self.done:
            return ()
        return tuple(self._results[i] for i in range(self.n))

    @property
    def total_usage(self) -> Usage | None:
        return self._total

    def next_request(self) -> pb.GenerateRequest:
        msg = pb.GenerateRequest()
        msg.CopyFrom(self.request)
        if self.retries:
            msg.request_id = f"{self.request.request_id}@r{self.retries}"
        return msg

    def on_response(self, resp: pb.GenerateResponse) -> TokenChunk | None:
        kind = resp.WhichOneof("kind")
        if kind == "chunk":
            i = self._choice(resp.chunk.choice_index)
            chunk = chunk_from_proto(resp.chunk)
            ids = self._ids.setdefault(i, [])
            if chunk.index != len(ids):
                raise InternalError(f"choice {i}: chunk index {chunk.index} != {len(ids)} tokens received")
            ids.extend(chunk.token_ids)
            self._texts.setdefault(i, []).append(chunk.text)
            return chunk
        if kind != "final":
            raise InternalError("empty GenerateResponse")
        i = self._choice(resp.final.choice_index)
        texts = self._texts.setdefault(i, [])
        texts.append(resp.final.text)
        self._results[i] = self._result(resp.final, self._ids.get(i, []), texts)
        if len(self._results) == self.n:
            if not resp.final.HasField("total_usage"):
                raise InternalError("the last Final of an n > 1 stream lacks total_usage")
            self._total = Usage(**{f: getattr(resp.final.total_usage, f) for f in USAGE_FIELDS})
            self.result = self._results[0]
        return None

    def _choice(self, index: int) -> int:
        if index >= self.n or (index in self._results):
            raise InternalError(f"unexpected message for choice {index} of {self.n}")
        return index

    def decide(self, error: FlashpdError) -> Action:
        if not isinstance(error, Unavailable) or self.remaining_s() == 0.0:
            return "raise"
        received = any(self._ids.values()) or self._results
        if not received and self.retries < self.policy.max_retries:
            self.retries += 1
            return "retry"
        return "raise"

    def next_action(self, error: FlashpdError) -> Action:
        return self.decide(error)


def chunk_from_proto(msg: pb.TokenChunk, base: int = 0) -> TokenChunk:
    return TokenChunk(
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        index=base + msg.index,
        logprobs=tuple(
            TokenLogprobs(lp.logprob, tuple(zip(lp.top_ids, lp.top_logprobs, strict=True))) for lp in msg.logprobs
        ),
        choice_index=msg.choice_index,
    )


CHANNEL_OPTIONS_BASE = (
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),  # long quiet streams (a long prefill) keep pinging
)


def channel_options(keepalive_s: float, tls_server_name: str | None = None) -> list[tuple]:
    options: list[tuple] = [("grpc.keepalive_time_ms", int(keepalive_s * 1000)), *CHANNEL_OPTIONS_BASE]
    if tls_server_name:  # the name the server's certificate carries, when it is not the target's
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return options


def channel_credentials(tls: bool | str, credentials: grpc.ChannelCredentials | None) -> grpc.ChannelCredentials | None:
    """TLS credentials: `tls=True` trusts the system roots, `tls="ca.pem"` that root certificate
    (PEM file); `credentials` (any grpc.ChannelCredentials) wins over both."""
    if credentials is not None:
        return credentials
    if tls is False or tls is None:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    if not isinstance(tls, str) or not tls:
        raise InvalidArgument("must be True, False or the path of a PEM root certificate", field="tls")
    try:
        with open(tls, "rb") as f:
            root = f.read()
    except OSError as exc:
        raise InvalidArgument(f"cannot read the root certificate {tls!r}: {exc.strerror}", field="tls") from None
    return grpc.ssl_channel_credentials(root_certificates=root)


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Sent with every call: `authorization: Bearer <key>` when an API key is given."""
    if api_key is None:
        return ()
    if not isinstance(api_key, str) or not api_key or any(not 33 <= ord(c) < 127 for c in api_key):
        raise InvalidArgument("must be a non-empty printable ASCII string without spaces", field="api_key")
    return (("authorization", f"Bearer {api_key}"),)


class ClientCore:
    """What the sync and async clients share: stubs on a channel, defaults, stream state."""

    def _attach(
        self, channel, default_timeout_s: float | None, retry: RetryPolicy, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self._channel = channel
        self._metadata = metadata
        self._stub = pb_grpc.GenerationStub(channel)
        self._health = channel.unary_unary(
            _health.CHECK_METHOD,
            request_serializer=_health.HealthCheckRequest.SerializeToString,
            response_deserializer=_health.HealthCheckResponse.FromString,
        )
        self.default_timeout_s, self.retry = default_timeout_s, retry

    def _stream_state(self, timeout_s: float | None, **request_fields) -> StreamState:
        timeout = timeout_s if timeout_s is not None else self.default_timeout_s
        request = build_request(**request_fields)
        cls = ChoicesState if request.HasField("n") and request.n > 1 else StreamState
        return cls(request, self.retry, timeout)
