"""In-process fake workers, a byte tokenizer and a router stack builder for the router tests.

The fakes honour the worker contract of `flashpd.services.api` and record every call, so the
tests can assert what the orchestrator did to each leg.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from flashpd.engine.events import BlockStored
from flashpd.engine.hashing import CHUNK_TOKENS, chunk_hashes, namespace_for
from flashpd.services.api import (
    FinalEvent,
    InternalRequest,
    PrefillResult,
    Ticket,
    Timeline,
    TokenEvent,
    TokenLogprobs,
    Unavailable,
    Usage,
    WorkerStats,
)
from flashpd.services.router.convert import ModelTable, ServedModel, deepseek_chat_prompt
from flashpd.services.router.index import IndexPublisher, PrefixIndex, router_redis
from flashpd.services.router.metrics import RouterMetrics
from flashpd.services.router.orchestrator import Orchestrator, OrchestratorConfig
from flashpd.services.router.placement import Placement
from flashpd.services.router.policy import make_policy

MODEL = "flash-tiny"
EOS_ID = 0
SERVED = ServedModel(MODEL, context_tokens=2048, vocab_size=256)


class ByteTokenizer:
    """Token id = UTF-8 byte; ids never exceed 255."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages) -> list[int]:
        return self.encode(deepseek_chat_prompt(messages))


def text_ids(text: str) -> tuple[int, ...]:
    return tuple(text.encode("utf-8"))


@dataclass
class FakeDecode:
    worker_id: str
    output: tuple[int, ...] = text_ids("abcdefghijklmnopqrstuvwxyz")
    cached_chunks: int = 0  # leading prompt chunks this worker reports as resident
    token_delay_s: float = 0.0
    reserve_error: Exception | None = None
    generate_error: Exception | None = None  # raised before the first token
    fail_after_tokens: tuple[int, Exception] | None = None
    follow_prompt: bool = False  # a "model": each token = next_token(the previous one)
    replay_ms: float = 1.5
    calls: list[tuple[str, str]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    seen: list[InternalRequest] = field(default_factory=list)
    closed_streams: int = 0

    def stats(self) -> WorkerStats:
        return WorkerStats(self.worker_id, "i0", "decode", kv_blocks_total=1000)

    async def reserve(self, req: InternalRequest) -> Ticket:
        self.calls.append(("reserve", req.request_id))
        self.seen.append(req)
        if self.reserve_error is not None:
            raise self.reserve_error
        prompt_chunks = -(-req.prompt_tokens // CHUNK_TOKENS)
        cached = min(self.cached_chunks, req.prompt_tokens // CHUNK_TOKENS)
        return Ticket(
            req.request_id,
            self.worker_id,
            "i0",
            cached * CHUNK_TOKENS,
            b"desc",
            tuple(range(100, 100 + prompt_chunks - cached)),
            cached,
            time.time() + 30,
        )

    async def generate(self, req: InternalRequest):
        self.calls.append(("generate", req.request_id))
        if self.generate_error is not None:
            raise self.generate_error
        try:
            reason, count = "length", 0
            output = greedy_chain(req.prompt_ids[-1], req.sampling.max_tokens) if self.follow_prompt else self.output
            for token in output[: req.sampling.max_tokens]:
                if self.fail_after_tokens and count == self.fail_after_tokens[0]:
                    raise self.fail_after_tokens[1]
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                logprobs = (TokenLogprobs(-0.5, ((token, -0.5), (1, -2.0))),) if req.sampling.logprobs else ()
                yield TokenEvent((token,), count, logprobs)
                count += 1
                if token == EOS_ID and not req.sampling.ignore_eos:
                    reason = "stop"
                    break
            cached = min(self.cached_chunks, req.prompt_tokens // CHUNK_TOKENS) * CHUNK_TOKENS
            yield FinalEvent(
                reason,
                Usage(req.prompt_tokens, count, 0, 0, cached),
                Timeline(replay_ms=self.replay_ms),
                decode_worker=self.worker_id,
            )
        finally:
            self.closed_streams += 1

    async def abort(self, request_id: str) -> bool:
        self.calls.append(("abort", request_id))
        self.aborted.append(request_id)
        return True


@dataclass
class FakeColocated:
    """A colocated worker: generate streams the output (the first token event carries the
    prefix credit it used), abort is recorded."""

    worker_id: str
    output: tuple[int, ...] = text_ids("abcdefghijklmnopqrstuvwxyz")
    credit_tokens: int = 0  # prefix credit reported with the first token
    token_delay_s: float = 0.0
    generate_error: Exception | None = None  # raised before the first token
    fail_after_tokens: tuple[int, Exception] | None = None
    follow_prompt: bool = False
    calls: list[tuple[str, str]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    seen: list[InternalRequest] = field(default_factory=list)
    closed_streams: int = 0

    def stats(self) -> WorkerStats:
        return WorkerStats(self.worker_id, "i0", "colocated", kv_blocks_total=1000)

    async def generate(self, req: InternalRequest):
        self.calls.append(("generate", req.request_id))
        self.seen.append(req)
        if self.generate_error is not None:
            raise self.generate_error
        try:
            output = greedy_chain(req.prompt_ids[-1], req.sampling.max_tokens) if self.follow_prompt else self.output
            count = 0
            for token in output[: req.sampling.max_tokens]:
                if self.fail_after_tokens and count == self.fail_after_tokens[0]:
                    raise self.fail_after_tokens[1]
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                yield TokenEvent((token,), count, (), prefill_credit_tokens=self.credit_tokens if count == 0 else None)
                count += 1
            yield FinalEvent(
                "length",
                Usage(req.prompt_tokens, count, self.credit_tokens, self.credit_tokens, 0),
                Timeline(prefill_queue_ms=0.75, prefill_ms=3.0),
                decode_worker=self.worker_id,
            )
        finally:
            self.closed_streams += 1

    async def abort(self, request_id: str) -> bool:
        self.calls.append(("abort", request_id))
        self.aborted.append(request_id)
        return True


class ActorDiedError(Exception):
    """Stands for Ray's error of that name (matched by name, as `api.as_service_error` does)."""


def next_token(token: int) -> int:
    return token % 250 + 1  # never EOS_ID


def greedy_chain(last: int, n: int) -> tuple[int, ...]:
    """What a `follow_prompt` decode generates after a prompt ending in `last`."""
    out = []
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return tuple(out)


@dataclass
class FakePrefill:
    worker_id: str
    cached_tokens: int = 0
    delay_s: float = 0.0
    error: Exception | None = None
    start_error: Exception | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)  # run and abort
    aborted: list[str] = field(default_factory=list)
    tickets: list[Ticket] = field(default_factory=list)
    started: list[str] = field(default_factory=list)  # head starts (`start`), by request id

    def stats(self) -> WorkerStats:
        return WorkerStats(self.worker_id, "i0", "prefill")

    async def start(self, req: InternalRequest) -> bool:
        self.started.append(req.request_id)
        if self.start_error is not None:
            raise self.start_error
        return True

    async def run(self, req: InternalRequest, ticket: Ticket) -> PrefillResult:
        self.calls.append(("run", req.request_id))
        self.tickets.append(ticket)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        computed = req.prompt_tokens - self.cached_tokens
        return PrefillResult(
            self.worker_id,
            self.cached_tokens,
            computed,
            pushed_bytes=890 * len(ticket.dst_block_ids) * CHUNK_TOKENS,
            queue_ms=0.5,
            compute_ms=2.0,
            transfer_ms=0.25,
        )

    async def abort(self, request_id: str) -> bool:
        self.calls.append(("abort", request_id))
        self.aborted.append(request_id)
        return True


@dataclass
class FakeDirectory:
    """Workers by id, editable while the router runs (replicas come and go)."""

    prefills: dict[str, FakePrefill]
    decodes: dict[str, FakeDecode]
    colocateds: dict[str, FakeColocated] = field(default_factory=dict)

    def prefill(self, worker):
        return self._get(self.prefills, worker)

    def colocated(self, worker):
        return self._get(self.colocateds, worker)

    def decode(self, worker):
        return self._get(self.decodes, worker)

    @staticmethod
    def _get(workers, worker):
        if worker.worker_id not in workers:
            raise Unavailable(f"no endpoint for worker {worker.key}")
        return workers[worker.worker_id]


@dataclass
class Stack:
    orchestrator: Orchestrator
    publisher: IndexPublisher
    index: PrefixIndex
    redis: aioredis.Redis
    metrics: RouterMetrics
    models: ModelTable
    tokenizer: ByteTokenizer
    directory: FakeDirectory

    def directory_add_prefill(self, worker: FakePrefill) -> None:
        """A new prefill replica comes up (it still has to register in Redis)."""
        self.directory.prefills[worker.worker_id] = worker

    async def cache(self, worker, prompt_ids) -> None:
        """Announce that `worker` holds every full chunk of `prompt_ids`."""
        hashes = chunk_hashes(prompt_ids, namespace_for(MODEL))
        await self.publisher.publish(worker.stats().ref, [BlockStored(tuple(hashes))])


@contextlib.asynccontextmanager
async def router_stack(
    redis_url: str,
    prefill: list[FakePrefill],
    decode: list[FakeDecode],
    *,
    routing: str = "affinity",
    config: OrchestratorConfig | None = None,
    clock=time.time,
    colocated: list[FakeColocated] | None = None,
):
    """`colocated`: serve in colocated mode with these workers (prefill/decode ones are then
    registered too, as workers of another mode the router must ignore)."""
    redis = router_redis(redis_url)
    publisher = IndexPublisher(redis, MODEL)
    for worker in [*prefill, *decode, *(colocated or [])]:
        await publisher.register(worker.stats())
    index = PrefixIndex(redis, MODEL)
    mode = "colocated" if colocated is not None else "disaggregated"
    placement = Placement(index, make_policy(routing), model=MODEL, view_refresh_s=0.0, mode=mode)
    metrics = RouterMetrics(MODEL)
    tokenizer = ByteTokenizer()
    directory = FakeDirectory(
        {p.worker_id: p for p in prefill}, {d.worker_id: d for d in decode}, {c.worker_id: c for c in colocated or []}
    )
    orchestrator = Orchestrator(
        {MODEL: placement},
        directory,
        tokenizer,
        metrics=metrics,
        config=config or OrchestratorConfig(resume_grace_s=0.2),
        clock=clock,
    )
    try:
        yield Stack(orchestrator, publisher, index, redis, metrics, ModelTable([SERVED]), tokenizer, directory)
    finally:
        await orchestrator.close()
        await redis.aclose()


def request(prompt_ids, *, rid="r1", max_tokens=5, session=None, deadline_s=None, **sampling):
    from flashpd.services.api import SamplingParams

    now = time.time()
    return InternalRequest(
        rid,
        MODEL,
        tuple(prompt_ids),
        SamplingParams(max_tokens=max_tokens, **sampling),
        session,
        None,
        None if deadline_s is None else now + deadline_s,
        now,
    )


async def collect(orchestrator: Orchestrator, run, from_token: int = 0):
    events = []
    async with contextlib.aclosing(orchestrator.stream(run, from_token)) as stream:
        async for event in stream:
            events.append(event)
    return events


@contextlib.asynccontextmanager
async def grpc_stack(redis_url: str, prefill: list[FakePrefill], decode: list[FakeDecode], **kwargs):
    """The router stack behind a real grpc.aio server on a free 127.0.0.1 port."""
    from flashpd.services.router.grpc_server import start_grpc_server

    async with router_stack(redis_url, prefill, decode, **kwargs) as stack:
        frontend = await start_grpc_server(
            stack.orchestrator, stack.models, stack.tokenizer, host="127.0.0.1", port=0, health_poll_s=0.05
        )
        try:
            yield stack, f"127.0.0.1:{frontend.port}"
        finally:
            await frontend.stop(grace_s=None)


@contextlib.asynccontextmanager
async def http_stack(redis_url: str, prefill: list[FakePrefill], decode: list[FakeDecode], **kwargs):
    """The router stack behind the OpenAI app served by uvicorn on a free 127.0.0.1 port."""
    import uvicorn

    from flashpd.services.redis_local import free_port
    from flashpd.services.router.http_app import build_http_app

    async with router_stack(redis_url, prefill, decode, **kwargs) as stack:
        app = build_http_app(stack.orchestrator, stack.models, stack.tokenizer, stack.metrics)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        try:
            yield stack, f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            await task
