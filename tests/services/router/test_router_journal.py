import asyncio

import pytest

from flashpd.services.api import FinalEvent, InternalRequest, TokenEvent, Unavailable, Usage
from flashpd.services.router.journal import Run, RunJournal


def make_run(rid="r", resumable=True):
    return Run(InternalRequest(rid, "m", (1, 2)), resumable=resumable, fingerprint="f")


def test_follow_replays_from_an_offset_then_waits_for_more():
    async def main():
        run = make_run()
        await run.push(TokenEvent((1, 2), 0))
        await run.push(TokenEvent((3,), 2))
        seen = []

        async def consumer():
            async for e in run.follow(2):
                seen.append(e)

        task = asyncio.create_task(consumer())
        await asyncio.sleep(0.01)
        await run.push(TokenEvent((4,), 3))
        await run.finish(FinalEvent("length", Usage(2, 4)))
        await task
        assert [e.index for e in seen[:-1]] == [2, 3] and isinstance(seen[-1], FinalEvent)

    asyncio.run(main())


def test_error_is_raised_to_followers_after_the_events():
    async def main():
        run = make_run()
        await run.push(TokenEvent((1,), 0))
        await run.fail(Unavailable("gone"))
        got = []
        with pytest.raises(Unavailable):
            async for e in run.follow():
                got.append(e)
        assert len(got) == 1

    asyncio.run(main())


def test_push_checks_the_index():
    async def main():
        with pytest.raises(ValueError):
            await make_run().push(TokenEvent((1,), 5))

    asyncio.run(main())


def test_journal_keeps_resumable_runs_for_the_ttl_only():
    async def main():
        journal = RunJournal(ttl_s=10)
        kept, plain, early_failure = make_run("a"), make_run("b", resumable=False), make_run("c")
        for run in (kept, plain, early_failure):
            journal.add(run)
        await kept.finish(FinalEvent("stop", Usage()))
        await plain.finish(FinalEvent("stop", Usage()))
        await early_failure.fail(Unavailable("no worker"))
        for run in (kept, plain, early_failure):
            journal.finished(run)
        assert journal.get("a") is kept and journal.get("b") is None and journal.get("c") is None
        journal.prune(now=kept.finished_at + 11)
        assert journal.get("a") is None

    asyncio.run(main())


def test_a_lagging_follower_gets_pending_events_merged():
    async def main():
        run = make_run()
        await run.push(TokenEvent((1,), 0, text="a"))
        await run.push(TokenEvent((2, 3), 1, text="bc"))
        await run.finish(FinalEvent("length", Usage(2, 3)))
        seen = [e async for e in run.follow()]
        assert seen[0] == TokenEvent((1, 2, 3), 0, (), "abc") and len(seen) == 2
        assert [e.index for e in [x async for x in run.follow(1)][:-1]] == [1]

    asyncio.run(main())


def test_events_pushed_while_a_follower_holds_one_are_not_skipped():
    async def main():
        run = make_run()
        await run.push(TokenEvent((1,), 0))
        follower = run.follow(0)
        first = await follower.__anext__()  # the follower is suspended holding this event
        await run.push(TokenEvent((2,), 1))  # pushed meanwhile
        await run.push(TokenEvent((3,), 2))
        await run.finish(FinalEvent("length", Usage(2, 3)))
        rest = [e async for e in follower]
        tokens = list(first.token_ids) + [t for e in rest[:-1] for t in e.token_ids]
        assert tokens == [1, 2, 3] and rest[0].index == 1

    asyncio.run(main())
