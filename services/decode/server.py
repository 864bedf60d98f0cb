"""DecodeWorker: the engine in decode role behind the `api.DecodeServerApi` contract.

    reserve(req)   blocks for the chunks this worker lacks (its own prefix hit reused), a
                   receiver lease for them, and a ticket for the prefill worker
    generate(req)  waits for the KV (completion notices polled on the engine thread), replays
                   the last 128 prompt tokens, streams tokens with continuous batching
    abort(rid)     frees the blocks and the lease; idempotent

Fencing: every reservation gets its own incarnation token `<worker incarnation>.<n>`; the
receiver only accepts a completion notice carrying the token of the live reservation, so a
write from a superseded or cancelled prefill never admits a request. NIXL writes are one-sided:
the bytes of a late write still land. So a request aborted (or whose lease expired) while its KV
was in flight keeps its blocks in quarantine for `transfer_timeout_s` (after which the prefill
side has given up on the write) before they return to the pool: no reused block is overwritten.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator

from flashpd.engine.llm_engine import LLMEngine
from flashpd.engine.request import RequestStatus
from flashpd.engine.sampling import SamplingParams
from flashpd.services.api import (
    Event,
    FinalEvent,
    InternalRequest,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Ticket,
    Timeline,
    TokenEvent,
    TokenLogprobs,
    Unavailable,
    Usage,
    WorkerRef,
)
from flashpd.services.worker_common import (
    EngineWorker,
    WorkerConfig,
    make_receiver,
    ms_since,
)

log = logging.getLogger(__name__)


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(self, engine: LLMEngine, config: WorkerConfig, ref: WorkerRef):
        super().__init__(engine, config, ref)
        self.receiver = make_receiver(config.transfer_backend, self.contract, self.pools,
                                      ref.incarnation)
        self.engine.hooks.append(self._poll_transfers)
        self._tokens = itertools.count()
        self._reserved_at: dict[str, float] = {}
        self._arrived_at: dict[str, float] = {}
        self._quarantine: dict[str, float] = {}  # request id -> monotonic release time

    # ------------------------------------------------------------------ api
    async def reserve(self, req: InternalRequest) -> Ticket:
        if self.draining:
            raise Unavailable(f"{self.ref.worker_id} is draining")
        self._check_request(req)
        params = SamplingParams.from_dict(req.sampling.to_dict())
        token = f"{self.ref.incarnation}.{next(self._tokens)}"
        lease = time.time() + self.config.lease_s
        self.engine.open_stream(req.request_id)

        def reserve_on_loop(e: LLMEngine):
            r = e.reserve(req.request_id, req.prompt_ids, params, req.session_id)
            if r is None:
                return None
            if r.missing_block_ids:
                self.receiver.expect(req.request_id, list(r.missing_block_ids), lease, token)
            else:
                e.kv_arrived(req.request_id)  # every chunk already resident: replay at once
            return r

        try:
            reservation = await self.engine.call(reserve_on_loop)
        except BaseException:
            await self.engine.call(lambda e: e.abort(req.request_id))
            self.engine.close_stream(req.request_id, abort=False)
            raise
        if reservation is None:
            self.engine.close_stream(req.request_id, abort=False)
            raise ResourceExhausted(f"{self.ref.worker_id}: no room for {req.prompt_tokens} tokens")
        self._reserved_at[req.request_id] = time.monotonic()
        return Ticket(
            request_id=req.request_id,
            decode_worker_id=self.ref.worker_id,
            incarnation=token,
            decode_cached_tokens=min(reservation.first_missing_token, req.prompt_tokens),
            transfer_descriptor=self.receiver.descriptor(),
            dst_block_ids=tuple(reservation.missing_block_ids),
            first_block_index=reservation.num_cached_blocks,
            lease_deadline_unix_s=lease,
        )

    async def generate(self, req: InternalRequest) -> AsyncIterator[Event]:
        rid = req.request_id
        t0 = time.monotonic()
        if not self.engine.has_stream(rid):
            raise NotFound(f"request {rid!r} was not reserved on {self.ref.worker_id}")
        stream = self.engine.stream(rid)
        try:
            async for event in self._events(rid, stream, t0):
                yield event
        finally:  # close the engine stream now (aborting an unfinished request), not at GC
            await stream.aclose()

    async def _events(self, rid: str, stream, t0: float) -> AsyncIterator[Event]:
        first_s = None
        index = 0
        async for out in stream:
            if out.new_token_ids:
                first_s = first_s or time.monotonic()
                lps = tuple(TokenLogprobs(s.logprob, s.top_logprobs) for s in out.logprobs)
                yield TokenEvent(out.new_token_ids, index, lps)
                index += len(out.new_token_ids)
            if out.finished:
                arrived = self._arrived_at.pop(rid, t0)
                self._reserved_at.pop(rid, None)
                replay_ms = 1e3 * ((first_s or time.monotonic()) - max(arrived, t0))
                yield FinalEvent(
                    finish_reason=out.finish_reason,  # type: ignore[arg-type]
                    usage=Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.output_tokens,
                                cached_tokens_decode=out.cached_tokens),
                    timeline=Timeline(replay_ms=replay_ms, e2e_ms=ms_since(t0)),
                    decode_worker=self.ref.worker_id, request_id=rid)

    async def abort(self, request_id: str) -> bool:
        def abort_on_loop(e: LLMEngine) -> bool:
            self.receiver.cancel(request_id)
            return self._abort_or_quarantine(e, request_id)

        found = await self.engine.call(abort_on_loop)
        self.engine.close_stream(request_id, abort=True)
        self._reserved_at.pop(request_id, None)
        self._arrived_at.pop(request_id, None)
        return found

    def _poll_transfers(self, e: LLMEngine) -> None:
        for rid in self.receiver.poll_completed():
            self._arrived_at[rid] = time.monotonic()
            e.kv_arrived(rid)
        for rid in self.receiver.expire(time.time()):
            log.warning("%s: KV lease of %s expired; quarantining its blocks", self.ref.worker_id,
                        rid)
            self._abort_or_quarantine(e, rid)
            self.engine.close_stream(rid, abort=True)
        now = time.monotonic()
        for rid in [r for r, until in self._quarantine.items() if until <= now]:
            del self._quarantine[rid]
            e.abort(rid)

    def _abort_or_quarantine(self, e: LLMEngine, request_id: str) -> bool:
        """Abort now, unless the request's KV may still be in flight: then hold its blocks."""
        if e.scheduler.status(request_id) is RequestStatus.WAITING_FOR_KV:
            self._quarantine.setdefault(request_id,
                                        time.monotonic() + self.config.transfer_timeout_s)
            return True
        return e.abort(request_id)

    def _check_request(self, req: InternalRequest) -> None:
        if req.model != self.config.model_id:
            raise InvalidArgument(f"unknown model {req.model!r}", field="model")
        limit = self.engine.engine.model.cfg.max_position_embeddings
        if req.prompt_tokens + req.sampling.max_tokens > limit:
            raise InvalidArgument(f"prompt + max_tokens exceeds the context limit {limit}",
                                  field="prompt")

    async def close(self) -> None:
        self.draining = True
        await asyncio.to_thread(self.engine.shutdown)
        self.receiver.close()
