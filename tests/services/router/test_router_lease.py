"""A KV lease that expires while the request waits for its prefill (a long prefill queue, n > 1
choices queued behind one prefill) is not a worker failure: the router places the request
again on the same workers (pins kept, nobody suspected) and the client sees no error. The
orchestrator reads leases against an injected clock, so "the lease has passed" is a fact of
the test, not a race with the wall clock."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import pytest
from router_fakes import FakeDecode, FakePrefill, request, router_stack

from flashpd.services.api import FinalEvent, Unavailable
from flashpd.services.router import choices
from flashpd.services.router.orchestrator import OrchestratorConfig

pytestmark = pytest.mark.net
LEASE_MSG = "the ticket's lease for {} passed before prefill started"


@dataclass
class QueuedPrefill(FakePrefill):
    """Refuses each request's first `refusals` runs as the real prefill worker does when the
    ticket's lease passed while the call queued."""

    refusals: int = 1

    async def run(self, req, ticket):
        seen = sum(1 for op, rid in self.calls if op == "run" and rid.split("@")[0] == req.request_id.split("@")[0])
        if seen < self.refusals:
            self.calls.append(("run", req.request_id))
            raise Unavailable(LEASE_MSG.format(req.request_id))
        return await super().run(req, ticket)


def _late():  # every ticket's lease (30 s from issue) has passed by this clock
    return time.time() + 3600.0


async def _all_choices(stack, n: int, **kw):
    base = request(range(300), rid="nl", max_tokens=4, **kw)
    finals: dict[int, FinalEvent] = {}
    events = choices.fan_out(stack.orchestrator, base, n)
    async with contextlib.aclosing(events):
        async for item in events:
            if isinstance(item.event, FinalEvent):
                finals[item.index] = item.event
    return finals


@contextlib.asynccontextmanager
async def _stack(redis_url, prefill, decode, clock=_late, **config):
    async with router_stack(
        redis_url, prefill, decode, clock=clock, config=OrchestratorConfig(resume_grace_s=0.2, **config)
    ) as stack:
        yield stack


def test_n_choices_whose_leases_expire_in_the_prefill_queue_all_complete(redis_url):
    """One prefill, one decode: each choice's first prefill is refused (lease passed). Before,
    the router excluded the only prefill worker and the client got UNAVAILABLE."""
    p, d = QueuedPrefill("p0"), FakeDecode("d0")

    async def main():
        async with _stack(redis_url, [p], [d]) as stack:
            return await _all_choices(stack, 3), stack

    finals, stack = asyncio.run(asyncio.wait_for(main(), 120))
    assert sorted(finals) == [0, 1, 2]
    assert all(f.finish_reason == "length" and f.usage.completion_tokens == 4 for f in finals.values())
    runs = [rid for op, rid in p.calls if op == "run"]
    assert len(runs) == 6  # each choice: one refused, one served
    assert sorted({r.split("@")[0] for r in runs}) == ["nl", "nl-1", "nl-2"]
    # the refused attempts' decode reservations were given up
    assert {r for r in runs if "@" not in r} <= set(d.aborted)


def test_lease_retry_keeps_the_pin_and_suspects_nobody(redis_url):
    """Two prefill workers: the choices stay on choice 0's pair after their lease retries (the
    pin and the prefix hit survive); a worker failure would have moved them to p1."""
    ps, d = [QueuedPrefill("p0"), FakePrefill("p1")], FakeDecode("d0")

    async def main():
        async with _stack(redis_url, ps, [d]) as stack:
            return await _all_choices(stack, 3)

    finals = asyncio.run(asyncio.wait_for(main(), 120))
    first = finals[0].prefill_worker
    assert all(f.prefill_worker == first for f in finals.values())
    if first == "p0":  # choice 0 went to p0: its refusals were retried there, not on p1
        assert ps[1].calls == []


def test_the_same_refusal_before_the_lease_passed_is_a_worker_failure(redis_url):
    """With the lease still running, an UNAVAILABLE from the prefill is the worker's: the
    request moves to the other prefill worker (the existing retry rule)."""
    ps, d = [QueuedPrefill("p0", refusals=10), FakePrefill("p1")], FakeDecode("d0")

    async def main():
        async with _stack(redis_url, ps, [d], clock=time.time) as stack:
            return await _all_choices(stack, 1)

    finals = asyncio.run(asyncio.wait_for(main(), 120))
    assert finals[0].prefill_worker == "p1"


def test_lease_retries_are_bounded_then_retryable_unavailable(redis_url):
    """A prefill queue that never drains in time: after max_lease_retries re-placements the
    ordinary attempts run out and the client gets UNAVAILABLE (retryable), never a hang."""
    p, d = QueuedPrefill("p0", refusals=1000), FakeDecode("d0")

    async def main():
        async with _stack(redis_url, [p], [d], max_lease_retries=2, max_attempts=1) as stack:
            with pytest.raises(Unavailable):
                await _all_choices(stack, 2)

    asyncio.run(asyncio.wait_for(main(), 120))
    assert sum(op == "run" for op, _ in p.calls) == 3  # 2 lease retries + 1 attempt
