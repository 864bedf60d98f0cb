"""Placement: one request -> one (prefill, decode) pair, from the Redis index and the policy.

Keeps what the policy must not: the cached live view of workers (refreshed every
`view_refresh_s`), background reaping of workers whose heartbeat expired, the router's own
in-flight load (work assigned since the last heartbeat), and the session bindings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from flashpd.engine.hashing import CHUNK_TOKENS, chunk_hashes, namespace_for
from flashpd.services.api import InternalRequest, WorkerRef
from flashpd.services.router.index import LiveView, PrefixIndex, SessionBinding
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


@dataclass
class _InFlight:
    prefill_tokens: Counter = field(default_factory=Counter)  # WorkerRef -> tokens
    decode_requests: Counter = field(default_factory=Counter)  # WorkerRef -> requests


class Placement:
    def __init__(self, index: PrefixIndex, policy: RoutingPolicy, *, model: str,
                 cache_salt: str = "", view_refresh_s: float = 0.25) -> None:
        self.index, self.policy = index, policy
        self._namespace = namespace_for(model, cache_salt)
        self._view_refresh_s = view_refresh_s
        self._view: LiveView | None = None
        self._view_at = float("-inf")
        self._view_lock = asyncio.Lock()
        self._in_flight = _InFlight()
        self._reaping: set[WorkerRef] = set()
        self._tasks: set[asyncio.Task] = set()

    async def live_view(self) -> LiveView:
        async with self._view_lock:
            if time.monotonic() - self._view_at >= self._view_refresh_s:
                self._view = await self.index.live_view()
                self._view_at = time.monotonic()
                self._reap(self._view.dead)
        assert self._view is not None
        return self._view

    async def place(self, req: InternalRequest, exclude: frozenset[WorkerRef]) -> Assignment:
        started = time.perf_counter()
        view = await self.live_view()
        usable = [w for w in view.workers if not w.draining and w.ref not in exclude]
        blind = self.policy.name in BLIND_POLICIES
        hit_chunks: dict[WorkerRef, int] = {}
        binding = parent = None
        if not blind:
            lookup = await self.index.lookup(
                chunk_hashes(req.prompt_ids, self._namespace, CHUNK_TOKENS),
                [w.ref for w in usable], req.session_id, req.parent_session_id)
            hit_chunks, binding, parent = lookup.hit_chunks, lookup.session, lookup.parent_session
        candidates = {role: [self._candidate(w, hit_chunks.get(w.ref, 0), req)
                             for w in usable if w.role == role] for role in ("prefill", "decode")}
        query = RouteQuery(
            prompt_tokens=req.prompt_tokens,
            affinity_key=req.session_id or req.request_id,
            bound=_refs(binding), preferred=_refs(parent))
        decision = self.policy.choose(query, candidates["prefill"], candidates["decode"])
        pending = req.prompt_tokens - decision.prefill_credit_tokens
        self._in_flight.prefill_tokens[decision.prefill.ref] += pending
        self._in_flight.decode_requests[decision.decode.ref] += 1
        route_ms = (time.perf_counter() - started) * 1e3
        return Assignment(decision, route_ms, binding, pending)

    def prefill_done(self, a: Assignment) -> None:
        if a.prefill_open:
            a.prefill_open = False
            _decrement(self._in_flight.prefill_tokens, a.prefill, a.pending_prefill_tokens)

    def release(self, a: Assignment) -> None:
        self.prefill_done(a)
        if a.decode_open:
            a.decode_open = False
            _decrement(self._in_flight.decode_requests, a.decode, 1)

    async def commit(self, req: InternalRequest, a: Assignment) -> None:
        """Record the session's binding after a successful turn (idle TTL restarts)."""
        if not req.session_id or self.policy.name in BLIND_POLICIES:
            return
        new = SessionBinding(a.prefill, a.decode)
        if new == a.previous_binding:
            await self.index.touch_session(req.session_id)
        else:
            await self.index.bind_session(req.session_id, a.prefill, a.decode, a.previous_binding)

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
            pending_requests=self._in_flight.decode_requests[stats.ref])

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
            await self.index.reap(dead)
        except Exception:
            log.exception("reaping %s failed; retried on the next view refresh", dead)
        finally:
            self._reaping.difference_update(dead)


def _refs(binding: SessionBinding | None) -> frozenset[WorkerRef]:
    if binding is None:
        return frozenset()
    return frozenset(w for w in (binding.prefill, binding.decode) if w is not None)


def _decrement(counter: Counter, key: WorkerRef, amount: int) -> None:
    counter[key] -= amount
    if counter[key] <= 0:
        del counter[key]
