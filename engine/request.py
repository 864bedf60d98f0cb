"""Request state as the scheduler sees it, and what it hands back per step.

There are no phases: a request knows `token_ids` (prompt + outputs so far) and how many of them
have their KV computed; every step moves `num_computed_tokens` towards `num_tokens`. The newest
sampled token is always known-but-not-computed, so a decoding request computes exactly one token.

The core reads only `max_tokens`, `ignore_eos` and `stop_token_ids` of the sampling parameters
(validated when they were built); a prefill-role request may come without any.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from flashpd.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: blocks reserved, global KV in flight
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, outputs kept, KV to be recomputed
    FINISHED_LENGTH = "finished_length"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_KV_READY = "finished_kv_ready"  # prefill role: the prompt's global KV is computed

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished")


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # EOS (unless ignore_eos), a stop token id, or a stop signal from the runner
    ABORT = "abort"
    KV_READY = "kv_ready"  # prefill role

    @property
    def status(self) -> RequestStatus:
        return _STATUS_OF_REASON[self]


_STATUS_OF_REASON = {
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.KV_READY: RequestStatus.FINISHED_KV_READY,
}


@dataclass(frozen=True)
class Replay:
    """Tokens [from_token, to_token) are recomputed only to rebuild private state (window rings,
    open-group rows): their global KV is already in the blocks, so global-KV writes are
    suppressed, and every layer's window is clipped at from_token."""

    from_token: int
    to_token: int

    def __post_init__(self) -> None:
        if not 0 <= self.from_token < self.to_token:
            raise ValueError(f"empty or negative replay range [{self.from_token}, {self.to_token})")


@dataclass(frozen=True)
class PrefixPolicy:
    """Where a request's prompt KV comes from, for exact continuations of a stream.

    kv_tokens (decode role): the global KV of prompt tokens [0, kv_tokens) arrives from a
    prefill or another decode worker (or is cached here); tokens [kv_tokens, N) are outputs a
    previous decode worker already streamed. This worker replays [kv_tokens - r, kv_tokens) as
    the first worker did, then recomputes [kv_tokens, N) teacher-forced through all layers, so
    its windows and the outputs' global KV are the first worker's (greedy output identical
    to an unbroken run). None: the whole prompt's KV arrives (a fresh request).

        prompt   0 ............... kv_tokens - r ...... kv_tokens ............. N
        KV       [ transferred / cached ......................]
        compute                    [ replay (windows) ]  [ teacher-forced outputs ]

    max_credit_tokens (prefill / colocated roles): use at most this much prefix-cache credit
    (None: any). A continuation's prefill caps it at the credit the original prefill used, so
    its bounded replay on a hit (or its cold run, at 0) recomputes the original KV.
    """

    kv_tokens: int | None = None
    max_credit_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_credit_tokens is not None and self.max_credit_tokens < 0:
            raise ValueError(f"max_credit_tokens must be >= 0, got {self.max_credit_tokens}")


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        session_id: str | None = None,
        arrival_time: float = 0.0,
        prefix: PrefixPolicy | None = None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r}: empty prompt")
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.token_ids: list[int] = list(self.prompt_token_ids)  # prompt + outputs (known tokens)
        self.sampling_params = sampling_params
        p = sampling_params
        self.max_tokens: int | None = None if p is None else p.max_tokens
        self.ignore_eos = False if p is None else p.ignore_eos
        self.stop_token_ids = frozenset(() if p is None else p.stop_token_ids)
        self.session_id = session_id
        self.arrival_time = arrival_time
        self.arrival_order = -1  # FCFS priority, assigned by the scheduler on admission
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix credit at first admission
        self.num_preemptions = 0
        self.replay: Replay | None = None  # set while a replay range is still ahead
        self.fresh_slot = False  # the slot's private state must be reset before the next chunk
        self.prefix = PrefixPolicy() if prefix is None else prefix
        if self.prefix.kv_tokens is not None and not 0 < self.prefix.kv_tokens <= len(self.prompt_token_ids):
            raise ValueError(
                f"request {request_id!r}: kv_tokens {self.prefix.kv_tokens} outside [1, {len(self.prompt_token_ids)}]"
            )

    @property
    def kv_tokens(self) -> int:
        """Prompt tokens whose global KV arrives (or is cached) on a decode worker."""
        k = self.prefix.kv_tokens
        return self.num_prompt_tokens if k is None else k

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"outputs={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    kv_block_ids: tuple[int, ...] = ()  # prefill role, kv_ready: blocks held until release_kv
