"""Receiver-side accounting of expected transfers: leases, completion, fencing of late writes.

Pure Python (no torch, no transport), shared by every receiver backend. A decode worker
`expect`s a request's KV into blocks it reserved, under a lease deadline and the incarnation id
of the prefill worker allowed to write it. Completion notices from the sender are matched
against that record:

    notice(request_id, sender_incarnation, dst_block_ids)
      request live, incarnation current, blocks within the expected set -> accepted
      anything else                                                   -> rejected, counted

A request completes when every expected block id has been covered by accepted notices (a
sender may push one request in several sends). Cancelled, expired and completed requests are
remembered (bounded) so that their late notices are classified rather than called unknown.

Draining: NIXL writes are one-sided, so a request given up while a write may be in flight must
not have its blocks reused until no write can still land. `drain` (and lease expiry) move the
request from live to draining, keyed by its fencing token; it becomes quiet (its token comes
out of `take_quiet`, and the owner frees the blocks) as soon as the sender's completion notice
covers every block, or the sender's abandon notice says nothing is or will be in flight, or,
for a dead sender, its fallback deadline passes. A live request whose sender already abandoned
it needs no draining, nor does one whose ticket was issued before an `abandon_all` of its
request id (the sender had no run of it and refuses such tickets).
"""

from __future__ import annotations

import enum
import math
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


class Rejection(str, enum.Enum):
    UNKNOWN = "unknown"  # never expected here (or forgotten long ago)
    CANCELLED = "cancelled"  # request cancelled before the notice arrived
    EXPIRED = "expired"  # lease passed before the notice arrived
    DUPLICATE = "duplicate"  # request already completed
    STALE_INCARNATION = "stale_incarnation"  # sender is not the incarnation now expected
    FOREIGN_BLOCKS = "foreign_blocks"  # notice names blocks the request did not reserve
    MALFORMED = "malformed"  # notice bytes could not be decoded


@dataclass
class _Expected:
    dst_block_ids: frozenset[int]
    lease_deadline_s: float
    incarnation: str
    received_block_ids: set[int] = field(default_factory=set)
    abandoned: bool = False  # the sender gave it up: no write in flight or to come
    issued_s: float | None = None  # when its ticket was issued (unix), for abandon_all


@dataclass
class _Draining:
    request_id: str
    expected: _Expected
    fallback_deadline_s: float


class ReceiverLedger:
    def __init__(self, num_blocks: int, max_remembered: int = 65536):
        self._num_blocks = num_blocks
        self._max_remembered = max_remembered
        self._live: dict[str, _Expected] = {}
        self._closed: OrderedDict[str, Rejection] = OrderedDict()  # request_id -> late reason
        self._completed: list[str] = []
        self._rejected: Counter[str] = Counter()
        self._draining: dict[str, _Draining] = {}  # fencing token -> draining request
        self._quiet: list[str] = []  # tokens whose draining ended since the last take_quiet
        self._abandoned_all: OrderedDict[str, float] = OrderedDict()  # request id -> before_s

    # ------------------------------------------------------------------ owner side
    def expect(
        self,
        request_id: str,
        dst_block_ids: Sequence[int],
        lease_deadline_s: float,
        incarnation: str,
        issued_s: float | None = None,
    ) -> None:
        """Start (or supersede, with a new sender incarnation) the wait for one request's KV."""
        block_ids = self._checked_block_ids(request_id, dst_block_ids)
        if not math.isfinite(lease_deadline_s):
            raise ValueError(f"{request_id}: lease_deadline_s must be finite")
        if not incarnation:
            raise ValueError(f"{request_id}: incarnation must be non-empty")
        current = self._live.get(request_id)
        if current is not None and current.incarnation == incarnation:
            raise ValueError(f"{request_id}: already expected from incarnation {incarnation!r}")
        # A newer incarnation restarts the request: the old sender's notices become stale.
        self._closed.pop(request_id, None)
        self._live[request_id] = _Expected(block_ids, float(lease_deadline_s), incarnation, issued_s=issued_s)

    def cancel(self, request_id: str) -> bool:
        """Stop waiting for a request; True if it was live. Its late notices are rejected."""
        if request_id not in self._live:
            return False
        del self._live[request_id]
        self._remember(request_id, Rejection.CANCELLED)
        return True

    def drain(self, request_id: str, fallback_deadline_s: float) -> str | None:
        """Stop waiting for a live request but keep its blocks until no write can land: returns
        the token to wait for in `take_quiet`, or None when the blocks may be freed now (not
        live, or abandoned by its sender)."""
        expected = self._live.pop(request_id, None)
        if expected is None:
            return None
        self._remember(request_id, Rejection.CANCELLED)
        if expected.abandoned or self._covered_by_abandon_all(request_id, expected):
            return None
        self._draining[expected.incarnation] = _Draining(request_id, expected, float(fallback_deadline_s))
        return expected.incarnation

    def take_quiet(self, now_s: float) -> list[str]:
        """Tokens of draining requests that no write can reach any more (a notice said so, or
        the fallback deadline passed at `now_s`); the owner frees their blocks."""
        for token, d in list(self._draining.items()):
            if d.fallback_deadline_s <= now_s:
                del self._draining[token]
                self._quiet.append(token)
        quiet, self._quiet = self._quiet, []
        return quiet

    def expire(self, now_s: float, grace_s: float = 0.0) -> list[str]:
        """Request ids whose lease passed at `now_s` without completion; they stop being live.
        Each drains until `lease + grace_s` (the sender posts no write after the lease and
        gives up on one after its transfer timeout), unless its sender abandoned it."""
        expired = [rid for rid, exp in self._live.items() if exp.lease_deadline_s <= now_s]
        for rid in expired:
            expected = self._live.pop(rid)
            self._remember(rid, Rejection.EXPIRED)
            if expected.abandoned or self._covered_by_abandon_all(rid, expected):
                continue
            self._draining[expected.incarnation] = _Draining(rid, expected, expected.lease_deadline_s + grace_s)
        return expired

    def take_completed(self) -> list[str]:
        done, self._completed = self._completed, []
        return done

    # ------------------------------------------------------------------ notice side
    def on_notice(
        self,
        request_id: str,
        incarnation: str,
        dst_block_ids: Sequence[int],
        kind: str = "write",
        before_unix_s: float = 0.0,
    ) -> bool:
        """Apply one sender notice; returns whether it was accepted (a notice that only ends a
        draining request is not accepted: its bytes are not used)."""
        if kind == "abandon_all":
            self._on_abandon_all(request_id, before_unix_s)
            return True
        self._on_draining_notice(request_id, incarnation, dst_block_ids, kind)
        expected = self._live.get(request_id)
        if expected is None:
            return self._reject(self._closed.get(request_id, Rejection.UNKNOWN))
        if incarnation != expected.incarnation:
            return self._reject(Rejection.STALE_INCARNATION)
        if kind == "abandon":
            expected.abandoned = True
            return True
        if not expected.dst_block_ids.issuperset(dst_block_ids):
            return self._reject(Rejection.FOREIGN_BLOCKS)
        expected.received_block_ids.update(dst_block_ids)
        if len(expected.received_block_ids) == len(expected.dst_block_ids):
            del self._live[request_id]
            self._remember(request_id, Rejection.DUPLICATE)
            self._completed.append(request_id)
        return True

    def _on_abandon_all(self, request_id: str, before_unix_s: float) -> None:
        self._abandoned_all[request_id] = max(before_unix_s, self._abandoned_all.get(request_id, before_unix_s))
        self._abandoned_all.move_to_end(request_id)
        while len(self._abandoned_all) > self._max_remembered:
            self._abandoned_all.popitem(last=False)
        for token, d in list(self._draining.items()):
            if d.request_id == request_id and self._covered_by_abandon_all(request_id, d.expected):
                del self._draining[token]
                self._quiet.append(token)

    def _covered_by_abandon_all(self, request_id: str, expected: _Expected) -> bool:
        before_s = self._abandoned_all.get(request_id)
        return before_s is not None and expected.issued_s is not None and expected.issued_s <= before_s

    def _on_draining_notice(self, request_id: str, incarnation: str, dst_block_ids: Sequence[int], kind: str) -> None:
        d = self._draining.get(incarnation)
        if d is None or d.request_id != request_id:
            return
        if kind == "write":
            d.expected.received_block_ids.update(dst_block_ids)
        if kind == "abandon" or d.expected.received_block_ids >= d.expected.dst_block_ids:
            del self._draining[incarnation]
            self._quiet.append(incarnation)

    def on_malformed(self) -> None:
        self._reject(Rejection.MALFORMED)

    # ------------------------------------------------------------------ views
    @property
    def live_request_ids(self) -> tuple[str, ...]:
        return tuple(self._live)

    @property
    def num_draining(self) -> int:
        return len(self._draining)

    def is_draining(self, token: str) -> bool:
        return token in self._draining

    def live_token(self, request_id: str) -> str | None:
        expected = self._live.get(request_id)
        return None if expected is None else expected.incarnation

    def rejection_counts(self) -> dict[str, int]:
        return dict(self._rejected)

    # ------------------------------------------------------------------ helpers
    def _checked_block_ids(self, request_id: str, block_ids: Sequence[int]) -> frozenset[int]:
        ids = frozenset(int(b) for b in block_ids)
        if not ids:
            raise ValueError(f"{request_id}: dst_block_ids is empty")
        if len(ids) != len(block_ids):
            raise ValueError(f"{request_id}: duplicate dst_block_ids")
        if min(ids) < 0 or max(ids) >= self._num_blocks:
            raise ValueError(f"{request_id}: dst_block_ids outside [0, {self._num_blocks})")
        return ids

    def _reject(self, reason: Rejection) -> bool:
        self._rejected[reason.value] += 1
        return False

    def _remember(self, request_id: str, late_reason: Rejection) -> None:
        self._closed[request_id] = late_reason
        self._closed.move_to_end(request_id)
        while len(self._closed) > self._max_remembered:
            self._closed.popitem(last=False)
