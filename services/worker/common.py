"""What prefill and decode workers share: config, identity, transfer contract and backends.

Validated config lives at the edge (services/app.py, pydantic); workers receive the frozen
`WorkerConfig` below. Runtime facts (block counts in use, peer addresses) never go back into it.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from flashpd.engine.kv_pools import KVPools
from flashpd.engine.llm_engine import EngineConfig, EngineOutput
from flashpd.engine.transfer.contract import GroupSpec, TransferContract
from flashpd.model.kv_format import INDEX_RECORD_FORMAT
from flashpd.services.api import FinalEvent, InternalRequest, InvalidArgument, Timeline, Usage, WorkerRef, WorkerStats

log = logging.getLogger(__name__)

TRANSFER_BACKENDS = ("nixl", "local")


@dataclass(frozen=True)
class WorkerConfig:
    checkpoint: str
    model_id: str
    engine: EngineConfig
    transfer_backend: str = "nixl"
    redis_url: str | None = None
    lease_s: float = 30.0  # decode frees reserved blocks if the KV has not arrived by then
    transfer_timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.5
    max_queued_requests: int = 1024  # decode: reserves waiting for capacity before refusing
    retry_after_s: float = 1.0  # the hint sent with a refusal when that queue is full
    extra: dict = field(default_factory=dict, compare=False)
    # the application's speculative decoding (SpeculativeConfig.handoff()), for the transfer
    # contract: only decode workers draft, both sides must agree (None = off)
    speculative: dict | None = None
    # prefill: write the KV of the chunks before a prompt's last one while the last computes
    # (then the kv_ready write moves the last chunk only; PrefillWorker._on_kv_pending)
    push_early: bool = False

    def __post_init__(self) -> None:
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer_backend must be one of {TRANSFER_BACKENDS}, got {self.transfer_backend!r}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        for name in ("lease_s", "transfer_timeout_s", "heartbeat_interval_s", "retry_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def transfer_contract(pools: KVPools, model_id: str, speculative: dict | None = None) -> TransferContract:
    """The contract both sides check at handshake: groups, block sizes, record formats, and the
    decode side's speculative configuration."""
    groups = []
    for name, block_bytes in pools.geometry.group_block_bytes().items():
        kind = name.split(".")[0]
        fmt = pools.format.record_format if kind == "main" else INDEX_RECORD_FORMAT
        groups.append(GroupSpec(name, block_bytes, fmt))
    spec = "" if not speculative else json.dumps(speculative, sort_keys=True)
    return TransferContract(model_id=model_id, groups=tuple(groups), speculative=spec)


def new_worker_ref(role: str, worker_id: str | None = None) -> WorkerRef:
    """A fresh incarnation; `worker_id` is stable across restarts when given."""
    wid = worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
    return WorkerRef(role, wid, f"{int(time.time())}-{uuid.uuid4().hex[:8]}")  # type: ignore[arg-type]


def make_receiver(backend: str, contract: TransferContract, pools: KVPools, incarnation: str):
    if backend == "nixl":
        from flashpd.engine.transfer.nixl_backend import NixlReceiver

        return NixlReceiver(contract, pools.transfer_groups(), incarnation)
    from flashpd.engine.transfer.local import LocalReceiver

    return LocalReceiver(contract, pools.transfer_groups(), incarnation)


def make_sender(backend: str, contract: TransferContract, pools: KVPools):
    if backend == "nixl":
        from flashpd.engine.transfer.nixl_backend import NixlSender

        return NixlSender(contract, pools.transfer_groups())
    from flashpd.engine.transfer.local import LocalSender

    return LocalSender(contract, pools.transfer_groups())


def final_event(
    out: EngineOutput, timeline: Timeline, worker_id: str, request_id: str, *, colocated: bool
) -> FinalEvent:
    """The final event of a stream from the engine's finished output. The engine's prefix credit
    is the decode tier's reuse on a decode worker; on a colocated worker it is both the OpenAI
    `cached_tokens` and the prefill tier's (there is no decode tier)."""
    credit = out.cached_tokens
    tiers = (
        {"cached_tokens": credit, "cached_tokens_prefill": credit} if colocated else {"cached_tokens_decode": credit}
    )
    return FinalEvent(
        finish_reason=out.finish_reason,  # type: ignore[arg-type]
        usage=Usage(
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.output_tokens,
            draft_tokens=out.draft_tokens,
            accepted_draft_tokens=out.accepted_draft_tokens,
            draft_steps=out.draft_steps,
            forced_acceptance_length=out.forced_acceptance_length or 0.0,
            **tiers,
        ),
        timeline=timeline,
        decode_worker=worker_id,
        request_id=request_id,
    )


def ms_since(t0: float) -> float:
    return 1e3 * (time.monotonic() - t0)


class EngineWorker:
    """What the prefill and decode workers share: role check, transfer contract, the async
    engine, draining, and the load record (`stats`)."""

    role = ""

    def __init__(self, engine, config: WorkerConfig, ref: WorkerRef):
        from flashpd.engine.async_engine import AsyncLLMEngine

        if engine.config.role != self.role:
            raise ValueError(f"{type(self).__name__} needs an engine in {self.role} role, got {engine.config.role}")
        self.config, self.ref = config, ref
        self.contract = transfer_contract(engine.pools, config.model_id, config.speculative)
        self.pools = engine.pools
        self.engine = AsyncLLMEngine(engine)
        self.draining = False

    def queued_prefill_tokens(self) -> int:
        return 0

    def check_request(self, req: InternalRequest) -> None:
        """What a worker that samples checks before its engine sees a request: the model, the
        sampling parameters (an unpickled request skipped __post_init__) and the context limit."""
        from flashpd.engine.sampling_params import SamplingError

        if req.model != self.config.model_id:
            raise InvalidArgument(f"unknown model {req.model!r}", field="model")
        try:
            req.sampling.check()
        except SamplingError as exc:
            raise InvalidArgument(exc.message, field=exc.field) from None
        limit = self.engine.engine.model.cfg.max_position_embeddings
        if req.prompt_tokens + req.sampling.max_tokens > limit:
            raise InvalidArgument(f"prompt + max_tokens exceeds the context limit {limit}", field="prompt")

    async def compile_grammar(self, params) -> None:
        """Compile a guided request's grammar in a thread before it reaches the engine loop
        (which then finds it cached): compiling never stalls the steps. A grammar the engine
        cannot compile is INVALID_ARGUMENT naming the request field."""
        import asyncio

        from flashpd.engine.sampling_params import SamplingError

        grammar = self.engine.engine.grammar
        if params.guided is None or grammar is None or grammar.is_compiled(params.guided):
            return
        try:
            await asyncio.to_thread(grammar.compile, params.guided)
        except SamplingError as exc:
            raise InvalidArgument(exc.message, field=exc.field) from None

    def admission_queue(self) -> tuple[int, int]:
        """(requests waiting for admission, the queue's bound); (0, 0) without a queue."""
        return 0, 0

    def health_error(self) -> str | None:
        """Why this worker cannot serve (its engine loop or a background task died), or None."""
        return self.engine.health_error()

    async def stats(self) -> WorkerStats:
        return self._stats_from(await self.engine.call(lambda e: e.usage()))

    def stats_now(self) -> WorkerStats:
        """As of the engine loop's last iteration, without waiting for a step (heartbeats)."""
        return self._stats_from(self.engine.usage_now())

    def _stats_from(self, usage: dict) -> WorkerStats:
        queued, limit = self.admission_queue()
        return worker_stats(
            self.ref,
            usage,
            queued_prefill_tokens=self.queued_prefill_tokens(),
            draining=self.draining,
            queued=queued,
            queue_limit=limit,
        )


def worker_stats(
    ref: WorkerRef,
    usage: dict,
    *,
    queued_prefill_tokens: int = 0,
    draining: bool = False,
    queued: int = 0,
    queue_limit: int = 0,
) -> WorkerStats:
    """A worker's load record from its engine's `usage()` counters.

    running = the engine's batch (requests with a slot, stepping); waiting = admitted requests
    waiting for a batch slot (decode: their KV arrived); queued = requests waiting for admission
    in the worker's bounded queue (decode reserves beyond capacity), queue_limit its bound;
    kv_blocks_used counts every block not free or merely cached (draining ones included)."""
    total = usage["blocks_total"]
    return WorkerStats(
        ref.worker_id,
        ref.incarnation,
        ref.role,
        queued_prefill_tokens=queued_prefill_tokens,
        kv_blocks_used=total - usage["blocks_free"] - usage["blocks_cached"],
        kv_blocks_total=total,
        running=usage["running"],
        waiting=usage["waiting"],
        draining=draining,
        queued=queued,
        queue_limit=queue_limit,
    )
