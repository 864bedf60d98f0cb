"""Request orchestration, the one internal API under both frontends (gRPC and OpenAI HTTP).

    open(req) -> Run ----------------------------------------------------------------------.
      producer task: place (Redis + policy) -> D.reserve -> P.run -> D.generate -> Final   |
      consumers:     stream(run, from_token) yields TokenEvent..., FinalEvent  <-----------'

- Deadline: the request's absolute deadline bounds the whole producer; when it passes, both
  legs are aborted and the run fails with DeadlineExceeded. Workers see the same deadline in
  the request.
- Cancel: `abort(request_id)`, or the last consumer of a non-resumable run going away, cancels
  the producer, which aborts both legs (freeing both sides' blocks) before it ends. A resumable
  run (client-chosen request id) keeps going for `resume_grace_s` waiting for the client to
  resume, then is aborted the same way.
- Retry: UNAVAILABLE (any leg) or RESOURCE_EXHAUSTED (reserve, prefill queue) before the first
  token aborts both legs of the attempt and places the request again without the failed worker,
  up to `max_attempts` placements. After the first token errors end the run (the client may
  resume or retry).
- Text: workers stream token ids; the router detokenizes, applies stop strings (aborting D on
  a match) and fills usage and the timeline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass

from flashpd.engine.hashing import CHUNK_TOKENS
from flashpd.services.api import (
    Cancelled,
    DeadlineExceeded,
    FinalEvent,
    FinishReason,
    Internal,
    InternalRequest,
    InvalidArgument,
    NotFound,
    PrefillResult,
    ResourceExhausted,
    ServiceError,
    Ticket,
    Timeline,
    TokenEvent,
    TransferFailed,
    Unavailable,
    Usage,
    WorkerRef,
    as_service_error,
)
from flashpd.services.router.endpoints import WorkerDirectory
from flashpd.services.router.journal import Run, RunJournal
from flashpd.services.router.metrics import RouterMetrics
from flashpd.services.router.placement import Assignment, Placement
from flashpd.services.router.text import TextStream, Tokenizer

log = logging.getLogger(__name__)

RETRY_RESERVE = (Unavailable, ResourceExhausted)
RETRY_PREFILL = (Unavailable, ResourceExhausted)
RETRY_DECODE = (Unavailable,)


@dataclass(frozen=True)
class OrchestratorConfig:
    max_attempts: int = 3  # placements per request
    resume_grace_s: float = 10.0  # a detached resumable run waits this long for its client
    journal_ttl_s: float = 60.0  # finished resumable runs stay replayable this long
    abort_timeout_s: float = 5.0  # bound on the abort calls to workers

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")


class _RetryElsewhere(Exception):
    def __init__(self, worker: WorkerRef, error: ServiceError) -> None:
        super().__init__(f"{worker.key}: {error}")
        self.worker, self.error = worker, error


@dataclass
class _Attempt:
    assignment: Assignment
    prefill: object  # PrefillServerApi endpoint
    decode: object  # DecodeServerApi endpoint
    text: TextStream
    ticket: Ticket | None = None
    result: PrefillResult | None = None
    reserve_ms: float = 0.0
    first_token_unix_s: float | None = None
    last_token_unix_s: float | None = None


class Orchestrator:
    def __init__(self, placements: Mapping[str, Placement], directory: WorkerDirectory,
                 tokenizer: Tokenizer, *, metrics: RouterMetrics,
                 config: OrchestratorConfig = OrchestratorConfig()) -> None:
        """`placements`: one per served model name (each has its own index keys)."""
        if not placements:
            raise ValueError("at least one placement (served model) is required")
        self.placements, self.directory, self.tokenizer = dict(placements), directory, tokenizer
        self.metrics, self.config = metrics, config
        self.journal = RunJournal(ttl_s=config.journal_ttl_s)
        self._timers: set[asyncio.Task] = set()

    # ------------------------------------------------------------------------- frontend API

    def open(self, req: InternalRequest, *, resumable: bool = False, fingerprint: str = "",
             resume_from_token: int = 0) -> Run:
        """Start the request, or re-attach to it (same client-chosen id and content)."""
        if req.model not in self.placements:
            raise InvalidArgument(f"model {req.model!r} is not served here", field="model")
        existing = self.journal.get(req.request_id)
        if existing is not None:
            if not (resumable and existing.resumable and existing.fingerprint == fingerprint):
                raise InvalidArgument("already in use by another request", field="request_id")
            return existing
        if resume_from_token > 0:
            raise NotFound(f"no resumable stream {req.request_id!r} on this router",
                           field="request_id")
        run = Run(req, resumable=resumable, fingerprint=fingerprint)
        self.journal.add(run)
        run.task = asyncio.create_task(self._produce(run), name=f"run-{req.request_id}")
        return run

    async def stream(self, run: Run, from_token: int = 0) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Follow a run; use under `contextlib.aclosing` so a gone client is noticed at once."""
        run.consumers += 1
        try:
            async for event in run.follow(from_token):
                yield event
        finally:
            run.consumers -= 1
            if not run.done and run.consumers == 0:
                self._detached(run)

    async def abort(self, request_id: str) -> bool:
        """Abort a live request on both legs; False if unknown or already finished."""
        run = self.journal.get(request_id)
        if run is None or run.done:
            return False
        self._cancel(run, Cancelled("aborted by the client"))
        await asyncio.wait({run.task}, timeout=self.config.abort_timeout_s + 1.0)
        return True

    async def ready(self) -> bool:
        """True when every served model has a live, non-draining prefill and decode worker."""
        for placement in self.placements.values():
            view = await placement.live_view()
            if not {w.role for w in view.workers if not w.draining} >= {"prefill", "decode"}:
                return False
        return True

    async def close(self) -> None:
        for run in self.journal.live_runs():
            self._cancel(run, Cancelled("router shutting down"))
        tasks = [r.task for r in self.journal.live_runs() if r.task] + list(self._timers)
        for timer in self._timers:
            timer.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for placement in self.placements.values():
            await placement.close()

    # --------------------------------------------------------------------- cancel / detach

    def _cancel(self, run: Run, reason: ServiceError) -> None:
        if run.cancel_reason is None and run.task is not None and not run.done:
            run.cancel_reason = reason
            run.task.cancel()

    def _detached(self, run: Run) -> None:
        if not run.resumable:
            self._cancel(run, Cancelled("client went away"))
            return
        timer = asyncio.create_task(self._expire_detached(run))
        self._timers.add(timer)
        timer.add_done_callback(self._timers.discard)

    async def _expire_detached(self, run: Run) -> None:
        await asyncio.sleep(self.config.resume_grace_s)
        if run.consumers == 0 and not run.done:
            self._cancel(run, Cancelled(f"client did not resume within "
                                        f"{self.config.resume_grace_s} s"))

    # --------------------------------------------------------------------------- producer

    async def _produce(self, run: Run) -> None:
        self.metrics.on_start()
        error: ServiceError | None = None
        try:
            remaining_s = run.request.remaining_s()
            if remaining_s is not None and remaining_s <= 0:
                raise DeadlineExceeded("the deadline passed before routing")
            await asyncio.wait_for(self._serve(run), remaining_s)
        except TimeoutError:
            error = DeadlineExceeded("the deadline passed; both legs were aborted")
        except asyncio.CancelledError:
            error = run.cancel_reason or Cancelled("request cancelled")
        except ServiceError as exc:
            error = exc
        except Exception as exc:
            log.exception("request %s failed", run.request_id)
            error = as_service_error(exc)
        finally:
            if error is not None and not run.done:
                await run.fail(error)
            self.metrics.on_end(error.code if error is not None else None)
            self.journal.finished(run)

    async def _serve(self, run: Run) -> None:
        placement = self.placements[run.request.model]
        excluded: set[WorkerRef] = set()
        last_error: ServiceError | None = None
        for _ in range(self.config.max_attempts):
            try:
                assignment = await placement.place(run.request, frozenset(excluded))
            except Unavailable:
                if last_error is not None:
                    raise last_error from None
                raise
            self.metrics.on_route(assignment.route_ms / 1e3)
            try:
                await self._attempt(run, assignment)
                return
            except _RetryElsewhere as retry:
                log.warning("request %s: %s; placing it again", run.request_id, retry)
                excluded.add(retry.worker)
                last_error = retry.error
                self.metrics.on_retry(retry.error.code)
            finally:
                placement.release(assignment)
        assert last_error is not None
        raise last_error

    async def _attempt(self, run: Run, a: Assignment) -> None:
        req = run.request
        placement = self.placements[req.model]
        attempt = _Attempt(a, prefill=self._endpoint(run, a.prefill),
                           decode=self._endpoint(run, a.decode),
                           text=TextStream(self.tokenizer, req.sampling.stop))
        try:
            started = time.perf_counter()
            attempt.ticket = await self._call(attempt.decode.reserve(req), run, a.decode,
                                              RETRY_RESERVE)
            attempt.reserve_ms = (time.perf_counter() - started) * 1e3
            if attempt.ticket.needs_prefill:
                attempt.result = await self._prefill(run, attempt)
            placement.prefill_done(a)
            await self._decode(run, attempt)
        except BaseException:
            await asyncio.shield(self._abort_legs(req.request_id, attempt))
            raise

    def _endpoint(self, run: Run, worker: WorkerRef):
        try:
            if worker.role == "prefill":
                return self.directory.prefill(worker)
            return self.directory.decode(worker)
        except ServiceError as exc:
            if isinstance(exc, Unavailable) and run.num_tokens == 0:
                raise _RetryElsewhere(worker, exc) from exc
            raise

    async def _prefill(self, run: Run, attempt: _Attempt) -> PrefillResult:
        a = attempt.assignment
        try:
            result = await self._call(attempt.prefill.run(run.request, attempt.ticket), run,
                                      a.prefill, RETRY_PREFILL)
        except (_RetryElsewhere, ServiceError) as exc:
            if isinstance(getattr(exc, "error", exc), TransferFailed):
                self.metrics.on_transfer_failure()
            raise
        self.metrics.on_prefill(result)
        return result

    async def _decode(self, run: Run, attempt: _Attempt) -> None:
        worker = attempt.assignment.decode
        stream = attempt.decode.generate(run.request)
        events = stream.__aiter__()
        try:
            while True:
                try:
                    event = await self._call(events.__anext__(), run, worker, RETRY_DECODE)
                except StopAsyncIteration:
                    raise Internal("decode stream ended without a final event") from None
                if isinstance(event, FinalEvent):
                    await self._finish(run, attempt, event.finish_reason, event)
                    return
                if not isinstance(event, TokenEvent):
                    raise Internal(f"decode stream yielded {type(event).__name__}")
                if await self._release_tokens(run, attempt, event):
                    await _aclose(stream)
                    await self._abort_legs(run.request_id, attempt)  # stop string: D stops now
                    await self._finish(run, attempt, "stop", None)
                    return
        finally:
            await _aclose(stream)

    async def _call(self, awaitable: Awaitable, run: Run, worker: WorkerRef,
                    retryable: tuple[type[ServiceError], ...]):
        try:
            return await awaitable
        except StopAsyncIteration:
            raise
        except Exception as exc:
            error = as_service_error(exc)
            if isinstance(error, retryable) and run.num_tokens == 0:
                raise _RetryElsewhere(worker, error) from exc
            if error is exc:
                raise
            raise error from exc

    async def _release_tokens(self, run: Run, attempt: _Attempt, event: TokenEvent) -> bool:
        """Detokenize D's tokens into the run; True when a stop string ended generation."""
        if event.index != run.num_tokens:
            raise Internal(f"decode sent token index {event.index}, "
                                f"expected {run.num_tokens}")
        ids: list[int] = []
        pieces: list[str] = []
        for token_id in event.token_ids:
            ids.append(token_id)
            pieces.append(attempt.text.push(token_id))
            if attempt.text.stopped:
                break
        now = time.time()
        if attempt.first_token_unix_s is None:
            attempt.first_token_unix_s = now
            self.metrics.on_first_token(now - run.request.arrival_unix_s)
            self.metrics.on_tokens(len(ids), None)
        else:
            self.metrics.on_tokens(len(ids), now - (attempt.last_token_unix_s or now))
        attempt.last_token_unix_s = now
        await run.push(TokenEvent(tuple(ids), run.num_tokens, event.logprobs[: len(ids)],
                                  "".join(pieces)))
        return attempt.text.stopped

    async def _finish(self, run: Run, attempt: _Attempt, reason: FinishReason,
                      decode_final: FinalEvent | None) -> None:
        final = self._final_event(run, attempt, reason, decode_final)
        try:
            await self.placements[run.request.model].commit(run.request, attempt.assignment)
        except Exception:
            log.exception("request %s: recording the session binding failed", run.request_id)
        self.metrics.on_final(final)
        await run.finish(final)

    def _final_event(self, run: Run, attempt: _Attempt, reason: FinishReason,
                     decode_final: FinalEvent | None) -> FinalEvent:
        req, result, ticket = run.request, attempt.result, attempt.ticket
        assert ticket is not None
        # without a prefill, D replays the last chunk itself: that much is computed afresh
        computed = result.computed_tokens if result else min(req.prompt_tokens, CHUNK_TOKENS)
        usage = Usage(
            prompt_tokens=req.prompt_tokens, completion_tokens=run.num_tokens,
            cached_tokens=max(0, req.prompt_tokens - computed),
            cached_tokens_prefill=result.prefill_cached_tokens if result else 0,
            cached_tokens_decode=ticket.decode_cached_tokens)
        first = attempt.first_token_unix_s
        timeline = Timeline(
            route_ms=attempt.assignment.route_ms, reserve_ms=attempt.reserve_ms,
            prefill_queue_ms=result.queue_ms if result else 0.0,
            prefill_ms=result.compute_ms if result else 0.0,
            transfer_ms=result.transfer_ms if result else 0.0,
            replay_ms=decode_final.timeline.replay_ms if decode_final else 0.0,
            first_token_ms=(first - req.arrival_unix_s) * 1e3 if first else 0.0,
            e2e_ms=(time.time() - req.arrival_unix_s) * 1e3)
        return FinalEvent(
            finish_reason=reason, usage=usage, timeline=timeline,
            prefill_worker=attempt.assignment.prefill.worker_id if result else "",
            decode_worker=attempt.assignment.decode.worker_id, request_id=req.request_id,
            text=attempt.text.flush() if reason != "stop" else "")

    async def _abort_legs(self, request_id: str, attempt: _Attempt) -> None:
        calls = {"prefill": attempt.prefill.abort(request_id),
                 "decode": attempt.decode.abort(request_id)}
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*calls.values(), return_exceptions=True),
                self.config.abort_timeout_s)
        except TimeoutError:
            log.warning("request %s: abort did not answer within %.1f s", request_id,
                        self.config.abort_timeout_s)
            return
        for role, result in zip(calls, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("request %s: abort on %s failed: %r", request_id, role, result)


async def _aclose(stream: object) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()
