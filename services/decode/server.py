"""DecodeWorker: the engine in decode role behind the `api.DecodeServerApi` contract.

    reserve(req)   blocks for the chunks this worker lacks (its own prefix hit reused), a
                   receiver lease for them, and a ticket for the prefill worker; beyond
                   capacity the call waits in a bounded FIFO queue (its deadline applies) and
                   only a full queue refuses (`WorkerFull`, RESOURCE_EXHAUSTED + retry-after)
    generate(req)  waits for the KV (completion notices polled on the engine thread), replays
                   the last 128 prompt tokens, streams tokens with continuous batching
    abort(rid)     frees the blocks and the lease; idempotent
    drain(s)       live migration: refuse new reserves; pause every stream holding its KV and
                   tell the router (MigrateEvent), which reserves on another decode worker and
                   calls migrate_out(rid, ticket) (this worker pushes the original prompt's
                   KV blocks D -> D, the target recomputes the streamed outputs), or
                   resume(rid) when nowhere has room (the stream finishes here)

Fencing: every reservation gets its own incarnation token `<worker incarnation>.<n>`, and runs in
the engine as `<request id>@<token>`; the receiver only accepts a completion notice carrying the
token of the live reservation, so a write from a superseded or cancelled prefill never admits a
request. A reserve of a request id this worker still holds (a retry after a lost prefill)
supersedes the old attempt: it is given up as below and the retry proceeds.

Giving up a reservation whose KV may be in flight (abort, lease expiry, supersede): NIXL writes
are one-sided, so its blocks return only once no write can land in them: when the prefill
side's completion notice covers them, or its abandon notice says nothing is or will be in
flight (the prefill worker sends one on every path that does not end in a completed write,
aborts included; an abort that finds no run there sends `abandon_all`, covering the tickets
the prefill will now refuse). For a dead prefill there is the bounded fallback `lease + transfer_timeout_s
+ DRAIN_MARGIN_S`: a prefill posts no write after the lease and none outlives its transfer
timeout. A reservation whose ticket never left this worker is freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from flashpd.engine.async_engine import RequestFailed
from flashpd.engine.llm_engine import LLMEngine
from flashpd.engine.request import PrefixPolicy, RequestStatus
from flashpd.engine.sampling_params import SamplingError, SamplingParams
from flashpd.engine.scheduler import PausedKV, Reservation
from flashpd.engine.transfer.base import TransferError
from flashpd.engine.transfer.contract import ContractMismatch
from flashpd.services.api import (
    Event,
    Internal,
    InternalRequest,
    InvalidArgument,
    MigrateEvent,
    MigrationResult,
    NotFound,
    Ticket,
    Timeline,
    TokenEvent,
    TokenLogprobs,
    TransferFailed,
    Unavailable,
    WorkerRef,
)
from flashpd.services.worker.admission import AdmissionQueue
from flashpd.services.worker.common import EngineWorker, WorkerConfig, final_event, make_receiver, ms_since

log = logging.getLogger(__name__)
DRAIN_MARGIN_S = 1.0  # clock skew and notice delivery between the two workers
MAX_EXPIRED = 4096  # request ids whose lease expired, remembered so generate says UNAVAILABLE


@dataclass
class _Attempt:
    """One reservation of a request id on this worker."""

    request_id: str
    token: str
    engine_id: str
    issued_unix_s: float
    lease_unix_s: float
    ticket_issued: bool = False  # the ticket left this worker: a prefill may write
    expired: bool = False
    reservation: Reservation | None = None
    paused: PausedKV | None = None  # draining: out of the batch, its KV held for a migration
    stays: bool = False  # draining, but nowhere to move: finishes here


_PAUSED = object()  # the marker a paused request's engine stream gets after its last output


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(self, engine: LLMEngine, config: WorkerConfig, ref: WorkerRef):
        super().__init__(engine, config, ref)
        self.receiver = make_receiver(config.transfer_backend, self.contract, self.pools, ref.incarnation)
        self.engine.hooks.append(self._poll_transfers)
        self.receiver.on_notice = self.engine.wake  # a KV push's notice: poll it now
        self.engine.on_unfinished_close = self._stream_closed
        self._tokens = itertools.count()
        self._attempts: dict[str, _Attempt] = {}  # request id -> live attempt (loop thread)
        self._draining: dict[str, str] = {}  # token -> engine id whose blocks wait to be quiet
        self._arrived_at: dict[str, float] = {}
        self._free_blocks = -1
        self.admission = AdmissionQueue(config.max_queued_requests, retry_after_s=config.retry_after_s)
        self._expired: OrderedDict[str, None] = OrderedDict()  # leases expired (bounded)
        self._sender = None  # made at the first migration (a NIXL agent of its own)
        self._peers: dict[bytes, str] = {}  # decode descriptor -> sender peer

    # ------------------------------------------------------------------ api
    async def reserve(self, req: InternalRequest) -> Ticket:
        if self.draining:
            raise Unavailable(f"{self.ref.worker_id} is draining")
        self._check_request(req)
        params = req.sampling
        await self._compile_grammar(params)
        attempt = await self.admission.admit(
            lambda: self._try_reserve(req, params), req.deadline_unix_s, req.request_id
        )
        attempt.ticket_issued = True
        return self._ticket(req, attempt)

    async def _try_reserve(self, req: InternalRequest, params: SamplingParams):
        """One reservation attempt on the loop thread: the attempt (with its reservation), or
        None when the pool is short."""
        n = next(self._tokens)
        token = f"{self.ref.incarnation}.{n}"
        now = time.time()
        attempt = _Attempt(req.request_id, token, f"{req.request_id}@{n}", now, now + self.config.lease_s)
        self.engine.open_stream(attempt.engine_id)
        superseded: list[str] = []  # engine ids of older attempts this one replaced
        try:
            reservation = await self.engine.call(lambda e: self._reserve_on_loop(e, req, params, attempt, superseded))
        except BaseException:
            await asyncio.shield(self.engine.call(lambda e: self._abandon_unissued(e, attempt)))
            self.engine.close_stream(attempt.engine_id, abort=False)
            raise
        finally:
            for engine_id in superseded:
                self.engine.close_stream(engine_id, abort=True)
        if reservation is None:
            self.engine.close_stream(attempt.engine_id, abort=False)
            return None
        attempt.reservation = reservation
        return attempt

    def _reserve_on_loop(
        self, e: LLMEngine, req: InternalRequest, params: SamplingParams, attempt: _Attempt, superseded: list[str]
    ) -> Reservation | None:
        """On the loop thread: give up an older attempt of the request (a retry), reserve, and
        expect the missing blocks' KV (none missing: replay at once). None when the pool is short."""
        old = self._attempts.pop(req.request_id, None)
        if old is not None:  # a retry: fence and give up the old attempt first
            log.info("%s: %s supersedes %s", self.ref.worker_id, attempt.token, old.token)
            self._give_up(e, old)
            superseded.append(old.engine_id)
        r = _engine_reserve(e, attempt.engine_id, req, params)
        if r is None:
            return None
        self._attempts[req.request_id] = attempt
        if r.missing_block_ids:
            self.receiver.expect(
                req.request_id, list(r.missing_block_ids), attempt.lease_unix_s, attempt.token, attempt.issued_unix_s
            )
        else:
            self._arrived_at[attempt.engine_id] = time.monotonic()
            e.kv_arrived(attempt.engine_id)  # every chunk already resident: replay at once
        return r

    async def _compile_grammar(self, params: SamplingParams) -> None:
        await self.compile_grammar(params)

    def _ticket(self, req: InternalRequest, attempt: _Attempt) -> Ticket:
        r = attempt.reservation
        return Ticket(
            request_id=req.request_id,
            decode_worker_id=self.ref.worker_id,
            incarnation=attempt.token,
            decode_cached_tokens=min(r.first_missing_token, req.prompt_tokens),
            transfer_descriptor=self.receiver.descriptor(),
            dst_block_ids=tuple(r.missing_block_ids),
            first_block_index=r.num_cached_blocks,
            lease_deadline_unix_s=attempt.lease_unix_s,
        )

    async def generate(self, req: InternalRequest) -> AsyncIterator[Event]:
        rid = req.request_id
        t0 = time.monotonic()
        attempt = self._attempts.get(rid)
        if attempt is None or not self.engine.has_stream(attempt.engine_id):
            if rid in self._expired:  # alive but slow (a loaded machine): place it again
                raise Unavailable(f"the KV of {rid} did not arrive within its lease on {self.ref.worker_id}")
            raise NotFound(f"request {rid!r} was not reserved on {self.ref.worker_id}")
        stream = self.engine.stream(attempt.engine_id)
        try:
            async for event in self._events(attempt, stream, t0):
                yield event
        finally:  # close the engine stream now (aborting an unfinished request), not at GC
            await stream.aclose()

    async def _events(self, attempt: _Attempt, stream, t0: float) -> AsyncIterator[Event]:
        rid, first_s, index = attempt.request_id, None, 0
        try:
            async for out in stream:
                if out is _PAUSED:  # draining: every token is out; the router moves us
                    yield MigrateEvent(index)
                    continue
                if out.new_token_ids:
                    first_s = first_s or time.monotonic()
                    lps = tuple(TokenLogprobs(s.logprob, s.top_logprobs) for s in out.logprobs)
                    yield TokenEvent(out.new_token_ids, index, lps)
                    index += len(out.new_token_ids)
                if out.finished:
                    first_token_s = await self.engine.call(lambda e: self._forget(e, attempt))
                    arrived = self._arrived_at.pop(attempt.engine_id, None)
                    replay_ms = _replay_ms(arrived, first_token_s, t0, first_s)
                    timeline = Timeline(replay_ms=replay_ms, e2e_ms=ms_since(t0))
                    yield final_event(out, timeline, self.ref.worker_id, rid, colocated=False)
        except RequestFailed as exc:
            raise Internal(f"decode of {rid} failed: {exc.reason}") from None
        except asyncio.CancelledError:
            if attempt.expired:  # retryable: the request's own deadline has not passed
                raise Unavailable(f"the KV of {rid} did not arrive within its lease") from None
            raise

    async def abort(self, request_id: str) -> bool:
        def abort_on_loop(e: LLMEngine) -> _Attempt | None:
            attempt = self._attempts.pop(request_id, None)
            if attempt is not None:
                self._give_up(e, attempt)
            return attempt

        attempt = await self.engine.call(abort_on_loop)
        if attempt is None:
            return False
        self.engine.close_stream(attempt.engine_id, abort=True)
        self._arrived_at.pop(attempt.engine_id, None)
        return True

    # ------------------------------------------------------------------ draining
    async def drain(self, deadline_s: float) -> int:
        """Take no new request and offer every stream for migration: each running (or
        admitted) request leaves the batch holding its KV and its stream tells the router
        (`MigrateEvent`); one whose KV is still in flight does so when it arrives. Returns how
        many were paused now. `deadline_s` bounds nothing here: streams that cannot move
        finish in place (`resume`), within the replica's graceful-shutdown timeout."""
        if not deadline_s > 0:
            raise InvalidArgument(f"must be > 0, got {deadline_s}", field="deadline_s")
        self.draining = True
        return await self.engine.call(self._pause_all)

    def undrain(self) -> None:
        """Take requests again (a drain mark was withdrawn: Serve stopped another replica).
        Streams already moved stay where they are."""
        self.draining = False

    async def migrate_out(self, request_id: str, ticket: Ticket) -> MigrationResult:
        """Push a paused request's prompt KV into another decode worker's reserved blocks
        (the path prefill uses), then free it here. On failure it stays paused (the router
        resumes it in place) and the target gets an abandon notice."""
        attempt = self._attempts.get(request_id)
        if attempt is None or attempt.paused is None:
            raise NotFound(f"request {request_id!r} is not paused on {self.ref.worker_id}")
        src = list(attempt.paused.kv_block_ids[ticket.first_block_index :])
        if len(src) != len(ticket.dst_block_ids):
            raise Internal(
                f"{len(attempt.paused.kv_block_ids)} KV blocks here; the ticket asks "
                f"for chunks {ticket.first_block_index}.. into "
                f"{len(ticket.dst_block_ids)} blocks"
            )
        t0 = time.monotonic()
        peer = self._connect(ticket)  # on the loop: one sender, one connection per target
        stats = await asyncio.to_thread(self._push, ticket, src, peer)

        def free_on_loop(e: LLMEngine) -> None:  # the write completed: nothing lands later
            if self._attempts.get(request_id) is attempt:
                del self._attempts[request_id]
            e.abort(attempt.engine_id)

        await self.engine.call(free_on_loop)
        self.engine.close_stream(attempt.engine_id, abort=False)  # the router left it
        return MigrationResult(moved_bytes=stats.num_bytes, transfer_ms=ms_since(t0))

    async def resume(self, request_id: str) -> bool:
        """Continue a paused request here (nowhere to move it): it replays from its prompt
        boundary and streams on. False when it is not paused here."""

        def resume_on_loop(e: LLMEngine) -> bool:
            attempt = self._attempts.get(request_id)
            if attempt is None or attempt.paused is None:
                return False
            attempt.paused, attempt.stays = None, True
            e.kv_arrived(attempt.engine_id)
            return True

        return await self.engine.call(resume_on_loop)

    def _connect(self, ticket: Ticket) -> str:
        """The sender's peer for the ticket's decode worker (the sender is made at the first
        migration; the contract is checked at connect)."""
        from flashpd.services.worker.common import make_sender

        if self._sender is None:
            self._sender = make_sender(self.config.transfer_backend, self.contract, self.pools)
        peer = self._peers.get(ticket.transfer_descriptor)
        if peer is None:
            try:
                peer = self._sender.connect(ticket.transfer_descriptor)
            except (TransferError, ContractMismatch) as exc:
                raise TransferFailed(f"cannot reach {ticket.decode_worker_id}: {exc}") from exc
            self._peers[ticket.transfer_descriptor] = peer
        return peer

    def _push(self, ticket: Ticket, src: list[int], peer: str):
        """On a worker thread: write and wait, or abandon the target's reservation."""
        try:
            handle = self._sender.send(
                ticket.request_id, src, list(ticket.dst_block_ids), ticket.incarnation, peer=peer
            )
            return self._sender.wait(handle, self.config.transfer_timeout_s, threading.Event())
        except TransferError as exc:
            with contextlib.suppress(TransferError):
                self._sender.abandon(ticket.request_id, ticket.incarnation, peer=peer)
            raise TransferFailed(f"KV migration to {ticket.decode_worker_id} failed: {exc}") from exc

    def _pause_all(self, e: LLMEngine) -> int:
        return sum(self._pause(e, a) for a in list(self._attempts.values()))

    def _pause(self, e: LLMEngine, attempt: _Attempt) -> bool:
        if attempt.stays or attempt.paused is not None:
            return False
        attempt.paused = e.pause(attempt.engine_id)
        if attempt.paused is None:
            return False
        self.engine.mark(attempt.engine_id, _PAUSED)  # after every output delivered so far
        return True

    # ------------------------------------------------------------------ loop thread
    def _poll_transfers(self, e: LLMEngine) -> None:
        self._admit_arrived(e)
        self._expire_leases(e)
        for token in self.receiver.take_quiet(time.time()):  # drained: no write can reach them any more
            engine_id = self._draining.pop(token, None)
            if engine_id is not None:
                e.abort(engine_id)
        self._signal_room(e)

    def _admit_arrived(self, e: LLMEngine) -> None:
        """Requests whose KV has all arrived start replaying."""
        for rid in self.receiver.poll_completed():
            attempt = self._attempts.get(rid)
            if attempt is None or e.scheduler.status(attempt.engine_id) is not RequestStatus.WAITING_FOR_KV:
                continue
            self._arrived_at[attempt.engine_id] = time.monotonic()
            e.kv_arrived(attempt.engine_id)
            if self.draining:  # admitted while draining: offered for migration at once
                self._pause(e, attempt)

    def _expire_leases(self, e: LLMEngine) -> None:
        """Give up requests whose KV did not arrive within the lease (+ a transfer's grace)."""
        grace_s = self.config.transfer_timeout_s + DRAIN_MARGIN_S
        for rid in self.receiver.expire(time.time(), grace_s):
            attempt = self._attempts.pop(rid, None)
            if attempt is None:
                continue
            log.warning("%s: KV lease of %s expired", self.ref.worker_id, rid)
            attempt.expired = True
            self._expired[rid] = None
            while len(self._expired) > MAX_EXPIRED:
                self._expired.popitem(last=False)
            if self.receiver.is_draining(attempt.token):
                self._draining[attempt.token] = attempt.engine_id
            else:
                e.abort(attempt.engine_id)
            self.engine.close_stream(attempt.engine_id, abort=True)

    def _signal_room(self, e: LLMEngine) -> None:
        usage = e.kv.usage()
        free = usage["blocks_free"] + usage["blocks_cached"] + usage["slots_free"]
        if free > self._free_blocks:
            self.admission.room_freed()
        self._free_blocks = free

    def _give_up(self, e: LLMEngine, attempt: _Attempt) -> None:
        """Abort an attempt now, or, while a write may still land in its blocks, keep them
        until the receiver says the request is quiet (see the module docstring)."""
        status = e.scheduler.status(attempt.engine_id)
        if status is RequestStatus.WAITING_FOR_KV:
            if not attempt.ticket_issued:
                self._abandon_unissued(e, attempt)
                return
            fallback = attempt.lease_unix_s + self.config.transfer_timeout_s + DRAIN_MARGIN_S
            token = self.receiver.drain(attempt.request_id, fallback)
            if token is not None:
                self._draining[token] = attempt.engine_id
                return
        e.abort(attempt.engine_id)

    def _abandon_unissued(self, e: LLMEngine, attempt: _Attempt) -> None:
        """A reservation whose ticket never left this worker: nothing can write; free now."""
        if self._attempts.get(attempt.request_id) is attempt:
            del self._attempts[attempt.request_id]
        if self.receiver.live_token(attempt.request_id) == attempt.token:
            self.receiver.cancel(attempt.request_id)
        e.abort(attempt.engine_id)

    def _stream_closed(self, e: LLMEngine, engine_id: str) -> None:
        """A consumer left an unfinished request: give its attempt up (draining if needed)."""
        rid = engine_id.rsplit("@", 1)[0]
        attempt = self._attempts.get(rid)
        if attempt is not None and attempt.engine_id == engine_id:
            del self._attempts[rid]
            self._give_up(e, attempt)
        elif engine_id not in self._draining.values():
            e.abort(engine_id)

    def _forget(self, e: LLMEngine, attempt: _Attempt) -> float | None:
        """On the loop thread: drop a finished attempt; returns when the engine produced its
        first token (time.monotonic), if it did."""
        if self._attempts.get(attempt.request_id) is attempt:
            del self._attempts[attempt.request_id]
        stats = e.stats.get(attempt.engine_id)
        return None if stats is None else stats.first_token_s

    # ------------------------------------------------------------------ views
    def admission_queue(self) -> tuple[int, int]:
        return self.admission.num_waiting, self.admission.max_waiting

    def _check_request(self, req: InternalRequest) -> None:
        self.check_request(req)

    async def close(self) -> None:
        self.draining = True
        await asyncio.to_thread(self.engine.shutdown)
        self.receiver.close()
        if self._sender is not None:
            self._sender.close()


def _engine_reserve(e: LLMEngine, engine_id: str, req: InternalRequest, params: SamplingParams) -> Reservation | None:
    """The engine's reservation for the request's prompt; bad input is INVALID_ARGUMENT."""
    try:
        return e.reserve(
            engine_id, req.prompt_ids, params, req.session_id, PrefixPolicy(kv_tokens=req.kv_prompt_tokens)
        )
    except SamplingError as exc:  # a grammar the replayed tokens break
        raise InvalidArgument(exc.message, field=exc.field) from None
    except ValueError as exc:
        raise InvalidArgument(str(exc), field="prompt") from None


def _replay_ms(arrived_s: float | None, first_token_s: float | None, t0: float, first_seen_s: float | None) -> float:
    """The decode leg's `replay_ms`: the KV complete here (the engine loop saw the last notice,
    or the reserve found every chunk resident) -> the engine produced the first token, i.e.
    the loop's pickup, the replay step (128 rows through every layer) and its sampling, on the
    loop thread's clock (time.monotonic), whenever `generate` was called. The router calls
    `generate` only after the prefill returned, a few ms after the KV arrived: measuring from
    that call (as before) left out the part of the replay that ran meanwhile. Without both
    times (a paused stream resumed here): arrival or the call -> the first token seen here."""
    if arrived_s is not None and first_token_s is not None and first_token_s >= arrived_s:
        return 1e3 * (first_token_s - arrived_s)
    start = t0 if arrived_s is None else max(arrived_s, t0)
    return 1e3 * ((first_seen_s or time.monotonic()) - start)
