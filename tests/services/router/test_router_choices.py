"""The n > 1 fan-out (services/router/choices.py) over the orchestrator with fake workers:
closing it aborts every choice still running, before its first event too; a failing choice
ends the request."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from router_fakes import FakeDecode, FakePrefill, request, router_stack

from flashpd.services.api import FinalEvent, InvalidArgument
from flashpd.services.router import choices

pytestmark = pytest.mark.net


def test_closing_before_the_first_event_aborts_choice_0(redis_url):
    d = FakeDecode("d0", token_delay_s=0.05)

    async def main():
        async with router_stack(redis_url, [FakePrefill("p0")], [d]) as stack:
            events = choices.fan_out(stack.orchestrator, request(range(10), rid="c0", max_tokens=50), 3)
            await events.aclose()
            for _ in range(500):  # the run is retired (its producer never ran)
                if not stack.orchestrator.journal.live_runs():
                    break
                await asyncio.sleep(0.01)
            assert not stack.orchestrator.journal.live_runs()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert d.calls == [] or "c0" in d.aborted  # no leg was reserved, or it was aborted


def test_closing_mid_stream_aborts_every_choice(redis_url):
    d = FakeDecode("d0", token_delay_s=0.05)

    async def main():
        async with router_stack(redis_url, [FakePrefill("p0")], [d]) as stack:
            events = choices.fan_out(stack.orchestrator, request(range(10), rid="c1", max_tokens=50), 3)
            seen: set[int] = set()
            async with contextlib.aclosing(events):
                async for item in events:
                    seen.add(item.index)
                    if seen == {0, 1, 2}:
                        break
            for _ in range(500):
                if not stack.orchestrator.journal.live_runs():
                    break
                await asyncio.sleep(0.01)
            assert not stack.orchestrator.journal.live_runs()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert {"c1", "c1-1", "c1-2"} <= set(d.aborted)


def test_refusal_of_choice_0_raises_at_open(redis_url):
    async def main():
        async with router_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as stack:
            run = stack.orchestrator.open(request(range(10), rid="busy", max_tokens=3))
            with pytest.raises(InvalidArgument) as info:  # the id is in use
                choices.fan_out(stack.orchestrator, request(range(10), rid="busy"), 2)
            assert info.value.field == "request_id"
            async with contextlib.aclosing(stack.orchestrator.stream(run)) as events:
                assert isinstance([e async for e in events][-1], FinalEvent)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_siblings_open_one_at_a_time(redis_url):
    """Sibling i + 1 is reserved only once sibling i's first event is out (SIBLING_WAVE = 1):
    opened together, their calls stalled in Serve's routing on the Ray stack."""
    assert choices.SIBLING_WAVE == 1
    d = FakeDecode("d0", token_delay_s=0.02)
    order: list[str] = []

    async def main():
        async with router_stack(redis_url, [FakePrefill("p0", delay_s=0.05)], [d]) as stack:
            events = choices.fan_out(stack.orchestrator, request(range(10), rid="w", max_tokens=3), 4)
            async with contextlib.aclosing(events):
                async for item in events:
                    if not order or order[-1] != f"out {item.index}":
                        order.append(f"out {item.index}")
                    reserved = [rid for op, rid in d.calls if op == "reserve"]
                    order.extend(f"reserve {r}" for r in reserved if f"reserve {r}" not in order)

    asyncio.run(asyncio.wait_for(main(), 60))
    for i in (1, 2):  # sibling i+1's reserve comes after sibling i's first event
        assert order.index(f"out {i}") < order.index(f"reserve w-{i + 1}")
