"""Plain result types of the flashpd SDK (no protobuf objects leak out of the client)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # of the sampled token
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    text: str  # text released with these tokens (may lag by a token)
    index: int  # offset of token_ids[0] in the completion
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose prefill compute was skipped
    cached_tokens_prefill: int = 0  # ... of which reused by the prefill worker
    cached_tokens_decode: int = 0  # prompt tokens already resident on the decode worker


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    output_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    usage: Usage
    timeline: dict[str, float] = field(default_factory=dict)  # *_ms, see the proto's Timeline
    prefill_worker: str = ""
    decode_worker: str = ""
    retries: int = 0  # attempts repeated before the first token (UNAVAILABLE)
    resumes: int = 0  # times the stream was resumed from a token offset


@dataclass(frozen=True)
class ModelInfo:
    id: str
    context_tokens: int
    vocab_size: int
