"""Placement: one request -> one (prefill, decode) pair, from the Redis index and the policy;
in colocated mode (`mode="colocated"`) one colocated worker, carried as both legs of the
decision (its in-flight load counts the request's prefill tokens and the request; its session
binding names it as the decode worker with no prefill worker).

Keeps what the policy must not: the cached live view of workers (refreshed every
`view_refresh_s`), background reaping of workers whose heartbeat expired, the router's own
in-flight load (work assigned since the last heartbeat), and the session bindings.

Redis loss never fails a request. Every Redis call here runs through one circuit breaker
(`breaker.py`: a short per-call timeout, then fail-fast while open, one probe per `open_s`), and
each has a fallback the router keeps locally:

    Redis call          fallback while Redis is paused, dead or restarting empty
    live_view           the last view; workers seen within `known_ttl_s` fill an empty role
    lookup              no prefix credit; session bindings from the local LRU of bindings
    bind/touch_session  the local LRU only (Redis gets the binding on the session's next turn)
    reap                retried on a later refresh

Workers that failed a call (`suspect`) are kept out of placement for `suspect_s` (their heartbeat
may outlive them by the heartbeat TTL) unless no other worker of the role is left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from flashpd.engine.hashing import CHUNK_TOKENS, chunk_hashes, namespace_for
from flashpd.services.api import MODE_ROLES, InternalRequest, ServingMode, WorkerRef, WorkerStats
from flashpd.services.router.breaker import CircuitBreaker
from flashpd.services.router.index import LiveView, Lookup, PrefixIndex, SessionBinding
from flashpd.services.router.policy import Candidate, RouteQuery, RoutingDecision, RoutingPolicy

log = logging.getLogger(__name__)

BLIND_POLICIES = frozenset({"random", "round_robin"})  # no index lookup, no session binding


@dataclass
class Assignment:
    """A decision plus the router-side load it holds until released."""

    decision: RoutingDecision
    route_ms: float
    previous_binding: SessionBinding | None
    pending_prefill_tokens: int
    prefill_open: bool = True
    decode_open: bool = True

    @property
    def prefill(self) -> WorkerRef:
        return self.decision.prefill.ref

    @property
    def decode(self) -> WorkerRef:
        return self.decision.decode.ref

    @property
    def colocated(self) -> bool:
        """One colocated worker serves both legs."""
        return self.decision.decode.ref.role == "colocated"


@dataclass
class _InFlight:
    prefill_tokens: Counter = field(default_factory=Counter)  # WorkerRef -> tokens
    decode_requests: Counter = field(default_factory=Counter)  # WorkerRef -> requests


@dataclass(frozen=True)
class _Affinity:
    """What placement knows of a request's workers before the policy chooses."""

    hit_chunks: dict[WorkerRef, int]  # cached prompt chunks per worker
    binding: SessionBinding | None  # the session's workers
    parent: SessionBinding | None  # the parent session's (preferred, not bound)
    marked: frozenset[str]  # worker keys marked draining


@dataclass(frozen=True)
class PlacementConfig:
    view_refresh_s: float = 0.25  # live view cache
    redis_timeout_s: float = 0.2  # per Redis call on the request path
    breaker_failures: int = 2  # failures in a row that open the circuit
    breaker_open_s: float = 1.0  # fail fast this long, then probe
    known_ttl_s: float = 60.0  # a worker seen this recently may stand in for an empty role
    suspect_s: float = 10.0  # a worker whose call failed is avoided this long
    max_local_sessions: int = 100_000  # LRU of session bindings kept by the router
    reap_timeout_s: float = 5.0


class Placement:
    def __init__(
        self,
        index: PrefixIndex,
        policy: RoutingPolicy,
        *,
        model: str,
        cache_salt: str = "",
        view_refresh_s: float | None = None,
        config: PlacementConfig = PlacementConfig(),
        clock: Callable[[], float] = time.monotonic,
        mode: ServingMode = "disaggregated",
    ) -> None:
        if mode not in MODE_ROLES:
            raise ValueError(f"mode must be one of {sorted(MODE_ROLES)}, got {mode!r}")
        self.index, self.policy = index, policy
        self.mode, self.roles = mode, MODE_ROLES[mode]
        self.config = config
        self._namespace = namespace_for(model, cache_salt)
        self._view_refresh_s = config.view_refresh_s if view_refresh_s is None else view_refresh_s
        self._clock = clock
        self.breaker = _index_breaker(model, config, clock)
        self._view: LiveView | None = None
        self._view_at = float("-inf")
        self._view_lock = asyncio.Lock()
        self._known: dict[WorkerRef, tuple[WorkerStats, float]] = {}  # ref -> (stats, seen at)
        self._suspects: dict[WorkerRef, float] = {}  # ref -> avoided until
        self._marked: frozenset[str] = frozenset()  # wkeys marked draining (Redis)
        self._sessions: OrderedDict[str, SessionBinding] = OrderedDict()
        self._in_flight = _InFlight()
        self._reaping: set[WorkerRef] = set()
        self._tasks: set[asyncio.Task] = set()

    @property
    def redis_ok(self) -> bool:
        return self.breaker.state == "closed"

    async def live_view(self) -> LiveView:
        """Workers to place on: Redis's view, or the router's own memory when Redis fails or
        forgot them (restarted empty). Never raises for a Redis failure."""
        async with self._view_lock:
            if self._clock() - self._view_at >= self._view_refresh_s:
                await self._refresh_view()
        return self._with_known(self._view or LiveView((), ()))

    async def _refresh_view(self) -> None:
        try:
            view = await self.breaker.call(self.index.live_view)
        except (TimeoutError, OSError, RedisError) as exc:
            log.debug("live view from Redis failed (%r); using the last one", exc)
            self._view_at = self._clock()
            return
        now = self._view_at = self._clock()
        self._view = view
        for stats in view.workers:
            self._known[stats.ref] = (stats, now)
        for ref in view.dead:
            self._known.pop(ref, None)
        self._reap(view.dead)

    def _with_known(self, view: LiveView) -> LiveView:
        """Fill a role the view lacks with recently seen workers (Redis restarted empty, or
        the view is stale)."""
        now = self._clock()
        for ref, (_, seen) in list(self._known.items()):
            if now - seen > self.config.known_ttl_s:
                del self._known[ref]
        roles = {w.role for w in view.workers if not w.draining}
        extra = tuple(
            stats for stats, _ in self._known.values() if stats.role not in roles and stats.ref not in view.dead
        )
        return LiveView(view.workers + extra, view.dead) if extra else view

    async def _draining_marks(self) -> frozenset[str]:
        """Workers marked draining in Redis (the last answer while Redis fails)."""
        try:
            self._marked = await self.breaker.call(self.index.draining)
        except (TimeoutError, OSError, RedisError) as exc:
            log.debug("draining marks from Redis failed (%r); using the last ones", exc)
        return self._marked

    def suspect(self, worker: WorkerRef) -> None:
        """A call to `worker` failed as if it were gone: avoid it for a while."""
        self._suspects[worker] = self._clock() + self.config.suspect_s

    def _usable(self, view: LiveView, exclude: frozenset[WorkerRef]) -> list[WorkerStats]:
        now = self._clock()
        for ref, until in list(self._suspects.items()):
            if until <= now:
                del self._suspects[ref]
        usable = [w for w in view.workers if not w.draining and w.ref not in exclude]
        healthy = [w for w in usable if w.ref not in self._suspects]
        # a suspect stays a candidate only where it is the last one of its role
        roles = {w.role for w in healthy}
        return healthy + [w for w in usable if w.ref in self._suspects and w.role not in roles]

    async def place(self, req: InternalRequest, exclude: frozenset[WorkerRef]) -> Assignment:
        started = time.perf_counter()
        view = await self.live_view()
        usable = self._usable(view, exclude)
        known = await self._affinity(req, usable)
        # draining marks are read with every placement: a drain takes effect from its mark on
        usable = [w for w in usable if w.ref.key not in known.marked]
        candidates = self._candidates(req, usable, known.hit_chunks)
        query = RouteQuery(
            prompt_tokens=req.prompt_tokens,
            affinity_key=req.session_id or req.request_id,
            bound=_refs(known.binding),
            preferred=_refs(known.parent),
        )
        if self.mode == "colocated":
            decision = self.policy.choose_colocated(query, candidates["colocated"])
        else:
            decision = self.policy.choose(query, candidates["prefill"], candidates["decode"])
        pending = req.prompt_tokens - decision.prefill_credit_tokens
        self._in_flight.prefill_tokens[decision.prefill.ref] += pending
        self._in_flight.decode_requests[decision.decode.ref] += 1
        route_ms = (time.perf_counter() - started) * 1e3
        return Assignment(decision, route_ms, known.binding, pending)

    async def _affinity(self, req: InternalRequest, usable: list[WorkerStats]) -> _Affinity:
        """What the index knows for the request (nothing for a blind policy), and the marks."""
        if self.policy.name in BLIND_POLICIES:
            return _Affinity({}, None, None, await self._draining_marks())
        lookup = await self._lookup(req, [w.ref for w in usable])
        binding = lookup.session or self._local_binding(req.session_id)
        parent = lookup.parent_session or self._local_binding(req.parent_session_id)
        if lookup.draining is not None:
            self._marked = lookup.draining
        return _Affinity(lookup.hit_chunks, binding, parent, self._marked)

    def _candidates(
        self, req: InternalRequest, usable: list[WorkerStats], hit_chunks: dict[WorkerRef, int]
    ) -> dict[str, list[Candidate]]:
        """role -> the policy's candidates (the mode's roles; a worker of another mode
        registered under the same model is never placed on); a pinned worker wins its role
        while it is usable."""
        candidates = {
            role: [self._candidate(w, hit_chunks.get(w.ref, 0), req) for w in usable if w.role == role]
            for role in self.roles
        }
        if req.pin:
            candidates = {role: [c for c in cands if c.ref in req.pin] or cands for role, cands in candidates.items()}
        return candidates

    def prefill_done(self, a: Assignment) -> None:
        if a.prefill_open:
            a.prefill_open = False
            _decrement(self._in_flight.prefill_tokens, a.prefill, a.pending_prefill_tokens)

    def release(self, a: Assignment) -> None:
        self.prefill_done(a)
        if a.decode_open:
            a.decode_open = False
            _decrement(self._in_flight.decode_requests, a.decode, 1)

    async def _lookup(self, req: InternalRequest, live: list[WorkerRef]) -> Lookup:
        try:
            return await self.breaker.call(
                lambda: self.index.lookup(
                    chunk_hashes(req.prompt_ids, self._namespace, CHUNK_TOKENS),
                    live,
                    req.session_id,
                    req.parent_session_id,
                )
            )
        except (TimeoutError, OSError, RedisError) as exc:
            log.debug("index lookup failed (%r); placing on session affinity and load", exc)
            return Lookup({}, None, None)

    def _local_binding(self, session_id: str | None) -> SessionBinding | None:
        if not session_id or session_id not in self._sessions:
            return None
        self._sessions.move_to_end(session_id)
        return self._sessions[session_id]

    async def commit(self, req: InternalRequest, a: Assignment) -> None:
        """Record the session's binding after a successful turn (idle TTL restarts): always in
        the router's LRU, in Redis when it answers in time."""
        if not req.session_id or self.policy.name in BLIND_POLICIES:
            return
        new = SessionBinding(None if a.colocated else a.prefill, a.decode)
        self._sessions[req.session_id] = new
        self._sessions.move_to_end(req.session_id)
        while len(self._sessions) > self.config.max_local_sessions:
            self._sessions.popitem(last=False)
        try:
            if new == a.previous_binding:
                await self.breaker.call(lambda: self.index.touch_session(req.session_id))
            else:
                await self.breaker.call(
                    lambda: self.index.bind_session(req.session_id, new.prefill, new.decode, a.previous_binding)
                )
        except (TimeoutError, OSError, RedisError) as exc:
            log.debug("session %s: binding kept locally only (%r)", req.session_id, exc)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Let background reaping finish (bounded), so no Redis work outlives the client."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _candidate(self, stats, hit_chunks: int, req: InternalRequest) -> Candidate:
        return Candidate(
            stats=stats,
            hit_tokens=min(hit_chunks * CHUNK_TOKENS, req.prompt_tokens),
            pending_prefill_tokens=self._in_flight.prefill_tokens[stats.ref],
            pending_requests=self._in_flight.decode_requests[stats.ref],
        )

    def _reap(self, dead: tuple[WorkerRef, ...]) -> None:
        fresh = [w for w in dead if w not in self._reaping]
        if not fresh:
            return
        self._reaping.update(fresh)
        log.warning("reaping workers with expired heartbeats: %s", [w.key for w in fresh])
        task = asyncio.create_task(self._reap_now(fresh))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reap_now(self, dead: list[WorkerRef]) -> None:
        try:
            await asyncio.wait_for(self.index.reap(dead), self.config.reap_timeout_s)
        except Exception:
            log.exception("reaping %s failed; retried on the next view refresh", dead)
        finally:
            self._reaping.difference_update(dead)


def _index_breaker(model: str, config: PlacementConfig, clock: Callable[[], float]) -> CircuitBreaker:
    """Redis calls fail fast while the index is down (the router places from memory)."""
    return CircuitBreaker(
        f"redis index ({model})",
        timeout_s=config.redis_timeout_s,
        failure_threshold=config.breaker_failures,
        open_s=config.breaker_open_s,
        failures=(RedisError,),
        clock=clock,
    )


def _refs(binding: SessionBinding | None) -> frozenset[WorkerRef]:
    if binding is None:
        return frozenset()
    return frozenset(w for w in (binding.prefill, binding.decode) if w is not None)


def _decrement(counter: Counter, key: WorkerRef, amount: int) -> None:
    counter[key] -= amount
    if counter[key] <= 0:
        del counter[key]
