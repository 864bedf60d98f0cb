"""The stack bench's plain-httpx client: counts streamed text chunks, records refusals."""

import asyncio
import json

import httpx

from flashpd.bench.h200_stack import http_request


def _sse(*texts: str) -> bytes:
    rows = [{"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": t}]} for t in texts]
    return b"".join(f"data: {json.dumps(r)}\n\n".encode() for r in rows) + b"data: [DONE]\n\n"


def _run(handler):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://t") as client:
            return await http_request(client, "m", [5, 6, 7], 4)

    return asyncio.run(go())


def test_counts_chunks_with_text_and_sends_the_ids():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content), path=request.url.path)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_sse("a", "", "b", "c"))

    rec = _run(handler)
    assert rec.error is None and rec.tokens == 3 and len(rec.arrivals) == 3
    assert seen["prompt"] == [5, 6, 7] and seen["stream"] is True and seen["path"] == "/v1/completions"


def test_a_refusal_is_the_record_error():
    rec = _run(lambda request: httpx.Response(400, json={"error": {"message": "bad prompt"}}))
    assert rec.tokens == 0 and "HTTP 400" in rec.error and "bad prompt" in rec.error
