"""OpenAI-compatible HTTP frontend over the orchestrator (FastAPI).

Routes: POST /v1/completions, POST /v1/chat/completions (SSE when `stream: true`), GET /v1/models,
GET /v1/models/{id}, GET /health (200 when a prefill and a decode worker are live, else 503),
GET /metrics. Headers: `x-session-id`, `x-parent-session-id`, `x-request-id` (optional client
id), `authorization: Bearer <key>` when API keys are configured (`auth.py`).

Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}`: request-field refusals
name the field in `param` (400; 413 for a body over the limit, 404 `model_not_found` for an
unknown model), unknown routes 404 and wrong methods 405, a bad key 401. Unexpected failures
answer 500 with a generic message and the request id; the details go to the log, never to the
client. Refusals are counted in `flashpd:request_errors` by code.

A streaming response starts once the first event is known, so errors before the first token
(bad request, no worker, deadline) still get a proper HTTP status. A client that disconnects
(streaming or not) aborts the request on both legs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashpd.services.api import Cancelled, FinalEvent, Internal, ResourceExhausted, ServiceError, TokenEvent
from flashpd.services.router import choices
from flashpd.services.router import validation as v
from flashpd.services.router.auth import ApiKeys
from flashpd.services.router.convert import ModelTable, ServedModel, new_request_id
from flashpd.services.router.metrics import RouterMetrics
from flashpd.services.router.openai_compat import (
    OpenAIRequest,
    ResponseShaper,
    chat_request,
    completion_request,
    error_body,
    merge_choices,
    parse_json,
    request_id_from,
    route_error_body,
)
from flashpd.services.router.orchestrator import Orchestrator
from flashpd.services.router.text import Tokenizer

log = logging.getLogger(__name__)
Events = AsyncIterator[TokenEvent | FinalEvent]


def build_http_app(
    orchestrator: Orchestrator,
    models: ModelTable,
    tokenizer: Tokenizer,
    metrics: RouterMetrics,
    *,
    api_keys: ApiKeys | None = None,
    max_body_bytes: int = v.MAX_BODY_BYTES,
) -> FastAPI:
    app = FastAPI(
        title="flashpd", description="OpenAI-compatible API of flashpd", openapi_url=None, docs_url=None, redoc_url=None
    )
    edge = _Edge(api_keys or ApiKeys(()), models, tokenizer, metrics, max_body_bytes)
    _add_error_handlers(app)
    _add_generation_routes(app, orchestrator, edge)
    _add_model_routes(app, edge.keys, models)
    _add_operations_routes(app, orchestrator, metrics)
    return app


@dataclasses.dataclass(frozen=True)
class _Edge:
    """What a request passes before the orchestrator sees it: the key, the body limit and the
    OpenAI validation. Refusals here are counted (the orchestrator counts the rest)."""

    keys: ApiKeys
    models: ModelTable
    tokenizer: Tokenizer
    metrics: RouterMetrics
    max_body_bytes: int

    def refused(self, exc: ServiceError) -> None:
        self.metrics.errors.labels(model_name=self.models.default.name, code=exc.code).inc()

    async def admit(self, request: Request, parse) -> OpenAIRequest:
        """Authorize, read and validate with `parse` (`chat_request` or `completion_request`)."""
        try:
            self.keys.require(request.headers.get("authorization"))
            rid = request.state.flashpd_request_id = request_id_from(request.headers)
            body = parse_json(await _read_body(request, self.max_body_bytes), self.max_body_bytes)
            return parse(body, request.headers, self.models, self.tokenizer, rid)
        except ServiceError as exc:
            self.refused(exc)
            raise


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        headers = {}
        if isinstance(exc, ResourceExhausted):
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        return JSONResponse(error_body(exc, _request_id(request)), status_code=exc.http_status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def route_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            route_error_body(exc.status_code, request.method, request.url.path),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = _request_id(request)
        log.error("request %s failed", rid, exc_info=exc)
        return JSONResponse(error_body(Internal("unexpected"), rid), status_code=500)


def _add_generation_routes(app: FastAPI, orchestrator: Orchestrator, edge: _Edge) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        oreq = await edge.admit(request, completion_request)
        return await _serve(orchestrator, oreq, edge.tokenizer, request, edge.refused)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        oreq = await edge.admit(request, chat_request)
        return await _serve(orchestrator, oreq, edge.tokenizer, request, edge.refused)


def _add_model_routes(app: FastAPI, keys: ApiKeys, models: ModelTable) -> None:
    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        keys.require(request.headers.get("authorization"))
        return {"object": "list", "data": [_model_card(m) for m in models.models]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(request: Request, model_id: str) -> dict:
        keys.require(request.headers.get("authorization"))
        v.check_unicode(model_id, "model")
        if not model_id:
            raise v.ModelNotFound("must not be empty", field="model")
        return _model_card(models.resolve(model_id))


def _add_operations_routes(app: FastAPI, orchestrator: Orchestrator, metrics: RouterMetrics) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            ready = await orchestrator.ready()
        except Exception as exc:  # Redis unreachable: not ready (details in the log only)
            log.warning("health check failed: %r", exc)
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok" if ready else "no_workers"}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def _model_card(m: ServedModel) -> dict:
    return {"id": m.name, "object": "model", "created": 0, "owned_by": "flashpd", "max_model_len": m.context_tokens}


def _request_id(request: Request) -> str:
    rid = getattr(request.state, "flashpd_request_id", None)
    if rid is None:
        rid = request.state.flashpd_request_id = new_request_id()
    return rid


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused as soon as it exceeds `max_bytes` (declared or received)."""
    declared = v.content_length(request.headers)
    if declared is not None and declared > max_bytes:
        raise v.PayloadTooLarge(f"request body of {declared} bytes exceeds {max_bytes} bytes", field="body")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise v.PayloadTooLarge(f"request body exceeds {max_bytes} bytes", field="body")
        chunks.append(chunk)
    return b"".join(chunks)


async def _serve(
    orchestrator: Orchestrator, oreq: OpenAIRequest, tokenizer: Tokenizer, request: Request, refused
) -> Response:
    if oreq.agent.n > 1:
        return await _serve_choices(orchestrator, oreq, tokenizer, request, refused)
    try:
        run = orchestrator.open(oreq.request)
    except ServiceError as exc:
        refused(exc)
        raise
    events = orchestrator.stream(run)
    shaper = ResponseShaper(oreq, tokenizer)
    if not oreq.stream:
        tokens, final = await _until_done_or_disconnect(_collect(events), request)
        return JSONResponse(shaper.response(tokens, final))
    first = await _first_event(events)
    return _event_stream(_sse(first, events, shaper, oreq.request.request_id))


async def _first_event(events):
    """The stream's first event; the stream is closed if that fails (no response has started,
    so the error still gets its HTTP status)."""
    try:
        return await anext(events)
    except BaseException:
        await events.aclose()
        raise


def _event_stream(lines: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(lines, media_type="text/event-stream", headers={"cache-control": "no-cache"})


async def _sse(
    first: TokenEvent | FinalEvent, events: Events, shaper: ResponseShaper, request_id: str
) -> AsyncIterator[str]:
    """`data: {chunk}` lines, then `data: [DONE]`; an error after the first event is sent as a
    `data: {"error": ...}` line before [DONE] (unexpected ones as a generic internal error)."""
    async with contextlib.aclosing(events):
        event, is_first = first, True
        try:
            while True:
                for payload in shaper.chunks(event, first=is_first):
                    yield _data(payload)
                if isinstance(event, FinalEvent):
                    break
                event, is_first = await anext(events), False
        except ServiceError as exc:
            yield _data(error_body(exc, request_id))
        except Exception as exc:
            log.error("request %s failed while streaming", request_id, exc_info=exc)
            yield _data(error_body(Internal("unexpected"), request_id))
    yield "data: [DONE]\n\n"


def _data(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _serve_choices(
    orchestrator: Orchestrator, oreq: OpenAIRequest, tokenizer: Tokenizer, request: Request, refused
) -> Response:
    """n > 1 (`choices.py`): one response of n choices, or one SSE stream whose chunks carry
    their choice's index, ending with one usage chunk (when asked for) counted as OpenAI does."""
    n = oreq.agent.n
    try:
        events = choices.fan_out(orchestrator, oreq.request, n)
    except ServiceError as exc:
        refused(exc)
        raise
    if not oreq.stream:
        results = await _until_done_or_disconnect(choices.collect(events, n), request)
        shapers = [ResponseShaper(oreq, tokenizer, i) for i in range(n)]
        return JSONResponse(merge_choices(shapers, results))
    first = await _first_event(events)
    per_choice = dataclasses.replace(oreq, include_usage=False)  # one usage chunk, at the end
    shapers = [ResponseShaper(per_choice, tokenizer, i) for i in range(n)]
    return _event_stream(_sse_choices(first, events, shapers, oreq))


async def _sse_choices(
    first: choices.ChoiceEvent, events, shapers: list[ResponseShaper], oreq: OpenAIRequest
) -> AsyncIterator[str]:
    request_id = oreq.request.request_id
    started: set[int] = set()
    finals: dict[int, FinalEvent] = {}
    async with contextlib.aclosing(events):
        item = first
        try:
            while True:
                for payload in shapers[item.index].chunks(item.event, first=item.index not in started):
                    yield _data(payload)
                started.add(item.index)
                if isinstance(item.event, FinalEvent):
                    finals[item.index] = item.event
                    if len(finals) == len(shapers):
                        break
                item = await anext(events)
        except ServiceError as exc:
            yield _data(error_body(exc, request_id))
        except Exception as exc:
            log.error("request %s failed while streaming", request_id, exc_info=exc)
            yield _data(error_body(Internal("unexpected"), request_id))
        else:
            if oreq.include_usage:
                total = choices.total_usage([finals[i] for i in range(len(shapers))])
                yield _data(shapers[0].usage_chunk(total))
    yield "data: [DONE]\n\n"


async def _collect(events: Events) -> tuple[list[TokenEvent], FinalEvent]:
    tokens: list[TokenEvent] = []
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, FinalEvent):
                return tokens, event
            tokens.append(event)
    raise AssertionError("an orchestrator stream always ends with a final event or an error")


async def _until_done_or_disconnect(work, request: Request):
    """Run `work`; if the client disconnects first, cancel it (which aborts the request)."""
    work_task = asyncio.ensure_future(work)
    gone_task = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, gone_task):
            if not task.done():
                task.cancel()
        await asyncio.gather(work_task, gone_task, return_exceptions=True)
    if not work_task.cancelled():
        return work_task.result()
    raise Cancelled("client disconnected")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        continue
