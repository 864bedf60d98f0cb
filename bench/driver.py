"""Closed-loop replay of AgentX-like session trees against a Backend.

C lanes each replay one session tree, request after request, sleeping each think time (capped,
see pacing.py) in between; when a tree ends the lane starts the next one from turn 0 under a new
salt and new session ids. Timeline of one run:

    lane:  [primer][warm-up x W] [pre ...] [measure ... measure]  drain
    run:   |------- warm-up -----|------- window (window_s) -------|----->
                                 ^ every lane warm                 ^ no new requests

A lane's first tree starts at a random request 25-75% in; the request before it goes first as a
primer (max_tokens=1) so the server holds the prefix, then W warm-up requests. The window opens
when every lane has finished its warm-up; requests started inside it are phase MEASURE. When the
window closes, lanes stop sending and in-flight requests drain (up to drain_timeout_s). Ctrl-C
stops at once: in-flight requests are cancelled and recorded, and the records so far are kept.

Outputs are spliced: with ignore_eos a request returns exactly max_tokens ids, and later prompts
of the same session carry the ids the server produced in place of the workload's synthetic ones,
so the server's own decode-side KV can be reused as it would be in a real session.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from flashpd.bench.backend import Backend, BackendError, Completion, GenerateCall
from flashpd.bench.pacing import IdlePacer
from flashpd.bench.prompts import PromptBuilder
from flashpd.bench.records import STOPPED_IN_FLIGHT, Phase, RequestRecord, RunMeta
from flashpd.bench.tokens import derive_key
from flashpd.bench.workload import Request, SessionTree, Workload

_LANE_SALT_TAG = 7
TREE_IDLE_CAP_S = 300.0
SYSTEM_IDLE_CAP_S = 10.0


@dataclass(frozen=True)
class DriverConfig:
    concurrency: int
    window_s: float
    warmup_requests: int = 10
    tree_idle_cap_s: float = TREE_IDLE_CAP_S
    system_idle_cap_s: float = SYSTEM_IDLE_CAP_S
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 600.0
    max_consecutive_errors: int = 50  # the run aborts (keeping its records) past this
    seed: int = 0
    salt_epoch: int = 0  # change it to re-run against a server whose cache is still warm
    splice_outputs: bool = True
    show_progress: bool = True
    handle_sigint: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.window_s <= 0 or self.warmup_requests < 0:
            raise ValueError(f"need concurrency >= 1, window_s > 0, warmup_requests >= 0: {self}")
        if self.request_timeout_s <= 0 or self.drain_timeout_s < 0 or self.max_consecutive_errors < 1:
            raise ValueError(f"bad timeouts or error limit: {self}")

    @classmethod
    def for_time_scale(cls, time_scale: float, **kwargs: object) -> DriverConfig:
        """Idle caps divided by the workload's time_scale, unless given."""
        kwargs.setdefault("tree_idle_cap_s", TREE_IDLE_CAP_S / time_scale)
        kwargs.setdefault("system_idle_cap_s", SYSTEM_IDLE_CAP_S / time_scale)
        return cls(**kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RunResult:
    meta: RunMeta
    records: list[RequestRecord]


class LaneFailure(RuntimeError):
    """A lane hit an unexpected error (a bug, not a request failure); carries the partial run."""

    def __init__(self, message: str, result: RunResult) -> None:
        super().__init__(message)
        self.result = result


class _Run:
    """Shared state of one run: clock, window, stop flags, records.

    The clock is the running loop's `time()`: real in runs, virtual in tests (bench/clock.py).
    """

    def __init__(self, config: DriverConfig, on_record: Callable[[RequestRecord], None] | None) -> None:
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.pacer = IdlePacer(config.tree_idle_cap_s, config.system_idle_cap_s)
        self.stopped = asyncio.Event()
        self.records: list[RequestRecord] = []
        self.on_record = on_record
        self.lanes_warm = 0
        self.window_start_s: float | None = None
        self.window_end_s: float | None = None
        self.interrupted = False
        self.aborted_reason: str | None = None
        self.failure: BaseException | None = None
        self._consecutive_errors = 0

    def now_s(self) -> float:
        return self.loop.time() - self.t0

    def lane_warmed(self) -> None:
        self.lanes_warm += 1
        if self.lanes_warm == self.config.concurrency and not self.stopped.is_set():
            self.window_start_s = self.now_s()
            self.window_end_s = self.window_start_s + self.config.window_s
            self.loop.call_later(self.config.window_s, self.stop)

    def send_phase(self) -> Phase | None:
        """Phase of a request sent now by a warm lane; None once the run is stopping."""
        if self.stopped.is_set():
            return None
        return Phase.PRE if self.window_start_s is None else Phase.MEASURE

    def stop(self) -> None:
        self.stopped.set()
        self.pacer.close()

    def interrupt(self) -> None:
        self.interrupted = True
        self._cut_window()
        self.stop()

    def fail(self, exc: BaseException) -> None:
        self.failure = exc
        self.aborted_reason = f"lane failure: {exc!r}"
        self._cut_window()
        self.stop()

    def record(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)
        self._consecutive_errors = 0 if record.ok else self._consecutive_errors + 1
        if self._consecutive_errors >= self.config.max_consecutive_errors and not self.stopped.is_set():
            self.aborted_reason = f"{self._consecutive_errors} consecutive errors, last: {record.error}"
            self._cut_window()
            self.stop()

    def _cut_window(self) -> None:
        if self.window_end_s is not None and not self.stopped.is_set():
            self.window_end_s = min(self.window_end_s, self.now_s())

    @property
    def hard_stop(self) -> bool:
        return self.interrupted or self.aborted_reason is not None


class _TokenTimer:
    """Collects streamed ids and their arrival gaps (a chunk of k ids counts k gaps of gap/k)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, start: float) -> None:
        self.loop = loop
        self.start = start
        self.first_s: float | None = None
        self.last = start
        self.itl_s: list[float] = []
        self.ids: list[int] = []

    def on_tokens(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            return
        now = self.loop.time()
        count = len(token_ids)
        if self.first_s is None:
            self.first_s = now - self.start
            self.itl_s.extend([0.0] * (count - 1))
        else:
            self.itl_s.extend([(now - self.last) / count] * count)
        self.last = now
        self.ids.extend(token_ids)


class _Lane:
    def __init__(self, lane: int, run: _Run, workload: Workload, backend: Backend) -> None:
        self.lane = lane
        self.run = run
        self.workload = workload
        self.backend = backend
        self.config = run.config
        self.warmup_left = run.config.warmup_requests
        self.prompts = PromptBuilder(workload.token_space, run.config.splice_outputs)

    async def replay(self) -> None:
        try:
            await self._replay_trees()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.run.fail(exc)
            raise

    async def _replay_trees(self) -> None:
        for ordinal in itertools.count():
            tree = self._tree(ordinal)
            self.prompts.clear()
            start = 0
            if ordinal == 0:
                start = self._start_index(tree)
                await self._prime(tree, start)
            for request in tree.requests[start:]:
                think_s = await self.run.pacer.think(self.lane, request.think_s)
                phase = Phase.WARMUP if self.warmup_left > 0 else self.run.send_phase()
                if phase is None or self.run.stopped.is_set():
                    return
                await self._send(request, phase, think_s)
                if phase is Phase.WARMUP:
                    self._warmup_done()

    async def _prime(self, tree: SessionTree, start: int) -> None:
        """Sends the main agent's previous turn (max_tokens=1) so the server holds its prefix."""
        turn = tree.requests[start].turn_index
        if turn > 0 and not self.run.stopped.is_set():
            previous = next(
                r for r in reversed(tree.requests[:start]) if not r.is_subagent and r.turn_index == turn - 1
            )
            await self._send(previous, Phase.PRIMER, 0.0, max_tokens=1)
        if self.warmup_left == 0:
            self.run.lane_warmed()

    def _warmup_done(self) -> None:
        self.warmup_left -= 1
        if self.warmup_left == 0:
            self.run.lane_warmed()

    def _tree(self, ordinal: int) -> SessionTree:
        c, trees = self.config.concurrency, self.workload.trees
        tree = trees[(self.lane + ordinal * c) % len(trees)]
        salt = derive_key(self.config.seed, self.config.salt_epoch, c, self.lane, ordinal, _LANE_SALT_TAG)
        prefix = f"e{self.config.salt_epoch}-c{c}-l{self.lane}-n{ordinal}-t{tree.tree_id}"
        return tree.instantiate(salt, prefix)

    def _start_index(self, tree: SessionTree) -> int:
        """The first main-agent request at or after a random point 25-75% into the tree."""
        rng = np.random.default_rng([self.config.seed, self.config.salt_epoch, self.config.concurrency, self.lane])
        point = int(rng.uniform(0.25, 0.75) * len(tree.requests))
        main = [r.index for r in tree.requests if not r.is_subagent]
        return next((i for i in main if i >= point), main[-1])

    async def _send(self, request: Request, phase: Phase, think_s: float, max_tokens: int | None = None) -> None:
        call = GenerateCall(
            prompt_ids=self.prompts.build(request).tolist(),
            max_tokens=request.max_tokens if max_tokens is None else max_tokens,
            session_id=request.session_id,
            parent_session_id=request.parent_session_id,
            timeout_s=self.config.request_timeout_s,
        )
        timer = _TokenTimer(self.run.loop, self.run.loop.time())
        start_s = self.run.now_s()
        outcome = _Outcome()
        self.run.pacer.request_started()
        try:
            outcome.completion = await asyncio.wait_for(
                self.backend.generate(call, timer.on_tokens), self.config.request_timeout_s + 5.0
            )
        except BackendError as exc:
            outcome.error_type, outcome.error = exc.kind, exc.message
        except asyncio.TimeoutError:
            outcome.error_type, outcome.error = ("ClientTimeout", f"no result after {self.config.request_timeout_s} s")
        except asyncio.CancelledError:
            outcome.error_type, outcome.error = "Cancelled", STOPPED_IN_FLIGHT
            raise
        finally:
            self.run.pacer.request_finished()
            self.run.record(
                _record(self.lane, phase, request, call, think_s, start_s, self.run.now_s(), timer, outcome)
            )
        if outcome.completion is not None and len(timer.ids) == call.max_tokens:
            self.prompts.record_output(request, timer.ids)


@dataclass
class _Outcome:
    completion: Completion | None = None
    error_type: str | None = None
    error: str | None = None


def _record(
    lane: int,
    phase: Phase,
    request: Request,
    call: GenerateCall,
    think_s: float,
    start_s: float,
    end_s: float,
    timer: _TokenTimer,
    outcome: _Outcome,
) -> RequestRecord:
    done = outcome.completion
    return RequestRecord(
        lane=lane,
        phase=phase,
        tree_id=request.tree_id,
        request_index=request.index,
        agent=request.agent,
        session_id=request.session_id,
        parent_session_id=request.parent_session_id,
        turn_index=request.turn_index,
        think_s=think_s,
        start_s=start_s,
        end_s=end_s,
        ttft_s=timer.first_s,
        itl_s=timer.itl_s,
        prompt_tokens=len(call.prompt_ids),
        expected_output_tokens=call.max_tokens,
        output_tokens=len(timer.ids),
        ideal_cached_tokens=request.ideal_cached_tokens,
        cached_tokens=None if done is None else done.cached_tokens,
        cached_tokens_prefill=None if done is None else done.cached_tokens_prefill,
        cached_tokens_decode=None if done is None else done.cached_tokens_decode,
        prefill_worker=None if done is None else done.prefill_worker,
        decode_worker=None if done is None else done.decode_worker,
        request_id=None if done is None else done.request_id,
        finish_reason=None if done is None else done.finish_reason,
        error_type=outcome.error_type,
        error=outcome.error,
        timeline={} if done is None else dict(done.timeline),
        draft_tokens=None if done is None else done.draft_tokens,
        accepted_draft_tokens=None if done is None else done.accepted_draft_tokens,
        draft_steps=None if done is None else done.draft_steps,
        forced_acceptance_length=None if done is None else done.forced_acceptance_length,
    )


@contextlib.contextmanager
def _sigint_stops(run: _Run, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    run.loop.add_signal_handler(signal.SIGINT, run.interrupt)
    try:
        yield
    finally:
        run.loop.remove_signal_handler(signal.SIGINT)


async def _show_progress(run: _Run, enabled: bool) -> None:
    from tqdm import tqdm

    total_s = max(1, int(round(run.config.window_s)))
    with tqdm(total=total_s, unit="s", file=sys.stderr, disable=not enabled, leave=False) as bar:
        while not run.stopped.is_set():
            if run.window_start_s is None:
                bar.set_description(f"warm-up {run.lanes_warm}/{run.config.concurrency} lanes")
            else:
                bar.set_description(f"C={run.config.concurrency} window")
                bar.n = min(total_s, int(run.now_s() - run.window_start_s))
            errors = sum(not r.ok for r in run.records)
            bar.set_postfix(requests=len(run.records), errors=errors, in_flight=run.pacer.in_flight)
            bar.refresh()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run.stopped.wait(), 0.5)


async def run_closed_loop(
    workload: Workload,
    backend: Backend,
    config: DriverConfig,
    *,
    name: str,
    target: str,
    num_gpus: int,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    run = _Run(config, on_record)
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with _sigint_stops(run, config.handle_sigint):
        progress = asyncio.create_task(_show_progress(run, config.show_progress))
        lanes = [asyncio.create_task(_Lane(i, run, workload, backend).replay()) for i in range(config.concurrency)]
        await run.stopped.wait()
        drain_s = 0.0 if run.hard_stop else config.drain_timeout_s
        _, pending = await asyncio.wait(lanes, timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*lanes, progress, return_exceptions=True)
    meta = RunMeta(
        name=name,
        target=target,
        concurrency=config.concurrency,
        num_gpus=num_gpus,
        window_s=config.window_s,
        window_start_s=run.window_start_s,
        window_end_s=run.window_end_s,
        interrupted=run.interrupted,
        aborted_reason=run.aborted_reason,
        started_at=started_at,
        workload=workload.config.to_dict(),
        driver=asdict(config),
    )
    result = RunResult(meta, run.records)
    if run.failure is not None:
        raise LaneFailure(str(run.aborted_reason), result) from run.failure
    return result
