"""`n` > 1: the choices of one request, fanned out over the orchestrator and merged into one
event stream (the HTTP frontend, streaming or not, and the gRPC frontend share it).

    choice 0 ----open----> first event ----> its prefill/decode pair holds the prompt's chunks
    choices 1..n-1 --open pinned to that pair (`InternalRequest.pin`)--> prefix hits there
                     one after another: the next opens when the previous one's first event is
                     out (`SIBLING_WAVE`); they then decode together

Each choice is its own run (request id `<id>` for choice 0, `<id>-<i>` for the others, seed
`seed + i`), so it keeps the orchestrator's transparent retries and continuations (a lease that
expired while the shared prefill queued, a decode worker that died). Events come out in arrival
order as `ChoiceEvent(index, event)`; every choice's stream ends with its FinalEvent. A choice that
fails ends the whole request: its error is raised and the other choices are aborted (their runs
are not resumable, so closing their streams cancels them on both legs).

Usage as OpenAI counts it (`total_usage`): the prompt once (choice 0's prompt and cached
tokens), the completion tokens of every choice summed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from flashpd.services.api import FinalEvent, InternalRequest, TokenEvent, Usage
from flashpd.services.router import validation as v
from flashpd.services.router.orchestrator import Orchestrator

# Siblings opened but not yet out (first event) at a time. Measured on the 2-core Ray stack
# (tiny model, 1P1D and 2P2D, the fuzz list's n = 16 case): with 4 (or all 15) opened at
# once, calls to the replicas stalled in the router replica's Serve handle routing ("Failed to
# get queue length ... within 0.1s", calls released ~10 s apart, KV leases expiring) and the
# request outlived the client's 60 s; with 1, n = 16 answered in 7 s with no stall. Each
# sibling's first event comes after its prefill, so the siblings' prefills are serialized
# (their decodes run together); the stall's cause inside Serve is not found.
SIBLING_WAVE = 1


@dataclass(frozen=True)
class ChoiceEvent:
    index: int  # the choice, 0..n-1
    event: TokenEvent | FinalEvent


def sibling(base: InternalRequest, i: int, placed: Sequence | None) -> InternalRequest:
    """Choice i's request: its own id and seed, pinned to the pair choice 0 ran on."""
    seed = base.sampling.seed
    sampling = base.sampling if seed is None else dataclasses.replace(base.sampling, seed=(seed + i) % (v.MAX_SEED + 1))
    return dataclasses.replace(base, request_id=f"{base.request_id}-{i}", sampling=sampling, pin=tuple(placed or ()))


def total_usage(finals: Sequence[FinalEvent]) -> Usage:
    """The prompt once (choice 0's counts), the completion tokens of every choice."""
    head = finals[0].usage
    return dataclasses.replace(head, completion_tokens=sum(f.usage.completion_tokens for f in finals))


def fan_out(orchestrator: Orchestrator, base: InternalRequest, n: int) -> Choices:
    """Open choice 0 now (its refusals raise here, before any event) and return the n choices'
    events, merged; iterate under `contextlib.aclosing` (closing aborts every choice still
    running)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return Choices(orchestrator, base, n)


class Choices:
    """The merged events of n choices (an async iterator with `aclose`)."""

    def __init__(self, orchestrator: Orchestrator, base: InternalRequest, n: int) -> None:
        self._orchestrator, self._request_id = orchestrator, base.request_id
        self._events = _merged(orchestrator, base, n, orchestrator.open(base))
        self._started = False

    def __aiter__(self) -> Choices:
        return self

    async def __anext__(self) -> ChoiceEvent:
        self._started = True
        return await self._events.__anext__()

    async def aclose(self) -> None:
        """Abort what still runs; before the first event only choice 0 was opened (and a
        generator that never ran has no cleanup of its own)."""
        if not self._started:
            await self._orchestrator.abort(self._request_id)
        await self._events.aclose()


async def _merged(orchestrator: Orchestrator, base: InternalRequest, n: int, first_run) -> AsyncIterator[ChoiceEvent]:
    queue: asyncio.Queue[ChoiceEvent | BaseException] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(orchestrator, first_run, 0, queue))]
    finals, out = 0, set()  # choices whose first event arrived
    try:
        while finals < n:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            out.add(item.index)
            # once choice 0 is out (its pair holds the prompt), open the siblings, at most
            # SIBLING_WAVE of them waiting for their first event at a time
            while 0 in out and len(tasks) < n and len(tasks) - len(out) < SIBLING_WAVE:
                i = len(tasks)
                run = orchestrator.open(sibling(base, i, first_run.placed))
                tasks.append(asyncio.ensure_future(_pump(orchestrator, run, i, queue)))
            finals += isinstance(item.event, FinalEvent)
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(orchestrator: Orchestrator, run, index: int, queue: asyncio.Queue) -> None:
    try:
        async with contextlib.aclosing(orchestrator.stream(run)) as events:
            async for event in events:
                queue.put_nowait(ChoiceEvent(index, event))
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
        queue.put_nowait(exc)


async def collect(events: Choices, n: int) -> list[tuple[list[TokenEvent], FinalEvent]]:
    """Every choice's tokens and final, in choice order (non-streaming responses), from
    `fan_out`'s events."""
    tokens: list[list[TokenEvent]] = [[] for _ in range(n)]
    finals: list[FinalEvent | None] = [None] * n
    async with contextlib.aclosing(events):
        async for item in events:
            if isinstance(item.event, FinalEvent):
                finals[item.index] = item.event
            else:
                tokens[item.index].append(item.event)
    return [(t, f) for t, f in zip(tokens, finals, strict=True) if f is not None]
