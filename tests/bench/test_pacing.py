"""Idle caps: think times are capped per tree; the whole system is never idle past its cap.

On virtual time (flashpd.bench.clock), so every duration is exact.
"""

from __future__ import annotations

import asyncio

import pytest

from flashpd.bench import clock
from flashpd.bench.pacing import IdlePacer


def test_think_is_capped_at_the_tree_idle_cap():
    async def scenario() -> float:
        pacer = IdlePacer(tree_idle_cap_s=0.05, system_idle_cap_s=10.0)
        pacer.request_started()  # something in flight: the system cap does not apply
        return await pacer.think(0, 5.0)

    assert clock.run(scenario(), clock="virtual") == pytest.approx(0.05, abs=1e-9)


def test_system_idle_cap_wakes_the_earliest_sleeper_only():
    async def scenario() -> tuple[float, float, bool]:
        pacer = IdlePacer(tree_idle_cap_s=100.0, system_idle_cap_s=0.05)
        late = asyncio.create_task(pacer.think(1, 9.0))
        early_s = await pacer.think(0, 8.0)  # due first: woken by the system cap
        await asyncio.sleep(0.02)
        still_sleeping = not late.done()
        pacer.request_started()  # the woken lane sends...
        pacer.request_finished()  # ...and once idle again, the next cap wakes the other
        late_s = await asyncio.wait_for(late, 1.0)
        return early_s, late_s, still_sleeping

    early_s, late_s, still_sleeping = clock.run(scenario(), clock="virtual")
    assert early_s == pytest.approx(0.05, abs=1e-9)
    assert still_sleeping
    assert late_s == pytest.approx(0.12, abs=1e-9)  # 0.05 + 0.02 + the next 0.05 cap


def test_in_flight_requests_keep_sleepers_asleep_past_the_system_cap():
    async def scenario() -> float:
        pacer = IdlePacer(tree_idle_cap_s=100.0, system_idle_cap_s=0.02)
        pacer.request_started()
        return await pacer.think(0, 0.15)

    assert clock.run(scenario(), clock="virtual") == pytest.approx(0.15, abs=1e-9)


def test_close_wakes_sleepers_and_skips_later_thinks():
    async def scenario() -> tuple[float, float]:
        pacer = IdlePacer(tree_idle_cap_s=100.0, system_idle_cap_s=100.0)
        sleeping = asyncio.create_task(pacer.think(0, 50.0))
        await asyncio.sleep(0.01)
        pacer.close()
        return await asyncio.wait_for(sleeping, 1.0), await pacer.think(1, 50.0)

    woken_s, later_s = clock.run(scenario(), clock="virtual")
    assert woken_s == pytest.approx(0.01, abs=1e-9) and later_s == 0.0
