"""OpenAI-compatible HTTP frontend over the orchestrator (FastAPI).

Routes: POST /v1/completions, POST /v1/chat/completions (SSE when `stream: true`), GET /v1/models,
GET /health (200 when a prefill and a decode worker are live, else 503), GET /metrics.
Headers: `x-session-id`, `x-parent-session-id`, `x-request-id` (optional client id).

A streaming response starts once the first event is known, so errors before the first token
(bad request, no worker, deadline) still get a proper HTTP status. A client that disconnects
(streaming or not) aborts the request on both legs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from flashpd.services.api import Cancelled, FinalEvent, ServiceError, TokenEvent
from flashpd.services.router.convert import ModelTable
from flashpd.services.router.metrics import RouterMetrics
from flashpd.services.router.openai_compat import (
    OpenAIRequest,
    ResponseShaper,
    chat_request,
    completion_request,
    error_body,
    parse_json,
)
from flashpd.services.router.orchestrator import Orchestrator
from flashpd.services.router.text import Tokenizer

Events = AsyncIterator[TokenEvent | FinalEvent]


def build_http_app(orchestrator: Orchestrator, models: ModelTable, tokenizer: Tokenizer,
                   metrics: RouterMetrics) -> FastAPI:
    app = FastAPI(title="flashpd", description="OpenAI-compatible API of flashpd")

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse(error_body(exc), status_code=exc.http_status)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_json(await request.body())
        oreq = completion_request(body, request.headers, models, tokenizer)
        return await _serve(orchestrator, oreq, tokenizer, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_json(await request.body())
        oreq = chat_request(body, request.headers, models, tokenizer)
        return await _serve(orchestrator, oreq, tokenizer, request)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "flashpd",
             "max_model_len": m.context_tokens} for m in models.models]}

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            ready = await orchestrator.ready()
        except Exception as exc:  # Redis unreachable: not ready, and say why
            return JSONResponse({"status": "unavailable", "reason": repr(exc)}, status_code=503)
        return JSONResponse({"status": "ok" if ready else "no_workers"},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _serve(orchestrator: Orchestrator, oreq: OpenAIRequest, tokenizer: Tokenizer,
                 request: Request) -> Response:
    run = orchestrator.open(oreq.request)
    events = orchestrator.stream(run)
    shaper = ResponseShaper(oreq, tokenizer)
    if not oreq.stream:
        tokens, final = await _until_done_or_disconnect(_collect(events), request)
        return JSONResponse(shaper.response(tokens, final))
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    return StreamingResponse(_sse(first, events, shaper), media_type="text/event-stream",
                             headers={"cache-control": "no-cache"})


async def _sse(first: TokenEvent | FinalEvent, events: Events,
               shaper: ResponseShaper) -> AsyncIterator[str]:
    """`data: {chunk}` lines, then `data: [DONE]`; an error after the first event is sent as a
    `data: {"error": ...}` line before [DONE]."""
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
            yield _data(error_body(exc))
    yield "data: [DONE]\n\n"


def _data(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


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
