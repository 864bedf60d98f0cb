"""Think-time pacing for the closed loop: per-tree and whole-system idle caps.

A lane sleeps its request's think time, capped at the per-tree idle cap. When no request is in
flight anywhere, the system is idle; after `system_idle_cap_s` of that, the lane due to wake first
is woken early, so no stretch of the run is longer than the cap with nothing to measure.
"""

from __future__ import annotations

import asyncio


class IdlePacer:
    def __init__(self, tree_idle_cap_s: float, system_idle_cap_s: float) -> None:
        if tree_idle_cap_s < 0 or system_idle_cap_s < 0:
            raise ValueError("idle caps must be >= 0")
        self.tree_idle_cap_s = tree_idle_cap_s
        self.system_idle_cap_s = system_idle_cap_s
        self._loop = asyncio.get_running_loop()
        self._in_flight = 0
        self._idle_since_s = self._loop.time()
        self._sleepers: dict[int, tuple[float, asyncio.Event]] = {}  # lane -> (wake time, event)
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def request_started(self) -> None:
        self._in_flight += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def request_finished(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle_since_s = self._loop.time()
            self._arm()

    async def think(self, lane: int, think_s: float) -> float:
        """Sleeps the (capped) think time; returns the seconds actually slept."""
        start_s = self._loop.time()
        sleep_s = min(think_s, self.tree_idle_cap_s)
        if sleep_s <= 0 or self._closed:
            return 0.0
        event = asyncio.Event()
        self._sleepers[lane] = (start_s + sleep_s, event)
        if self._in_flight == 0:
            self._arm()
        try:
            await asyncio.wait_for(event.wait(), sleep_s)
        except asyncio.TimeoutError:
            pass
        finally:
            del self._sleepers[lane]
        return self._loop.time() - start_s

    def close(self) -> None:
        """Wakes every sleeper; later think() calls return at once."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for _, event in self._sleepers.values():
            event.set()

    def _arm(self) -> None:
        if self._timer is None and self._in_flight == 0 and not self._closed:
            due_s = max(0.0, self._idle_since_s + self.system_idle_cap_s - self._loop.time())
            self._timer = self._loop.call_later(due_s, self._cut_idle)

    def _cut_idle(self) -> None:
        self._timer = None
        if self._in_flight > 0 or not self._sleepers:
            return
        lane = min(self._sleepers, key=lambda k: self._sleepers[k][0])
        self._sleepers[lane][1].set()
