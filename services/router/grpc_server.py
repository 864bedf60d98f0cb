"""gRPC frontend: `flashpd.v1.Generation` over the orchestrator, plus grpc.health.v1 and server
reflection. Errors leave as status codes; an InvalidArgument also carries its field name in the
trailing metadata key `flashpd-field`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from flashpd.services.api import InvalidArgument, ServiceError
from flashpd.services.router.convert import ModelTable, event_to_proto, request_from_proto
from flashpd.services.router.orchestrator import Orchestrator
from flashpd.services.router.text import Tokenizer
from flashpd_sdk._gen import flashpd_pb2 as pb
from flashpd_sdk._gen import flashpd_pb2_grpc as pb_grpc

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


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, orchestrator: Orchestrator, models: ModelTable, tokenizer: Tokenizer) -> None:
        self.orchestrator, self.models, self.tokenizer = orchestrator, models, tokenizer

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            edge = request_from_proto(request, self.models, self.tokenizer,
                                      timeout_s=context.time_remaining())
            run = self.orchestrator.open(
                edge.request, resumable=edge.resumable, fingerprint=edge.fingerprint,
                resume_from_token=edge.resume_from_token)
            events = self.orchestrator.stream(run, edge.resume_from_token)
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event_to_proto(event)
        except ServiceError as exc:
            await _abort(context, exc)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        if not request.request_id:
            await _abort(context, InvalidArgument("must be non-empty", field="request_id"))
        return pb.AbortResponse(found=await self.orchestrator.abort(request.request_id))

    async def ListModels(self, request: pb.ListModelsRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext):
        return pb.ListModelsResponse(models=[
            pb.ModelCard(id=m.name, context_tokens=m.context_tokens, vocab_size=m.vocab_size)
            for m in self.models.models])


async def _abort(context: grpc.aio.ServicerContext, exc: ServiceError) -> None:
    metadata = ((FIELD_METADATA_KEY, exc.field),) if exc.field else ()
    await context.abort(grpc.StatusCode[exc.code], str(exc), trailing_metadata=metadata)


@dataclass
class GrpcFrontend:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    _health_task: asyncio.Task

    async def stop(self, grace_s: float | None = 5.0) -> None:
        self._health_task.cancel()
        await asyncio.gather(self._health_task, return_exceptions=True)
        await self.server.stop(grace_s)


async def start_grpc_server(orchestrator: Orchestrator, models: ModelTable, tokenizer: Tokenizer,
                            *, host: str = "127.0.0.1", port: int = 0,
                            health_poll_s: float = 1.0) -> GrpcFrontend:
    """Start serving; `port=0` picks a free port (see `.port`)."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_GenerationServicer_to_server(
        GenerationServicer(orchestrator, models, tokenizer), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    task = asyncio.create_task(_health_loop(orchestrator, health_servicer, health_poll_s))
    return GrpcFrontend(server, bound, health_servicer, task)


async def _health_loop(orchestrator: Orchestrator, servicer: health.aio.HealthServicer,
                       poll_s: float) -> None:
    """SERVING while at least one prefill and one decode worker are live."""
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    while True:
        try:
            status = serving if await orchestrator.ready() else not_serving
        except Exception:
            log.exception("health check failed")
            status = not_serving
        for name in ("", SERVICE_NAME):
            await servicer.set(name, status)
        await asyncio.sleep(poll_s)
