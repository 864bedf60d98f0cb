"""A circuit breaker with a per-call timeout, for the router's Redis calls on the request path.

    closed --(`failure_threshold` failures in a row)--> open --(`open_s` later)--> half-open
      ^                                                   |                         |
      '------------------- the probe call succeeds -------+----- it fails ----------'--> open

- closed: every call runs, bounded by `timeout_s`; a timeout or a connection error counts as a
  failure, a success resets the count.
- open: calls fail at once with `BreakerOpen` (no waiting on a dead or paused Redis), so the
  caller takes its fallback (the router's local view of workers and sessions).
- half-open: one call at a time probes Redis; the others fail fast until it answers.

Pure asyncio; the clock is injected so the tests need no wall-clock tolerances.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class BreakerOpen(ConnectionError):
    """The breaker refused the call (the dependency failed recently)."""


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        *,
        timeout_s: float = 0.2,
        failure_threshold: int = 2,
        open_s: float = 1.0,
        failures: tuple[type[BaseException], ...] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0 or open_s <= 0 or failure_threshold < 1:
            raise ValueError("timeout_s and open_s must be > 0, failure_threshold >= 1")
        self.name, self.timeout_s, self.open_s = name, timeout_s, open_s
        self.failure_threshold = failure_threshold
        # what counts as the dependency failing (besides timeouts and OSError)
        self._failures = (TimeoutError, OSError, *failures)
        self._clock = clock
        self._consecutive = 0
        self._opened_at: float | None = None
        self._probing = False
        self.trips = 0  # times it opened
        self.last_failure: BaseException | None = None

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "closed"
        return "half_open" if self._clock() - self._opened_at >= self.open_s else "open"

    async def call(self, make: Callable[[], Awaitable[T]], *, timeout_s: float | None = None) -> T:
        """Run `make()` under the timeout; raise BreakerOpen when refused, else the call's own
        outcome (a timeout raises TimeoutError)."""
        state = self.state
        if state == "open" or (state == "half_open" and self._probing):
            raise BreakerOpen(f"{self.name} is unavailable (circuit open)")
        probe = state == "half_open"
        self._probing = self._probing or probe
        try:
            result = await asyncio.wait_for(make(), timeout_s or self.timeout_s)
        except self._failures as exc:
            self.last_failure = exc
            self._failed()
            raise
        finally:
            if probe:
                self._probing = False
        self._succeeded()
        return result

    def _failed(self) -> None:
        self._consecutive += 1
        if self._opened_at is not None or self._consecutive >= self.failure_threshold:
            if self._opened_at is None:
                self.trips += 1
                log.warning("%s: circuit open after %d failures", self.name, self._consecutive)
            self._opened_at = self._clock()

    def _succeeded(self) -> None:
        if self._opened_at is not None:
            log.warning("%s: circuit closed (answering again)", self.name)
        self._consecutive, self._opened_at = 0, None
