"""The Ray Serve deployment base for the prefill, decode and colocated workers.

Each replica is one worker: its worker id is its Serve replica id (so `PinnedWorkerRouter`
can send the router's chosen worker exactly its calls), its incarnation is new per process.
A replica registers itself in Redis, publishes its cache events and heartbeat from a small
background thread (off the engine's step loop), survives Redis pauses and restarts (retrying,
then re-registering and re-publishing its cached chunks), and deregisters on graceful shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

from flashpd.engine.loading import load_engine
from flashpd.services.api import Event, InternalRequest, Unavailable, WorkerRef, WorkerStats
from flashpd.services.worker.common import WorkerConfig, new_worker_ref

log = logging.getLogger(__name__)
DRAIN_DEADLINE_S = 30.0  # a drain started by a Redis mark (streams that cannot move finish)


def _replica_worker_id(role: str) -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (direct construction in tests)
        return new_worker_ref(role).worker_id


class RedisPublisher:
    """Redis registration, heartbeat and cache-event publishing on a private asyncio loop.

    It never gives up: a failed round (Redis paused, killed, unreachable; a call that exceeds
    `op_timeout_s`) is retried with exponential backoff up to `max_backoff_s`. After a failure,
    and whenever a heartbeat finds this worker missing from the registry (a fresh, empty Redis),
    it registers again and re-publishes every chunk the engine holds (`snapshot`: AllCleared +
    BlockStored of all cached hashes), so prefix hits come back without a restart.
    """

    def __init__(
        self,
        redis_url: str,
        model_id: str,
        ref: WorkerRef,
        stats,
        drain_events,
        snapshot,
        interval_s: float,
        *,
        op_timeout_s: float = 2.0,
        max_backoff_s: float = 2.0,
        on_drain_mark=None,
    ):
        """`on_drain_mark`: an async callable run (once) on this thread's loop when the
        worker finds itself marked draining in Redis (an operator's `flashpd drain`, the
        autoscaler's scale-down)."""
        self._url, self._model_id, self._ref = redis_url, model_id, ref
        self._on_drain_mark, self._drain_task = on_drain_mark, None
        self._stats, self._drain_events, self._snapshot = stats, drain_events, snapshot
        self._interval_s, self._op_timeout_s = interval_s, op_timeout_s
        self._max_backoff_s = max(max_backoff_s, interval_s)
        self.registered = False  # the last round succeeded
        self.republished = 0  # full snapshots published (first registration included)
        self.failures = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flashpd-publisher", daemon=True)
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self._main(), self._loop)

    async def _main(self) -> None:
        import redis.asyncio as aioredis

        from flashpd.services.router.index import IndexPublisher

        self.redis = aioredis.from_url(
            self._url, socket_timeout=self._op_timeout_s, socket_connect_timeout=self._op_timeout_s
        )
        self.publisher = IndexPublisher(self.redis, self._model_id)
        fresh, backoff_s = True, self._interval_s
        while True:
            try:
                await asyncio.wait_for(self._round(fresh), 4 * self._op_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried forever; the worker keeps serving
                self._count_failure(exc)
                fresh = True
                await asyncio.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, self._max_backoff_s)
                continue
            if fresh:
                log.info("%s: registered in Redis, cached chunks published", self._ref.key)
            self.registered, fresh, backoff_s = True, False, self._interval_s
            await asyncio.sleep(self._interval_s)

    def _count_failure(self, exc: Exception) -> None:
        """A failed round; logged on the first failure after a success (and the very first)."""
        self.failures += 1
        if self.registered or self.failures == 1:
            log.warning(
                "%s: Redis publishing failed (%r); retrying, and re-publishing every cached chunk once Redis answers",
                self._ref.key,
                exc,
            )
        self.registered = False

    async def _round(self, fresh: bool) -> None:
        if fresh:
            await self.publisher.register(self._stats())
            await self._republish()
            return
        events = self._drain_events()
        if events:
            await self.publisher.publish(self._ref, events)
        if await self.publisher.heartbeat(self._stats()):  # we were missing: a fresh Redis
            log.warning("%s: missing from the Redis registry; re-publishing every cached chunk", self._ref.key)
            await self._republish()
        if self._on_drain_mark is not None:
            await self._follow_drain_mark()

    async def _follow_drain_mark(self) -> None:
        """Drain once marked draining in Redis; serve again once the mark is removed."""
        marked = await self.publisher.is_marked_draining(self._ref)
        if marked and self._drain_task is None:
            log.warning("%s: marked draining in Redis; draining", self._ref.key)
            self._drain_task = asyncio.ensure_future(self._on_drain_mark(True))
        elif not marked and self._drain_task is not None and self._drain_task.done():
            log.warning("%s: drain mark removed; serving again", self._ref.key)
            self._drain_task = None
            await self._on_drain_mark(False)

    async def _republish(self) -> None:
        await self.publisher.publish(self._ref, self._snapshot())
        self.republished += 1

    def mark_draining(self, timeout_s: float = 5.0) -> None:
        """Mark this worker draining in Redis now (routers place nothing new here); raises
        when Redis does not answer in time."""
        while not hasattr(self, "publisher"):  # _main sets it first thing
            time.sleep(0.01)
        fut = asyncio.run_coroutine_threadsafe(self.publisher.mark_draining(self._ref), self._loop)
        fut.result(timeout_s)

    def health_error(self) -> str | None:
        if not self._thread.is_alive():
            return "the Redis publisher thread stopped"
        if self._task.done():
            error = None if self._task.cancelled() else self._task.exception()
            return f"the Redis publisher task ended: {error!r}"
        return None

    def stop(self, ref: WorkerRef) -> None:
        async def _stop():
            self._task.cancel()
            publisher = getattr(self, "publisher", None)
            if publisher is not None:
                await asyncio.wait_for(publisher.deregister(ref), self._op_timeout_s)
                await self.redis.aclose()

        fut = asyncio.run_coroutine_threadsafe(_stop(), self._loop)
        try:
            fut.result(10)
        except Exception as exc:  # noqa: BLE001 - shutdown must not hang on Redis
            log.warning("deregistering %s failed: %r", ref.key, exc)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)


class WorkerDeployment:
    """One engine worker as a Serve replica; the role folders subclass it (`prefill/deployment.py`,
    `decode/deployment.py`) with their calls and `_make_worker`."""

    role = ""

    def __init__(self, config: WorkerConfig):
        engine = load_engine(config.checkpoint, config.engine)
        _return_cached_gpu_memory(config)
        ref = new_worker_ref(self.role, _replica_worker_id(self.role))
        self.worker = self._make_worker(engine, config, ref)
        self.ref = ref
        self._publisher = None
        if config.redis_url:
            engine = self.worker.engine
            self._publisher = RedisPublisher(
                # stats and events never wait for a step: a long forward must not make this
                # live worker's heartbeat lapse (the router would reap it)
                config.redis_url,
                config.model_id,
                ref,
                self.worker.stats_now,
                engine.take_cache_events,
                lambda: engine.cache_snapshot(5.0),
                config.heartbeat_interval_s,
                on_drain_mark=self._drained_by_mark,
            )

    def _make_worker(self, engine, config, ref):
        raise TypeError("subclasses build their worker")

    async def _drained_by_mark(self, marked: bool) -> None:
        """Marked draining in Redis (or the mark removed): what the role does then (decode:
        live migration; serving again)."""

    def _check_target(self, target_worker: str | None) -> None:
        if target_worker is not None and target_worker != self.ref.worker_id:
            raise Unavailable(f"worker {target_worker} is gone (reached {self.ref.worker_id})")

    async def abort(self, request_id: str, target_worker: str | None = None) -> bool:
        self._check_target(target_worker)
        return await self.worker.abort(request_id)

    async def stats(self, target_worker: str | None = None) -> WorkerStats:
        self._check_target(target_worker)
        return await self.worker.stats()

    def check_health(self) -> None:
        """Serve replaces a replica whose check fails: its engine loop died, a loop hook (KV
        transfer progress, cache events) keeps failing, or the Redis publisher stopped. Redis
        itself being down is not the replica's fault and does not fail it."""
        error = self.worker.health_error()
        if error is None and self._publisher is not None:
            error = self._publisher.health_error()
        if error is not None:
            raise RuntimeError(f"{self.ref.key} unhealthy: {error}")

    async def __del__(self) -> None:
        """Graceful shutdown: leave the Redis index first, then stop the engine."""
        publisher = getattr(self, "_publisher", None)
        if publisher is not None:
            await asyncio.to_thread(publisher.stop, self.ref)
        worker = getattr(self, "worker", None)
        if worker is not None:
            await worker.close()


class StreamingDeployment(WorkerDeployment):
    """A worker that streams tokens to the router (decode, colocated): `generate` and the drain,
    whose meaning is the role's `_drain_worker` (decode: live migration; colocated: the streams
    finish in place)."""

    async def generate(self, req: InternalRequest, target_worker: str | None = None) -> AsyncIterator[Event]:
        self._check_target(target_worker)
        events = self.worker.generate(req)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    async def _drain_worker(self, deadline_s: float) -> int:
        raise TypeError("subclasses say what draining does")

    async def _drained_by_mark(self, marked: bool) -> None:
        if marked:
            await self._drain_worker(DRAIN_DEADLINE_S)
        else:
            self.worker.undrain()

    async def drain(self, deadline_s: float = DRAIN_DEADLINE_S, target_worker: str | None = None) -> int:
        """Mark this worker draining in Redis first (no router places a new request here), then
        `_drain_worker`. Returns how many streams it had."""
        self._check_target(target_worker)
        if self._publisher is not None:
            await asyncio.to_thread(self._publisher.mark_draining)
        return await self._drain_worker(deadline_s)


def _return_cached_gpu_memory(config: WorkerConfig) -> None:
    """After load and warm-up, give the caching allocator's unused reserve back to the driver:
    replicas sharing one GPU would otherwise each keep their warm-up peak."""
    if not config.engine.device.startswith("cuda"):
        return
    import torch

    torch.cuda.empty_cache()
    log.warning(
        "%s engine ready: %.1f GiB allocated, %.1f GiB reserved on %s",
        config.engine.role,
        torch.cuda.memory_allocated() / 2**30,
        torch.cuda.memory_reserved() / 2**30,
        config.engine.device,
    )
