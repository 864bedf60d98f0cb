"""flashpd on a local Ray cluster, 1 prefill + 1 decode replica, real Redis/NIXL/gRPC/HTTP.

The app runs with bounded replay off, so its greedy outputs must equal the single-process
engine's (exact replay semantics on both sides)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis
import torch

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams

from .conftest import deploy

pytestmark = pytest.mark.net
APP = "pd1"
BLOCK_BYTES = 106 * 128  # tiny preset: 106 B/token of global KV per 128-token chunk


@pytest.fixture(scope="module")
def app(ray_serve, ckpt_dir, redis_server):
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    args = deploy(APP, ckpt_dir, redis_server.url, swa_bounded_replay=False)
    from flashpd_sdk import Client

    client = Client(f"127.0.0.1:{args['grpc_port']}")
    deadline = time.monotonic() + 60
    while client.health() != "SERVING" and time.monotonic() < deadline:
        time.sleep(0.3)
    yield {"args": args, "client": client, "http": f"http://127.0.0.1:{ray_serve}/{APP}", "redis": r}
    client.close()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine_greedy(model, prompt: list[int], n: int) -> list[int]:
    eng = LLMEngine(model, EngineConfig(swa_bounded_replay=False, num_blocks=32, model_id="flashpd-tiny"))
    eng.add_request("x", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    out = []
    while eng.has_unfinished():
        for o in eng.step():
            out.extend(o.new_token_ids)
    return out


def _generate(client, prompt_ids, n, **kw):
    stream = client.generate(prompt_ids=prompt_ids, max_tokens=n, ignore_eos=True, timeout_s=120, **kw)
    ids = [t for chunk in stream for t in chunk.token_ids]
    return ids, stream.result


def _transfer_bytes(app) -> float:
    text = httpx.get(f"{app['http']}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("flashpd:kv_transfer_bytes_total"):
            total += float(line.split()[-1])
    return total


def test_grpc_greedy_equals_single_process_engine(app, model_f32):
    prompt = _prompt(200, 1)
    ids, result = _generate(app["client"], prompt, 6)
    assert ids == _engine_greedy(model_f32, prompt, 6)
    assert result.finish_reason == "length" and result.usage.completion_tokens == 6


def test_three_turn_session_moves_only_new_tail(app):
    client, context, session = app["client"], _prompt(150, 2), "sess-3turn"
    decodes, before = set(), _transfer_bytes(app)
    for turn in range(3):
        ids, result = _generate(client, context, 8, session_id=session)
        decodes.add(result.decode_worker)
        after = _transfer_bytes(app)
        chunks_total = -(-len(context) // 128)
        chunks_cached = result.usage.cached_tokens_decode // 128
        if turn > 0:
            assert result.usage.cached_tokens_decode > 0
        assert after - before == (chunks_total - chunks_cached) * BLOCK_BYTES
        before = after
        context = context + ids + _prompt(100, 10 + turn)
    assert len(decodes) == 1  # the session stayed bound to one decode worker


def test_redis_holds_chunks_and_session_binding(app):
    _generate(app["client"], _prompt(300, 3), 4, session_id="sess-redis")
    r = app["redis"]
    keys = {k.decode() for k in r.keys("*")}
    assert any("sess-redis" in k for k in keys), keys
    assert any(":chunk:" in k or "chunk" in k for k in keys)


def test_cancel_mid_stream_frees_blocks_on_both_sides(app):
    from ray import serve

    decode = serve.get_deployment_handle("DecodeServer", app_name=APP)
    prefill = serve.get_deployment_handle("PrefillServer", app_name=APP)
    idle_d = decode.stats.remote().result().kv_blocks_used
    idle_p = prefill.stats.remote().result().kv_blocks_used
    stream = app["client"].generate(prompt_ids=_prompt(260, 4), max_tokens=400, ignore_eos=True, timeout_s=120)
    for n, _chunk in enumerate(stream):
        if n == 2:
            stream.cancel()
            break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (
            decode.stats.remote().result().kv_blocks_used == idle_d
            and prefill.stats.remote().result().kv_blocks_used == idle_p
        ):
            break
        time.sleep(0.2)
    assert decode.stats.remote().result().kv_blocks_used == idle_d
    assert prefill.stats.remote().result().kv_blocks_used == idle_p


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"prompt_ids": []}, "prompt"),
        ({"prompt_ids": [1, 2, 3], "max_tokens": -1}, "max_tokens"),
        ({"prompt_ids": list(range(3, 503)) * 5, "max_tokens": 4}, "prompt"),
    ],
)
def test_bad_grpc_requests_are_invalid_argument(app, kwargs, field):
    from flashpd_sdk.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as err:
        list(app["client"].generate(timeout_s=30, **kwargs))
    assert field in str(err.value)


def test_unknown_model_is_invalid_argument(app):
    from flashpd_sdk.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="model"):
        list(app["client"].generate(prompt_ids=[1, 2, 3], max_tokens=2, model="nope", timeout_s=30))


def test_http_completion_stream_and_usage(app):
    body = {
        "model": "flashpd-tiny",
        "prompt": "Hello there",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", f"{app['http']}/v1/completions", json=body, timeout=60, headers={"x-session-id": "http-sess"}
    ) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 5
    assert "cached_tokens" in usage[-1]["prompt_tokens_details"]


def test_http_chat_completion(app):
    body = {"model": "flashpd-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    resp = httpx.post(f"{app['http']}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["choices"][0]["message"]["role"] == "assistant"
    assert data["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    "body,field",
    [
        ({"model": "flashpd-tiny", "prompt": "", "max_tokens": 4}, "prompt"),
        ({"model": "other", "prompt": "hi", "max_tokens": 4}, "model"),
        ({"model": "flashpd-tiny", "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ],
)
def test_bad_http_requests_are_400_naming_the_field(app, body, field):
    resp = httpx.post(f"{app['http']}/v1/completions", json=body, timeout=30)
    assert resp.status_code == (404 if field == "model" else 400), resp.text  # model_not_found
    assert field in resp.text


def test_malformed_json_is_400(app):
    resp = httpx.post(
        f"{app['http']}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}, timeout=30
    )
    assert resp.status_code == 400


def test_stopping_the_app_removes_its_redis_entries(app):
    from ray import serve

    _generate(app["client"], _prompt(300, 5), 2, session_id="sess-stop")
    serve.delete(APP)
    r = app["redis"]
    leftover = [k.decode() for k in r.keys("*") if b"chunk" in k or b"sess-stop" in k]
    assert leftover == [], leftover
