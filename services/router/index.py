"""The Redis prefix/session index: workers write it (`IndexPublisher`), the router reads it
(`PrefixIndex`). Only the router reads Redis on the request path.

Key layout, all under one model (the `{model}` braces are also a Redis Cluster hash tag, so one
model's keys share a slot and pipelines stay on one node). A worker key (`wkey`) is
`role|worker_id|incarnation`, so a restarted worker never inherits its predecessor's entries.

    fpd:{model}:workers          SET    wkeys that registered                 (no TTL)
    fpd:{model}:hb:<wkey>        STRING WorkerStats JSON = liveness + load    PX heartbeat_ttl
    fpd:{model}:chunk:<hash>     SET    wkeys holding this chunk              EX chunk_ttl
    fpd:{model}:wchunks:<wkey>   SET    hashes this worker holds (reverse)    EX chunk_ttl
    fpd:{model}:session:<sid>    HASH   {prefill: wkey, decode: wkey}         EX session_ttl (idle)
    fpd:{model}:wsessions:<wkey> SET    session ids bound to this worker      EX session_ttl

Invariants: nothing on the request path uses SCAN or KEYS (a lookup is one round trip); `deregister` finds a worker's chunks
and sessions through its reverse sets. A registered worker whose heartbeat key expired is dead:
lookups ignore it at once and the router deregisters it in the background. TTLs on chunk keys are
a safety net for garbage, not an eviction policy: engines report evictions (BlockRemoved).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from flashpd.engine.events import AllCleared, BlockRemoved, BlockStored, KVCacheEvent
from flashpd.services.api import WorkerRef, WorkerStats

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TTL_S = 5.0
DEFAULT_CHUNK_TTL_S = 24 * 3600.0
DEFAULT_SESSION_TTL_S = 3600.0
# KEYS: chunk keys in prompt order; ARGV: worker keys. Returns, per worker, how many leading
# chunks it holds. Stops at the first chunk that no still-running worker holds, so a miss costs
# one SMISMEMBER, and nothing but the counts crosses the network. All keys share the {model}
# hash tag, so the script is also valid on Redis Cluster.
LONGEST_PREFIX_LUA = """
local counts, running, n_running = {}, {}, #ARGV
for i = 1, #ARGV do counts[i] = 0; running[i] = true end
for c = 1, #KEYS do
  if n_running == 0 then break end
  local held = redis.call('SMISMEMBER', KEYS[c], unpack(ARGV))
  for i = 1, #ARGV do
    if running[i] then
      if held[i] == 1 then counts[i] = counts[i] + 1
      else running[i] = false; n_running = n_running - 1 end
    end
  end
end
return counts
"""
LONGEST_PREFIX_SHA = hashlib.sha1(LONGEST_PREFIX_LUA.encode()).hexdigest()
DELETE_BATCH = 1000  # members per SREM pipeline when deregistering


def router_redis(url: str, *, socket_timeout_s: float = 2.0, connect_timeout_s: float = 0.5):
    """The router's asyncio Redis client. After Redis restarts, every pooled connection is
    stale and its next command fails: it is retried once on a fresh connection, so one call
    does not fail (and trip the breaker) per stale connection. Socket timeouts bound how long a
    paused Redis can hold a connection that the breaker's timeout left behind."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return aioredis.from_url(
        url,
        retry=Retry(NoBackoff(), 1),
        retry_on_error=[RedisConnectionError],
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
    )


def _cancel_safe(method):
    """Run an index operation as its own task, shielded from the caller's cancellation.

    redis-py's asyncio client can swallow a cancellation that lands mid-command (measured here:
    a cancelled MGET/pipeline loop ignored the cancel in 15-45% of tries), so a cancelled request
    or shutdown would carry on as if nothing happened. Shielded, the caller gets CancelledError at
    once and the Redis exchange finishes in the background, leaving no connection half-read.
    """

    @functools.wraps(method)
    async def wrapper(*args, **kwargs):
        task = asyncio.ensure_future(method(*args, **kwargs))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_log_orphan_failure)
            raise

    return wrapper


def _log_orphan_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("index operation finished after its caller left: %r", task.exception())


class IndexKeys:
    def __init__(self, model: str) -> None:
        if not model or any(c in model for c in "{} \t\n"):
            raise ValueError(f"model name must be non-empty without braces or spaces: {model!r}")
        self.prefix = f"fpd:{{{model}}}:"

    @property
    def workers(self) -> str:
        return self.prefix + "workers"

    @property
    def draining(self) -> str:
        """SET of wkeys told to drain: routers place nothing new there from the moment a
        wkey is added (before the worker itself starts draining)."""
        return self.prefix + "draining"

    def heartbeat(self, wkey: str) -> str:
        return f"{self.prefix}hb:{wkey}"

    def chunk(self, chunk_hash: str) -> str:
        return f"{self.prefix}chunk:{chunk_hash}"

    def worker_chunks(self, wkey: str) -> str:
        return f"{self.prefix}wchunks:{wkey}"

    def session(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}"

    def worker_sessions(self, wkey: str) -> str:
        return f"{self.prefix}wsessions:{wkey}"


@dataclass(frozen=True)
class SessionBinding:
    prefill: WorkerRef | None  # None: the session's turns needed no prefill so far
    decode: WorkerRef


@dataclass(frozen=True)
class LiveView:
    workers: tuple[WorkerStats, ...]  # registered with a live heartbeat
    dead: tuple[WorkerRef, ...]  # registered, heartbeat expired

    def role(self, role: str) -> list[WorkerStats]:
        return [w for w in self.workers if w.role == role]


@dataclass(frozen=True)
class Lookup:
    hit_chunks: dict[WorkerRef, int]  # leading chunks of the prompt each worker holds (> 0 only)
    session: SessionBinding | None
    parent_session: SessionBinding | None
    draining: frozenset[str] | None = None  # wkeys marked draining (None: not read)


async def deregister_worker(redis, keys: IndexKeys, worker: WorkerRef) -> None:
    """Remove a worker's chunks and session bindings via its reverse sets, then the worker."""
    wkey = worker.key
    await _drop_worker_chunks(redis, keys, wkey)
    await _drop_worker_sessions(redis, keys, wkey)
    pipe = redis.pipeline(transaction=True)
    pipe.srem(keys.workers, wkey)
    pipe.srem(keys.draining, wkey)
    pipe.delete(keys.heartbeat(wkey))
    await pipe.execute()


async def _drop_worker_chunks(redis, keys: IndexKeys, wkey: str) -> None:
    hashes = sorted(_text(h) for h in await redis.smembers(keys.worker_chunks(wkey)))
    for begin in range(0, len(hashes), DELETE_BATCH):
        pipe = redis.pipeline(transaction=False)
        for chunk_hash in hashes[begin : begin + DELETE_BATCH]:
            pipe.srem(keys.chunk(chunk_hash), wkey)
        await pipe.execute()
    await redis.delete(keys.worker_chunks(wkey))


async def _drop_worker_sessions(redis, keys: IndexKeys, wkey: str) -> None:
    """Drop only bindings that still name this worker (a session may have moved since)."""
    session_ids = sorted(_text(s) for s in await redis.smembers(keys.worker_sessions(wkey)))
    if session_ids:
        pipe = redis.pipeline(transaction=False)
        for sid in session_ids:
            pipe.hgetall(keys.session(sid))
        bindings = await pipe.execute()
        stale = [
            keys.session(sid)
            for sid, b in zip(session_ids, bindings, strict=True)
            if wkey in {_text(v) for v in b.values()}
        ]
        if stale:
            await redis.delete(*stale)
    await redis.delete(keys.worker_sessions(wkey))


class IndexPublisher:
    """Worker-side writer. Call `register` at start, `heartbeat` every ~1 s with fresh stats,
    `publish` with batches of cache events drained from the engine (off the step loop), and
    `deregister` on graceful shutdown."""

    def __init__(
        self,
        redis,
        model: str,
        *,
        heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S,
        chunk_ttl_s: float = DEFAULT_CHUNK_TTL_S,
    ) -> None:
        self._redis, self.keys = redis, IndexKeys(model)
        self._heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self._chunk_ttl_s = int(chunk_ttl_s)

    @_cancel_safe
    async def mark_draining(self, worker: WorkerRef) -> None:
        """The worker is about to drain: routers stop placing new requests on it now."""
        await self._redis.sadd(self.keys.draining, worker.key)

    @_cancel_safe
    async def is_marked_draining(self, worker: WorkerRef) -> bool:
        """Whether an operator or the autoscaler marked `worker` draining."""
        return bool(await self._redis.sismember(self.keys.draining, worker.key))

    @_cancel_safe
    async def register(self, stats: WorkerStats) -> None:
        """Announce a new incarnation; earlier incarnations of the same worker are removed."""
        me = stats.ref
        for wkey in await self._redis.smembers(self.keys.workers):
            other = WorkerRef.from_key(_text(wkey))
            if (other.role, other.worker_id) == (me.role, me.worker_id) and other != me:
                await deregister_worker(self._redis, self.keys, other)
        await self.heartbeat(stats)

    @_cancel_safe
    async def heartbeat(self, stats: WorkerStats) -> bool:
        """Refresh liveness and load. Returns True when the worker had been dropped from the
        registry (e.g. reaped after a long stall): its cache entries are gone, so the caller
        should re-publish what it holds."""
        wkey = stats.ref.key
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self.keys.heartbeat(wkey), stats.to_json(), px=self._heartbeat_ttl_ms)
        pipe.sadd(self.keys.workers, wkey)
        _, added = await pipe.execute()
        return bool(added)

    @_cancel_safe
    async def publish(self, worker: WorkerRef, events: Sequence[KVCacheEvent]) -> None:
        """Apply a batch of cache events in order; each run between AllCleared events is one
        MULTI/EXEC transaction."""
        pending: list[BlockStored | BlockRemoved] = []
        for event in events:
            if isinstance(event, AllCleared):
                await self._apply(worker.key, pending)
                pending = []
                await _drop_worker_chunks(self._redis, self.keys, worker.key)
            elif isinstance(event, BlockStored | BlockRemoved):
                pending.append(event)
            else:
                raise TypeError(f"unknown cache event {type(event).__name__}")
        await self._apply(worker.key, pending)

    @_cancel_safe
    async def deregister(self, worker: WorkerRef) -> None:
        await deregister_worker(self._redis, self.keys, worker)

    async def run(
        self,
        stats: Callable[[], WorkerStats],
        drain_events: Callable[[], Sequence[KVCacheEvent]],
        interval_s: float = 0.5,
    ) -> None:
        """Publish loop for a worker's event loop (cancel it to stop): every interval, publish
        the drained cache events and refresh the heartbeat. Events stay ordered because one
        task publishes them all."""
        first = stats()
        await self.register(first)
        while True:
            events = drain_events()
            if events:
                await self.publish(first.ref, events)
            if await self.heartbeat(stats()):
                log.warning(
                    "%s was reaped (heartbeat lapsed) and re-registered; chunks cached "
                    "before that are not indexed until stored again",
                    first.ref.key,
                )
            await asyncio.sleep(interval_s)

    async def _apply(self, wkey: str, events: Iterable[BlockStored | BlockRemoved]) -> None:
        pipe = self._redis.pipeline(transaction=True)
        reverse = self.keys.worker_chunks(wkey)
        touched = False
        for event in events:
            for chunk_hash in event.block_hashes:
                touched = True
                if isinstance(event, BlockStored):
                    pipe.sadd(self.keys.chunk(chunk_hash), wkey)
                    pipe.expire(self.keys.chunk(chunk_hash), self._chunk_ttl_s)
                    pipe.sadd(reverse, chunk_hash)
                else:
                    pipe.srem(self.keys.chunk(chunk_hash), wkey)
                    pipe.srem(reverse, chunk_hash)
        if touched:
            pipe.expire(reverse, self._chunk_ttl_s)
            await pipe.execute()


class PrefixIndex:
    """Router-side reader (plus session bindings and reaping of dead workers)."""

    def __init__(self, redis, model: str, *, session_ttl_s: float = DEFAULT_SESSION_TTL_S) -> None:
        self._redis, self.keys = redis, IndexKeys(model)
        self._session_ttl_s = int(session_ttl_s)

    @_cancel_safe
    async def live_view(self) -> LiveView:
        wkeys = sorted(_text(k) for k in await self._redis.smembers(self.keys.workers))
        beats = await self._redis.mget([self.keys.heartbeat(k) for k in wkeys]) if wkeys else []
        marked = await self.draining()
        live, dead = [], []
        for wkey, beat in zip(wkeys, beats, strict=True):
            if beat is None:
                dead.append(WorkerRef.from_key(wkey))
            else:
                stats = WorkerStats.from_json(beat)
                live.append(dataclasses.replace(stats, draining=True) if wkey in marked else stats)
        return LiveView(tuple(live), tuple(dead))

    async def draining(self) -> frozenset[str]:
        """The wkeys marked draining (`mark_draining`)."""
        return frozenset(_text(k) for k in await self._redis.smembers(self.keys.draining))

    async def mark_draining(self, worker: WorkerRef) -> None:
        """Operator side: no router places a new request on `worker` from now on."""
        await self._redis.sadd(self.keys.draining, worker.key)

    @_cancel_safe
    async def lookup(
        self,
        chunk_hashes: Sequence[str],
        live: Iterable[WorkerRef],
        session_id: str | None = None,
        parent_session_id: str | None = None,
    ) -> Lookup:
        """Per live worker, the number of leading prompt chunks it holds, plus the session's and
        the parent session's bindings: one pipelined round trip, in which a server-side script
        walks the chunks and stops at the first chunk no remaining worker holds."""
        workers = sorted(live, key=lambda w: w.key)
        sids = [sid for sid in (session_id, parent_session_id) if sid]
        chunk_keys = [self.keys.chunk(h) for h in chunk_hashes] if workers else []
        try:
            replies = await self._lookup_pipeline(sids, chunk_keys, workers)
        except NoScriptError:  # Redis restarted or flushed its script cache
            await self._redis.script_load(LONGEST_PREFIX_LUA)
            replies = await self._lookup_pipeline(sids, chunk_keys, workers)
        bindings = dict(zip(sids, (_binding(r) for r in replies), strict=False))
        counts = replies[len(sids)] if chunk_keys else [0] * len(workers)
        hits = {w: int(n) for w, n in zip(workers, counts, strict=True) if int(n) > 0}
        return Lookup(
            hits,
            bindings.get(session_id or ""),
            bindings.get(parent_session_id or ""),
            frozenset(_text(k) for k in replies[-1]),
        )

    async def _lookup_pipeline(self, sids: list[str], chunk_keys: list[str], workers: list[WorkerRef]) -> list:
        pipe = self._redis.pipeline(transaction=False)
        for sid in sids:
            pipe.hgetall(self.keys.session(sid))
        if chunk_keys:
            pipe.evalsha(LONGEST_PREFIX_SHA, len(chunk_keys), *chunk_keys, *(w.key for w in workers))
        pipe.smembers(self.keys.draining)  # last: read with every placement, same round trip
        return await pipe.execute()

    @_cancel_safe
    async def bind_session(
        self, session_id: str, prefill: WorkerRef | None, decode: WorkerRef, previous: SessionBinding | None
    ) -> None:
        """Bind (or re-bind) a session to a worker pair and restart its idle TTL."""
        key = self.keys.session(session_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(key)
        pipe.hset(key, mapping={"decode": decode.key, "prefill": prefill.key if prefill else ""})
        pipe.expire(key, self._session_ttl_s)
        for worker in (prefill, decode):
            if worker is not None:
                pipe.sadd(self.keys.worker_sessions(worker.key), session_id)
                pipe.expire(self.keys.worker_sessions(worker.key), self._session_ttl_s)
        if previous is not None:
            for old in {previous.prefill, previous.decode} - {prefill, decode, None}:
                pipe.srem(self.keys.worker_sessions(old.key), session_id)
        await pipe.execute()

    @_cancel_safe
    async def touch_session(self, session_id: str) -> None:
        await self._redis.expire(self.keys.session(session_id), self._session_ttl_s)

    @_cancel_safe
    async def deregister(self, worker: WorkerRef) -> None:
        await deregister_worker(self._redis, self.keys, worker)

    @_cancel_safe
    async def reap(self, dead: Iterable[WorkerRef]) -> None:
        """Deregister workers whose heartbeat expired (their chunks, bindings, registry entry)."""
        await asyncio.gather(*(self.deregister(w) for w in dead))


def live_worker_stats(redis_url: str, model_id: str, timeout_s: float = 1.0) -> list[WorkerStats]:
    """The live workers' last heartbeats, read once with a synchronous client (operators'
    tools and fault harnesses; the router reads them through `PrefixIndex`). Empty when Redis
    does not answer within `timeout_s`."""
    import redis

    keys = IndexKeys(model_id)
    client = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        wkeys = sorted(_text(k) for k in client.smembers(keys.workers))
        beats = client.mget([keys.heartbeat(k) for k in wkeys]) if wkeys else []
    except redis.RedisError:
        return []
    finally:
        client.close()
    return [WorkerStats.from_json(b) for b in beats if b is not None]


def _binding(raw: dict) -> SessionBinding | None:
    data = {_text(k): _text(v) for k, v in raw.items()}
    if not data.get("decode"):
        return None
    prefill = WorkerRef.from_key(data["prefill"]) if data.get("prefill") else None
    return SessionBinding(prefill, WorkerRef.from_key(data["decode"]))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
