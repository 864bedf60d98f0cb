"""PrefillWorker: the engine in prefill role behind the `api.PrefillServerApi` contract.

    run(req, ticket)  encoder path over the prompt (bounded replay on this worker's own prefix
                      hit), then push the chunks the decode worker lacks, chunk
                      `ticket.first_block_index` onwards, into `ticket.dst_block_ids`; returns
                      once the write completed. The blocks are released right after the push.
    abort(rid)        stops the compute (and frees its blocks); idempotent

The transfer contract is checked when a decode worker is first connected (fail fast, no bytes
moved); connections are kept per decode incarnation.
"""

from __future__ import annotations

import asyncio
import logging
import time

from flashpd.engine.llm_engine import LLMEngine
from flashpd.engine.transfer.base import TransferError
from flashpd.engine.transfer.contract import ContractMismatch
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
from flashpd.services.worker_common import (
    EngineWorker,
    WorkerConfig,
    make_sender,
    ms_since,
)

log = logging.getLogger(__name__)


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, engine: LLMEngine, config: WorkerConfig, ref: WorkerRef):
        super().__init__(engine, config, ref)
        self.sender = make_sender(config.transfer_backend, self.contract, self.pools)
        self._peers: dict[bytes, str] = {}
        self._queued_tokens: dict[str, int] = {}
        self.transfer_failures = 0

    async def run(self, req: InternalRequest, ticket: Ticket) -> PrefillResult:
        if self.draining:
            raise Unavailable(f"{self.ref.worker_id} is draining")
        if req.model != self.config.model_id:
            raise InvalidArgument(f"unknown model {req.model!r}", field="model")
        t0 = time.monotonic()
        peer = self._connect(ticket.transfer_descriptor)
        self._queued_tokens[req.request_id] = req.prompt_tokens
        try:
            ready = await self._compute(req)
            compute_ms = ms_since(t0)
            t1 = time.monotonic()
            src = list(ready.kv_block_ids[ticket.first_block_index:])
            if len(src) != len(ticket.dst_block_ids):
                raise Internal(f"prefill holds {len(ready.kv_block_ids)} blocks; the ticket "
                               f"asks for chunks {ticket.first_block_index}.. into "
                               f"{len(ticket.dst_block_ids)} blocks")
            stats = await asyncio.to_thread(self._push, req, ticket, peer, src)
            return PrefillResult(
                prefill_worker_id=self.ref.worker_id,
                prefill_cached_tokens=ready.cached_tokens,
                computed_tokens=req.prompt_tokens - ready.cached_tokens,
                pushed_bytes=stats.num_bytes, queue_ms=0.0, compute_ms=compute_ms,
                transfer_ms=ms_since(t1))
        finally:
            self._queued_tokens.pop(req.request_id, None)
            await self.engine.call(lambda e: _release(e, req.request_id))

    async def _compute(self, req: InternalRequest):
        remaining = req.remaining_s()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded("deadline passed before prefill started")
        try:
            return await asyncio.wait_for(
                self.engine.prefill(req.request_id, req.prompt_ids), timeout=remaining)
        except TimeoutError:
            raise DeadlineExceeded("deadline passed during prefill") from None
        except asyncio.CancelledError:
            raise Cancelled(f"prefill of {req.request_id} cancelled") from None

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
        return peer

    def _push(self, req: InternalRequest, ticket: Ticket, peer: str, src: list[int]):
        try:
            handle = self.sender.send(req.request_id, src, list(ticket.dst_block_ids),
                                      ticket.incarnation, peer=peer)
            return self.sender.wait(handle, self.config.transfer_timeout_s)
        except TransferError as exc:
            self.transfer_failures += 1
            raise TransferFailed(f"KV push to {ticket.decode_worker_id} failed: {exc}") from exc

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    def queued_prefill_tokens(self) -> int:
        return sum(self._queued_tokens.values())

    async def close(self) -> None:
        self.draining = True
        await asyncio.to_thread(self.engine.shutdown)
        self.sender.close()


def _release(e: LLMEngine, request_id: str) -> None:
    """Free a finished prefill's blocks (they stay prefix-cached) or abort an unfinished one."""
    try:
        e.release_kv(request_id)
    except KeyError:
        e.abort(request_id)
