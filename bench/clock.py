"""The benchmark's clock: the asyncio loop's `time()`, real in runs, virtual in tests.

The driver, pacing and records read time only through their event loop (`loop.time()`,
`asyncio.sleep`, `call_later`), so the loop is the one clock to inject. `run(coro)` runs a
coroutine on the real clock; `run(coro, clock="virtual")` runs it on `VirtualClockLoop`, whose
time stands still while callbacks run and jumps straight to the next timer when nothing is ready.
A test on virtual time sees exact durations (a 0.05 s think lasts exactly 0.05 s) however loaded
the machine is, and a minute of simulated load takes milliseconds.

Virtual time suits coroutines that wait only on timers and on each other (the fake backends in
the tests). Real I/O still works (the selector is polled before every jump, signals arrive
through the loop's self-pipe), but a wait on a thread or socket that is slower than the next
timer would see that timer fire first.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")
Clock = Literal["real", "virtual"]


class _JumpingSelector(selectors.BaseSelector):
    """A selector that polls real I/O, then advances its loop's virtual time instead of blocking."""

    def __init__(self) -> None:
        self._inner = selectors.DefaultSelector()
        self.now_s = 0.0

    def select(self, timeout: float | None = None) -> list:
        events = self._inner.select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # no timer pending: only outside I/O can wake the loop
            return self._inner.select(None)
        self.now_s += timeout
        return []

    def register(self, fileobj, events, data=None):  # type: ignore[no-untyped-def]
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj):  # type: ignore[no-untyped-def]
        return self._inner.unregister(fileobj)

    def modify(self, fileobj, events, data=None):  # type: ignore[no-untyped-def]
        return self._inner.modify(fileobj, events, data)

    def get_key(self, fileobj):  # type: ignore[no-untyped-def]
        return self._inner.get_key(fileobj)

    def get_map(self):  # type: ignore[no-untyped-def]
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time, starting at 0.0 s."""

    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(selector=self._jumping)

    def time(self) -> float:
        return self._jumping.now_s


def run(coro: Coroutine[Any, Any, T], clock: Clock = "real") -> T:
    """`asyncio.run(coro)` on the chosen clock."""
    if clock == "real":
        return asyncio.run(coro)
    if clock != "virtual":
        raise ValueError(f"clock must be 'real' or 'virtual', got {clock!r}")
    loop = VirtualClockLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            _cancel_remaining(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_remaining(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
