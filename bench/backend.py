"""The driver's seam to a server: one streaming generate call, plus the flashpd SDK adapter.

The driver only needs `Backend.generate(call, on_tokens) -> Completion`: the backend calls
`on_tokens(ids)` as each chunk of output ids arrives (the driver timestamps them) and returns the
final usage. Transport failures are raised as BackendError; anything else is a bug and propagates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

OnTokens = Callable[[Sequence[int]], None]


@dataclass(frozen=True)
class GenerateCall:
    prompt_ids: list[int]
    max_tokens: int
    session_id: str
    parent_session_id: str | None
    timeout_s: float


@dataclass(frozen=True)
class Completion:
    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_prefill: int
    cached_tokens_decode: int
    prefill_worker: str
    decode_worker: str
    timeline: dict[str, float] = field(default_factory=dict)
    # speculative decoding (the usage's figures): drafts verified, accepted, verify steps; and the
    # benchmark's forced acceptance length (> 0: outputs are not the model's)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_steps: int = 0
    forced_acceptance_length: float = 0.0


class BackendError(Exception):
    """A request failed at the server or on the wire; `kind` names the failure class."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class Backend(Protocol):
    async def generate(self, call: GenerateCall, on_tokens: OnTokens) -> Completion: ...

    async def aclose(self) -> None: ...


class SdkBackend:
    """Backend over `flashpd_sdk.AsyncClient` (greedy, ignore_eos, session ids on every call)."""

    def __init__(self, client: Any, error_type: type[BaseException]) -> None:
        self._client = client
        self._error_type = error_type

    @classmethod
    def connect(cls, target: str) -> SdkBackend:
        from flashpd_sdk import AsyncClient
        from flashpd_sdk.errors import FlashpdError

        return cls(AsyncClient(target), FlashpdError)

    async def generate(self, call: GenerateCall, on_tokens: OnTokens) -> Completion:
        stream = self._client.generate(
            prompt_ids=call.prompt_ids,
            max_tokens=call.max_tokens,
            ignore_eos=True,
            session_id=call.session_id,
            parent_session_id=call.parent_session_id,
            temperature=0.0,
            timeout_s=call.timeout_s,
        )
        try:
            async for chunk in stream:
                on_tokens(chunk.token_ids)
            result = stream.result
        except self._error_type as exc:
            raise BackendError(type(exc).__name__, str(exc)) from exc
        except asyncio.CancelledError:
            await stream.aclose()  # Abort on the server, so neither leg keeps the request
            raise
        return _completion(result)

    async def aclose(self) -> None:
        await self._client.close()


def _completion(result: Any) -> Completion:
    usage = result.usage
    return Completion(
        request_id=result.request_id,
        finish_reason=result.finish_reason,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        cached_tokens_prefill=usage.cached_tokens_prefill,
        cached_tokens_decode=usage.cached_tokens_decode,
        prefill_worker=result.prefill_worker,
        decode_worker=result.decode_worker,
        timeline=dict(result.timeline),
        draft_tokens=usage.draft_tokens,
        accepted_draft_tokens=usage.accepted_draft_tokens,
        draft_steps=usage.draft_steps,
        # a 32-bit float on the wire (3.51 arrives as 3.5099999...): the setting had <= 4 decimals
        forced_acceptance_length=round(usage.forced_acceptance_length, 4),
    )
