"""Plain result types of the flashpd SDK (no protobuf objects leak out of the client)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # of the sampled token
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    text: str  # text released with these tokens (may lag by a token)
    index: int  # offset of token_ids[0] in its choice's completion
    logprobs: tuple[TokenLogprobs, ...] = ()
    choice_index: int = 0  # n > 1: the choice (0..n-1) these tokens belong to


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose prefill compute was skipped
    cached_tokens_prefill: int = 0  # ... of which reused by the prefill worker
    cached_tokens_decode: int = 0  # prompt tokens already resident on the decode worker
    draft_tokens: int = 0  # speculative decoding: drafts verified
    accepted_draft_tokens: int = 0  # ... of which accepted
    draft_steps: int = 0  # verify steps (acceptance length = 1 + accepted / steps)
    forced_acceptance_length: float = 0.0  # > 0: a benchmark forced acceptance (not the model's)


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model made (chat input with tools)."""

    id: str
    name: str
    arguments: str  # a JSON object as text

    def parsed_arguments(self) -> dict:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is the JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict | None = None
    strict: bool = False


@dataclass(frozen=True)
class ResponseFormat:
    """Structured output: `json_object` (any JSON object) or `json_schema` (`schema`)."""

    type: str = "json_object"
    schema: dict | None = None
    name: str = "response"
    strict: bool = True

    @classmethod
    def json_schema(cls, schema: dict, name: str = "response", strict: bool = True):
        return cls("json_schema", schema, name, strict)


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    output_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | "tool_calls"
    usage: Usage
    timeline: dict[str, float] = field(default_factory=dict)  # *_ms, see the proto's Timeline
    prefill_worker: str = ""
    decode_worker: str = ""
    retries: int = 0  # attempts repeated before the first token (UNAVAILABLE)
    resumes: int = 0  # times the stream was resumed from a token offset
    tool_calls: tuple[ToolCall, ...] = ()  # finish_reason "tool_calls": the parsed calls
    content: str | None = None  # with tool calls: the text before them (else None: see text)
    choice_index: int = 0  # n > 1: which choice this is

    def json(self):
        """The text as JSON (a response_format request's output)."""
        return json.loads(self.text)


@dataclass(frozen=True)
class ModelInfo:
    id: str
    context_tokens: int
    vocab_size: int
