"""Routing policy: which prefill (P) and decode (D) worker serve a request.

Pure: it sees candidates (stats + cached-prefix length + the router's own in-flight work) and
returns a decision; Redis, clocks and retries live in `placement.py`.

`affinity` (default), per tier:

1. session: a session bound to a healthy worker stays there (its KV is resident);
2. prefix: when some worker of the tier holds a useful prefix, score it against load
   - P cost = prefill tokens queued there + the tokens this request adds there
              (prompt - usable credit, credit = align_down(hit, 128) - 128);
   - D: projected KV occupancy after admitting the request (a hit saves blocks); among workers
     within `decode_slack` of the least occupied, the longest hit wins;
3. hash: otherwise consistent hashing of the session id (or request id) with bounded load: walk
   the ring from the key's point, take the first worker whose load is at most
   (1 + load_slack) x the tier's mean load.

Ties prefer the parent session's workers (sub-agents share the parent's system prefix).

Colocated mode (`choose_colocated`): one worker per request, picked as D is above (session, then
longest prefix among the workers within `decode_slack` of the least projected KV occupancy,
then the hash ring with bounded load): on a colocated worker a hit saves both the prefill
compute and the blocks, and the decision carries that worker as both legs.
`random` and `round_robin` are prefix- and session-blind baselines for A/B runs.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from flashpd.engine.hashing import CHUNK_TOKENS, usable_prefix_tokens
from flashpd.services.api import Unavailable, WorkerRef, WorkerStats

Reason = Literal["session", "prefix", "hash", "random", "round_robin"]
RING_VNODES = 64  # virtual nodes per worker on the consistent-hash ring


@dataclass(frozen=True)
class Candidate:
    stats: WorkerStats
    hit_tokens: int = 0  # leading prompt tokens cached on this worker (whole chunks)
    pending_prefill_tokens: int = 0  # assigned by this router, maybe not yet in stats
    pending_requests: int = 0

    @property
    def ref(self) -> WorkerRef:
        return self.stats.ref


@dataclass(frozen=True)
class RouteQuery:
    prompt_tokens: int
    affinity_key: str  # session id, else request id
    bound: frozenset[WorkerRef] = frozenset()  # the session's current binding
    preferred: frozenset[WorkerRef] = frozenset()  # parent session's binding (tie-break)


@dataclass(frozen=True)
class RoutingDecision:
    prefill: Candidate
    decode: Candidate
    prefill_reason: Reason
    decode_reason: Reason

    @property
    def prefill_credit_tokens(self) -> int:
        return usable_prefix_tokens(self.prefill.hit_tokens)


class RoutingPolicy(Protocol):
    name: str

    def choose(
        self, query: RouteQuery, prefill: Sequence[Candidate], decode: Sequence[Candidate]
    ) -> RoutingDecision: ...

    def choose_colocated(self, query: RouteQuery, colocated: Sequence[Candidate]) -> RoutingDecision: ...


class AffinityPolicy:
    name = "affinity"

    def __init__(self, *, load_slack: float = 0.25, decode_slack: float = 0.10) -> None:
        if load_slack < 0 or decode_slack < 0:
            raise ValueError("load_slack and decode_slack must be >= 0")
        self.load_slack, self.decode_slack = load_slack, decode_slack

    def choose(self, query: RouteQuery, prefill: Sequence[Candidate], decode: Sequence[Candidate]) -> RoutingDecision:
        _require(prefill, "prefill")
        _require(decode, "decode")
        p, p_reason = self._pick_prefill(query, prefill)
        d, d_reason = self._pick_decode(query, decode)
        return RoutingDecision(p, d, p_reason, d_reason)

    def choose_colocated(self, query: RouteQuery, colocated: Sequence[Candidate]) -> RoutingDecision:
        _require(colocated, "colocated")
        c, reason = self._pick_decode(query, colocated)
        return RoutingDecision(c, c, reason, reason)

    def _pick_prefill(self, q: RouteQuery, cands: Sequence[Candidate]) -> tuple[Candidate, Reason]:
        bound = [c for c in cands if c.ref in q.bound]
        if bound:
            return bound[0], "session"
        if any(usable_prefix_tokens(c.hit_tokens) > 0 for c in cands):

            def cost(c: Candidate) -> tuple:
                work_tokens = _prefill_load(c) + q.prompt_tokens - usable_prefix_tokens(c.hit_tokens)
                return (work_tokens, c.ref not in q.preferred, c.ref.worker_id)

            return min(cands, key=cost), "prefix"
        return self._hash_pick(q, cands, _prefill_load), "hash"

    def _pick_decode(self, q: RouteQuery, cands: Sequence[Candidate]) -> tuple[Candidate, Reason]:
        bound = [c for c in cands if c.ref in q.bound]
        if bound:
            return bound[0], "session"
        if any(c.hit_tokens >= CHUNK_TOKENS for c in cands):
            occupancy = {c.ref: _projected_kv_occupancy(c, q.prompt_tokens) for c in cands}
            best = min(occupancy.values())
            close = [c for c in cands if occupancy[c.ref] <= best + self.decode_slack]
            return min(
                close, key=lambda c: (-c.hit_tokens, c.ref not in q.preferred, _decode_load(c), c.ref.worker_id)
            ), "prefix"
        return self._hash_pick(q, cands, _decode_load), "hash"

    def _hash_pick(self, q: RouteQuery, cands: Sequence[Candidate], load: Callable[[Candidate], float]) -> Candidate:
        mean = sum(load(c) for c in cands) / len(cands)
        under_cap = [c for c in cands if load(c) <= (1.0 + self.load_slack) * mean + 1e-9]
        preferred = [c for c in under_cap if c.ref in q.preferred]
        if preferred:
            return preferred[0]
        by_id = {c.ref.worker_id: c for c in under_cap}
        for worker_id in ring_walk(q.affinity_key, tuple(sorted(c.ref.worker_id for c in cands))):
            if worker_id in by_id:
                return by_id[worker_id]
        raise AssertionError("the least loaded worker is always under the cap")


class RandomPolicy:
    name = "random"

    def __init__(self, *, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, query: RouteQuery, prefill: Sequence[Candidate], decode: Sequence[Candidate]) -> RoutingDecision:
        _require(prefill, "prefill")
        _require(decode, "decode")
        return RoutingDecision(self._rng.choice(_by_id(prefill)), self._rng.choice(_by_id(decode)), "random", "random")

    def choose_colocated(self, query: RouteQuery, colocated: Sequence[Candidate]) -> RoutingDecision:
        _require(colocated, "colocated")
        c = self._rng.choice(_by_id(colocated))
        return RoutingDecision(c, c, "random", "random")


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = {"prefill": 0, "decode": 0, "colocated": 0}

    def choose(self, query: RouteQuery, prefill: Sequence[Candidate], decode: Sequence[Candidate]) -> RoutingDecision:
        _require(prefill, "prefill")
        _require(decode, "decode")
        return RoutingDecision(
            self._take("prefill", prefill), self._take("decode", decode), "round_robin", "round_robin"
        )

    def choose_colocated(self, query: RouteQuery, colocated: Sequence[Candidate]) -> RoutingDecision:
        _require(colocated, "colocated")
        c = self._take("colocated", colocated)
        return RoutingDecision(c, c, "round_robin", "round_robin")

    def _take(self, role: str, cands: Sequence[Candidate]) -> Candidate:
        ordered = _by_id(cands)
        pick = ordered[self._next[role] % len(ordered)]
        self._next[role] += 1
        return pick


POLICIES: dict[str, Callable[..., RoutingPolicy]] = {
    "affinity": AffinityPolicy,
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
}


def make_policy(name: str, **kwargs) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"routing must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](**kwargs)


def ring_walk(key: str, worker_ids: tuple[str, ...]) -> list[str]:
    """Distinct workers in ring order starting at the key's point (`worker_ids` sorted)."""
    points, owners = _ring(worker_ids)
    start = bisect.bisect_left(points, _point(key))
    seen: dict[str, None] = {}
    for i in range(len(points)):
        seen.setdefault(owners[(start + i) % len(points)])
        if len(seen) == len(worker_ids):
            break
    return list(seen)


@functools.lru_cache(maxsize=64)
def _ring(worker_ids: tuple[str, ...]) -> tuple[list[int], list[str]]:
    # keyed by worker_id, not incarnation: a restarted worker keeps its arc of the ring
    nodes = sorted((_point(f"{w}#{v}"), w) for w in worker_ids for v in range(RING_VNODES))
    return [p for p, _ in nodes], [w for _, w in nodes]


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _prefill_load(c: Candidate) -> float:
    return c.stats.queued_prefill_tokens + c.pending_prefill_tokens


def _decode_load(c: Candidate) -> float:
    return c.stats.running + c.stats.waiting + c.pending_requests


def _projected_kv_occupancy(c: Candidate, prompt_tokens: int) -> float:
    """Fraction of D's KV blocks in use after this request's missing chunks are allocated."""
    if c.stats.kv_blocks_total <= 0:
        return 0.0
    hit_tokens = min(c.hit_tokens - c.hit_tokens % CHUNK_TOKENS, prompt_tokens)
    needed_blocks = -(-(prompt_tokens - hit_tokens) // CHUNK_TOKENS)
    return (c.stats.kv_blocks_used + needed_blocks) / c.stats.kv_blocks_total


def _by_id(cands: Sequence[Candidate]) -> list[Candidate]:
    return sorted(cands, key=lambda c: c.ref.worker_id)


def _require(cands: Sequence[Candidate], role: str) -> None:
    if not cands:
        raise Unavailable(f"no healthy {role} worker")
