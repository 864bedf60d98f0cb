"""Request orchestration, the one internal API under both frontends (gRPC and OpenAI HTTP).

    open(req) -> Run ----------------------------------------------------------------------.
      producer task: place (Redis + policy) -> D.reserve -> P.run -> D.generate -> Final   |
                                            \_ P.start (concurrent with the reserve)       |
      consumers:     stream(run, from_token) yields TokenEvent..., FinalEvent  <-----------'

- Head start (`overlap_reserve`, on by default): the prefill's compute does not need the ticket,
  only its push does, so `P.start(req)` goes out with `D.reserve(req)` and the compute runs
  while D reserves; `P.run(req, ticket)` then takes it over (after `start` answered: the run
  never overtakes it). `start` is best effort: its failure changes nothing (the run reports
  the worker's state). When the ticket needs no prefill, or the attempt fails, the prefill leg
  is aborted, which ends the head start and frees its blocks. Not while the decode worker
  queues reserves (its last heartbeat): the ticket would come late.

- Deadline: the request's absolute deadline bounds the whole producer; when it passes, both
  legs are aborted and the run fails with DeadlineExceeded. Workers see the same deadline in
  the request.
- Cancel: `abort(request_id)`, or the last consumer of a non-resumable run going away, cancels
  the producer, which aborts both legs (freeing both sides' blocks) before it ends. A resumable
  run (client-chosen request id) keeps going for `resume_grace_s` waiting for the client to
  resume, then is aborted the same way.
- Attempts: each placement of a run is one attempt with its own worker-side request id
  (`rid`, then `rid@1`, `rid@2`, ...), so a worker still holding a failed attempt (a reservation
  fenced or quarantined after a dead prefill) never collides with the next one. The failed
  attempt's legs are aborted first (the dead worker's in the background, bounded).
- Retry: UNAVAILABLE (any leg: a dead replica, Ray's ActorDiedError) or RESOURCE_EXHAUSTED
  (reserve, prefill queue) aborts the attempt, marks the failed worker suspect and places the
  request again without it, up to `max_attempts` placements. When no worker of a role is left
  (the only prefill replica died), the run waits for a replacement to register, within its
  deadline and at most `wait_for_workers_s`. Before the first token the client sees a slower
  first token; after it, the run *continues*: the next attempt sends prompt + the tokens
  released so far to another decode worker with `max_tokens` reduced by as many
  (`kv_prompt_tokens` = the original prompt): a prefill worker recomputes only the original
  prompt's KV, capped at the original prefill's prefix credit (the same KV), and the new decode
  worker replays from the original prompt boundary and recomputes the released tokens
  teacher-forced, so its windows are the first worker's and greedy output is identical to an
  unbroken run, with bounded replay too. Its tokens are appended at the right offsets. Both
  frontends get this transparently: the gRPC stream and the HTTP SSE stream simply go on.
- Resume: a client that comes back for a resumable run (`resume_from_token`) re-attaches to it;
  if the run had failed UNAVAILABLE after its first token (every attempt used up), it is
  revived and continues the same way.
- Text: workers stream token ids; the router detokenizes, applies stop strings (aborting D on
  a match) and fills usage and the timeline.
- Colocated mode (the placement's mode): an attempt is one leg, `generate` on the colocated
  worker the placement picked (no reserve, no prefill call, no KV transfer); the first token
  event carries the prefix credit the worker used (usage's cached_tokens, a continuation's
  credit cap). Deadlines, cancel, retries before and after the first token, resume, stop
  strings and metrics are the same code as above. A continuation re-prefills prompt + the
  released tokens on the next worker (capped at the first attempt's credit): no KV moves, and
  its output continues the stream (greedy identity with an unbroken run is not promised here,
  the recomputed rows batch differently).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from flashpd.engine.detokenizer import TextStream
from flashpd.engine.hashing import CHUNK_TOKENS
from flashpd.services.api import (
    Cancelled,
    DeadlineExceeded,
    FinalEvent,
    FinishReason,
    Internal,
    InternalRequest,
    InvalidArgument,
    MigrateEvent,
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
from flashpd.services.router.text import Tokenizer

log = logging.getLogger(__name__)

RETRY_RESERVE = (Unavailable, ResourceExhausted)
RETRY_PREFILL = (Unavailable, ResourceExhausted)
RETRY_DECODE = (Unavailable,)
# a colocated stream's first event may be its admission queue's refusal (another replica may
# have room); after tokens, only a failed worker is retried (a continuation)
RETRY_COLOCATED = (Unavailable, ResourceExhausted)


@dataclass(frozen=True)
class OrchestratorConfig:
    max_attempts: int = 4  # placements per request (a failed worker is skipped on the next)
    resume_grace_s: float = 10.0  # a detached resumable run waits this long for its client
    journal_ttl_s: float = 60.0  # finished resumable runs stay replayable this long
    abort_timeout_s: float = 5.0  # bound on the abort calls to workers
    wait_for_workers_s: float = 60.0  # a run whose workers all failed waits this long for more
    wait_poll_s: float = 0.25  # ... checking this often
    reprobe_excluded_s: float = 6.0  # while waiting, retry failed workers this often
    # placements after a KV lease expired before the first token (a queued prefill, not a
    # failed worker): placed again with no worker excluded or suspected, before the failures
    # of `max_attempts` count
    max_lease_retries: int = 4
    overlap_reserve: bool = True  # the prefill's compute starts alongside the reservation (P.start)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")


class _RetryElsewhere(Exception):
    def __init__(self, worker: WorkerRef, error: ServiceError, *, died: bool = False) -> None:
        super().__init__(f"{worker.key}: {error}")
        self.worker, self.error = worker, error
        self.died = died  # the worker is gone (Serve replaces it), not merely refusing
        # the attempt's KV lease had passed when a live worker refused it, before its first
        # token: the request waited too long (a queued prefill), the worker did nothing wrong
        self.lease_expired = False


def _ray_root(exc: BaseException) -> BaseException:
    """The failure a Ray wrapper carries (RayTaskError(ActorDiedError) -> the ActorDiedError);
    a ServiceError a worker raised is what `as_service_error` reads from `cause` itself."""
    seen = 0
    while (
        seen < 8 and isinstance(getattr(exc, "cause", None), BaseException) and not isinstance(exc.cause, ServiceError)
    ):
        exc, seen = exc.cause, seen + 1
    return exc


def _worker_died(exc: BaseException, error: ServiceError) -> bool:
    """An UNAVAILABLE that means the replica is gone: Ray's own failure (ActorDiedError,
    RayActorError, ...), or another replica answering for a target that no longer exists
    (`deployments._check_target`: "worker ... is gone"). A worker raising UNAVAILABLE itself
    (draining) is alive."""
    cause = getattr(exc, "cause", None)
    raised_by_worker = isinstance(exc, ServiceError) or isinstance(cause, ServiceError)
    return isinstance(error, Unavailable) and (not raised_by_worker or "is gone" in str(error))


@dataclass
class _Retries:
    """One run's placements so far (within one `_serve`)."""

    excluded: set[WorkerRef] = dataclasses.field(default_factory=set)  # failed: not placed on again
    last_error: ServiceError | None = None
    died: bool = False  # the last failure was a worker's death: a replacement is coming
    failures: int = 0  # bounded by max_attempts
    lease_retries: int = 0  # bounded by max_lease_retries
    waited_s: float = 0.0  # for a replacement worker
    cleared_at_s: float = 0.0  # `waited_s` when `excluded` was last cleared


@dataclass
class _Progress:
    """What a run has released so far, across its attempts."""

    text: TextStream
    first_token_unix_s: float | None = None
    last_token_unix_s: float | None = None
    # prefix credit of the prefill whose KV the released tokens rest on (None: no prefill):
    # a continuation's prefill is capped at it, so it recomputes the same KV
    prefill_credit_tokens: int | None = None


@dataclass
class _Attempt:
    assignment: Assignment
    request: InternalRequest  # as the workers see it (own id; continuation prompt)
    base_tokens: int  # completion tokens released before this attempt
    prefill: object  # PrefillServerApi endpoint (None: colocated, or after a live migration)
    decode: object  # DecodeServerApi endpoint (ColocatedServerApi in colocated mode)
    ticket: Ticket | None = None
    result: PrefillResult | None = None
    reserve_ms: float = 0.0
    moved: list[Assignment] = dataclasses.field(default_factory=list)  # earlier decode legs
    migrate_ms: float = 0.0  # live migrations of this attempt, summed (pause to new stream)
    colocated_credit_tokens: int | None = None  # colocated: the credit its worker used (first event)

    def moved_to(self, a: Assignment, req: InternalRequest, base_tokens: int, decode: object, ticket: Ticket) -> None:
        """The stream continues on another decode worker (a live migration)."""
        self.moved.append(self.assignment)
        self.assignment, self.request, self.base_tokens = a, req, base_tokens
        self.prefill, self.decode, self.ticket, self.result = None, decode, ticket, None


class Orchestrator:
    def __init__(
        self,
        placements: Mapping[str, Placement],
        directory: WorkerDirectory,
        tokenizer: Tokenizer,
        *,
        metrics: RouterMetrics,
        config: OrchestratorConfig = OrchestratorConfig(),
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`placements`: one per served model name (each has its own index keys); `clock`:
        unix seconds, the time KV leases (`Ticket.lease_deadline_unix_s`) are read against."""
        if not placements:
            raise ValueError("at least one placement (served model) is required")
        self.placements, self.directory, self.tokenizer = dict(placements), directory, tokenizer
        self.metrics, self.config, self._clock = metrics, config, clock
        self.journal = RunJournal(ttl_s=config.journal_ttl_s)
        self._timers: set[asyncio.Task] = set()

    # ------------------------------------------------------------------------- frontend API

    def open(
        self, req: InternalRequest, *, resumable: bool = False, fingerprint: str = "", resume_from_token: int = 0
    ) -> Run:
        """Start the request, or re-attach to it (same client-chosen id and content)."""
        if req.model not in self.placements:
            raise InvalidArgument(f"model {req.model!r} is not served here", field="model")
        existing = self.journal.get(req.request_id)
        if existing is not None:
            if not (resumable and existing.resumable and existing.fingerprint == fingerprint):
                raise InvalidArgument("already in use by another request", field="request_id")
            if resume_from_token > 0 and _revivable(existing):
                self._revive(existing)
            return existing
        if resume_from_token > 0:
            raise NotFound(f"no resumable stream {req.request_id!r} on this router", field="request_id")
        run = Run(req, resumable=resumable, fingerprint=fingerprint)
        self.journal.add(run)
        self._start(run)
        return run

    def _start(self, run: Run) -> None:
        run.task = asyncio.create_task(self._produce(run), name=f"run-{run.request_id}")
        run.task.add_done_callback(lambda task: self._ended(run, task))

    def _ended(self, run: Run, task: asyncio.Task) -> None:
        """A producer cancelled before it ever ran (aborted right after `open`) skipped its own
        cleanup: fail the run and retire it here (no worker was called)."""
        if task.cancelled() and not run.done:
            self._background(self._retire_unstarted(run))

    async def _retire_unstarted(self, run: Run) -> None:
        await run.fail(run.cancel_reason or Cancelled("request cancelled"))
        self.journal.finished(run)

    def _revive(self, run: Run) -> None:
        """Continue a run that broke UNAVAILABLE after tokens: a client came back for it."""
        log.warning(
            "request %s: resumed by its client after %r; continuing from token %d",
            run.request_id,
            run.error,
            run.num_tokens,
        )
        self.journal.revive(run)
        self._start(run)

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

    async def serving_status(self) -> tuple[bool, str]:
        """(serving, why). Serving when every served model has a known, non-draining worker of
        each role of its mode (prefill and decode, or colocated): live in Redis, or remembered
        by the router while Redis is away (a Redis outage alone does not stop serving). Never
        raises."""
        for model, placement in self.placements.items():
            try:
                view = await placement.live_view()
            except Exception as exc:  # never let a health probe fail on a bug here
                log.exception("serving status of %s failed", model)
                return False, f"{model}: {type(exc).__name__}"
            roles = {w.role for w in view.workers if not w.draining}
            missing = [r for r in placement.roles if r not in roles]
            if missing:
                return False, f"{model}: no healthy {' or '.join(missing)} worker"
        redis = "ok" if all(p.redis_ok for p in self.placements.values()) else "degraded"
        return True, f"workers known; redis {redis}"

    async def ready(self) -> bool:
        """True when every served model has a known, non-draining prefill and decode worker
        (what `/health` and the gRPC health service report)."""
        return (await self.serving_status())[0]

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
        self._background(self._expire_detached(run))

    def _background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._timers.add(task)
        task.add_done_callback(self._timers.discard)

    async def _expire_detached(self, run: Run) -> None:
        await asyncio.sleep(self.config.resume_grace_s)
        if run.consumers == 0 and not run.done:
            self._cancel(run, Cancelled(f"client did not resume within {self.config.resume_grace_s} s"))

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
        if run.progress is None:  # kept across attempts and a revival
            run.progress = _Progress(TextStream(self.tokenizer, run.request.sampling.stop))
        progress = run.progress
        retries = _Retries()
        while retries.failures < self.config.max_attempts:
            if run.num_tokens >= run.request.sampling.max_tokens:  # broke right before Final
                await self._finish_without_decode(run, progress)
                return
            attempt_req = self._attempt_request(run)
            try:
                assignment = await placement.place(attempt_req, frozenset(retries.excluded))
            except Unavailable as exc:
                await self._wait_for_workers(retries, exc)
                continue
            self.metrics.on_route(assignment.route_ms / 1e3)
            try:
                await self._attempt(run, assignment, attempt_req, progress)
                return
            except _RetryElsewhere as retry:
                self._count_retry(run, placement, retries, retry)
            finally:
                placement.release(assignment)
        assert retries.last_error is not None
        raise retries.last_error

    async def _wait_for_workers(self, retries: _Retries, no_worker: Unavailable) -> None:
        """No worker to place on. With no failure before, that is the answer; when the last
        failure was a worker's death, wait (within `wait_for_workers_s`) for a replacement to
        register (a new incarnation is never excluded); after `reprobe_excluded_s` the excluded
        ones get another chance (a transient failure, not a death)."""
        if retries.last_error is None:
            raise no_worker
        if not retries.died or retries.waited_s >= self.config.wait_for_workers_s:
            raise retries.last_error from None
        await asyncio.sleep(self.config.wait_poll_s)
        retries.waited_s += self.config.wait_poll_s
        if retries.waited_s - retries.cleared_at_s >= self.config.reprobe_excluded_s:
            retries.excluded.clear()
            retries.cleared_at_s = retries.waited_s

    def _count_retry(self, run: Run, placement: Placement, retries: _Retries, retry: _RetryElsewhere) -> None:
        """Book a failed attempt before the next placement."""
        if retry.lease_expired and retries.lease_retries < self.config.max_lease_retries:
            retries.lease_retries += 1  # nobody failed: same workers allowed, none suspected
            log.warning(
                "request %s: its KV lease expired before prefill (%s); placing it again (%d)",
                run.request_id,
                retry,
                retries.lease_retries,
            )
            self.metrics.on_retry(retry.error.code)
            return
        log.warning("request %s (%d tokens out): %s; placing it again", run.request_id, run.num_tokens, retry)
        retries.excluded.add(retry.worker)
        if isinstance(retry.error, Unavailable):
            placement.suspect(retry.worker)
        retries.last_error, retries.died = retry.error, retry.died
        retries.failures += 1
        self.metrics.on_retry(retry.error.code)

    def _attempt_request(self, run: Run) -> InternalRequest:
        """The request as the next attempt's workers see it: a fresh worker-side id, and after
        tokens were released, prompt + those tokens with the remaining token budget."""
        req = run.request
        number = run.attempts
        run.attempts += 1
        if number == 0:
            return req
        done = tuple(t for e in run.events for t in e.token_ids)
        if not done:
            return dataclasses.replace(req, request_id=f"{req.request_id}@{number}")
        progress = run.progress
        guided = req.sampling.guided
        if guided is not None:  # the grammar resumes after the tokens already released
            guided = dataclasses.replace(guided, replay_tokens=guided.replay_tokens + len(done))
        return dataclasses.replace(
            req,
            request_id=f"{req.request_id}@{number}",
            prompt_ids=req.prompt_ids + done,
            sampling=dataclasses.replace(req.sampling, guided=guided, max_tokens=req.sampling.max_tokens - len(done)),
            kv_prompt_tokens=req.kv_prompt_tokens or req.prompt_tokens,
            max_prefill_credit_tokens=progress.prefill_credit_tokens if progress else None,
        )

    async def _attempt(self, run: Run, a: Assignment, req: InternalRequest, progress: _Progress) -> None:
        if a.colocated:
            await self._attempt_colocated(run, a, req, progress)
            return
        placement = self.placements[req.model]
        attempt = _Attempt(a, req, run.num_tokens, prefill=self._endpoint(a.prefill), decode=self._endpoint(a.decode))
        head_start = asyncio.ensure_future(self._head_start(attempt)) if self._overlaps(a) else None
        try:
            started = time.perf_counter()
            attempt.ticket = await self._call(attempt.decode.reserve(req), a.decode, RETRY_RESERVE)
            run.placed = (a.prefill, a.decode)  # n > 1: the other choices follow this pair
            attempt.reserve_ms = (time.perf_counter() - started) * 1e3
            computing = head_start is not None and await head_start
            if attempt.ticket.needs_prefill:
                attempt.result = await self._prefill(attempt)
            elif computing:  # D holds every chunk: the head start computed for nobody
                self._background(self._abort_one(req.request_id, a.prefill, attempt.prefill))
            if attempt.base_tokens == 0:  # the KV the first tokens will rest on
                progress.prefill_credit_tokens = attempt.result.prefill_cached_tokens if attempt.result else None
            placement.prefill_done(a)
            await self._decode(run, attempt, progress)
        except BaseException as exc:
            failed = exc.worker if isinstance(exc, _RetryElsewhere) else None
            if isinstance(exc, _RetryElsewhere):
                exc.lease_expired = self._lease_expired(run, attempt, exc)
                if exc.lease_expired:
                    failed = None  # alive: its leg is aborted in line like the other
            if head_start is not None:  # a start still on its way is refused after the abort
                head_start.cancel()
            await asyncio.shield(self._abort_legs(attempt, failed))
            raise
        finally:
            for moved in attempt.moved:  # decode legs a live migration left
                placement.release(moved)
            if attempt.moved:
                placement.release(attempt.assignment)

    async def _attempt_colocated(self, run: Run, a: Assignment, req: InternalRequest, progress: _Progress) -> None:
        """One colocated attempt: stream from the one worker; on failure its leg is aborted
        (in the background when that worker just failed) before the next placement."""
        attempt = _Attempt(a, req, run.num_tokens, prefill=None, decode=self._endpoint(a.decode))
        run.placed = (a.decode, a.decode)  # n > 1: the other choices follow this worker
        try:
            await self._decode(run, attempt, progress)
        except BaseException as exc:
            failed = exc.worker if isinstance(exc, _RetryElsewhere) else None
            await asyncio.shield(self._abort_legs(attempt, failed))
            raise

    def _colocated_first_event(self, run: Run, attempt: _Attempt, progress: _Progress, event: TokenEvent) -> None:
        """A colocated attempt's first token: its prefill is over, and the credit it used is
        the KV the first tokens rest on (capping a later continuation's credit)."""
        attempt.colocated_credit_tokens = event.prefill_credit_tokens
        if attempt.base_tokens == 0:
            progress.prefill_credit_tokens = event.prefill_credit_tokens
        self.placements[run.request.model].prefill_done(attempt.assignment)

    def _lease_expired(self, run: Run, attempt: _Attempt, retry: _RetryElsewhere) -> bool:
        """A live worker's UNAVAILABLE, before the attempt's first token, once its ticket's
        lease had passed: the prefill refused a ticket it could no longer honour, or the KV
        did not reach the decode worker in time. The request queued too long; no worker
        failed (a slow machine, a long prefill queue: n > 1 choices all queue behind one)."""
        ticket = attempt.ticket
        return (
            ticket is not None
            and not retry.died
            and isinstance(retry.error, Unavailable)
            and run.num_tokens == attempt.base_tokens
            and self._clock() >= ticket.lease_deadline_unix_s
        )

    def _endpoint(self, worker: WorkerRef):
        try:
            if worker.role == "prefill":
                return self.directory.prefill(worker)
            if worker.role == "colocated":
                return self.directory.colocated(worker)
            return self.directory.decode(worker)
        except Unavailable as exc:
            raise _RetryElsewhere(worker, exc, died=True) from exc

    def _overlaps(self, a: Assignment) -> bool:
        """Start the prefill alongside the reserve, unless the decode worker was queueing
        reserves at its last heartbeat: this reserve would wait too, and the head start would
        hold the prefill's blocks (up to its lease) for a run that comes late."""
        return self.config.overlap_reserve and a.decision.decode.stats.queued == 0

    async def _head_start(self, attempt: _Attempt) -> bool:
        """`P.start`: True when the prefill worker began computing. Never raises: a worker that
        cannot start fails its `run` the same way, where the retries handle it."""
        try:
            return await attempt.prefill.start(attempt.request)
        except Exception as exc:  # noqa: BLE001 - best effort, see above
            log.warning(
                "request %s: no head start on %s (%r)", attempt.request.request_id, attempt.assignment.prefill.key, exc
            )
            return False

    async def _prefill(self, attempt: _Attempt) -> PrefillResult:
        a = attempt.assignment
        try:
            result = await self._call(attempt.prefill.run(attempt.request, attempt.ticket), a.prefill, RETRY_PREFILL)
        except (_RetryElsewhere, ServiceError) as exc:
            if isinstance(getattr(exc, "error", exc), TransferFailed):
                self.metrics.on_transfer_failure()
            raise
        self.metrics.on_prefill(result)
        return result

    async def _decode(self, run: Run, attempt: _Attempt, progress: _Progress) -> None:
        worker = attempt.assignment.decode
        stream = attempt.decode.generate(attempt.request)
        events = stream.__aiter__()
        colocated = attempt.assignment.colocated
        try:
            while True:
                event = await self._next_decode_event(events, worker, colocated)
                if isinstance(event, MigrateEvent):
                    if await self._migrate(run, attempt):  # the stream moved: follow it
                        await _aclose(stream)
                        worker = attempt.assignment.decode
                        stream = attempt.decode.generate(attempt.request)
                        events = stream.__aiter__()
                    continue
                if isinstance(event, FinalEvent):
                    await self._finish(run, attempt, progress, event.finish_reason, event)
                    return
                if not isinstance(event, TokenEvent):
                    raise Internal(f"decode stream yielded {type(event).__name__}")
                if colocated and attempt.colocated_credit_tokens is None:
                    self._colocated_first_event(run, attempt, progress, event)
                if await self._release_tokens(run, attempt, progress, event):
                    await _aclose(stream)
                    await self._abort_legs(attempt)  # stop string: D stops now
                    await self._finish(run, attempt, progress, "stop", None)
                    return
        finally:
            await _aclose(stream)

    async def _next_decode_event(self, events: AsyncIterator, worker: WorkerRef, colocated: bool = False):
        try:
            return await self._call(events.__anext__(), worker, RETRY_COLOCATED if colocated else RETRY_DECODE)
        except StopAsyncIteration:  # the worker went away mid-stream
            raise _RetryElsewhere(worker, Unavailable("decode stream ended without a final event"), died=True) from None

    async def _migrate(self, run: Run, attempt: _Attempt) -> bool:
        """The attempt's decode worker is draining and paused the stream after every token
        it sent. Place a continuation (prompt + the tokens released, KV boundary at the
        original prompt) on another decode worker, have the draining one push the prompt's KV
        blocks there (D -> D, no prefill), and switch `attempt` to it: True. With no room
        anywhere (or any failure before the push completed), the stream resumes in place:
        False. The client's stream sees only a pause."""
        started = time.perf_counter()
        source, placement = attempt.assignment.decode, self.placements[run.request.model]
        req = self._attempt_request(run)
        try:
            a = await placement.place(req, frozenset({source}))
        except Unavailable:
            return await self._stay(run, attempt, "no other decode worker")
        placement.prefill_done(a)  # no prefill leg: the KV comes from the source
        target = None
        try:
            target = self._endpoint(a.decode)
            ticket = await target.reserve(req)
            moved = (
                await attempt.decode.migrate_out(attempt.request.request_id, ticket) if ticket.needs_prefill else None
            )
        except asyncio.CancelledError:
            placement.release(a)
            raise
        except Exception as exc:  # noqa: BLE001 - the stream stays where it is
            placement.release(a)
            if target is not None:
                self._background(self._abort_one(req.request_id, a.decode, target))
            return await self._stay(run, attempt, f"{type(exc).__name__}: {exc}")
        attempt.moved_to(a, req, run.num_tokens, target, ticket)
        attempt.migrate_ms += (time.perf_counter() - started) * 1e3
        self._count_move(run, attempt, source, moved.moved_bytes if moved else 0)
        return True

    def _count_move(self, run: Run, attempt: _Attempt, source: WorkerRef, moved_bytes: int) -> None:
        self.metrics.on_migration("moved", moved_bytes)
        log.info(
            "request %s: moved from %s to %s after %d tokens (%d KV bytes, %.1f ms)",
            run.request_id,
            source.worker_id,
            attempt.assignment.decode.worker_id,
            run.num_tokens,
            moved_bytes,
            attempt.migrate_ms,
        )

    async def _stay(self, run: Run, attempt: _Attempt, why: str) -> bool:
        log.warning("request %s: stays on draining %s (%s)", run.request_id, attempt.assignment.decode.worker_id, why)
        self.metrics.on_migration("stayed")
        await self._call(attempt.decode.resume(attempt.request.request_id), attempt.assignment.decode, RETRY_DECODE)
        return False

    async def _call(self, awaitable: Awaitable, worker: WorkerRef, retryable: tuple[type[ServiceError], ...]):
        """Await a worker call; a retryable failure becomes _RetryElsewhere (before or after
        the first token: a later attempt continues from the tokens released)."""
        try:
            return await awaitable
        except StopAsyncIteration:
            raise
        except Exception as exc:
            root = _ray_root(exc)
            error = as_service_error(root)
            if isinstance(error, retryable):
                raise _RetryElsewhere(worker, error, died=_worker_died(root, error)) from exc
            if error is exc:
                raise
            raise error from exc

    async def _release_tokens(self, run: Run, attempt: _Attempt, progress: _Progress, event: TokenEvent) -> bool:
        """Detokenize D's tokens into the run; True when a stop string ended generation."""
        if attempt.base_tokens + event.index != run.num_tokens:
            raise Internal(f"decode sent token index {event.index} (+{attempt.base_tokens}), expected {run.num_tokens}")
        ids: list[int] = []
        pieces: list[str] = []
        for token_id in event.token_ids:
            ids.append(token_id)
            pieces.append(progress.text.push(token_id))
            if progress.text.stopped:
                break
        now = time.time()
        if progress.first_token_unix_s is None:
            progress.first_token_unix_s = now
            self.metrics.on_first_token(now - run.request.arrival_unix_s)
            self.metrics.on_tokens(len(ids), None)
        else:
            self.metrics.on_tokens(len(ids), now - (progress.last_token_unix_s or now))
        progress.last_token_unix_s = now
        credit = progress.prefill_credit_tokens if run.num_tokens == 0 else None
        await run.push(TokenEvent(tuple(ids), run.num_tokens, event.logprobs[: len(ids)], "".join(pieces), credit))
        return progress.text.stopped

    async def _finish(
        self, run: Run, attempt: _Attempt, progress: _Progress, reason: FinishReason, decode_final: FinalEvent | None
    ) -> None:
        final = self._final_event(run, attempt, progress, reason, decode_final)
        try:
            await self.placements[run.request.model].commit(run.request, attempt.assignment)
        except Exception:
            log.exception("request %s: recording the session binding failed", run.request_id)
        self.metrics.on_final(final)
        await run.finish(final)

    async def _finish_without_decode(self, run: Run, progress: _Progress) -> None:
        """Every token was released but the decode worker died before its final event."""
        first = progress.first_token_unix_s
        req = run.request
        final = FinalEvent(
            finish_reason="length",
            usage=Usage(prompt_tokens=req.prompt_tokens, completion_tokens=run.num_tokens),
            timeline=Timeline(
                first_token_ms=(first - req.arrival_unix_s) * 1e3 if first else 0.0,
                e2e_ms=(time.time() - req.arrival_unix_s) * 1e3,
            ),
            request_id=req.request_id,
            text=progress.text.flush(),
        )
        self.metrics.on_final(final)
        await run.finish(final)

    def _final_event(
        self, run: Run, attempt: _Attempt, progress: _Progress, reason: FinishReason, decode_final: FinalEvent | None
    ) -> FinalEvent:
        req, result = run.request, attempt.result
        return FinalEvent(
            finish_reason=reason,
            usage=_usage(run, attempt, decode_final),
            timeline=_timeline(req, attempt, progress, decode_final),
            prefill_worker=attempt.assignment.prefill.worker_id if result else "",
            decode_worker=attempt.assignment.decode.worker_id,
            request_id=req.request_id,
            text=progress.text.flush() if reason != "stop" else "",
        )

    async def _abort_legs(self, attempt: _Attempt, failed: WorkerRef | None = None) -> None:
        """Abort both legs of an attempt (bounded). The leg of a worker that just failed is
        aborted in the background: a dead replica may not answer before the timeout, and the
        next attempt must not wait for it."""
        request_id = attempt.request.request_id
        a = attempt.assignment
        legs = {a.decode: attempt.decode}  # colocated: the one leg
        if attempt.prefill is not None:  # a migrated run or a colocated one: no prefill leg
            legs = {a.prefill: attempt.prefill, **legs}
        for worker, endpoint in legs.items():
            if worker == failed:
                self._background(self._abort_one(request_id, worker, endpoint))
        awaited = [self._abort_one(request_id, w, e) for w, e in legs.items() if w != failed]
        await asyncio.gather(*awaited)

    async def _abort_one(self, request_id: str, worker: WorkerRef, endpoint) -> None:
        try:
            await asyncio.wait_for(endpoint.abort(request_id), self.config.abort_timeout_s)
        except TimeoutError:
            log.warning(
                "request %s: abort on %s did not answer within %.1f s",
                request_id,
                worker.key,
                self.config.abort_timeout_s,
            )
        except Exception as exc:
            log.warning("request %s: abort on %s failed: %r", request_id, worker.key, exc)


def _revivable(run: Run) -> bool:
    """A finished run that broke UNAVAILABLE after its first token can continue."""
    return (
        run.done
        and isinstance(run.error, Unavailable)
        and run.num_tokens > 0
        and run.num_tokens < run.request.sampling.max_tokens
    )


async def _aclose(stream: object) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


def _usage(run: Run, attempt: _Attempt, decode_final: FinalEvent | None) -> Usage:
    if attempt.assignment.colocated:
        return _colocated_usage(run, attempt, decode_final)
    req, result, ticket = run.request, attempt.result, attempt.ticket
    assert ticket is not None
    # without a prefill, D replays the last chunk itself: that much is computed afresh
    computed = result.computed_tokens if result else min(attempt.request.prompt_tokens, CHUNK_TOKENS)
    return Usage(
        prompt_tokens=req.prompt_tokens,
        completion_tokens=run.num_tokens,
        cached_tokens=max(0, req.prompt_tokens - computed),
        cached_tokens_prefill=min(req.prompt_tokens, result.prefill_cached_tokens if result else 0),
        cached_tokens_decode=min(req.prompt_tokens, ticket.decode_cached_tokens),
        **_speculative_usage(decode_final),
    )


def _colocated_usage(run: Run, attempt: _Attempt, decode_final: FinalEvent | None) -> Usage:
    """The colocated worker's prefix credit is cached_tokens (and the prefill tier's reuse);
    nothing is transferred, so no decode tier. Known from its first token event on (a stop
    string ends the run before the worker's final event)."""
    credit = attempt.colocated_credit_tokens or 0
    cached = min(run.request.prompt_tokens, credit)
    return Usage(
        prompt_tokens=run.request.prompt_tokens,
        completion_tokens=run.num_tokens,
        cached_tokens=cached,
        cached_tokens_prefill=cached,
        **_speculative_usage(decode_final),
    )


def _timeline(
    req: InternalRequest, attempt: _Attempt, progress: _Progress, decode_final: FinalEvent | None
) -> Timeline:
    if attempt.assignment.colocated:
        return _colocated_timeline(req, attempt, progress, decode_final)
    result, first = attempt.result, progress.first_token_unix_s
    return Timeline(
        route_ms=attempt.assignment.route_ms,
        reserve_ms=attempt.reserve_ms,
        prefill_queue_ms=result.queue_ms if result else 0.0,
        prefill_ms=result.compute_ms if result else 0.0,
        transfer_ms=result.transfer_ms if result else 0.0,
        replay_ms=decode_final.timeline.replay_ms if decode_final else 0.0,
        first_token_ms=(first - req.arrival_unix_s) * 1e3 if first else 0.0,
        e2e_ms=(time.time() - req.arrival_unix_s) * 1e3,
        migrate_ms=attempt.migrate_ms,
    )


def _colocated_timeline(
    req: InternalRequest, attempt: _Attempt, progress: _Progress, decode_final: FinalEvent | None
) -> Timeline:
    """The worker's admission wait and prefill (admitted -> first token) from its final event."""
    worker = decode_final.timeline if decode_final else Timeline()
    first = progress.first_token_unix_s
    return Timeline(
        route_ms=attempt.assignment.route_ms,
        prefill_queue_ms=worker.prefill_queue_ms,
        prefill_ms=worker.prefill_ms,
        first_token_ms=(first - req.arrival_unix_s) * 1e3 if first else 0.0,
        e2e_ms=(time.time() - req.arrival_unix_s) * 1e3,
    )


def _speculative_usage(decode_final: FinalEvent | None) -> dict:
    """The decode worker's speculative-decoding counts (zeros without a decode final)."""
    if decode_final is None:
        return {}
    u = decode_final.usage
    return {
        "draft_tokens": u.draft_tokens,
        "accepted_draft_tokens": u.accepted_draft_tokens,
        "draft_steps": u.draft_steps,
        "forced_acceptance_length": u.forced_acceptance_length,
    }
