"""Placement's local fallbacks, with a fake index at the Redis seam and an injected clock:
suspects, the last view and remembered workers when Redis fails or forgets, local sessions."""

import asyncio

import pytest

from flashpd.services.api import InternalRequest, Unavailable, WorkerStats
from flashpd.services.router.index import LiveView, Lookup
from flashpd.services.router.placement import Placement, PlacementConfig
from flashpd.services.router.policy import make_policy

P0, P1 = WorkerStats("p0", "i0", "prefill"), WorkerStats("p1", "i0", "prefill")
D0, D1 = WorkerStats("d0", "i0", "decode"), WorkerStats("d1", "i0", "decode")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeIndex:
    """What Redis holds; `down` makes every call fail as a dead Redis does."""

    def __init__(self, workers) -> None:
        self.workers = list(workers)
        self.down = False
        self.sessions: dict = {}
        self.marked: set[str] = set()  # wkeys marked draining

    def _check(self) -> None:
        if self.down:
            raise ConnectionRefusedError("redis down")

    async def live_view(self) -> LiveView:
        self._check()
        return LiveView(tuple(self.workers), ())

    async def lookup(self, hashes, live, session_id=None, parent_session_id=None) -> Lookup:
        self._check()
        return Lookup({}, self.sessions.get(session_id), None, frozenset(self.marked))

    async def bind_session(self, sid, prefill, decode, previous) -> None:
        self._check()

    async def touch_session(self, sid) -> None:
        self._check()

    async def reap(self, dead) -> None:
        self._check()

    async def draining(self) -> frozenset[str]:
        self._check()
        return frozenset(self.marked)


def req(rid="r", session=None) -> InternalRequest:
    return InternalRequest(rid, "m", tuple(range(1, 300)), session_id=session)


def placement(index, clock) -> Placement:
    return Placement(
        index,
        make_policy("affinity"),
        model="m",
        view_refresh_s=0.0,
        config=PlacementConfig(suspect_s=10.0, known_ttl_s=60.0, breaker_failures=1, breaker_open_s=1.0),
        clock=clock,
    )


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_suspect_is_avoided_while_another_worker_of_its_role_is_left():
    clock = Clock()
    pl = placement(FakeIndex([P0, P1, D0]), clock)

    async def main():
        pl.suspect(P0.ref)
        picks = {(await pl.place(req(f"r{i}"), frozenset())).prefill.worker_id for i in range(8)}
        assert picks == {"p1"}
        pl.suspect(P1.ref)  # now every prefill worker is suspect: they stay candidates
        assert (await pl.place(req(), frozenset())).prefill.worker_id in {"p0", "p1"}
        clock.now = 10.0  # suspicion expires
        pl.suspect(P1.ref)
        assert (await pl.place(req(), frozenset())).prefill.worker_id == "p0"

    run(main())


def test_redis_down_keeps_the_last_view_and_the_local_session_binding():
    clock = Clock()
    index = FakeIndex([P0, P1, D0, D1])
    pl = placement(index, clock)

    async def main():
        first = await pl.place(req("a", session="s"), frozenset())
        await pl.commit(req("a", session="s"), first)
        pl.release(first)
        index.down = True
        for i in range(5):
            a = await pl.place(req(f"b{i}", session="s"), frozenset())
            assert (a.prefill, a.decode) == (first.prefill, first.decode)
            assert a.decision.decode_reason == "session"
            pl.release(a)
        assert not pl.redis_ok

    run(main())


def test_redis_restarted_empty_is_bridged_by_remembered_workers_until_they_expire():
    clock = Clock()
    index = FakeIndex([P0, D0])
    pl = placement(index, clock)

    async def main():
        await pl.live_view()
        index.workers = []  # a fresh, empty Redis: nobody registered yet
        view = await pl.live_view()
        assert {w.worker_id for w in view.workers} == {"p0", "d0"}
        clock.now = 61.0
        assert (await pl.live_view()).workers == ()
        with pytest.raises(Unavailable):
            await pl.place(req(), frozenset())

    run(main())


def test_a_worker_marked_draining_gets_no_new_request_from_the_next_placement():
    """The mark is read per placement: no view refresh (here: an hour) stands between an
    operator's or the autoscaler's drain and the router avoiding the worker."""
    clock = Clock()
    index = FakeIndex([P0, D0, D1])
    pl = Placement(
        index,
        make_policy("affinity"),
        model="m",
        view_refresh_s=3600.0,
        config=PlacementConfig(breaker_failures=1),
        clock=clock,
    )

    async def main():
        first = await pl.place(req("a", session="s"), frozenset())
        index.marked.add(first.decode.key)
        for i in range(6):  # the session's binding and the cached view both say "first"
            a = await pl.place(req(f"b{i}", session="s"), frozenset())
            assert a.decode != first.decode
        index.down = True  # Redis gone: the last marks still hold
        clock.now += 10
        assert (await pl.place(req("c"), frozenset())).decode != first.decode

    run(main())
