"""ColocatedWorker: the engine in colocated role behind the `api.ColocatedServerApi` contract.

    generate(req)  admit (bounded FIFO queue beyond capacity), prefill what this worker's prefix
                   cache lacks (bounded replay on a hit), decode with continuous batching and
                   stream TokenEvent* then one FinalEvent; no ticket, no KV transfer
    abort(rid)     stops the request and frees its blocks (they stay prefix-cached); idempotent

Admission: the engine's own waiting queue is kept to at most `max_num_seqs` requests (a batch's
worth, so the scheduler always has the next admissions at hand); beyond that a request waits in
the worker's `AdmissionQueue` (FIFO, its deadline applies) and only a full queue refuses it
(`WorkerFull`: RESOURCE_EXHAUSTED + retry-after, the router tries another replica). A request
that could never fit the pool is INVALID_ARGUMENT at admission (the scheduler's check).

No stranded capacity: every path out of `generate` that is not the engine's final output (a
client gone, a deadline, a router abort, an error) aborts the engine request, so its blocks
return to the pool; the engine run id (`<request id>@<n>`) is new per call, so a retry of a
request id never collides with a run still winding down.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator

from flashpd.engine.async_engine import EngineDead, RequestFailed
from flashpd.engine.llm_engine import LLMEngine
from flashpd.engine.request import PrefixPolicy
from flashpd.engine.sampling_params import SamplingError
from flashpd.services.api import (
    Cancelled,
    Event,
    FinalEvent,
    Internal,
    InternalRequest,
    InvalidArgument,
    Timeline,
    TokenEvent,
    TokenLogprobs,
    Unavailable,
    WorkerRef,
)
from flashpd.services.worker.admission import AdmissionQueue
from flashpd.services.worker.common import EngineWorker, WorkerConfig, final_event, ms_since


class ColocatedWorker(EngineWorker):
    role = "colocated"

    def __init__(self, engine: LLMEngine, config: WorkerConfig, ref: WorkerRef):
        super().__init__(engine, config, ref)
        self._runs = itertools.count()
        self._live: dict[str, str] = {}  # request id -> engine id of its run (asyncio side)
        self._prefilling: dict[str, int] = {}  # engine id -> prompt tokens before its first token
        self._engine_waiting_limit = engine.config.max_num_seqs
        self.admission = AdmissionQueue(config.max_queued_requests, retry_after_s=config.retry_after_s)
        self.engine.hooks.append(self._signal_room)

    # ------------------------------------------------------------------ api
    async def generate(self, req: InternalRequest) -> AsyncIterator[Event]:
        if self.draining:
            raise Unavailable(f"{self.ref.worker_id} is draining")
        self.check_request(req)
        await self.compile_grammar(req.sampling)
        if req.request_id in self._live:  # a retry of a run still here: it supersedes it
            await self.abort(req.request_id)
        t0 = time.monotonic()
        engine_id = f"{req.request_id}@{next(self._runs)}"
        await self.admission.admit(lambda: self._try_add(req, engine_id), req.deadline_unix_s, req.request_id)
        self._live[req.request_id] = engine_id
        self._prefilling[engine_id] = req.prompt_tokens
        finished = False
        try:
            async for event in self._events(req, engine_id, t0, time.monotonic()):
                finished = isinstance(event, FinalEvent)
                yield event
        finally:
            self._prefilling.pop(engine_id, None)
            if self._live.get(req.request_id) == engine_id:
                del self._live[req.request_id]
            if not finished:
                await asyncio.shield(self._abort_run(engine_id))

    async def _try_add(self, req: InternalRequest, engine_id: str) -> str | None:
        """One admission attempt: the engine run id once the engine holds the request, None
        while its waiting queue is full (the admission queue retries)."""
        self.engine.open_stream(engine_id)  # before the engine can produce an output
        try:
            added = await self.engine.call(lambda e: self._add_on_loop(e, req, engine_id))
        except BaseException as exc:
            self.engine.close_stream(engine_id, abort=False)
            await asyncio.shield(self._abort_run(engine_id))  # a cancel may land after the add ran
            if isinstance(exc, EngineDead):  # the replica is replaced: another worker may serve it
                raise Unavailable(f"the engine of {self.ref.worker_id} stopped: {exc}") from None
            raise
        if not added:
            self.engine.close_stream(engine_id, abort=False)
            return None
        return engine_id

    def _add_on_loop(self, e: LLMEngine, req: InternalRequest, engine_id: str) -> bool:
        """On the loop thread: add the request unless a batch's worth already waits; bad input
        (ids outside the vocabulary, more blocks than the pool, a grammar that cannot start)
        is INVALID_ARGUMENT."""
        if e.scheduler.num_waiting >= self._engine_waiting_limit:
            return False
        prefix = PrefixPolicy(max_credit_tokens=req.max_prefill_credit_tokens)
        try:
            e.add_request(engine_id, req.prompt_ids, req.sampling, req.session_id, prefix)
        except SamplingError as exc:  # a grammar error is one
            raise InvalidArgument(exc.message, field=exc.field) from None
        except ValueError as exc:
            raise InvalidArgument(str(exc), field="prompt") from None
        return True

    async def _events(self, req: InternalRequest, engine_id: str, t0: float, admitted: float) -> AsyncIterator[Event]:
        """The engine run's outputs as the router's events; the first token event carries the
        prefix credit the run used."""
        first_s, index = None, 0
        try:
            async for out in self.engine.stream(engine_id):
                if out.new_token_ids:
                    credit = None
                    if first_s is None:
                        first_s, credit = time.monotonic(), out.cached_tokens
                        self._prefilling.pop(engine_id, None)
                    lps = tuple(TokenLogprobs(s.logprob, s.top_logprobs) for s in out.logprobs)
                    yield TokenEvent(out.new_token_ids, index, lps, prefill_credit_tokens=credit)
                    index += len(out.new_token_ids)
                if out.finished:
                    first = first_s or time.monotonic()
                    timeline = Timeline(
                        prefill_queue_ms=1e3 * (admitted - t0), prefill_ms=1e3 * (first - admitted), e2e_ms=ms_since(t0)
                    )
                    yield final_event(out, timeline, self.ref.worker_id, req.request_id, colocated=True)
                    return
        except RequestFailed as exc:
            raise Internal(f"{req.request_id} failed in the engine: {exc.reason}") from None
        except EngineDead as exc:  # the replica is replaced: another worker may serve it
            raise Unavailable(f"the engine of {self.ref.worker_id} stopped: {exc}") from None
        except KeyError:  # aborted between admission and the first read
            raise Cancelled(f"{req.request_id} was aborted on {self.ref.worker_id}") from None

    async def abort(self, request_id: str) -> bool:
        engine_id = self._live.pop(request_id, None)
        if engine_id is None:
            return False
        await self._abort_run(engine_id)
        return True

    async def _abort_run(self, engine_id: str) -> None:
        """Stop an engine run and free its blocks (idempotent; nothing to do once the engine
        is gone: its blocks went with it)."""
        self.engine.close_stream(engine_id, abort=True)
        with contextlib.suppress(EngineDead):
            await self.engine.call(lambda e: e.abort(engine_id))

    # ------------------------------------------------------------------ loop thread
    def _signal_room(self, e: LLMEngine) -> None:
        """Wake the admission queue's head while the engine's waiting queue has room."""
        if self.admission.num_waiting and e.scheduler.num_waiting < self._engine_waiting_limit:
            self.admission.room_freed()

    # ------------------------------------------------------------------ views
    def queued_prefill_tokens(self) -> int:
        return sum(self._prefilling.values())

    def admission_queue(self) -> tuple[int, int]:
        return self.admission.num_waiting, self.admission.max_waiting

    def undrain(self) -> None:
        self.draining = False

    async def drain(self) -> int:
        """Take no new request; the streams running here finish in place (a colocated stream
        has no KV elsewhere to move to). Returns how many are running."""
        self.draining = True
        return len(self._live)

    async def close(self) -> None:
        self.draining = True
        await asyncio.to_thread(self.engine.shutdown)
