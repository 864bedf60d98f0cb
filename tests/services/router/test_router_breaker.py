"""The circuit breaker in front of the router's Redis calls (injected clock, no sleeps)."""

import asyncio

import pytest

from flashpd.services.router.breaker import BreakerOpen, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def ok():
    return "ok"


async def refused():
    raise ConnectionRefusedError("redis down")


async def hangs():
    await asyncio.sleep(3600)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_opens_after_consecutive_failures_and_then_fails_fast():
    clock = Clock()
    b = CircuitBreaker("r", failure_threshold=2, open_s=1.0, clock=clock)

    async def main():
        for _ in range(2):
            with pytest.raises(ConnectionRefusedError):
                await b.call(refused)
        assert b.state == "open" and b.trips == 1
        calls = []

        async def counted():
            calls.append(1)
            return 1

        with pytest.raises(BreakerOpen):
            await b.call(counted)
        assert calls == []  # refused without calling

    run(main())


def test_a_success_resets_the_failure_count():
    b = CircuitBreaker("r", failure_threshold=2, clock=Clock())

    async def main():
        with pytest.raises(ConnectionRefusedError):
            await b.call(refused)
        assert await b.call(ok) == "ok"
        with pytest.raises(ConnectionRefusedError):
            await b.call(refused)
        assert b.state == "closed"

    run(main())


def test_a_hung_call_times_out_and_counts_as_a_failure():
    b = CircuitBreaker("r", timeout_s=0.01, failure_threshold=1, clock=Clock())

    async def main():
        with pytest.raises(TimeoutError):
            await b.call(hangs)
        assert b.state == "open"

    run(main())


def test_half_open_probe_closes_on_success_and_reopens_on_failure():
    clock = Clock()
    b = CircuitBreaker("r", failure_threshold=1, open_s=1.0, clock=clock)

    async def main():
        with pytest.raises(ConnectionRefusedError):
            await b.call(refused)
        clock.now = 1.0
        assert b.state == "half_open"
        with pytest.raises(ConnectionRefusedError):
            await b.call(refused)  # the probe fails: open again for open_s
        assert b.state == "open"
        clock.now = 2.0
        assert await b.call(ok) == "ok"
        assert b.state == "closed" and b.trips == 1

    run(main())


def test_only_one_probe_at_a_time():
    clock = Clock()
    b = CircuitBreaker("r", failure_threshold=1, open_s=1.0, timeout_s=5.0, clock=clock)

    async def main():
        with pytest.raises(ConnectionRefusedError):
            await b.call(refused)
        clock.now = 1.0
        gate = asyncio.Event()

        async def slow():
            await gate.wait()
            return "probe"

        probe = asyncio.create_task(b.call(slow))
        await asyncio.sleep(0)
        with pytest.raises(BreakerOpen):
            await b.call(ok)
        gate.set()
        assert await probe == "probe" and b.state == "closed"

    run(main())
