"""gRPC frontend: `flashpd.v1.Generation` over the orchestrator, plus grpc.health.v1 and server
reflection. Errors leave as status codes; an InvalidArgument also carries its field name in the
trailing metadata key `flashpd-field`.

Requests arrive as raw bytes and are parsed here, so a message that does not parse (bad wire
format, invalid UTF-8 in a string field) is INVALID_ARGUMENT naming `request`, not the UNKNOWN a
failing deserializer would give. Messages over `max_message_bytes` are refused by gRPC itself
(RESOURCE_EXHAUSTED). Unexpected failures answer INTERNAL with a generic message and the request
id (details in the log). Optional: API keys (metadata `authorization: Bearer <key>`, else
UNAUTHENTICATED; health and reflection stay open) and TLS (`auth.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from flashpd.services.api import FinalEvent, Internal, InvalidArgument, ServiceError
from flashpd.services.router import choices
from flashpd.services.router import validation as v
from flashpd.services.router.auth import OPEN_GRPC_PREFIXES, ApiKeys, TlsFiles
from flashpd.services.router.convert import (
    EdgeRequest,
    ModelTable,
    calls_to_proto,
    event_to_proto,
    new_request_id,
    request_from_proto,
)
from flashpd.services.router.metrics import RouterMetrics
from flashpd.services.router.orchestrator import Orchestrator
from flashpd.services.router.text import Tokenizer
from flashpd_sdk._gen import flashpd_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
FIELD_METADATA_KEY = "flashpd-field"
SERVER_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),  # ping idle clients, so dead streams end
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),  # accept SDK keepalive pings
    ("grpc.http2.max_pings_without_data", 0),
)


def parse_message(cls, raw: bytes | object):
    """A request message from raw bytes; anything unparsable is INVALID_ARGUMENT."""
    if not isinstance(raw, bytes):
        return raw  # already a message (in-process callers)
    msg = cls()
    try:
        msg.ParseFromString(raw)
    except (DecodeError, ValueError, RuntimeError):
        raise InvalidArgument(
            f"is not a valid {cls.DESCRIPTOR.name} message (bad wire format or invalid UTF-8 in a string field)",
            field="request",
        ) from None
    return msg


class GenerationServicer:
    """The Generation service's methods; requests are raw bytes (see `parse_message`)."""

    def __init__(
        self, orchestrator: Orchestrator, models: ModelTable, tokenizer: Tokenizer, metrics: RouterMetrics | None = None
    ) -> None:
        self.orchestrator, self.models, self.tokenizer = orchestrator, models, tokenizer
        self.metrics = metrics

    async def Generate(self, raw, context: grpc.aio.ServicerContext):  # noqa: N802
        rid = None
        error: ServiceError | None = None
        try:
            try:  # the edge: a refusal here never reaches the orchestrator
                request = parse_message(pb.GenerateRequest, raw)
                edge = request_from_proto(request, self.models, self.tokenizer, timeout_s=context.time_remaining())
                rid = edge.request.request_id
                messages = self._open(edge)
            except ServiceError as exc:
                self._refused(exc)
                raise
            async with contextlib.aclosing(messages):
                async for msg in messages:
                    yield msg
        except ServiceError as exc:
            error = exc
        except Exception as exc:
            rid = rid or new_request_id()
            log.error("request %s failed", rid, exc_info=exc)
            error = Internal("unexpected")
        if error is not None:
            await _abort(context, error, rid)

    def _open(self, edge: EdgeRequest) -> AsyncIterator[pb.GenerateResponse]:
        """Start the request (refusals raise here) and return its response messages."""
        if edge.n > 1:
            return self._choice_messages(edge, choices.fan_out(self.orchestrator, edge.request, edge.n))
        run = self.orchestrator.open(
            edge.request,
            resumable=edge.resumable,
            fingerprint=edge.fingerprint,
            resume_from_token=edge.resume_from_token,
        )
        return self._messages(edge, run)

    async def _messages(self, edge: EdgeRequest, run) -> AsyncIterator[pb.GenerateResponse]:
        events = self.orchestrator.stream(run, edge.resume_from_token)
        async with contextlib.aclosing(events):
            async for event in events:
                msg = event_to_proto(event)
                if (
                    msg.HasField("final") and edge.agent is not None and edge.agent.parses_calls
                ):  # the whole text, resumed or not
                    calls_to_proto(msg.final, "".join(e.text for e in run.events) + event.text, edge.agent)
                yield msg

    async def _choice_messages(self, edge: EdgeRequest, events: choices.Choices) -> AsyncIterator[pb.GenerateResponse]:
        """n > 1: the choices' chunks tagged with their index, one Final per choice; the last
        Final carries the request's usage (OpenAI's rule, `choices.total_usage`)."""
        texts: list[list[str]] = [[] for _ in range(edge.n)]
        finals: dict[int, FinalEvent] = {}
        async with contextlib.aclosing(events):
            async for item in events:
                msg = event_to_proto(item.event)
                if msg.HasField("chunk"):
                    msg.chunk.choice_index = item.index
                    texts[item.index].append(item.event.text)
                    yield msg
                    continue
                msg.final.choice_index = item.index
                if edge.agent is not None and edge.agent.parses_calls:
                    calls_to_proto(msg.final, "".join(texts[item.index]) + item.event.text, edge.agent)
                finals[item.index] = item.event
                if len(finals) == edge.n:
                    total = choices.total_usage([finals[i] for i in range(edge.n)])
                    msg.final.total_usage.CopyFrom(pb.Usage(**vars(total)))
                yield msg

    async def Abort(self, raw, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            request = parse_message(pb.AbortRequest, raw)
            request_id = v.as_id(request.request_id, "request_id")
            if request_id is None:
                raise InvalidArgument("must be non-empty", field="request_id")
            return pb.AbortResponse(found=await self.orchestrator.abort(request_id))
        except ServiceError as exc:
            error = exc
        except Exception as exc:
            log.error("abort failed", exc_info=exc)
            error = Internal("unexpected")
        await _abort(context, error, None)

    async def ListModels(self, raw, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            parse_message(pb.ListModelsRequest, raw)
        except ServiceError as exc:
            await _abort(context, exc, None)
        return pb.ListModelsResponse(
            models=[
                pb.ModelCard(id=m.name, context_tokens=m.context_tokens, vocab_size=m.vocab_size)
                for m in self.models.models
            ]
        )

    def _refused(self, exc: ServiceError) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(model_name=self.models.default.name, code=exc.code).inc()


def generation_handler(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    """The service's handlers with raw-bytes requests (parsed by the servicer)."""

    def out(cls):
        return cls.SerializeToString

    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Generate": grpc.unary_stream_rpc_method_handler(
                servicer.Generate, response_serializer=out(pb.GenerateResponse)
            ),
            "Abort": grpc.unary_unary_rpc_method_handler(servicer.Abort, response_serializer=out(pb.AbortResponse)),
            "ListModels": grpc.unary_unary_rpc_method_handler(
                servicer.ListModels, response_serializer=out(pb.ListModelsResponse)
            ),
        },
    )


async def _abort(context: grpc.aio.ServicerContext, exc: ServiceError, request_id: str | None) -> None:
    metadata = ((FIELD_METADATA_KEY, exc.field),) if exc.field else ()
    code = grpc.StatusCode[exc.code] if exc.code in grpc.StatusCode.__members__ else grpc.StatusCode.INTERNAL
    await context.abort(code, v.public_message(exc, request_id), trailing_metadata=metadata)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the metadata carries `authorization: Bearer <key>`."""

    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_GRPC_PREFIXES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self._keys.allows(metadata.get("authorization")):
            return await continuation(handler_call_details)
        return grpc.unary_unary_rpc_method_handler(_deny)  # same wire for unary and streaming


async def _deny(raw, context: grpc.aio.ServicerContext):
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (send authorization: Bearer <key>)"
    )


@dataclass
class GrpcFrontend:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    _health_task: asyncio.Task
    _health_stop: asyncio.Event

    async def stop(self, grace_s: float | None = 5.0) -> None:
        # The event ends the loop even when the cancel is lost: on Python < 3.12, a task
        # cancelled just as its `wait_for` completes swallows the cancellation.
        self._health_stop.set()
        self._health_task.cancel()
        await asyncio.gather(self._health_task, return_exceptions=True)
        await self.server.stop(grace_s)


async def start_grpc_server(
    orchestrator: Orchestrator,
    models: ModelTable,
    tokenizer: Tokenizer,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    health_poll_s: float = 1.0,
    metrics: RouterMetrics | None = None,
    api_keys: ApiKeys | None = None,
    tls: TlsFiles | None = None,
    max_message_bytes: int = v.MAX_BODY_BYTES,
) -> GrpcFrontend:
    """Start serving on `host` only; `port=0` picks a free port (see `.port`)."""
    interceptors = [ApiKeyInterceptor(api_keys)] if api_keys is not None and len(api_keys) else []
    options = (*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_message_bytes))
    server = grpc.aio.server(options=options, interceptors=interceptors)
    server.add_generic_rpc_handlers((generation_handler(GenerationServicer(orchestrator, models, tokenizer, metrics)),))
    health_servicer = _add_health_and_reflection(server)
    bound = _bind(server, host, port, tls)
    await server.start()
    stop = asyncio.Event()
    task = asyncio.create_task(_health_loop(orchestrator, health_servicer, health_poll_s, stop))
    return GrpcFrontend(server, bound, health_servicer, task, stop)


def _add_health_and_reflection(server: grpc.aio.Server) -> health.aio.HealthServicer:
    """The standard health service (its status set by `_health_loop`) and server reflection."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    return health_servicer


def _bind(server: grpc.aio.Server, host: str, port: int, tls: TlsFiles | None) -> int:
    """The port bound on `host` (TLS when given)."""
    address = f"{host}:{port}"
    if tls is not None:
        bound = server.add_secure_port(address, grpc.ssl_server_credentials([tls.read()]))
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    return bound


async def _health_loop(
    orchestrator: Orchestrator, servicer: health.aio.HealthServicer, poll_s: float, stop: asyncio.Event
) -> None:
    """SERVING while at least one prefill and one decode worker are live."""
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    while not stop.is_set():
        try:
            status = serving if await orchestrator.ready() else not_serving
        except Exception:
            log.exception("health check failed")
            status = not_serving
        for name in ("", SERVICE_NAME):
            await servicer.set(name, status)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_s)
