"""A worker's admission queue: requests beyond capacity wait (FIFO, with their deadlines)
instead of being refused; only a full queue refuses, with `WorkerFull` and a retry-after hint.

    queue = AdmissionQueue(max_waiting=256)
    ticket = await queue.admit(try_admit, deadline_unix_s)    # try_admit() -> result | None
    queue.room_freed()                                        # capacity may have come back

`try_admit` is retried (by the queue's head only, so nobody overtakes) whenever the owner says
room was freed, and at least every `recheck_s`. A waiter whose deadline passes leaves the queue
with DeadlineExceeded; a cancelled waiter simply leaves. This module imports no engine code, so
the router can unpickle `WorkerFull`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from flashpd.services.api import DeadlineExceeded, ResourceExhausted

T = TypeVar("T")


class WorkerFull(ResourceExhausted):
    """The worker's admission queue is full (RESOURCE_EXHAUSTED / HTTP 429): retry after
    `retry_after_s`, here or on another replica."""

    def __init__(self, message: str, *, field: str | None = None, retry_after_s: float = 1.0):
        self.retry_after_s = float(retry_after_s)
        super().__init__(message, field=field)

    def __reduce__(self):  # keep retry_after_s through pickling (Ray)
        return (_rebuild_worker_full, (self.message, self.field, self.retry_after_s))


def _rebuild_worker_full(message: str, field: str | None, retry_after_s: float) -> WorkerFull:
    return WorkerFull(message, field=field, retry_after_s=retry_after_s)


class AdmissionQueue:
    def __init__(
        self,
        max_waiting: int,
        recheck_s: float = 0.05,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self._recheck_s = recheck_s
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._waiting: deque[int] = deque()  # waiter ids, FIFO
        self._ids = itertools.count()
        self._room: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def room_freed(self) -> None:
        """Wake the queue's head (callable from any thread)."""
        loop, room = self._loop, self._room
        if loop is None or room is None:
            return
        try:
            loop.call_soon_threadsafe(room.set)
        except RuntimeError:  # the loop closed
            pass

    async def admit(
        self, try_admit: Callable[[], Awaitable[T | None]], deadline_unix_s: float | None, what: str = "request"
    ) -> T:
        self._loop = asyncio.get_running_loop()
        if self._room is None:
            self._room = asyncio.Event()
        if not self._waiting:
            result = await try_admit()
            if result is not None:
                return result
        if len(self._waiting) >= self.max_waiting:
            raise WorkerFull(
                f"{what}: the admission queue is full ({self.max_waiting} waiting); "
                f"retry after {self._retry_after_s:g} s",
                retry_after_s=self._retry_after_s,
            )
        me = next(self._ids)
        self._waiting.append(me)
        try:
            while True:
                if self._waiting[0] == me:
                    result = await try_admit()
                    if result is not None:
                        return result
                await self._wait_for_room(self._wait_s(deadline_unix_s, what))
        finally:
            self._waiting.remove(me)
            if self._room is not None:
                self._room.set()  # the next head tries at once

    def _wait_s(self, deadline_unix_s: float | None, what: str) -> float:
        """Until the next recheck, or the deadline if sooner (passed: DEADLINE_EXCEEDED)."""
        if deadline_unix_s is None:
            return self._recheck_s
        left_s = deadline_unix_s - self._clock()
        if left_s <= 0:
            raise DeadlineExceeded(f"{what}: the deadline passed while queued for capacity")
        return min(self._recheck_s, left_s)

    async def _wait_for_room(self, wait_s: float) -> None:
        room = self._room
        with contextlib.suppress(TimeoutError):  # the timeout is the recheck, not a failure
            await asyncio.wait_for(room.wait(), wait_s)
        if room.is_set() and self._room is room:
            # a fresh event for the next wake-up; only once per event, or a waiter
            # already parked on the fresh one would be orphaned until its recheck
            self._room = asyncio.Event()
