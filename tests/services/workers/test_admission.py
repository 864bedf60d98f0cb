"""The admission queue: FIFO (nobody overtakes the head), refuses only when full, and a waiter
whose deadline passes leaves with DeadlineExceeded (the clock is injected)."""

from __future__ import annotations

import asyncio

import pytest

from flashpd.services.api import DeadlineExceeded
from flashpd.services.worker.admission import AdmissionQueue, WorkerFull


class Capacity:
    """A pool of units at the try_admit seam."""

    def __init__(self, units: int):
        self.units = units
        self.order: list[str] = []

    def taker(self, name: str, need: int = 1):
        async def try_admit():
            if self.units < need:
                return None
            self.units -= need
            self.order.append(name)
            return name

        return try_admit


def test_waiters_are_admitted_in_arrival_order_as_room_frees():
    async def main():
        cap, queue = Capacity(0), AdmissionQueue(max_waiting=8, recheck_s=10.0)
        big = asyncio.create_task(queue.admit(cap.taker("big", 2), None))
        await asyncio.sleep(0)
        small = asyncio.create_task(queue.admit(cap.taker("small", 1), None))
        await asyncio.sleep(0)
        assert queue.num_waiting == 2
        cap.units = 1
        queue.room_freed()
        await asyncio.sleep(0.01)
        assert cap.order == []  # the head needs 2: the small one does not overtake it
        cap.units = 3
        queue.room_freed()
        assert await big == "big" and await small == "small" and cap.order == ["big", "small"]
        assert queue.num_waiting == 0

    asyncio.run(main())


def test_full_queue_refuses_with_a_retry_after_hint():
    async def main():
        queue = AdmissionQueue(max_waiting=1, recheck_s=10.0, retry_after_s=3.0)
        cap = Capacity(0)
        waiting = asyncio.create_task(queue.admit(cap.taker("a"), None))
        await asyncio.sleep(0)
        with pytest.raises(WorkerFull) as err:
            await queue.admit(cap.taker("b"), None)
        assert err.value.retry_after_s == 3.0 and err.value.code == "RESOURCE_EXHAUSTED"
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert queue.num_waiting == 0

    asyncio.run(main())


def test_a_waiter_past_its_deadline_leaves_with_deadline_exceeded():
    async def main():
        now = {"t": 100.0}
        queue = AdmissionQueue(max_waiting=4, recheck_s=0.001, clock=lambda: now["t"])
        waiting = asyncio.create_task(queue.admit(Capacity(0).taker("a"), 105.0))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        now["t"] = 105.0
        with pytest.raises(DeadlineExceeded):
            await waiting
        assert queue.num_waiting == 0

    asyncio.run(main())
