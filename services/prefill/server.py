"""PrefillWorker: the engine in prefill role behind the `api.PrefillServerApi` contract.

    start(req)        head start: compute the prompt's KV now, before the decode worker's
                      ticket exists (the router reserves meanwhile); `run` joins it. Best effort:
                      False (nothing started) for a request already started or running here,
                      aborted since it arrived at the router, or with half the engine's sequences
                      held by head starts already. One no `run` joins within `lease_s` (or the
                      request's deadline) frees its blocks (they stay prefix-cached).
    run(req, ticket)  encoder path over the prompt (bounded replay on this worker's own prefix
                      hit; the head start's compute when there is one), then push the chunks the
                      decode worker lacks, chunk `ticket.first_block_index` onwards, into
                      `ticket.dst_block_ids`; returns once the write completed. The blocks are
                      released right after the push.
    abort(rid)        stops the compute (and frees its blocks), or cancels the push; idempotent

The head start is a call of its own, not `run` waiting for a ticket: a run waiting in a Serve
replica would hold one of its `max_ongoing_requests` slots, and with every slot held by runs
waiting for tickets no ticket could get in.

The transfer contract is checked when a decode worker is first connected (fail fast, no bytes
moved); connections are kept per decode incarnation.

No stranded capacity: on every path that does not end in a completed write (error, deadline,
cancel, abort, transfer timeout or failure), once no write of the request is in flight the
decode worker gets an abandon notice, so it reuses its reserved blocks at once, and this
worker's blocks are freed. An abort that arrives before its run (a head start alone counts as
no run: it knows no ticket) leaves a tombstone: the late run is refused (and abandoned) instead
of computing for nobody, and every connected decode worker gets an `abandon_all` notice: it may
reuse the blocks of the tickets this worker now refuses. No write is posted after the ticket's
lease, and none outlives `transfer_timeout_s`: the decode side's fallback for a dead prefill
rests on that bound. Each attempt runs in the engine under `<request id>@p<n>` (n counts this
worker's attempts), so a retry of a request id never collides with an attempt still winding down.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from flashpd.engine.async_engine import EngineDead, RequestFailed
from flashpd.engine.llm_engine import LLMEngine
from flashpd.engine.request import PrefixPolicy
from flashpd.engine.transfer.base import TransferCancelled, TransferError
from flashpd.engine.transfer.contract import CHUNK_TOKENS, ContractMismatch
from flashpd.services.api import (
    Cancelled,
    DeadlineExceeded,
    Internal,
    InternalRequest,
    InvalidArgument,
    PrefillResult,
    Ticket,
    TransferFailed,
    Unavailable,
    WorkerRef,
)
from flashpd.services.worker.common import EngineWorker, WorkerConfig, make_sender

log = logging.getLogger(__name__)


MAX_TOMBSTONES = 4096  # request ids aborted before their run arrived, remembered (bounded)
PUSH_RECORDS = 64  # the last pushes' timings, kept for `push_records` (diagnostics)
PUSH_THREADS = 4  # threads that wait on KV pushes (the NIXL agent itself is serialized)
INLINE_WAIT_S = 1e-3  # a push is polled on the event loop this long before a thread waits on it
# ... and by the engine's loop thread right after it posted at kv_ready (a 128K-token prompt's KV
# lands in ~0.1 ms over cuda_ipc): the completion is seen there, not after the output's hop
ENGINE_POLL_S = 1e-3
# an early write (`WorkerConfig.push_early`) is waited for this long on the engine's loop thread,
# then aborted (the kv_ready write then moves every block): cuda_ipc moves 100 MB in ~0.1 ms
EARLY_WAIT_S = 0.05


@dataclass
class _Run:
    """One prefill attempt: its engine id, the cancel flag its push polls, and what it did."""

    engine_id: str
    phase: str = "compute"  # "compute" | "push" | "done"
    cancel: threading.Event = field(default_factory=threading.Event)
    write_may_land: bool = False  # a transfer could not be cancelled: never send abandon
    push_started_s: float = 0.0  # time.monotonic() when the push thread took the push
    posted_s: float = 0.0  # ... when the write was posted (descriptors built, NIXL called)
    trace: dict = field(default_factory=dict)  # the push's phases (TransferHandle.trace)
    inline: bool = False  # the push completed within the event loop's polls (no thread hop)
    computed_s: float = 0.0  # time.monotonic() when the compute ended
    early_bytes: int = 0  # written before kv_ready (the chunks whose KV was final), complete
    early_ms: float = 0.0  # ... that write's post -> completion seen
    engine_post: bool = False  # the write was posted by the engine's loop thread at kv_ready


@dataclass
class _Armed:
    """A run whose ticket is known, waiting for its KV: the engine's loop thread posts the write
    at kv_ready (`PrefillWorker._on_engine_output`) and records the outcome here. Whoever takes
    it out of `_armed` first owns it: the output hook (then `settled` is set once it posted or
    failed) or `run` (then no write was posted for it by the hook)."""

    req: InternalRequest
    ticket: Ticket
    peer: str
    run: _Run
    handle: object = None  # the posted write (TransferHandle)
    error: BaseException | None = None  # what refused or failed the post
    compute_end_s: float = 0.0  # time.monotonic() when the hook saw kv_ready
    settled: threading.Event = field(default_factory=threading.Event)
    # built before the last chunk's kernels were waited for (`_on_kv_pending`), for these blocks
    prepared: object = None  # PreparedSend
    prepared_blocks: tuple[int, ...] = ()
    done_s: float = 0.0  # time.monotonic() when the hook's polls saw the write complete


@dataclass
class _HeadStart:
    """A prefill computing before its ticket (`start`); `run` takes it over, or `expiry` drops it."""

    req: InternalRequest
    run: _Run
    compute: asyncio.Task  # -> the engine's kv_ready output
    started_s: float  # time.monotonic()
    expiry: asyncio.TimerHandle | None = None


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, engine: LLMEngine, config: WorkerConfig, ref: WorkerRef):
        super().__init__(engine, config, ref)
        self.sender = make_sender(config.transfer_backend, self.contract, self.pools)
        self._peers: dict[bytes, str] = {}
        self._queued_tokens: dict[str, int] = {}
        self._runs: dict[str, dict[str, _Run]] = {}  # request id -> engine id -> attempt
        self._heads: dict[str, _HeadStart] = {}  # request id -> head start no run took over yet
        self._attempt_numbers = itertools.count()
        # head starts no run took over yet hold at most half the engine's sequences, so runs
        # whose decode worker queued their reserve never wait for them (up to the lease)
        self._max_heads = max(1, config.engine.max_num_seqs // 2)
        self._tombstones: OrderedDict[str, float] = OrderedDict()  # request id -> unix time
        self._pushes = ThreadPoolExecutor(PUSH_THREADS, thread_name_prefix="flashpd-push")
        self._cleanups: set[asyncio.Task] = set()
        self.transfer_failures = 0
        self.push_records: deque[dict] = deque(maxlen=PUSH_RECORDS)
        # runs armed for a push at kv_ready, by engine id; the engine's loop thread takes them
        self._armed: dict[str, _Armed] = {}
        self._armed_lock = threading.Lock()
        self.engine.output_hooks.append(self._on_engine_output)
        self.engine.kv_pending_hooks.append(self._on_kv_pending)

    async def start(self, req: InternalRequest) -> bool:
        """Start computing `req`'s KV before its ticket exists; `run(req, ticket)` joins it."""
        self._check_servable(req)
        rid = req.request_id
        running = any(not r.cancel.is_set() for r in self._runs.get(rid, {}).values())
        if rid in self._heads or running or self._aborted_since(rid, req.arrival_unix_s):
            return False
        if len(self._heads) >= self._max_heads:  # a burst whose tickets come late: leave room for runs
            return False
        run = self._new_run(req)
        compute = asyncio.ensure_future(self._compute(req, run))
        compute.add_done_callback(_consume_result)  # a dropped head start's outcome is nobody's
        head = _HeadStart(req, run, compute, time.monotonic())
        remaining = req.remaining_s()
        bound = self.config.lease_s if remaining is None else min(self.config.lease_s, max(remaining, 0.0))
        head.expiry = asyncio.get_running_loop().call_later(bound, self._expire_head, head)
        self._heads[rid] = head
        return True

    async def run(self, req: InternalRequest, ticket: Ticket) -> PrefillResult:
        head = self._take_head(req)
        try:
            self._check_servable(req)
            peer = self._connect(ticket.transfer_descriptor)
        except BaseException:
            if head is not None:
                await self._drop_head(head)
            raise
        t0 = time.monotonic() if head is None else head.started_s
        rid = req.request_id
        run = self._new_run(req) if head is None else head.run
        self._runs.setdefault(rid, {})[run.engine_id] = run
        push = armed = None
        try:
            self._check_may_start(rid, ticket)
            armed = self._arm(req, ticket, peer, run)
            try:
                ready = await (self._compute(req, run) if head is None else head.compute)
            finally:
                if self._disarm(armed):
                    armed = None  # the hook never took it: no write was posted for it
            compute_ms = 1e3 * (run.computed_s - t0)  # not the wait for a head start's run
            if armed is not None:  # posted (or refused) by the engine's loop thread at kv_ready
                t1 = armed.compute_end_s
                run.phase = "push"
                stats, push = self._follow_engine_post(req, ticket, armed)
            else:
                t1 = time.monotonic()
                run.phase = "push"
                stats, push = self._start_push(req, ticket, peer, ready.kv_block_ids, run)
            if push is not None:  # still moving after the inline polls: a push thread waits
                stats = await asyncio.shield(push)
            run.phase = "done"
            # compute end -> the write seen complete: by the engine's loop thread right after
            # its post, else here (the push's own time, not the kv_ready output's hop to here)
            done_s = armed.done_s if armed is not None and armed.done_s else time.monotonic()
            transfer_ms = 1e3 * (done_s - t1)
            self._record_push(req.request_id, stats, t1, run, transfer_ms)
            return PrefillResult(
                prefill_worker_id=self.ref.worker_id,
                prefill_cached_tokens=ready.cached_tokens,
                computed_tokens=len(req.kv_prompt_ids) - ready.cached_tokens,
                pushed_bytes=stats.num_bytes + run.early_bytes,
                queue_ms=0.0,
                compute_ms=compute_ms,
                transfer_ms=transfer_ms,
            )
        finally:
            if run.phase != "done":
                run.cancel.set()  # a push still running aborts its transfer
                if armed is not None and push is None:  # the hook posted: end that write first
                    push = asyncio.ensure_future(self._settle_engine_post(req, ticket, armed))
                    push.add_done_callback(_consume_result)
                elif head is not None and push is None:
                    head.compute.cancel()  # refused before the compute ended
                    push = head.compute  # ... whose end the cleanup waits for
            await self._finish_shielded(req, run, push, ticket, peer)

    def _new_run(self, req: InternalRequest) -> _Run:
        run = _Run(f"{req.request_id}@p{next(self._attempt_numbers)}")
        self._queued_tokens[run.engine_id] = len(req.kv_prompt_ids)
        return run

    def _take_head(self, req: InternalRequest) -> _HeadStart | None:
        """The head start of this very request (same prompt, same credit cap), now run's; one
        for another request under the same id is dropped."""
        head = self._heads.pop(req.request_id, None)
        if head is None:
            return None
        if head.expiry is not None:
            head.expiry.cancel()
        if (
            head.req.kv_prompt_ids != req.kv_prompt_ids
            or head.req.max_prefill_credit_tokens != req.max_prefill_credit_tokens
        ):
            self._spawn_cleanup(self._drop_head(head))
            return None
        return head

    def _expire_head(self, head: _HeadStart) -> None:
        """No run took the head start over in time (its router gave up or died): free it."""
        if self._heads.get(head.req.request_id) is head:
            del self._heads[head.req.request_id]
            log.warning("head start of %s: no run within its bound; blocks freed", head.req.request_id)
            self._spawn_cleanup(self._drop_head(head))

    async def _drop_head(self, head: _HeadStart) -> None:
        """End a head start no run owns: stop its compute and free its blocks. It knew no
        ticket, so no decode worker expects a write from it (an abort adds the tombstone)."""
        head.run.cancel.set()
        head.compute.cancel()
        await asyncio.wait([head.compute])
        await self._finish(head.req, head.run, None)

    def _check_servable(self, req: InternalRequest) -> None:
        if self.draining:
            raise Unavailable(f"{self.ref.worker_id} is draining")
        if req.model != self.config.model_id:
            raise InvalidArgument(f"unknown model {req.model!r}", field="model")

    def _check_may_start(self, rid: str, ticket: Ticket) -> None:
        if self._aborted_before(rid, ticket):
            raise Cancelled(f"prefill of {rid} was aborted before it started")
        if time.time() >= ticket.lease_deadline_unix_s:
            raise Unavailable(f"the ticket's lease for {rid} passed before prefill started")

    async def _finish_shielded(
        self, req: InternalRequest, run: _Run, push, ticket: Ticket | None = None, peer: str | None = None
    ) -> None:
        """`_finish` as its own task: a second cancel of the run leaves the cleanup running."""
        await asyncio.shield(self._spawn_cleanup(self._finish(req, run, push, ticket, peer)))

    def _spawn_cleanup(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task

    async def _finish(
        self, req: InternalRequest, run: _Run, push, ticket: Ticket | None = None, peer: str | None = None
    ) -> None:
        """After every run: once no write is in flight, abandon an unfinished handoff (the
        decode worker frees its blocks now) and free this worker's blocks. `push`: the push
        (or a head start's compute) to wait for first. Without a ticket (a head start no run
        took over) there is no handoff to abandon."""
        if push is not None:
            await asyncio.wait([push])  # the thread returns once the transfer ended or aborted
        if ticket is not None and run.phase != "done" and not run.write_may_land:
            abandon = functools.partial(self.sender.abandon, req.request_id, ticket.incarnation, peer=peer)
            try:
                await asyncio.get_running_loop().run_in_executor(self._pushes, abandon)
            except Exception as exc:  # noqa: BLE001 - the decode side falls back on its lease
                log.warning("abandon notice for %s failed: %r", req.request_id, exc)
        runs = self._runs.get(req.request_id, {})
        runs.pop(run.engine_id, None)
        if not runs:
            self._runs.pop(req.request_id, None)
        self._queued_tokens.pop(run.engine_id, None)
        try:
            await self.engine.call(lambda e: _release(e, run.engine_id))
        except EngineDead:  # shutting down (or dead): its blocks go with the engine
            pass

    async def _compute(self, req: InternalRequest, run: _Run):
        remaining = req.remaining_s()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded("deadline passed before prefill started")
        try:
            prefix = PrefixPolicy(max_credit_tokens=req.max_prefill_credit_tokens)
            ready = await asyncio.wait_for(
                self.engine.prefill(run.engine_id, req.kv_prompt_ids, prefix), timeout=remaining
            )
            run.computed_s = time.monotonic()
            return ready
        except TimeoutError:
            raise DeadlineExceeded("deadline passed during prefill") from None
        except asyncio.CancelledError:
            raise Cancelled(f"prefill of {req.request_id} cancelled") from None
        except RequestFailed as exc:
            raise Internal(f"prefill of {req.request_id} failed: {exc.reason}") from None

    def _connect(self, descriptor: bytes) -> str:
        peer = self._peers.get(descriptor)
        if peer is None:
            try:
                peer = self.sender.connect(descriptor)
            except ContractMismatch as exc:
                raise Internal(f"transfer contract mismatch with decode worker: {exc}") from exc
            except TransferError as exc:
                self.transfer_failures += 1
                raise TransferFailed(f"cannot reach decode worker: {exc}") from exc
            self._peers[descriptor] = peer
            self._announce_tombstones(peer)
        return peer

    def _record_push(self, request_id: str, stats, t1: float, run: _Run, transfer_ms: float) -> None:
        """Where a push's time went (ms after the compute ended): compute end -> the push
        started (`hop_ms`), posting (`post_ms`: `send`, checks + descriptors + NIXL post; only
        the post when the write was built ahead, `prepared`), the transport's post -> completion
        seen (`wire_ms` = stats.seconds), compute end -> completion seen (`transfer_ms`, what
        PrefillResult.transfer_ms reports), compute end -> push done on the event loop
        (`total_ms`: with the kv_ready output's hop), and `send`/`wait`'s own phases (`phases`:
        TransferHandle.trace; `inline`: done within the event loop's polls, no thread hop)."""
        started, posted, now = run.push_started_s, run.posted_s, time.monotonic()
        self.push_records.append(
            {
                "request_id": request_id,
                "bytes": stats.num_bytes + run.early_bytes,
                "early_bytes": run.early_bytes,  # written before kv_ready (`push_early`)
                "early_ms": run.early_ms,
                "descriptors": int(run.trace.get("num_descriptors", 0)),
                "hop_ms": 1e3 * (started - t1) if started else None,
                "post_ms": 1e3 * (posted - started) if posted and started else None,
                "wire_ms": 1e3 * stats.seconds,
                "transfer_ms": transfer_ms,
                "total_ms": 1e3 * (now - t1),
                "prepared": bool(run.trace.get("prepared_ahead")),
                "gb_s_wire": stats.num_bytes / stats.seconds / 1e9 if stats.seconds > 0 else None,
                "inline": run.inline,
                "engine_post": run.engine_post,
                "phases": {k: round(v, 4) for k, v in run.trace.items()},
            }
        )

    def _announce_tombstones(self, peer: str) -> None:
        """A newly connected decode worker learns of the recent aborts that found no run here
        (it may be draining blocks for them; older ones are past its fallback anyway)."""
        horizon = time.time() - self.config.lease_s - self.config.transfer_timeout_s
        for request_id, aborted_at in list(self._tombstones.items()):
            if aborted_at < horizon:
                continue
            notice = functools.partial(self.sender.abandon_all, request_id, aborted_at, peer=peer)
            try:
                notice()
            except TransferError as exc:
                log.warning("abandon_all notice for %s failed: %s", request_id, exc)

    # ------------------------------------------------------------------ push at kv_ready
    def _arm(self, req: InternalRequest, ticket: Ticket, peer: str, run: _Run) -> _Armed:
        armed = _Armed(req, ticket, peer, run)
        with self._armed_lock:
            self._armed[run.engine_id] = armed
        return armed

    def _disarm(self, armed: _Armed) -> bool:
        """True when `run` took it back (the hook never fired for it); a write prepared for it
        is dropped."""
        with self._armed_lock:
            taken = self._armed.pop(armed.run.engine_id, None)
        if taken is not None and taken.prepared is not None:
            self.sender.discard(taken.prepared)
        return taken is not None

    def _on_kv_pending(self, engine_id: str, kv_block_ids: tuple[int, ...], final_tokens: int) -> None:
        """On the engine's loop thread, before it waits for the last chunk's kernels: build an
        armed run's write (checks, descriptors, NIXL's request) so that at kv_ready only the post
        is left. With `push_early`, first write the blocks whose KV is already final (those of
        the chunks before the last: `final_tokens`) and wait for that write here, so the
        kv_ready write moves the last chunk only, on a warm transport path. A refusal here is
        left for kv_ready, which checks again and raises it. Under the armed lock: a run that
        takes its armed entry back (`_disarm`) finds no write of the hook in flight."""
        with self._armed_lock:
            armed = self._armed.get(engine_id)
            if armed is None or armed.prepared is not None:
                return
            try:
                src = _blocks_to_push(kv_block_ids, armed.ticket)
                dst = armed.ticket.dst_block_ids
                _check_may_push(armed.req.request_id, armed.run, armed.ticket)
                early = 0
                if self.config.push_early:
                    final_blocks = final_tokens // CHUNK_TOKENS - armed.ticket.first_block_index
                    early = self._push_early(armed, src, dst, max(0, min(final_blocks, len(src) - 1)))
                armed.prepared = self.sender.prepare(
                    armed.req.request_id, src[early:], dst[early:], armed.ticket.incarnation, peer=armed.peer
                )
                armed.prepared_blocks = tuple(kv_block_ids)
            except Exception:  # noqa: BLE001 - kv_ready posts without it (and raises what refuses)
                log.debug("push of %s not prepared ahead", engine_id, exc_info=True)

    def _push_early(self, armed: _Armed, src: list[int], dst, n: int) -> int:
        """Write the first `n` blocks now (a normal write, with its notice: the decode side
        counts the blocks received) and wait for it; -> n, or 0 when it did not complete (it
        was aborted: the kv_ready write then moves every block)."""
        if n <= 0:
            return 0
        req, run = armed.req, armed.run
        try:
            handle = self.sender.send(req.request_id, src[:n], dst[:n], armed.ticket.incarnation, peer=armed.peer)
        except TransferError:
            return 0  # nothing in flight
        try:
            stats = self.sender.wait(handle, EARLY_WAIT_S, run.cancel)
        except TransferError:
            if handle.abort_failed:
                run.write_may_land = True  # never send abandon: the bytes may still land
            return 0
        run.early_bytes, run.early_ms = stats.num_bytes, 1e3 * stats.seconds
        return n

    def _on_engine_output(self, out) -> None:
        """On the engine's loop thread, before the output is delivered: at kv_ready of an armed
        run, post its write right away (the KV is in the pools: kv_ready waited for the step's
        kernels). The same checks as the event loop's path; any refusal is kept for `run`."""
        if out.finish_reason != "kv_ready":
            return
        with self._armed_lock:
            armed = self._armed.pop(out.request_id, None)
        if armed is None:
            return
        try:
            armed.compute_end_s = time.monotonic()
            prepared, armed.prepared = armed.prepared, None
            if prepared is not None and armed.prepared_blocks != tuple(out.kv_block_ids):
                self.sender.discard(prepared)  # not the blocks it was built for
                prepared = None
            armed.handle = self._post(
                armed.req, armed.ticket, armed.peer, out.kv_block_ids, armed.run, armed.compute_end_s, prepared
            )
            armed.run.engine_post = True
            if self.sender.poll_briefly(armed.handle, ENGINE_POLL_S) is not None:
                armed.done_s = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - `run` raises it on the event loop
            armed.error = exc  # a TransferError leaves nothing in flight (refused, or ended)
        finally:
            armed.settled.set()

    def _follow_engine_post(self, req: InternalRequest, ticket: Ticket, armed: _Armed):
        """After kv_ready reached `run`: the hook has settled (it ran before the output was
        delivered). Poll its write like `_start_push` does; raise what refused it."""
        if armed.error is not None:
            exc = armed.error
            if isinstance(exc, TransferError):  # nothing in flight: refused, or ended (ERR)
                raise self._push_error(req, ticket, exc) from exc
            raise exc
        return self._poll_posted(req, ticket, armed.handle, armed.run)

    async def _settle_engine_post(self, req: InternalRequest, ticket: Ticket, armed: _Armed) -> None:
        """`run` ended before following the hook's write (cancelled, say): wait until the hook
        has settled, then until its write ended (run.cancel is set: the wait aborts it), so the
        cleanup's abandon notice never races a write still in flight."""
        loop = asyncio.get_running_loop()
        if not armed.settled.is_set():
            await loop.run_in_executor(self._pushes, armed.settled.wait)
        if armed.handle is not None:
            await loop.run_in_executor(self._pushes, self._wait_push, req, ticket, armed.handle, armed.run)

    def _post(
        self, req: InternalRequest, ticket: Ticket, peer: str, kv_block_ids, run: _Run, started_s: float, prepared=None
    ):
        """Check the push may go (the blocks match the ticket, not cancelled, lease not passed)
        and post the write of the chunks the decode worker lacks (`prepared`: built ahead for
        these blocks); returns its handle. Raises with nothing in flight (a prepared write is
        dropped). On the engine's loop thread (at kv_ready) or the event loop."""
        run.push_started_s = started_s
        try:
            src = _blocks_to_push(kv_block_ids, ticket) if prepared is None else None
            _check_may_push(req.request_id, run, ticket)
            if prepared is not None:
                handle = self.sender.post(prepared)
                handle.trace["prepared_ahead"] = 1
            else:
                handle = self.sender.send(req.request_id, src, ticket.dst_block_ids, ticket.incarnation, peer=peer)
        finally:
            if prepared is not None:
                self.sender.discard(prepared)  # a no-op once posted
        run.posted_s, run.trace = time.monotonic(), handle.trace
        return handle

    def _start_push(self, req: InternalRequest, ticket: Ticket, peer: str, kv_block_ids, run: _Run):
        """On the event loop: post the write and poll it for up to INLINE_WAIT_S, so a push
        that completes that fast (a 128K-token prompt's 117 MB over cuda_ipc) pays no hop onto
        a push thread and back (~0.2-0.5 ms, most of a 32K-token push); a slower one is waited
        on by a push thread. Returns (stats, None) or (None, the waiting thread's future).
        Raises with nothing in flight. A backend that copies inside the post (local, UCX cma
        between host pools) holds the loop for the copy: CPU deployments only."""
        try:
            handle = self._post(req, ticket, peer, kv_block_ids, run, time.monotonic())
        except TransferError as exc:  # nothing in flight: refused
            raise self._push_error(req, ticket, exc) from exc
        return self._poll_posted(req, ticket, handle, run)

    def _poll_posted(self, req: InternalRequest, ticket: Ticket, handle, run: _Run):
        """Poll a posted write on the event loop for up to INLINE_WAIT_S; a slower one is waited
        on by a push thread. Returns (stats, None) or (None, the waiting thread's future)."""
        try:
            stats = self.sender.poll_briefly(handle, INLINE_WAIT_S)
        except TransferError as exc:  # nothing in flight: ended (ERR, judged)
            raise self._push_error(req, ticket, exc) from exc
        if stats is not None:
            run.inline = True
            return stats, None
        wait = functools.partial(self._wait_push, req, ticket, handle, run)
        return None, asyncio.get_running_loop().run_in_executor(self._pushes, wait)

    def _wait_push(self, req: InternalRequest, ticket: Ticket, handle, run: _Run):
        """On a push thread; returns or raises once the write completed or was cancelled (or,
        when the transport could not cancel it, marks the run so no abandon notice is sent:
        the decode worker then keeps the blocks until its lease bound)."""
        try:
            return self.sender.wait(handle, self.config.transfer_timeout_s, run.cancel)
        except TransferError as exc:
            raise self._push_error(req, ticket, exc) from exc
        finally:
            if handle.abort_failed:
                run.write_may_land = True

    def _push_error(self, req: InternalRequest, ticket: Ticket, exc: TransferError) -> Exception:
        if isinstance(exc, TransferCancelled):
            return Cancelled(f"KV push of {req.request_id} cancelled")
        self.transfer_failures += 1
        return TransferFailed(f"KV push to {ticket.decode_worker_id} failed: {exc}")

    async def abort(self, request_id: str) -> bool:
        head = self._heads.pop(request_id, None)
        if head is not None:
            if head.expiry is not None:
                head.expiry.cancel()
            await asyncio.shield(self._spawn_cleanup(self._drop_head(head)))
        runs = list(self._runs.get(request_id, {}).values())
        if not runs:  # not started (or already over): refuse a run that arrives later
            now = time.time()
            self._tombstones[request_id] = now
            while len(self._tombstones) > MAX_TOMBSTONES:
                self._tombstones.popitem(last=False)
            try:  # decode workers may reuse blocks reserved for this request before now
                await asyncio.get_running_loop().run_in_executor(self._pushes, self.sender.abandon_all, request_id, now)
            except Exception as exc:  # noqa: BLE001 - the decode side falls back on its lease
                log.warning("abandon_all notice for %s failed: %r", request_id, exc)
            return head is not None
        for run in runs:
            run.cancel.set()
            if run.phase == "compute":
                await self.engine.abort(run.engine_id)
        return True

    def _aborted_before(self, request_id: str, ticket: Ticket) -> bool:
        """Whether an abort of `request_id` came after this ticket was issued (a retry reserved
        after the abort is a new attempt and runs). The issue time is the lease deadline minus
        the lease both sides are configured with."""
        aborted_at = self._tombstones.get(request_id)
        if aborted_at is None:
            return False
        if ticket.lease_deadline_unix_s - self.config.lease_s > aborted_at:
            return False
        del self._tombstones[request_id]
        return True

    def _aborted_since(self, request_id: str, since_unix_s: float) -> bool:
        """Whether an abort of `request_id` came at or after `since_unix_s` (its arrival at the
        router): a head start that arrives after its own abort computes nothing."""
        aborted_at = self._tombstones.get(request_id)
        return aborted_at is not None and aborted_at >= since_unix_s

    def queued_prefill_tokens(self) -> int:
        return sum(self._queued_tokens.values())

    async def close(self) -> None:
        self.draining = True
        for head in self._heads.values():
            if head.expiry is not None:
                head.expiry.cancel()
            self._spawn_cleanup(self._drop_head(head))
        self._heads.clear()
        for run in [r for runs in self._runs.values() for r in runs.values()]:
            run.cancel.set()
        if self._cleanups:
            await asyncio.wait(set(self._cleanups), timeout=self.config.transfer_timeout_s)
        await asyncio.to_thread(self.engine.shutdown)
        self._pushes.shutdown(wait=True)
        self.sender.close()


def _consume_result(task: asyncio.Task) -> None:
    """Mark a head start's outcome seen: a dropped one's error is expected, not news."""
    if not task.cancelled():
        task.exception()


def _release(e: LLMEngine, request_id: str) -> None:
    """Free a finished prefill's blocks (they stay prefix-cached) or abort an unfinished one."""
    try:
        e.release_kv(request_id)
    except KeyError:
        e.abort(request_id)


def _blocks_to_push(kv_block_ids: tuple[int, ...], ticket: Ticket) -> list[int]:
    """The prompt's blocks from the ticket's first missing chunk on, one per destination block."""
    src = list(kv_block_ids[ticket.first_block_index :])
    if len(src) != len(ticket.dst_block_ids):
        raise Internal(
            f"prefill holds {len(kv_block_ids)} blocks; the ticket "
            f"asks for chunks {ticket.first_block_index}.. into "
            f"{len(ticket.dst_block_ids)} blocks"
        )
    return src


def _check_may_push(rid: str, run: _Run, ticket: Ticket) -> None:
    if run.cancel.is_set():
        raise Cancelled(f"prefill of {rid} aborted")
    if time.time() >= ticket.lease_deadline_unix_s:  # decode gave the blocks up: the
        # attempt is lost, not the request (a slow, loaded machine): place it again
        raise Unavailable(f"the ticket's lease for {rid} passed before the KV push")
