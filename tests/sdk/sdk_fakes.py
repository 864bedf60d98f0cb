"""A scripted flashpd gRPC server for SDK tests: each Generate call plays the next step of a
script (fail, stream some tokens then break, finish), honouring resume_from_token."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from flashpd_sdk._gen import flashpd_pb2 as pb
from flashpd_sdk._gen import flashpd_pb2_grpc as pb_grpc

OUTPUT = b"hello world"


@dataclass(frozen=True)
class Step:
    """fail: a status code to end with; tokens: how many tokens to send first (None = all, then
    the final message); delay_s: pause before each token."""

    fail: grpc.StatusCode | None = None
    tokens: int | None = None
    delay_s: float = 0.0
    field: str | None = None


COMPLETE = Step()


@dataclass
class Servicer(pb_grpc.GenerationServicer):
    script: list[Step] = field(default_factory=list)
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        step = self.script.pop(0) if self.script else COMPLETE
        context.add_callback(self.cancelled.set)
        start = request.resume_from_token
        end = len(OUTPUT) if step.tokens is None else min(len(OUTPUT), start + step.tokens)
        for i in range(start, end):
            if step.delay_s:
                time.sleep(step.delay_s)
            if not context.is_active():
                return
            yield pb.GenerateResponse(chunk=pb.TokenChunk(
                token_ids=[OUTPUT[i]], text=chr(OUTPUT[i]), index=i))
        if step.fail is not None:
            metadata = (("flashpd-field", step.field),) if step.field else None
            context.abort_with_status(_status(step.fail, f"scripted {step.fail.name}", metadata))
        yield pb.GenerateResponse(final=pb.Final(
            finish_reason=pb.FINISH_REASON_LENGTH, request_id=request.request_id,
            usage=pb.Usage(prompt_tokens=3, completion_tokens=len(OUTPUT), cached_tokens=1,
                           cached_tokens_prefill=1, cached_tokens_decode=2),
            timeline=pb.Timeline(route_ms=0.5, first_token_ms=3.0, e2e_ms=9.0),
            prefill_worker="p0", decode_worker="d0"))

    def Abort(self, request, context):  # noqa: N802
        self.aborts.append(request.request_id)
        return pb.AbortResponse(found=True)

    def ListModels(self, request, context):  # noqa: N802
        return pb.ListModelsResponse(models=[pb.ModelCard(id="m", context_tokens=64,
                                                          vocab_size=256)])


class _Status(grpc.Status):
    def __init__(self, code, details, trailing_metadata):
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


def _status(code: grpc.StatusCode, details: str, metadata) -> grpc.Status:
    return _Status(code, details, metadata)


class ScriptedServer:
    def __init__(self) -> None:
        self.servicer = Servicer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_GenerationServicer_to_server(self.servicer, self._server)
        self.health = health.HealthServicer()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{self.port}"

    def play(self, *steps: Step) -> None:
        self.servicer.script = list(steps)

    @property
    def requests(self) -> list[pb.GenerateRequest]:
        return self.servicer.requests

    def __enter__(self) -> ScriptedServer:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(None)
