"""The OpenAI-compatible HTTP frontend over real HTTP (uvicorn + httpx) with fake workers."""

import asyncio
import contextlib
import json

import httpx
import pytest
from edge_servers import http_server
from router_fakes import ByteTokenizer, FakeDecode, FakePrefill, http_stack, router_stack

from flashpd.services.api import Unavailable
from flashpd.services.router.auth import ApiKeys
from flashpd.services.worker.admission import WorkerFull

pytestmark = pytest.mark.net
PROMPT = "x" * 300


def run_async(coro):
    asyncio.run(asyncio.wait_for(coro, 180))  # a hang guard, not a tolerance


def sse_payloads(body: str) -> list:
    """Parse an SSE body strictly: `data: ...` lines, each followed by a blank line."""
    blocks = body.split("\n\n")
    assert blocks[-1] == "", "the stream must end with a blank line"
    out = []
    for block in blocks[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    assert out[-1] == "[DONE]"
    return out[:-1]


def test_completion_returns_text_and_usage_with_cached_tokens(redis_url):
    async def main():
        async with http_stack(redis_url, [FakePrefill("p0", cached_tokens=128)], [FakeDecode("d0")]) as (_, url):
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/v1/completions", json={"model": "flash-tiny", "prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["choices"][0]["text"] == "abcd"
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {
            "prompt_tokens": 300,
            "completion_tokens": 4,
            "total_tokens": 304,
            "prompt_tokens_details": {"cached_tokens": 128},
        }
        assert body["flashpd"]["prefill_worker"] == "p0"
        assert body["flashpd"]["timeline"]["prefill_ms"] == 2.0

    run_async(main())


def test_completion_stream_is_well_formed_sse_with_a_usage_chunk(redis_url):
    async def main():
        async with http_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as (_, url):
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post(
                    "/v1/completions",
                    json={"prompt": PROMPT, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
                )
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_payloads(r.text)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "abc"
        reasons = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
        assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert all(c["object"] == "text_completion" for c in chunks)

    run_async(main())


def test_chat_stream_uses_the_template_and_delta_format(redis_url):
    d = FakeDecode("d0")

    async def main():
        async with http_stack(redis_url, [FakePrefill("p0")], [d]) as (_, url):
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post(
                    "/v1/chat/completions",
                    json={
                        "model": "flash-tiny",
                        "max_tokens": 3,
                        "stream": True,
                        "messages": [{"role": "user", "content": "Hi"}],
                    },
                )
        chunks = sse_payloads(r.text)
        first = chunks[0]["choices"][0]["delta"]
        assert first["role"] == "assistant" and first["content"].startswith("a")
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "abc"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert ByteTokenizer().decode(d.seen[0].prompt_ids) == ("<|begin_of_sentence|><|User|>Hi<|Assistant|>")

    run_async(main())


def test_chat_non_stream_with_logprobs(redis_url):
    async def main():
        async with http_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as (_, url):
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post(
                    "/v1/chat/completions",
                    json={
                        "max_tokens": 2,
                        "logprobs": True,
                        "top_logprobs": 1,
                        "messages": [{"role": "user", "content": "Hi"}],
                    },
                )
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
        content = body["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in content] == ["a", "b"] and content[0]["logprob"] == -0.5
        assert len(content[0]["top_logprobs"]) == 1

    run_async(main())


def test_session_header_binds_the_session(redis_url):
    async def main():
        async with http_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as (stack, url):
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post(
                    "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers={"x-session-id": "chat-9"}
                )
            assert r.status_code == 200
            binding = (await stack.index.lookup([], [], "chat-9")).session
            assert binding.decode.worker_id == "d0"

    run_async(main())


@pytest.mark.parametrize(
    "path,payload,param",
    [
        ("/v1/completions", b"{not json", "body"),
        ("/v1/completions", b"[1, 2]", "body"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x" * 3000}, "prompt"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "temperature": -2}, "temperature"),
        ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_bad_requests_are_400_naming_the_param(redis_url, path, payload, param):
    async def main():
        async with http_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as (_, url):
            async with httpx.AsyncClient(base_url=url) as http:
                if isinstance(payload, bytes):
                    r = await http.post(path, content=payload, headers={"content-type": "application/json"})
                else:
                    r = await http.post(path, json=payload)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert param in error["message"]

    run_async(main())


def test_error_before_the_first_token_keeps_its_status_when_streaming(redis_url):
    d = FakeDecode("d0", reserve_error=Unavailable("draining"))

    async def main():
        async with http_stack(redis_url, [FakePrefill("p0")], [d]) as (_, url):
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/v1/completions", json={"prompt": "x", "stream": True})
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"

    run_async(main())


def test_a_full_worker_queue_answers_429_with_its_retry_after(redis_url):
    d = FakeDecode("d0", reserve_error=WorkerFull("decode queue full", retry_after_s=2.5))

    async def main():
        async with http_stack(redis_url, [FakePrefill("p0")], [d]) as (_, url):
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["type"] == "rate_limit_error"

    run_async(main())


def test_client_disconnect_mid_stream_aborts_both_legs(redis_url):
    p, d = FakePrefill("p0"), FakeDecode("d0", token_delay_s=0.05)

    async def main():
        async with http_stack(redis_url, [p], [d]) as (_, url):
            async with httpx.AsyncClient(base_url=url) as http:
                async with http.stream(
                    "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 20, "stream": True}
                ) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break  # first chunk received: hang up
            for _ in range(100):
                if d.aborted:
                    break
                await asyncio.sleep(0.02)
        assert len(d.aborted) == 1 and p.aborted == d.aborted
        assert d.closed_streams == 1

    run_async(main())


def test_models_health_and_metrics(redis_url):
    async def main():
        async with http_stack(redis_url, [FakePrefill("p0")], [FakeDecode("d0")]) as (_, url):
            async with httpx.AsyncClient(base_url=url) as http:
                models = (await http.get("/v1/models")).json()
                health = await http.get("/health")
                await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
                metrics = (await http.get("/metrics")).text
        assert [m["id"] for m in models["data"]] == ["flash-tiny"]
        assert health.status_code == 200
        for name in (
            "flashpd:time_to_first_token_seconds",
            "flashpd:inter_token_latency_seconds",
            "flashpd:e2e_request_latency_seconds",
            "flashpd:prefix_cache_hits_total",
            "flashpd:kv_transfer_latency_seconds",
            "flashpd:kv_transfer_bytes_total",
            "flashpd:router_decision_latency_seconds",
        ):
            assert name in metrics, name
        assert 'flashpd:prefix_cache_hits_total{model_name="flash-tiny",tier="none"} 1.0' in metrics

    run_async(main())


def test_health_is_503_without_workers(redis_url):
    async def main():
        async with http_stack(redis_url, [], [FakeDecode("d0")]) as (_, url):
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "no_workers"

    run_async(main())


# ----------------------------------------------------------------------------- the edge


@contextlib.asynccontextmanager
async def edge_http(redis_url, decode=None, **app_kwargs):
    workers = [FakePrefill("p0"), decode or FakeDecode("d0")]
    async with router_stack(redis_url, workers[:1], workers[1:]) as stack:
        async with http_server(stack, **app_kwargs) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                yield stack, http


def test_models_retrieve_and_unknown_model_is_404_model_not_found(redis_url):
    async def main():
        async with edge_http(redis_url) as (_, http):
            card = await http.get("/v1/models/flash-tiny")
            missing = await http.get("/v1/models/gpt-4")
            chat = await http.post(
                "/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}
            )
        assert card.status_code == 200
        assert card.json() == {
            "id": "flash-tiny",
            "object": "model",
            "created": 0,
            "owned_by": "flashpd",
            "max_model_len": 2048,
        }
        for r in (missing, chat):
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "model_not_found"
            assert r.json()["error"]["param"] == "model"

    run_async(main())


@pytest.mark.parametrize(
    "method,path,status,code",
    [
        ("GET", "/v1/nope", 404, "not_found"),
        ("POST", "/v2/chat/completions", 404, "not_found"),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
        ("DELETE", "/v1/models", 405, "method_not_allowed"),
    ],
)
def test_unknown_routes_and_methods_use_the_openai_error_shape(redis_url, method, path, status, code):
    async def main():
        async with edge_http(redis_url) as (_, http):
            return await http.request(method, path)

    r = asyncio.run(asyncio.wait_for(main(), 30))
    assert r.status_code == status
    assert set(r.json()) == {"error"} and r.json()["error"]["code"] == code
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_response_format_of_an_unknown_type_is_refused(redis_url):
    async def main():
        async with edge_http(redis_url) as (_, http):
            body = {
                "messages": [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}],
                "max_tokens": 2,
            }
            bad = await http.post("/v1/chat/completions", json={**body, "response_format": {"type": "yaml"}})
            text = await http.post("/v1/chat/completions", json={**body, "response_format": {"type": "text"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.type"
        assert text.status_code == 200  # and the developer role is accepted

    run_async(main())


def test_refusals_are_counted_by_code(redis_url):
    async def main():
        async with edge_http(redis_url) as (_, http):
            await http.post("/v1/completions", json={"prompt": "x", "temperature": "hot"})
            await http.post("/v1/completions", json={"prompt": "x", "model": "nope"})
            await http.post("/v1/completions", content=b"{")
            return (await http.get("/metrics")).text

    text = asyncio.run(asyncio.wait_for(main(), 30))
    assert 'flashpd:request_errors_total{code="INVALID_ARGUMENT",model_name="flash-tiny"} 3.0' in text


def test_body_over_the_limit_is_413_naming_the_body(redis_url):
    async def main():
        async with edge_http(redis_url, max_body_bytes=1000) as (_, http):
            return await http.post("/v1/completions", json={"prompt": "x" * 2000})

    r = asyncio.run(asyncio.wait_for(main(), 30))
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def test_unexpected_failure_is_a_generic_500_with_the_request_id(redis_url):
    decode = FakeDecode("d0", generate_error=RuntimeError("secret detail at /srv/x.py"))

    async def main():
        async with edge_http(redis_url, decode=decode) as (_, http):
            return await http.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"x-request-id": "req-42"}
            )

    r = asyncio.run(asyncio.wait_for(main(), 60))
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "req-42" in message and "RuntimeError" not in message and "secret" not in message


def test_api_key_is_required_except_for_health(redis_url):
    keys = ApiKeys(["k-123"])
    body = {"prompt": "x", "max_tokens": 2}

    async def main():
        async with edge_http(redis_url, api_keys=keys) as (_, http):
            none = await http.post("/v1/completions", json=body)
            wrong = await http.post("/v1/completions", json=body, headers={"authorization": "Bearer k-124"})
            latin = await http.post("/v1/completions", json=body, headers={"authorization": b"Bearer k\xe9"})
            models = await http.get("/v1/models")
            good = await http.post("/v1/completions", json=body, headers={"authorization": "Bearer k-123"})
            health = await http.get("/health")
        return none, wrong, latin, models, good, health

    none, wrong, latin, models, good, health = asyncio.run(asyncio.wait_for(main(), 30))
    for r in (none, wrong, latin, models):
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "k-12" not in r.text
    assert good.status_code == 200 and health.status_code == 200
