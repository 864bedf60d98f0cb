"""Backend-neutral KV transfer interface: a decode-side receiver and a prefill-side sender.

Each worker owns one pool per global group, a contiguous uint8 tensor [num_blocks, block_bytes];
block id b addresses the same 128-token chunk in every group. A transfer copies, for pairs
(src_block_id -> dst_block_id), every group's block bytes from the sender's pools into the
receiver's, then delivers a notice (request id, sender incarnation, dst block ids).

    decode (KVReceiver)                         prefill (KVSender)
    descriptor() ---- bytes via router/ticket ---> connect(descriptor)   contract checked here
    expect(request, dst blocks, lease, inc)
                                                 send(request, src, dst, inc) -> handle
                 <-- WRITE block bytes + notice --
    poll_completed() -> [request]                poll_briefly(handle, budget_s) -> stats | None
                                                 wait(handle, timeout_s, cancel) -> TransferStats
    drain(request, fallback_s) -> token | None   abandon(request, inc, peer)  (nothing in flight)
                 <------- abandon notice ---------
    take_quiet(now_s) -> [token]  (owner frees the blocks of a drained request)
    expire(now_s, grace_s) -> [request]  (drained like an abort)

Thread safety: a sender may be used from several threads (each transfer waited on by its own
thread); backends serialize their transport calls. A receiver is used from one thread.

Backends implement a handful of `_`-prefixed hooks; accounting lives here and in ledger.py.
"""

from __future__ import annotations

import resource
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from flashpd.engine.transfer.contract import TransferContract, check_compatible
from flashpd.engine.transfer.ledger import ReceiverLedger
from flashpd.engine.transfer.wire import PeerDescriptor, PoolRegion, TransferNotice, write_notice_bytes

KVPools = Mapping[str, torch.Tensor]  # group name -> [num_blocks, block_bytes] uint8

# Polling while waiting on a transfer. For the first SPIN_S after the post every poll only
# yields the GIL (time.sleep(0)): a push of a 128K-token prompt's KV (117 MB) completes in well
# under a millisecond over cuda_ipc, and the old back-off (sleeps doubling from 10 us to 1 ms)
# saw a completion up to a whole sleep late. After SPIN_S each sleep is 1/8 of the time waited
# so far, between MIN_POLL_SLEEP_S and MAX_POLL_SLEEP_S: a slow push's completion is seen
# within ~12% of its duration, and a stuck one costs one poll per millisecond.
SPIN_S = 2e-3
MIN_POLL_SLEEP_S = 5e-5
MAX_POLL_SLEEP_S = 1e-3


class TransferError(RuntimeError):
    """A transfer could not be set up or did not complete."""


class TransferTimeout(TransferError):
    """A transfer did not complete within its wait; it has been aborted."""


class TransferCancelled(TransferError):
    """The waiter cancelled an unfinished transfer; it has been aborted."""


@dataclass(frozen=True)
class TransferStats:
    num_bytes: int
    seconds: float  # from posting to observed completion


class PreparedSend:
    """A write checked and built by `KVSender.prepare`, not posted yet (see `post`)."""

    def __init__(self, request_id: str, peer: str, num_bytes: int, state: Any, trace: dict[str, float]):
        self.request_id = request_id
        self.peer = peer
        self.num_bytes = num_bytes
        self.state = state  # the backend's (NIXL: an initialised transfer request)
        self.trace = trace  # becomes the handle's
        self.taken = False  # posted or discarded


class TransferHandle:
    """One posted send; opaque to callers except for the fields below."""

    def __init__(
        self,
        request_id: str,
        peer: str,
        num_bytes: int,
        posted_at_s: float,
        xfer: Any,
        trace: dict[str, float] | None = None,
    ):
        self.request_id = request_id
        self.peer = peer
        self.num_bytes = num_bytes
        self.posted_at_s = posted_at_s  # time.perf_counter() before the backend's post
        self.post_returned_s = posted_at_s  # ... once it returned (the transport has the write)
        self.xfer = xfer  # backend transfer object
        self.stats: TransferStats | None = None  # set once complete
        self.aborted = False
        self.abort_failed = False  # the transport could not cancel it: bytes may still land
        # Where the push's time went, in order (diagnostics): send's "check_ms" and
        # "notice_ms", the backend's own post phases (nixl: "lock_ms", "descriptors_ms",
        # "nixl_init_ms", "nixl_post_ms", "num_descriptors"), then wait's "done_ms" (the post's return
        # -> completion seen) and "polls". Beside the wall times, what the posting thread itself
        # did (`thread_usage`): "send_cpu_ms" (its CPU time in `send`), "send_vcsw" / "send_ivcsw"
        # (voluntary / involuntary context switches there: blocked, e.g. on the GIL / preempted),
        # and the same from the post's return to completion ("done_cpu_ms", "done_vcsw",
        # "done_ivcsw") when the same thread polled it to the end.
        self.trace: dict[str, float] = {} if trace is None else trace
        self.post_returned_usage: tuple[int, float, int, int] | None = None  # (thread, thread_usage())


def thread_usage() -> tuple[float, int, int]:
    """The calling thread's (CPU seconds, voluntary, involuntary context switches): set against
    wall time, they tell a slow phase that ran (CPU) from one that waited for the GIL or a lock
    (voluntary switches) or was preempted (involuntary). CPU time from the thread's clock
    (getrusage's counts at the scheduler's tick resolution read 0 for sub-ms phases)."""
    usage = resource.getrusage(_RUSAGE_THREAD)
    return time.thread_time(), usage.ru_nvcsw, usage.ru_nivcsw


_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def note_usage(trace: dict[str, float], prefix: str, before: tuple[float, int, int]) -> tuple[float, int, int]:
    """The thread's usage since `before` into `trace` under `prefix`; -> the usage now."""
    now = cpu_s, vcsw, ivcsw = thread_usage()
    trace[f"{prefix}_cpu_ms"] = 1e3 * (cpu_s - before[0])
    trace[f"{prefix}_vcsw"] = vcsw - before[1]
    trace[f"{prefix}_ivcsw"] = ivcsw - before[2]
    return now


@dataclass(frozen=True)
class BlockRuns:
    """A push's checked (src -> dst) block pairs as maximal runs ascending by one on both sides,
    in ascending src order: run r is the pairs (src_start[r] + i, dst_start[r] + i) for
    i < length[r]. A prompt whose blocks were allocated in order on both workers is one run,
    whatever order the ids came in. Plain ints, not arrays: the notice and the descriptor rows
    are built from them with no numpy call (see checked_runs)."""

    src_start: tuple[int, ...]  # [R]
    dst_start: tuple[int, ...]  # [R]
    length: tuple[int, ...]  # [R] blocks
    num_blocks: int  # sum(length)

    @property
    def src(self) -> np.ndarray:
        """[num_blocks] int64 src ids in ascending order (for a backend that copies by index)."""
        return _expand(self.src_start, self.length)

    @property
    def dst(self) -> np.ndarray:
        """[num_blocks] int64 dst ids, paired with `src`."""
        return _expand(self.dst_start, self.length)


def checked_runs(src_block_ids, dst_block_ids, src_num_blocks: int, dst_num_blocks: int) -> BlockRuns:
    """Validate a push's block pairs (equal non-empty lists, ids inside both pools, no dst id
    twice) and merge them into runs. On a push's critical path, where the caches are cold
    (after a forward pass; on a CPU host after the previous push's copy) and each numpy call
    costs ~10 us: ids that ascend by one on both sides, the usual push, are checked with a few
    C-level list compares and no numpy call; anything else takes whole-array numpy calls, never
    a Python loop over the ids (1,024 of them for a 128K-token prompt)."""
    n = len(src_block_ids)
    s0, d0 = _run_start(src_block_ids), _run_start(dst_block_ids)  # the ends only: O(1)
    if (
        s0 is not None
        and d0 is not None
        and len(dst_block_ids) == n
        and 0 <= s0
        and s0 + n <= src_num_blocks
        and 0 <= d0
        and d0 + n <= dst_num_blocks
        and _ascends_by_one(src_block_ids, s0)
        and _ascends_by_one(dst_block_ids, d0)
    ):
        return BlockRuns((s0,), (d0,), (n,), n)
    return _checked_runs_numpy(src_block_ids, dst_block_ids, src_num_blocks, dst_num_blocks)


def _run_start(block_ids) -> int | None:
    """block_ids[0] when the ids are a non-empty list, tuple or range starting at an int whose
    last id is where a run ascending by one would end, else None (then checked_runs' numpy path
    decides, and raises for bad input)."""
    kind = type(block_ids)
    if kind is range:
        return block_ids.start if block_ids.step == 1 and len(block_ids) > 0 else None
    if (kind is not list and kind is not tuple) or not block_ids:
        return None
    start = block_ids[0]
    if type(start) is not int or block_ids[-1] != start + len(block_ids) - 1:
        return None
    return start


def _ascends_by_one(block_ids, start: int) -> bool:
    """Whether ids that passed _run_start are exactly start, start + 1, ...: one C-level compare."""
    kind = type(block_ids)
    return kind is range or block_ids == kind(range(start, start + len(block_ids)))


def _checked_runs_numpy(src_block_ids, dst_block_ids, src_num_blocks: int, dst_num_blocks: int) -> BlockRuns:
    """checked_runs for any ids; sorted src, the usual case here too, skips the sort and dst
    ids that ascend skip the duplicate search."""
    src, dst = _int64_ids(src_block_ids), _int64_ids(dst_block_ids)  # [n], [n]
    n = len(src)
    if n == 0 or n != len(dst):
        raise ValueError(f"need equal, non-empty block lists, got {n} -> {len(dst)}")
    ds = np.diff(src)  # [n - 1]
    if not (ds > 0).all():
        order = np.argsort(src, kind="stable")
        src, dst = src[order], dst[order]
        ds = np.diff(src)
    if src[0] < 0 or src[-1] >= src_num_blocks:
        raise ValueError(f"src_block_ids outside [0, {src_num_blocks})")
    dd = np.diff(dst)  # [n - 1]
    ascending = bool((dd > 0).all())  # then no id twice, and the ends are the extremes
    lo, hi = (dst[0], dst[-1]) if ascending else (dst.min(), dst.max())
    if lo < 0 or hi >= dst_num_blocks:
        raise ValueError(f"dst_block_ids outside the peer's [0, {dst_num_blocks})")
    if not ascending and len(np.unique(dst)) != n:
        raise ValueError("duplicate dst_block_ids")
    later = (np.flatnonzero((ds != 1) | (dd != 1)) + 1).tolist()  # [R - 1] first pair of each later run
    first = [0, *later]  # [R]
    length = tuple(end - start for start, end in zip(first, [*later, n], strict=True))
    return BlockRuns(tuple(src[first].tolist()), tuple(dst[first].tolist()), length, n)


def _int64_ids(block_ids) -> np.ndarray:
    """[n] int64 copy of a list, tuple or array of ids (fromiter: ~1.5x np.array on a list)."""
    if isinstance(block_ids, np.ndarray):
        return block_ids.astype(np.int64).reshape(-1)
    return np.fromiter(block_ids, dtype=np.int64, count=len(block_ids))


def _expand(starts: tuple[int, ...], lengths: tuple[int, ...]) -> np.ndarray:
    """[sum(lengths)] int64: each run's ids, run after run."""
    return np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, lengths, strict=True)])


def poll_sleep_s(waited_s: float) -> float:
    """How long `wait` sleeps between polls, `waited_s` after the post (see SPIN_S)."""
    if waited_s < SPIN_S:
        return 0.0
    return min(max(waited_s / 8, MIN_POLL_SLEEP_S), MAX_POLL_SLEEP_S)


def check_pools(contract: TransferContract, pools: KVPools) -> int:
    """Validate pools against the contract; returns the shared num_blocks."""
    if set(pools) != set(contract.group_names):
        raise ValueError(f"pool groups {sorted(pools)} != contract groups {sorted(contract.group_names)}")
    shapes = {}
    for name, pool in pools.items():
        block_bytes = contract.group(name).block_bytes
        if pool.dtype != torch.uint8 or pool.dim() != 2 or not pool.is_contiguous():
            raise ValueError(f"pool {name}: need a contiguous 2-D uint8 tensor")
        if pool.shape[1] != block_bytes:
            raise ValueError(f"pool {name}: row of {pool.shape[1]} B, contract says {block_bytes}")
        shapes[name] = (pool.shape[0], pool.device)
    if len(set(shapes.values())) != 1:
        raise ValueError(f"pools must share num_blocks and device, got {shapes}")
    num_blocks = next(iter(shapes.values()))[0]
    if num_blocks == 0:
        raise ValueError("pools have no blocks")
    return num_blocks


def pool_regions(contract: TransferContract, pools: KVPools) -> tuple[PoolRegion, ...]:
    regions = []
    for name in contract.group_names:
        pool = pools[name]
        on_cpu = pool.device.type == "cpu"
        regions.append(
            PoolRegion(
                group=name,
                address=pool.data_ptr(),
                num_blocks=pool.shape[0],
                block_bytes=pool.shape[1],
                device_id=0 if on_cpu else pool.get_device(),
                mem_type="DRAM" if on_cpu else "VRAM",
            )
        )
    return tuple(regions)


class KVReceiver(ABC):
    """Decode side: owns the destination pools and the ledger of expected requests."""

    backend: ClassVar[str]

    def __init__(self, contract: TransferContract, pools: KVPools, incarnation: str, agent_name: str):
        if not incarnation:
            raise ValueError("incarnation must be non-empty")
        self.contract = contract
        self.pools = dict(pools)
        self.num_blocks = check_pools(contract, self.pools)
        self.incarnation = incarnation
        self.agent_name = agent_name
        self._ledger = ReceiverLedger(self.num_blocks)
        # called (from a transport thread) when a notice arrived that `poll_completed` will
        # see: the owner's loop polls now instead of at its next iteration
        self.on_notice: Callable[[], None] | None = None

    def descriptor(self) -> bytes:
        """Peer metadata for the sender: contract, agent, incarnation, pool registrations."""
        return PeerDescriptor(
            backend=self.backend,
            agent_name=self.agent_name,
            incarnation=self.incarnation,
            contract=self.contract,
            regions=pool_regions(self.contract, self.pools),
            agent_metadata=self._agent_metadata(),
        ).to_bytes()

    def expect(
        self,
        request_id: str,
        dst_block_ids: Sequence[int],
        lease_deadline_s: float,
        incarnation: str,
        issued_s: float | None = None,
    ) -> None:
        """Wait for `request_id`'s KV in `dst_block_ids`, from writes carrying `incarnation`.

        `incarnation` is the fencing token the writer must echo in `send`: the sender worker's
        incarnation id, or a token handed out with the ticket. Expecting again with another
        token supersedes the first; writes carrying the old one are then rejected.
        `lease_deadline_s` is absolute, on whatever clock the owner later passes to `expire`
        (e.g. a ticket's unix deadline with time.time()). `issued_s` (unix) lets an
        `abandon_all` notice cover this ticket.
        """
        self._ledger.expect(request_id, dst_block_ids, lease_deadline_s, incarnation, issued_s)

    def poll_completed(self) -> list[str]:
        """Request ids whose every expected block has arrived since the last poll."""
        self._drain_notices()
        return self._ledger.take_completed()

    def cancel(self, request_id: str) -> bool:
        """Stop waiting; True if the request was live. Later notices for it are rejected."""
        return self._ledger.cancel(request_id)

    def drain(self, request_id: str, fallback_deadline_s: float) -> str | None:
        """Give a live request up, keeping its blocks until no write can land (see
        ledger.ReceiverLedger.drain): the token to wait for in `take_quiet`, or None to free
        the blocks now."""
        self._drain_notices()
        return self._ledger.drain(request_id, fallback_deadline_s)

    def take_quiet(self, now_s: float) -> list[str]:
        """Tokens of drained requests whose blocks no write can reach any more."""
        self._drain_notices()
        return self._ledger.take_quiet(now_s)

    @property
    def num_draining(self) -> int:
        return self._ledger.num_draining

    def is_draining(self, token: str) -> bool:
        return self._ledger.is_draining(token)

    def live_token(self, request_id: str) -> str | None:
        """The fencing token a live request is expected with, or None."""
        return self._ledger.live_token(request_id)

    def expire(self, now_s: float, grace_s: float = 0.0) -> list[str]:
        """Request ids whose lease passed at `now_s` without completion; they drain until
        `lease + grace_s` (or their sender's notice), then come out of `take_quiet`."""
        self._drain_notices()  # a transfer that did finish is not expired
        return self._ledger.expire(now_s, grace_s)

    def rejection_counts(self) -> dict[str, int]:
        """Rejected notices by reason (see ledger.Rejection)."""
        self._drain_notices()
        return self._ledger.rejection_counts()

    @property
    def live_request_ids(self) -> tuple[str, ...]:
        return self._ledger.live_request_ids

    def _drain_notices(self) -> None:
        for raw in self._fetch_notices():
            try:
                notice = TransferNotice.from_bytes(raw)
            except ValueError:
                self._ledger.on_malformed()
                continue
            self._ledger.on_notice(
                notice.request_id, notice.incarnation, notice.dst_block_ids, notice.kind, notice.before_unix_s
            )

    @abstractmethod
    def _agent_metadata(self) -> bytes:
        """Transport metadata the sender needs to reach this receiver."""

    @abstractmethod
    def _fetch_notices(self) -> list[bytes]:
        """Notices that arrived since the last call."""

    @abstractmethod
    def close(self) -> None:
        """Release transport resources (memory registrations, agent)."""


class KVSender(ABC):
    """Prefill side: owns the source pools; writes blocks into connected receivers."""

    backend: ClassVar[str]

    def __init__(self, contract: TransferContract, pools: KVPools):
        self.contract = contract
        self.pools = dict(pools)
        self.num_blocks = check_pools(contract, self.pools)
        self._bytes_per_block = contract.bytes_per_block
        self._peers: dict[str, PeerDescriptor] = {}

    # ------------------------------------------------------------------ peers
    def connect(self, descriptor: bytes) -> str:
        """Check the receiver's contract, then attach to it; returns the peer name."""
        try:
            peer = PeerDescriptor.from_bytes(descriptor)
        except (ValueError, KeyError, TypeError) as e:
            raise TransferError(f"malformed peer descriptor: {e}") from e
        if peer.backend != self.backend:
            raise TransferError(f"peer uses backend {peer.backend!r}, this sender {self.backend!r}")
        check_compatible(self.contract, peer.contract)  # before the transport sees the peer
        for name in self.contract.group_names:
            if peer.region(name).block_bytes != self.contract.group(name).block_bytes:
                raise TransferError(f"peer region {name} disagrees with its own contract")
        if peer.agent_name in self._peers:
            raise TransferError(f"already connected to {peer.agent_name}")
        self._attach(peer)
        self._peers[peer.agent_name] = peer
        return peer.agent_name

    def disconnect(self, peer: str) -> None:
        self._detach(self._peer(peer))
        del self._peers[peer]

    def peer_incarnation(self, peer: str) -> str:
        return self._peer(peer).incarnation

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    # ------------------------------------------------------------------ transfers
    def send(
        self,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        incarnation: str,
        *,
        peer: str | None = None,
    ) -> TransferHandle:
        """Post the write of every group's src blocks into the peer's dst blocks.

        `incarnation` is the fencing token the receiver expects (see KVReceiver.expect);
        `peer` may be omitted with exactly one connection.
        """
        return self.post(self.prepare(request_id, src_block_ids, dst_block_ids, incarnation, peer=peer))

    def prepare(
        self,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        incarnation: str,
        *,
        peer: str | None = None,
    ) -> PreparedSend:
        """`send`'s work up to the post: the block checks, the notice and the backend's
        descriptors (NIXL: the transfer request, initialised, not posted). A prefill worker
        prepares while its last chunk's kernels still run, so that only the post is left for
        when the KV has landed. Then `post` it once, or `discard` it; nothing moves before."""
        usage0 = thread_usage()
        t0 = time.perf_counter()
        target = self._only_peer() if peer is None else self._peer(peer)
        runs = checked_runs(src_block_ids, dst_block_ids, self.num_blocks, target.num_blocks)
        t1 = time.perf_counter()
        notice = write_notice_bytes(request_id, incarnation, runs.dst_start, runs.length)
        t2 = time.perf_counter()
        trace = {"check_ms": 1e3 * (t1 - t0), "notice_ms": 1e3 * (t2 - t1)}
        state = self._prepare(target, runs, notice, trace)
        prepared = PreparedSend(request_id, target.agent_name, runs.num_blocks * self._bytes_per_block, state, trace)
        note_usage(trace, "prepare", usage0)
        return prepared

    def post(self, prepared: PreparedSend) -> TransferHandle:
        """Post a prepared write (once): the transport has it when this returns."""
        if prepared.taken:
            raise TransferError(f"{prepared.request_id}: prepared write already posted or discarded")
        prepared.taken = True
        usage0 = thread_usage()
        posted_at_s = time.perf_counter()
        xfer = self._post_prepared(prepared.state, prepared.trace)
        handle = TransferHandle(
            prepared.request_id, prepared.peer, prepared.num_bytes, posted_at_s, xfer, prepared.trace
        )
        handle.post_returned_s = time.perf_counter()
        handle.post_returned_usage = (threading.get_ident(), *note_usage(prepared.trace, "send", usage0))
        return handle

    def discard(self, prepared: PreparedSend) -> None:
        """Drop a prepared write that will not be posted (idempotent; after `post`, a no-op)."""
        if prepared.taken:
            return
        prepared.taken = True
        self._discard_prepared(prepared.state)

    def abandon(self, request_id: str, incarnation: str, *, peer: str | None = None) -> None:
        """Tell the receiver that `request_id` (token `incarnation`) will get no write from this
        sender and none is in flight, so its blocks may be reused. Call it only once every
        transfer posted for the request is complete or aborted."""
        target = self._only_peer() if peer is None else self._peer(peer)
        notice = TransferNotice(request_id, incarnation, (), kind="abandon").to_bytes()
        self._notify(target, notice)

    def abandon_all(self, request_id: str, before_unix_s: float, *, peer: str | None = None) -> None:
        """Tell every connected receiver (or `peer`) that this sender has no run of
        `request_id` and refuses its tickets issued at or before `before_unix_s`."""
        notice = TransferNotice(request_id, "", (), kind="abandon_all", before_unix_s=before_unix_s).to_bytes()
        targets = list(self._peers.values()) if peer is None else [self._peer(peer)]
        for target in targets:
            self._notify(target, notice)

    def wait(self, handle: TransferHandle, timeout_s: float, cancel: threading.Event | None = None) -> TransferStats:
        """Block until the transfer completes; on failure, timeout or `cancel` being set, abort
        it and raise (once this returns or raises, no byte of the transfer is still moving)."""
        if handle.stats is not None:
            return handle.stats
        if handle.aborted:
            raise TransferError(f"{handle.request_id}: transfer was aborted")
        deadline_s = time.perf_counter() + timeout_s
        while True:
            stats, now_s = self._poll_handle(handle)
            if stats is not None:
                return stats
            if now_s >= deadline_s:
                self.abort(handle)
                raise TransferTimeout(f"{handle.request_id}: not done after {timeout_s} s")
            if cancel is not None and cancel.is_set():
                self.abort(handle)
                raise TransferCancelled(f"{handle.request_id}: transfer cancelled")
            time.sleep(poll_sleep_s(now_s - handle.posted_at_s))

    def poll_briefly(self, handle: TransferHandle, budget_s: float) -> TransferStats | None:
        """Poll without sleeping (or yielding) for up to `budget_s`: the stats once complete, or
        None while it is still moving (it stays posted: `wait` on it, or `abort` it). Raises
        like `wait` when it failed. For a caller on a latency-critical thread that hands only
        slow pushes to a waiting thread (a 128K-token prompt's KV moves in < 1 ms over cuda_ipc;
        two thread hops cost ~0.2-0.5 ms)."""
        if handle.stats is not None:
            return handle.stats
        if handle.aborted:
            raise TransferError(f"{handle.request_id}: transfer was aborted")
        end_s = time.perf_counter() + budget_s
        while True:
            stats, now_s = self._poll_handle(handle)
            if stats is not None or now_s >= end_s:
                return stats

    def _poll_handle(self, handle: TransferHandle) -> tuple[TransferStats | None, float]:
        """One poll: (stats, now) once DONE (the transport judged), (None, now) while PROC."""
        state = self._poll(handle.xfer)
        now_s = time.perf_counter()
        handle.trace["polls"] = handle.trace.get("polls", 0) + 1
        if state == "DONE":
            handle.stats = TransferStats(handle.num_bytes, now_s - handle.posted_at_s)
            handle.trace["done_ms"] = 1e3 * (now_s - handle.post_returned_s)
            returned = handle.post_returned_usage
            if returned is not None and returned[0] == threading.get_ident():
                note_usage(handle.trace, "done", returned[1:])
            self._check_done(handle)
            return handle.stats, now_s
        if state != "PROC":
            handle.aborted = True
            raise TransferError(f"{handle.request_id}: transfer to {handle.peer} failed")
        return None, now_s

    def abort(self, handle: TransferHandle) -> None:
        """Cancel an unfinished transfer (best effort at the transport); idempotent."""
        if handle.stats is not None or handle.aborted:
            return
        handle.aborted = True
        if self._poll(handle.xfer) == "PROC":
            try:
                self._abort(handle.xfer)
            except BaseException:
                handle.abort_failed = True
                raise

    # ------------------------------------------------------------------ helpers
    def _peer(self, peer: str) -> PeerDescriptor:
        if peer not in self._peers:
            raise TransferError(f"not connected to {peer!r} (peers: {sorted(self._peers)})")
        return self._peers[peer]

    def _only_peer(self) -> PeerDescriptor:
        if len(self._peers) != 1:
            raise TransferError(f"send needs peer= with {len(self._peers)} connections")
        return next(iter(self._peers.values()))

    def _check_done(self, handle: TransferHandle) -> None:
        """After a transfer completed: raise TransferError if it went a way it must not
        (e.g. NIXL over a transport the policy forbids); the default checks nothing."""
        return None

    @abstractmethod
    def _attach(self, peer: PeerDescriptor) -> None:
        """Make the peer reachable (load its metadata, prepare its descriptor lists)."""

    @abstractmethod
    def _detach(self, peer: PeerDescriptor) -> None:
        """Forget the peer and free what _attach prepared."""

    def _prepare(self, peer: PeerDescriptor, runs: BlockRuns, notice: bytes, trace: dict[str, float]) -> Any:
        """What `_post_prepared` posts later. Default: the arguments, posted by `_post` (a
        backend with nothing to build ahead of the post)."""
        return (peer, runs, notice)

    def _post_prepared(self, state: Any, trace: dict[str, float]) -> Any:
        peer, runs, notice = state
        return self._post(peer, runs, notice, trace)

    def _discard_prepared(self, state: Any) -> None:
        """Release what `_prepare` built (default: nothing was)."""
        del state

    @abstractmethod
    def _post(self, peer: PeerDescriptor, runs: BlockRuns, notice: bytes, trace: dict[str, float]) -> Any:
        """Start the write of all groups' blocks runs.src -> runs.dst plus the notice; returns xfer.
        May record its own phases in `trace` (see TransferHandle.trace)."""

    @abstractmethod
    def _poll(self, xfer: Any) -> str:
        """ "DONE", "PROC" or "ERR"; a finished xfer frees its transport resources."""

    @abstractmethod
    def _abort(self, xfer: Any) -> None:
        """Cancel an unfinished xfer and free it."""

    @abstractmethod
    def _notify(self, peer: PeerDescriptor, notice: bytes) -> None:
        """Deliver a notice that carries no data (an abandon notice)."""

    @abstractmethod
    def close(self) -> None:
        """Release transport resources (memory registrations, agent)."""
