"""Per-request event logs, so a broken stream can be resumed from a token offset.

A `Run` holds one request's released events. Its producer (the orchestrator) appends; any number
of consumers follow it from a token offset: the original stream, and after a disconnect a resumed
stream with `resume_from_token`. A consumer that lags gets the events that piled up merged into
one (fewer, larger messages under load; chunk boundaries stay boundaries of the log). Offsets must fall on event boundaries (the client counts tokens
of whole chunks it received):

    events:   [ids 0..0] [ids 1..3] [ids 4..4] ... Final
    index:        0          1          4
    resume_from_token = 4  -> replay from the third event, then follow live

The `RunJournal` keeps live runs by request id (for Abort and resume) and, for resumable runs,
finished ones for `ttl_s`; a run that failed before its first token is dropped at once so a retry
with the same request id starts afresh.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

from flashpd.services.api import FinalEvent, InternalRequest, InvalidArgument, ServiceError, TokenEvent, WorkerRef


class Run:
    def __init__(self, request: InternalRequest, *, resumable: bool, fingerprint: str) -> None:
        self.request = request
        self.resumable = resumable
        self.fingerprint = fingerprint
        self.events: list[TokenEvent] = []
        self.num_tokens = 0
        self.final: FinalEvent | None = None
        self.error: ServiceError | None = None
        self.finished_at: float | None = None  # monotonic
        self.consumers = 0
        self.task: asyncio.Task | None = None
        self.cancel_reason: ServiceError | None = None
        self.attempts = 0  # placements so far (each gets its own worker-side request id)
        self.progress: object | None = None  # the producer's state kept across attempts
        self.placed: tuple[WorkerRef, WorkerRef] | None = None  # the last attempt's (P, D)
        self._changed = asyncio.Condition()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    async def push(self, event: TokenEvent) -> None:
        if self.done:
            raise RuntimeError(f"push to finished run {self.request_id}")
        if event.index != self.num_tokens:
            raise ValueError(f"event index {event.index} != {self.num_tokens} tokens so far")
        self.events.append(event)
        self.num_tokens += len(event.token_ids)
        await self._notify()

    async def finish(self, final: FinalEvent) -> None:
        self.final = final
        await self._end()

    async def fail(self, error: ServiceError) -> None:
        self.error = error
        await self._end()

    def reopen(self) -> None:
        """Un-finish a run that failed, so its producer can continue it (same log)."""
        if not self.done or self.error is None:
            raise RuntimeError(f"run {self.request_id} is not a failed run")
        self.error, self.finished_at, self.cancel_reason = None, None, None

    async def follow(self, from_token: int = 0) -> AsyncIterator[TokenEvent | FinalEvent]:
        """Events from token offset `from_token`, then the final event (or the error raised)."""
        i = self._event_at(from_token)
        while True:
            if i < len(self.events):  # a lagging consumer gets what piled up as one event
                # Fix the end before yielding: events pushed while the consumer holds this one
                # must be sent next, not skipped.
                end = len(self.events)
                yield _merge(self.events[i:end])
                i = end
                continue
            if self.done:
                break
            async with self._changed:
                await self._changed.wait_for(lambda n=i: self.done or n < len(self.events))
        if self.error is not None:
            raise self.error
        assert self.final is not None
        yield self.final

    def _event_at(self, from_token: int) -> int:
        if from_token == 0:
            return 0
        offsets = [e.index for e in self.events]
        if from_token == self.num_tokens:
            return len(self.events)
        if from_token in offsets:
            return offsets.index(from_token)
        raise InvalidArgument(
            f"{from_token} is not a chunk boundary of this stream ({self.num_tokens} tokens so far)",
            field="resume_from_token",
        )

    async def _end(self) -> None:
        if self.done:
            raise RuntimeError(f"run {self.request_id} already finished")
        self.finished_at = time.monotonic()
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


def _merge(events: list[TokenEvent]) -> TokenEvent:
    if len(events) == 1:
        return events[0]
    return TokenEvent(
        token_ids=tuple(t for e in events for t in e.token_ids),
        index=events[0].index,
        logprobs=tuple(lp for e in events for lp in e.logprobs),
        text="".join(e.text for e in events),
        prefill_credit_tokens=events[0].prefill_credit_tokens,
    )


class RunJournal:
    def __init__(self, *, ttl_s: float = 60.0, max_finished: int = 10_000) -> None:
        self.ttl_s, self.max_finished = ttl_s, max_finished
        self._live: dict[str, Run] = {}
        self._finished: OrderedDict[str, Run] = OrderedDict()

    def get(self, request_id: str) -> Run | None:
        self.prune()
        return self._live.get(request_id) or self._finished.get(request_id)

    def add(self, run: Run) -> None:
        if self.get(run.request_id) is not None:
            raise InvalidArgument("already in use", field="request_id")
        self._live[run.request_id] = run

    def finished(self, run: Run) -> None:
        """Move a finished run out of the live set; keep it only if a client may resume it."""
        self._live.pop(run.request_id, None)
        failed_early = run.error is not None and run.num_tokens == 0
        if run.resumable and not failed_early:
            self._finished[run.request_id] = run
        self.prune()

    def revive(self, run: Run) -> None:
        """A failed run continues: back to the live set."""
        self._finished.pop(run.request_id, None)
        run.reopen()
        self._live[run.request_id] = run

    def live_runs(self) -> list[Run]:
        return list(self._live.values())

    def prune(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        while self._finished:
            oldest = next(iter(self._finished.values()))
            expired = now - (oldest.finished_at or now) > self.ttl_s
            if not expired and len(self._finished) <= self.max_finished:
                break
            self._finished.popitem(last=False)
