"""The internal API between the router and the prefill/decode workers.

Plain frozen dataclasses (picklable, no Ray/gRPC imports), so the same types travel through Ray
Serve handles in production and through in-process fakes in tests. The sampling parameters are the
engine's own `SamplingParams` (engine/sampling_params.py); a `SamplingError` maps to
`InvalidArgument` naming the field. The wire contract for clients
is `proto/flashpd.proto`; `services/router/convert.py` is the only place that maps between them.

Life of a request (all calls made by the router's orchestrator):

    router --start(req)-----------> PrefillServer  -> bool          (compute begins; optional,
           --reserve(req)---------> DecodeServer   -> Ticket         concurrent with reserve)
           --run(req, ticket)-----> PrefillServer  -> PrefillResult (KV pushed into the blocks)
           --generate(req)--------> DecodeServer   -> TokenEvent* FinalEvent
           --abort(request_id)----> both, on cancel / deadline / failure (idempotent)

Colocated mode (one worker role, `ColocatedServerApi`; no ticket, no KV transfer):

    router --generate(req)--------> ColocatedServer -> TokenEvent* FinalEvent (prefill + decode)
           --abort(request_id)----> it, on cancel / deadline / failure (idempotent)

Worker method contract (the lead implements these as Ray Serve deployments; the orchestrator
calls `handle.method.remote(...)` and awaits it, `generate` through
`handle.options(stream=True)`):

- `DecodeServer.reserve(req: InternalRequest) -> Ticket`
  Looks up the prompt's chunk hashes in D's prefix cache, allocates blocks for the chunks D
  lacks (including a trailing partial chunk) and pins the hit blocks until `lease_deadline`.
  Raises `ResourceExhausted` when the blocks do not fit, `Unavailable` while draining.
  `ticket.dst_block_ids` empty means D already holds every chunk: the router skips prefill.
- `PrefillServer.start(req: InternalRequest) -> bool`
  A head start: begins the encoder path before the ticket exists, so the compute overlaps the
  reservation (the router calls it alongside `reserve` and awaits it before `run`). `run` with
  the same request takes the compute over; `abort` ends it (as an abort before the run: the
  late run is refused); one no `run` takes over frees its blocks after the worker's lease
  (`kv_lease_s`). Best effort: False when nothing was started (already started or running,
  aborted since the request arrived, half the engine's sequences already held by head starts);
  its errors change nothing (the `run` reports them).
- `PrefillServer.run(req: InternalRequest, ticket: Ticket) -> PrefillResult`
  Runs the encoder path over the chunks D lacks (bounded replay on P's own prefix hit) and
  pushes them into `ticket.dst_block_ids` (chunk `ticket.first_block_index` onwards) through
  `ticket.transfer_descriptor`. Returns after the last write completed. Writes carry
  `ticket.incarnation`; D drops writes for a request it no longer holds or from an older
  incarnation (fencing). Raises `TransferFailed` when the push fails, `DeadlineExceeded` past
  `req.deadline_unix_s`, `ResourceExhausted` when its queue is full.
- `DecodeServer.generate(req: InternalRequest) -> async iterator of TokenEvent, then exactly one
  FinalEvent`. Called after `run` returned (or right after `reserve` when no prefill was
  needed). D checks that every reserved chunk arrived, replays the last 128 prompt tokens,
  samples and streams. D fills FinalEvent.usage (prompt_tokens, completion_tokens,
  cached_tokens_decode), FinalEvent.timeline.replay_ms and FinalEvent.decode_worker; the router
  fills in the rest. D applies stop token ids and EOS; stop *strings* are applied by the router
  (it owns the tokenizer) and it aborts D when one matches.
- `abort(request_id: str) -> bool` on both: frees the request's blocks and stops its work;
  unknown ids return False. Idempotent.
- `stats() -> WorkerStats` on both; the same record is published as the worker's heartbeat.

Errors cross the seam as the `ServiceError` subclasses below; each maps to one gRPC status code
and one HTTP status. `as_service_error` also maps Ray's own failures (actor died, back-pressure,
cancellation) so the router never has to import Ray.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar, Literal, Protocol

from flashpd.engine.sampling_params import SamplingError, SamplingParams

FinishReason = Literal["stop", "length", "abort"]
Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[Role, ...] = ("prefill", "decode")  # the disaggregated worker roles
DeploymentRole = Literal["prefill", "decode", "router"]
# Every Serve deployment of a disaggregated application: the workers and the router (scaled together).
DEPLOYMENT_ROLES: tuple[DeploymentRole, ...] = (*ROLES, "router")
# Serving modes: disaggregated (a prefill and a decode worker per request, KV pushed P -> D) or
# colocated (one worker prefills and decodes, no KV transfer). One mode per application.
ServingMode = Literal["disaggregated", "colocated"]
MODE_ROLES: dict[str, tuple[Role, ...]] = {"disaggregated": ROLES, "colocated": ("colocated",)}
WORKER_ROLES: tuple[Role, ...] = ("prefill", "decode", "colocated")  # every worker role


# ---------------------------------------------------------------------------------------- errors


class ServiceError(Exception):
    """Base of the errors that cross the router/worker seam. `field` names the offending request
    field for InvalidArgument (and is the OpenAI `param`)."""

    code: ClassVar[str] = "INTERNAL"  # grpc.StatusCode name
    http_status: ClassVar[int] = 500

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.message = message
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)

    def __reduce__(self):  # keep `field` through pickling (Ray, multiprocessing)
        return (_rebuild_error, (type(self), self.message, self.field))


def _rebuild_error(cls: type[ServiceError], message: str, field: str | None) -> ServiceError:
    return cls(message, field=field)


class InvalidArgument(ServiceError):
    code, http_status = "INVALID_ARGUMENT", 400


class NotFound(ServiceError):
    code, http_status = "NOT_FOUND", 404


class ResourceExhausted(ServiceError):
    code, http_status = "RESOURCE_EXHAUSTED", 429
    retry_after_s = 1.0  # sent as HTTP Retry-After; a full worker queue sets its own hint


class DeadlineExceeded(ServiceError):
    code, http_status = "DEADLINE_EXCEEDED", 504


class Unavailable(ServiceError):
    """A worker is gone, draining or unreachable; the router retries elsewhere before the
    first token."""

    code, http_status = "UNAVAILABLE", 503


class TransferFailed(Unavailable):
    """The KV push from prefill to decode failed (counted in the transfer-failure metric)."""


class Cancelled(ServiceError):
    code, http_status = "CANCELLED", 499


class Unauthenticated(ServiceError):
    """Missing or wrong API key (HTTP 401, gRPC UNAUTHENTICATED)."""

    code, http_status = "UNAUTHENTICATED", 401


class Internal(ServiceError):
    code, http_status = "INTERNAL", 500


ERRORS_BY_CODE: dict[str, type[ServiceError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        ResourceExhausted,
        DeadlineExceeded,
        Unavailable,
        Cancelled,
        Unauthenticated,
        Internal,
    )
}

# Ray failures by class name (matched by name so this module never imports Ray).
_RAY_UNAVAILABLE = frozenset(
    {
        "ActorDiedError",
        "ActorUnavailableError",
        "RayActorError",
        "BackPressureError",
        "DeploymentUnavailableError",
        "WorkerCrashedError",
        "NodeDiedError",
        "ObjectLostError",
        "OwnerDiedError",
        "RaySystemError",
    }
)
_RAY_CANCELLED = frozenset({"RequestCancelledError", "TaskCancelledError"})


def as_service_error(exc: BaseException) -> ServiceError:
    """The ServiceError an exception raised by a worker call stands for.

    Ray re-raises a replica's exception as a RayTaskError subclass whose `cause` is the original;
    that original is returned when it is a ServiceError.
    """
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ServiceError | SamplingError):
        exc = cause
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, SamplingError):
        return InvalidArgument(exc.message, field=exc.field)
    name = type(exc).__name__
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return DeadlineExceeded("deadline passed during a worker call")
    if isinstance(exc, asyncio.CancelledError) or name in _RAY_CANCELLED:
        return Cancelled("worker call cancelled")
    if name in _RAY_UNAVAILABLE or isinstance(exc, ConnectionError):
        return Unavailable(f"worker unavailable ({name}: {exc})")
    return Internal(f"{name}: {exc}")


# -------------------------------------------------------------------------------- request types


@dataclass(frozen=True)
class InternalRequest:
    request_id: str
    model: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    session_id: str | None = None
    parent_session_id: str | None = None
    deadline_unix_s: float | None = None  # absolute; None = no deadline
    arrival_unix_s: float = field(default_factory=time.time)
    # A continuation of a stream (router-internal, never on the wire): prompt_ids is the
    # original prompt + the outputs already streamed; the KV of the first `kv_prompt_tokens`
    # (the original prompt) comes from a prefill or the previous decode worker, the outputs are
    # recomputed by the new decode worker (engine.request.PrefixPolicy). None: a fresh request.
    kv_prompt_tokens: int | None = None
    # the prefill of a continuation uses at most this prefix credit: the original prefill's
    max_prefill_credit_tokens: int | None = None
    # placement pin: workers to use when they are usable (the later choices of an n > 1
    # request follow the first choice's pair, whose decode worker holds the prompt's KV)
    pin: tuple[WorkerRef, ...] = ()

    def __post_init__(self) -> None:
        if not self.request_id:
            raise InvalidArgument("must be non-empty", field="request_id")
        if not self.prompt_ids:
            raise InvalidArgument("must not be empty", field="prompt")
        if self.kv_prompt_tokens is not None and not 0 < self.kv_prompt_tokens <= len(self.prompt_ids):
            raise InvalidArgument("kv_prompt_tokens outside the prompt", field="prompt")

    @property
    def kv_prompt_ids(self) -> tuple[int, ...]:
        """The tokens whose KV a prefill computes: the original prompt of a continuation."""
        return self.prompt_ids if self.kv_prompt_tokens is None else self.prompt_ids[: self.kv_prompt_tokens]

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def remaining_s(self, now_unix_s: float | None = None) -> float | None:
        """Seconds left before the deadline (may be negative); None without a deadline."""
        if self.deadline_unix_s is None:
            return None
        return self.deadline_unix_s - (time.time() if now_unix_s is None else now_unix_s)


@dataclass(frozen=True)
class Ticket:
    """Decode's answer to reserve: where the prefill worker writes the missing chunks.

    prompt chunks: | 0 | 1 | 2 | 3 | 4 | 5 |      (128 tokens each, the last may be partial)
    cached on D:   |<- decode_cached ->|          decode_cached_tokens = 3 * 128
    dst_block_ids:                 | b0| b1| b2|  first_block_index = 3
    """

    request_id: str
    decode_worker_id: str
    incarnation: str  # D's incarnation; P's writes carry it, D fences older ones
    decode_cached_tokens: int
    transfer_descriptor: bytes  # opaque to the router: D's transfer agent + memory descriptors
    dst_block_ids: tuple[int, ...]
    first_block_index: int  # prompt chunk index written into dst_block_ids[0]
    lease_deadline_unix_s: float  # D frees the blocks if generate has not started by then

    @property
    def needs_prefill(self) -> bool:
        return bool(self.dst_block_ids)


@dataclass(frozen=True)
class PrefillResult:
    prefill_worker_id: str
    prefill_cached_tokens: int  # prompt tokens P reused from its prefix cache (usable credit)
    computed_tokens: int  # prompt tokens P ran through the encoder path (incl. the replay)
    pushed_bytes: int
    queue_ms: float
    compute_ms: float
    transfer_ms: float


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # of the sampled token
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    index: int  # offset of token_ids[0] in the completion
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id when requested
    text: str = ""  # released text; filled by the router's detokenizer
    # first event of a run (router): the prefix credit of the prefill its KV rests on, for a
    # client that continues the stream itself (proto TokenChunk.prefill_credit_tokens)
    prefill_credit_tokens: int | None = None


@dataclass(frozen=True)
class Usage:
    """Each prompt token counted once; see proto/flashpd.proto `Usage` for the definitions."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_prefill: int = 0
    cached_tokens_decode: int = 0
    # speculative decoding (decode worker): drafts verified, drafts accepted, verify steps;
    # forced_acceptance_length > 0 only in a benchmark run that forced acceptance (outputs are
    # then not the model's)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_steps: int = 0
    forced_acceptance_length: float = 0.0


@dataclass(frozen=True)
class Timeline:
    """Milliseconds; see proto/flashpd.proto `Timeline`."""

    route_ms: float = 0.0
    reserve_ms: float = 0.0
    prefill_queue_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    replay_ms: float = 0.0
    first_token_ms: float = 0.0
    e2e_ms: float = 0.0
    migrate_ms: float = 0.0  # live migrations (decode drained), summed; 0: never moved

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class FinalEvent:
    finish_reason: FinishReason
    usage: Usage
    timeline: Timeline = Timeline()
    prefill_worker: str = ""  # worker id; empty when no prefill was needed
    decode_worker: str = ""
    request_id: str = ""
    text: str = ""  # router: text released only at the end (held-back tail)


@dataclass(frozen=True)
class MigrateEvent:
    """Decode -> router only (never to a client): this worker is draining and has paused the
    stream after the `tokens_sent` tokens it streamed, holding its KV. The router continues it
    elsewhere (`DecodeServerApi.migrate_out`) or in place (`resume`)."""

    tokens_sent: int


@dataclass(frozen=True)
class MigrationResult:
    """What a draining decode worker moved for one stream (`migrate_out`)."""

    moved_bytes: int
    transfer_ms: float


Event = TokenEvent | FinalEvent | MigrateEvent


# ------------------------------------------------------------------------------- worker identity


@dataclass(frozen=True)
class WorkerRef:
    """One incarnation of one worker. `worker_id` is stable across restarts (e.g. "decode-3"),
    `incarnation` is new for every process start."""

    role: Role
    worker_id: str
    incarnation: str

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {WORKER_ROLES}, got {self.role!r}")
        for name in ("worker_id", "incarnation"):
            value = getattr(self, name)
            if not value or any(c in value for c in "| \t\n{}"):
                raise ValueError(f"{name} must be non-empty without '|', braces or spaces: {value!r}")

    @property
    def key(self) -> str:
        return f"{self.role}|{self.worker_id}|{self.incarnation}"

    @classmethod
    def from_key(cls, key: str) -> WorkerRef:
        role, worker_id, incarnation = key.split("|")
        return cls(role, worker_id, incarnation)  # type: ignore[arg-type]


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    incarnation: str
    role: Role
    queued_prefill_tokens: int = 0  # prompt tokens waiting or running in prefill
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    running: int = 0
    waiting: int = 0
    draining: bool = False  # a draining worker takes no new requests
    queued: int = 0  # requests waiting in the worker's bounded admission queue
    queue_limit: int = 0  # that queue's bound (0: no queue); full = refusals

    @property
    def ref(self) -> WorkerRef:
        return WorkerRef(self.role, self.worker_id, self.incarnation)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerStats:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        if set(data) != known:
            raise ValueError(f"worker stats fields {sorted(data)} != {sorted(known)}")
        return cls(**data)


# ----------------------------------------------------------------------------- worker protocols


class PrefillServerApi(Protocol):
    async def start(self, req: InternalRequest) -> bool: ...

    async def run(self, req: InternalRequest, ticket: Ticket) -> PrefillResult: ...

    async def abort(self, request_id: str) -> bool: ...

    async def stats(self) -> WorkerStats: ...


class ColocatedServerApi(Protocol):
    """One worker prefills (its own prefix cache, bounded replay on a hit) and decodes.

    `generate(req)` admits the request (a bounded FIFO queue beyond capacity: only a full queue
    refuses, RESOURCE_EXHAUSTED; its deadline applies while queued), prefills the part of the
    prompt it lacks and streams TokenEvent* then one FinalEvent. The first TokenEvent carries
    `prefill_credit_tokens` (the prefix-cache credit it used); FinalEvent.usage fills
    prompt_tokens, completion_tokens, cached_tokens (= cached_tokens_prefill, the credit) and
    the timeline's prefill_queue_ms / prefill_ms (admission wait; admitted -> first token).
    `abort`, `stats` as on the other roles."""

    def generate(self, req: InternalRequest) -> AsyncIterator[Event]: ...

    async def abort(self, request_id: str) -> bool: ...

    async def stats(self) -> WorkerStats: ...


class DecodeServerApi(Protocol):
    async def reserve(self, req: InternalRequest) -> Ticket: ...

    def generate(self, req: InternalRequest) -> AsyncIterator[Event]: ...

    async def abort(self, request_id: str) -> bool: ...

    async def drain(self, deadline_s: float) -> int: ...

    async def migrate_out(self, request_id: str, ticket: Ticket) -> MigrationResult: ...

    async def resume(self, request_id: str) -> bool: ...

    async def stats(self) -> WorkerStats: ...
