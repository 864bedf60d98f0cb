"""Ray Serve deployment classes for the prefill and decode workers.

Each replica is one worker: its worker id is its Serve replica id (so `PinnedWorkerRouter`
can send the router's chosen worker exactly its calls), its incarnation is new per process.
A replica registers itself in Redis, publishes its cache events and heartbeat from a small
background thread (off the engine's step loop), and deregisters on graceful shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from flashpd.engine.llm_engine import EngineConfig
from flashpd.engine.loading import load_engine
from flashpd.services.api import (
    Event,
    InternalRequest,
    PrefillResult,
    Ticket,
    Unavailable,
    WorkerRef,
    WorkerStats,
)
from flashpd.services.worker_common import WorkerConfig, new_worker_ref

log = logging.getLogger(__name__)


def _replica_worker_id(role: str) -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (direct construction in tests)
        return new_worker_ref(role).worker_id


class _Publisher:
    """Redis registration, heartbeat and cache-event publishing on a private asyncio loop."""

    def __init__(self, redis_url: str, model_id: str, stats, drain_events, interval_s: float):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flashpd-publisher",
                                        daemon=True)
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(
            self._start(redis_url, model_id, stats, drain_events, interval_s), self._loop)
        try:
            started.result(30)
        except Exception as exc:
            raise Unavailable(f"could not register with Redis at {redis_url}: {exc}") from exc

    async def _start(self, redis_url, model_id, stats, drain_events, interval_s) -> None:
        import redis.asyncio as aioredis

        from flashpd.services.router.index import IndexPublisher

        self.redis = aioredis.from_url(redis_url)
        self.publisher = IndexPublisher(self.redis, model_id)
        await self.publisher.register(stats())
        self._task = asyncio.create_task(self.publisher.run(stats, drain_events, interval_s))

    def stop(self, ref: WorkerRef) -> None:
        async def _stop():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            await self.publisher.deregister(ref)
            await self.redis.aclose()

        fut = asyncio.run_coroutine_threadsafe(_stop(), self._loop)
        try:
            fut.result(10)
        except Exception as exc:  # shutdown must not hang on Redis
            log.warning("deregistering %s failed: %s", ref.key, exc)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)


class _WorkerDeployment:
    role = ""

    def __init__(self, config: WorkerConfig):
        engine = load_engine(config.checkpoint, config.engine)
        ref = new_worker_ref(self.role, _replica_worker_id(self.role))
        self.worker = self._make_worker(engine, config, ref)
        self.ref = ref
        self._publisher = None
        if config.redis_url:
            self._publisher = _Publisher(config.redis_url, config.model_id, self.worker.stats_now,
                                         lambda: self.worker.engine.call_sync(
                                             lambda e: e.drain_cache_events()),
                                         config.heartbeat_interval_s)

    def _make_worker(self, engine, config, ref):
        raise TypeError("subclasses build their worker")

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
        if self.worker.engine.error is not None:
            raise RuntimeError(f"engine loop died: {self.worker.engine.error!r}")

    async def __del__(self) -> None:
        """Graceful shutdown: leave the Redis index first, then stop the engine."""
        publisher = getattr(self, "_publisher", None)
        if publisher is not None:
            await asyncio.to_thread(publisher.stop, self.ref)
        worker = getattr(self, "worker", None)
        if worker is not None:
            await worker.close()


class PrefillServer(_WorkerDeployment):
    role = "prefill"

    def _make_worker(self, engine, config, ref):
        from flashpd.services.prefill.server import PrefillWorker

        return PrefillWorker(engine, config, ref)

    async def run(self, req: InternalRequest, ticket: Ticket,
                  target_worker: str | None = None) -> PrefillResult:
        self._check_target(target_worker)
        return await self.worker.run(req, ticket)


class DecodeServer(_WorkerDeployment):
    role = "decode"

    def _make_worker(self, engine, config, ref):
        from flashpd.services.decode.server import DecodeWorker

        return DecodeWorker(engine, config, ref)

    async def reserve(self, req: InternalRequest, target_worker: str | None = None) -> Ticket:
        self._check_target(target_worker)
        return await self.worker.reserve(req)

    async def generate(self, req: InternalRequest,
                       target_worker: str | None = None) -> AsyncIterator[Event]:
        self._check_target(target_worker)
        events = self.worker.generate(req)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()


def engine_config_for(role: str, base: EngineConfig) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(base, role=role)
