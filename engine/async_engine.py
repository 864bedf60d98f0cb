"""AsyncLLMEngine: the step loop on its own thread, an asyncio face for servers.

Every engine mutation runs on the loop thread: callers submit commands (`call`), which run
between steps, so the engine itself needs no locks. Outputs are fanned out to per-request
asyncio queues on the caller's event loop.

    async for out in engine.generate(rid, prompt_ids, params):   # colocated / decode role
        ...
    ready = await engine.prefill(rid, prompt_ids)                  # prefill role -> kv_ready

`hooks` run on the loop thread once per iteration (after commands, before a step): the decode
server polls KV-transfer completions there. `output_hooks` run on the loop thread with each
finished output of a step, before it is delivered and before the loop's own bookkeeping: the
prefill server posts a KV push there the moment the KV is in the pools, a hop onto the event
loop earlier (on the H200 the post itself cost the same from either thread).
An output hook that raises is logged; the output is delivered all the same.

Views that never wait for a step: after every iteration the loop thread stores the engine's
`usage()` counters (`usage_now`) and moves its prefix-cache events into a queue
(`take_cache_events`). A worker's heartbeat reads them from another thread: a forward that
runs for seconds (a 2,048-token prefill step is ~6 s on a 2-core CPU) must not make a live
worker look dead (a heartbeat blocked on the loop times out, its key expires and the router
reaps the worker; with every worker of a role in such a step, a new request found none).

Containment: a request that fails inside a step (its sampling, or the forward of its batch)
ends alone: its stream raises `RequestFailed`, and the loop goes on. A hook that raises is
logged and retried next iteration; after `MAX_HOOK_FAILURES` consecutive failures the loop
reports itself unhealthy (`health_error`), so the replica's health check fails and it is
replaced. Only an exception outside those (a bug in the scheduler's bookkeeping) stops the loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from flashpd.engine.llm_engine import EngineOutput, LLMEngine
from flashpd.engine.request import PrefixPolicy
from flashpd.engine.sampling import SamplingParams

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.005
MAX_HOOK_FAILURES = 50  # consecutive failures of one hook before the loop reports unhealthy


class EngineDead(RuntimeError):
    """The step loop stopped (an exception in a step, or shutdown)."""


class RequestFailed(RuntimeError):
    """One request failed inside a step; the engine and every other request go on."""

    def __init__(self, request_id: str, reason: str):
        self.request_id, self.reason = request_id, reason
        super().__init__(f"request {request_id!r} failed in the engine: {reason}")


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = _IDLE_WAIT_S):
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.hooks: list[Callable[[LLMEngine], None]] = []
        self.output_hooks: list[Callable[[EngineOutput], None]] = []
        # hook(request_id, kv_block_ids, final_tokens) on the loop thread before a kv_ready
        # step's kernels are waited for (LLMEngine.kv_pending_hooks); its output hook follows
        self.kv_pending_hooks: list[Callable[[str, tuple[int, ...], int], None]] = getattr(
            engine, "kv_pending_hooks", []
        )
        # What closing an unfinished stream does, on the loop thread (default: abort). The decode
        # worker replaces it to keep blocks that a KV write may still reach.
        self.on_unfinished_close: Callable[[LLMEngine, str], Any] = lambda e, request_id: e.abort(request_id)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._error: BaseException | None = None
        self._hook_failures: dict[int, int] = {}  # hook index -> consecutive failures
        self._hook_error: BaseException | None = None
        self._usage: dict[str, int] = engine.usage()  # replaced whole by the loop thread
        self._cache_events: collections.deque = collections.deque()  # loop thread appends
        self._thread = threading.Thread(target=self._loop, name="flashpd-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ commands
    def call_sync(self, fn: Callable[[LLMEngine], Any], timeout_s: float | None = 60.0) -> Any:
        """Run fn(engine) on the loop thread and wait for its result (from a non-loop thread)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(fn, fut)
        return fut.result(timeout_s)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(fn, fut)
        return await asyncio.wrap_future(fut)

    def wake(self) -> None:
        """End the loop's idle wait now (another thread has news for a hook: a KV notice)."""
        self._wake.set()

    def _submit(self, fn, fut) -> None:
        if self._error is not None or self._stop.is_set():
            raise EngineDead(f"engine loop is not running: {self._error!r}")
        self._commands.put((fn, fut))
        self._wake.set()

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        request_id: str,
        prompt_ids,
        params: SamplingParams,
        session_id: str | None = None,
        prefix: PrefixPolicy | None = None,
    ) -> AsyncIterator[EngineOutput]:
        """Colocated role: add and stream. Cancelling the consumer aborts the request."""
        stream = self._open(request_id)
        try:
            await self.call(lambda e: e.add_request(request_id, prompt_ids, params, session_id, prefix))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        inner = self._drain(request_id, stream)
        try:
            async for out in inner:
                yield out
        finally:  # close (and so abort) as soon as the consumer leaves, not at GC time
            await inner.aclose()

    async def stream(self, request_id: str) -> AsyncIterator[EngineOutput]:
        """Stream outputs of a request already admitted (decode role after reserve)."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"request {request_id!r} has no open stream")
        inner = self._drain(request_id, stream[1])
        try:
            async for out in inner:
                yield out
        finally:
            await inner.aclose()

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the step loop, if it died."""
        return self._error

    def health_error(self) -> str | None:
        """Why this engine cannot serve (loop dead or stopped, a hook failing on every
        iteration), or None when healthy."""
        if self._error is not None:
            return f"engine loop died: {self._error!r}"
        if not self._thread.is_alive():
            return "engine loop is not running"
        if self._hook_error is not None:
            return f"engine hook keeps failing: {self._hook_error!r}"
        return None

    def usage_now(self) -> dict[str, int]:
        """The engine's `usage()` as of its last loop iteration (any thread, never waits)."""
        return self._usage

    def take_cache_events(self) -> list:
        """Prefix-cache events since the last call, in order (any thread, never waits)."""
        events = []
        while True:
            try:
                events.append(self._cache_events.popleft())
            except IndexError:
                return events

    def cache_snapshot(self, timeout_s: float | None = 60.0) -> list:
        """Every cached chunk as events (re-publish after index loss); events queued before it
        are dropped (the snapshot starts with AllCleared and covers them)."""

        def snapshot(e: LLMEngine) -> list:
            self._cache_events.clear()
            return e.drain_cache_snapshot()

        return self.call_sync(snapshot, timeout_s)

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    def open_stream(self, request_id: str) -> None:
        """Create the output queue before the request is admitted (so no output is missed)."""
        self._open(request_id)

    async def prefill(self, request_id: str, prompt_ids, prefix: PrefixPolicy | None = None) -> EngineOutput:
        """Prefill role: run the encoder path; returns the kv_ready output (blocks held)."""
        params = SamplingParams(max_tokens=1)
        last = None
        async for out in self.generate(request_id, prompt_ids, params, prefix=prefix):
            last = out
        if last is None or last.finish_reason != "kv_ready":
            raise RuntimeError(f"prefill of {request_id!r} ended with {last and last.finish_reason}")
        return last

    async def abort(self, request_id: str) -> bool:
        found = await self.call(lambda e: e.abort(request_id))
        self.close_stream(request_id, abort=True)
        return found

    def _open(self, request_id: str) -> asyncio.Queue:
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} already has an open stream")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    async def _drain(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[EngineOutput]:
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, EngineOutput) and item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                try:
                    await self.call(lambda e: self.on_unfinished_close(e, request_id))
                except EngineDead:
                    pass

    def mark(self, request_id: str, marker: object) -> None:
        """On the loop thread: put `marker` in the request's stream after every output
        delivered so far (its consumer receives it in order)."""
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, marker)

    def close_stream(self, request_id: str, abort: bool) -> None:
        """Drop a request's output queue; with abort, its consumer sees CancelledError."""
        entry = self._streams.pop(request_id, None)
        if entry is not None and abort:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, asyncio.CancelledError(f"{request_id} aborted"))

    # ------------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_commands()
                self._run_hooks()
                self._publish_views()  # what admissions and aborts changed, before a long step
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        if out.finished and self.output_hooks:
                            self._run_output_hooks(out)
                        self._deliver(out)
                    self._publish_views()
                else:
                    self._wait_for_command()
        except BaseException as exc:  # surface to every waiter, never hang them
            log.exception("engine loop died")
            self._error = exc
            for loop, q in list(self._streams.values()):
                loop.call_soon_threadsafe(q.put_nowait, EngineDead(repr(exc)))
            self._fail_pending(exc)

    def _publish_views(self) -> None:
        self._cache_events.extend(self.engine.drain_cache_events())
        self._usage = self.engine.usage()

    def _run_hooks(self) -> None:
        for index, hook in enumerate(list(self.hooks)):
            try:
                hook(self.engine)
            except Exception as exc:  # noqa: BLE001 - retried next iteration; health reports it
                failures = self._hook_failures.get(index, 0) + 1
                self._hook_failures[index] = failures
                if failures == 1 or failures % MAX_HOOK_FAILURES == 0:
                    log.exception("engine hook %r failed (%d in a row)", hook, failures)
                if failures >= MAX_HOOK_FAILURES:
                    self._hook_error = exc
            else:
                if self._hook_failures.pop(index, None) is not None and not any(self._hook_failures.values()):
                    self._hook_error = None

    def _run_output_hooks(self, out: EngineOutput) -> None:
        for hook in list(self.output_hooks):
            try:
                hook(out)
            except Exception:  # noqa: BLE001 - the output is delivered; its owner sees its state
                log.exception("output hook %r failed on %s", hook, out.request_id)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except Exception as exc:
                fut.set_exception(exc)

    def _wait_for_command(self) -> None:
        self._wake.wait(self._idle_wait_s)
        self._wake.clear()

    def _fail_pending(self, exc: BaseException) -> None:
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            fut.set_exception(EngineDead(repr(exc)))

    def _deliver(self, out: EngineOutput) -> None:
        entry = self._streams.get(out.request_id)
        if entry is not None:
            loop, q = entry
            item = out if out.error is None else RequestFailed(out.request_id, out.error)
            loop.call_soon_threadsafe(q.put_nowait, item)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
