"""flashpd in colocated mode on a local Ray cluster: router + 1 colocated replica, real
Redis/gRPC/HTTP, no KV transfer (`mode: colocated`, the tiny preset with bounded replay on).

Greedy output through the stack equals the colocated engine's own; a session's turns stay on
its worker and get prefix credit (cached chunks published to Redis as a prefill worker does);
cancel frees the blocks; bad input is INVALID_ARGUMENT / HTTP 400; a killed replica ends its
stream cleanly (continued on the replacement, or a clear UNAVAILABLE) and the service serves
on the replacement."""

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
APP = "co1"
DEPLOYMENT = "ColocatedServer"


@pytest.fixture(scope="module")
def app(ray_serve, ckpt_dir, redis_server):
    from ray import serve

    from flashpd_sdk import Client

    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    args = deploy(APP, ckpt_dir, redis_server.url, mode="colocated")
    client = Client(f"127.0.0.1:{args['grpc_port']}")
    deadline = time.monotonic() + 60
    while client.health() != "SERVING" and time.monotonic() < deadline:
        time.sleep(0.3)
    yield {"args": args, "client": client, "http": f"http://127.0.0.1:{ray_serve}/{APP}", "redis": r}
    client.close()
    serve.delete(APP)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The colocated engine alone, as the app configures it (bounded replay on)."""
    eng = LLMEngine(model, EngineConfig(role="colocated", num_blocks=64, model_id="flashpd-tiny"))
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


def _handle():
    from ray import serve

    return serve.get_deployment_handle(DEPLOYMENT, app_name=APP)


def test_grpc_greedy_equals_the_colocated_engines_own(app, model_f32):
    for seed, n in ((1, 200), (11, 333)):
        prompt = _prompt(n, seed)
        ids, result = _generate(app["client"], prompt, 6)
        assert ids == _engine_greedy(model_f32, prompt, 6)
        assert result.finish_reason == "length" and result.usage.completion_tokens == 6
        assert result.prefill_worker == "" and result.decode_worker


def test_session_turns_stay_on_their_worker_with_prefix_credit_from_redis(app):
    client, context, session = app["client"], _prompt(300, 2), "sess-co"
    workers = set()
    for turn in range(3):
        ids, result = _generate(client, context, 6, session_id=session)
        workers.add(result.decode_worker)
        assert result.usage.prompt_tokens == len(context)
        if turn > 0:  # the previous turn's whole chunks, less the 128-token replay
            assert result.usage.cached_tokens >= 128
            assert result.usage.cached_tokens == result.usage.cached_tokens_prefill
        context = context + ids + _prompt(100, 20 + turn)
    assert len(workers) == 1
    r = app["redis"]
    keys = {k.decode() for k in r.keys("*")}
    assert any("colocated|" in k for k in keys), keys  # the worker's chunk set, by its worker key
    session_key = next(k for k in keys if "sess-co" in k and r.type(k) == b"hash")
    binding = {k.decode(): v.decode() for k, v in r.hgetall(session_key).items()}
    assert binding["prefill"] == "" and binding["decode"].startswith("colocated|")


def test_http_completion_stream_reports_usage_with_cached_tokens(app):
    body = {"model": "flashpd-tiny", "prompt": "Hello there " * 100, "max_tokens": 5, "stream": True}
    body["stream_options"] = {"include_usage": True}
    usages = []
    for _ in range(2):  # the second request hits the first one's cached chunks
        with httpx.stream(
            "POST", f"{app['http']}/v1/completions", json=body, timeout=60, headers={"x-session-id": "http-co"}
        ) as resp:
            assert resp.status_code == 200
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        usages.append([json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")][-1])
    assert all(u["completion_tokens"] == 5 for u in usages)
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0


def test_http_chat_completion(app):
    body = {"model": "flashpd-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    resp = httpx.post(f"{app['http']}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"prompt_ids": []}, "prompt"),
        ({"prompt_ids": [1, 2, 3], "max_tokens": -1}, "max_tokens"),
        ({"prompt_ids": list(range(3, 503)) * 5, "max_tokens": 4}, "prompt"),
        ({"prompt_ids": [1, 2, 10**7], "max_tokens": 2}, "prompt"),
    ],
)
def test_bad_grpc_requests_are_invalid_argument(app, kwargs, field):
    from flashpd_sdk.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as err:
        list(app["client"].generate(timeout_s=30, **kwargs))
    assert field in str(err.value)


@pytest.mark.parametrize(
    "body,status,field",
    [
        ({"model": "flashpd-tiny", "prompt": "", "max_tokens": 4}, 400, "prompt"),
        ({"model": "other", "prompt": "hi", "max_tokens": 4}, 404, "model"),
        ({"model": "flashpd-tiny", "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ],
)
def test_bad_http_requests_are_4xx_naming_the_field(app, body, status, field):
    resp = httpx.post(f"{app['http']}/v1/completions", json=body, timeout=30)
    assert resp.status_code == status and field in resp.text


def test_cancel_mid_stream_frees_the_blocks(app):
    idle = _handle().stats.remote().result().kv_blocks_used
    stream = app["client"].generate(prompt_ids=_prompt(260, 4), max_tokens=400, ignore_eos=True, timeout_s=120)
    for n, _chunk in enumerate(stream):
        if n == 2:
            stream.cancel()
            break
    deadline = time.monotonic() + 20
    while _handle().stats.remote().result().kv_blocks_used != idle and time.monotonic() < deadline:
        time.sleep(0.2)
    stats = _handle().stats.remote().result()
    assert stats.kv_blocks_used == idle and stats.running == 0


def test_router_metrics_count_the_colocated_requests(app):
    text = httpx.get(f"{app['http']}/metrics", timeout=10).text
    ttft = [line for line in text.splitlines() if line.startswith("flashpd:time_to_first_token_seconds_count")]
    assert ttft and float(ttft[0].split()[-1]) >= 3
    assert "flashpd:kv_transfer_bytes_total" not in text or all(
        float(line.split()[-1]) == 0 for line in text.splitlines() if line.startswith("flashpd:kv_transfer_bytes_total")
    )


def test_killed_replica_ends_the_stream_cleanly_and_the_replacement_serves(app):
    """Last in the module: the replica dies mid-stream (as SIGKILL does). The stream either
    continues on the replacement (the router re-prefills prompt + released tokens there) or
    ends with a clear UNAVAILABLE; the next request is served by the replacement."""
    import ray

    from flashpd_sdk.errors import Unavailable

    before = _handle().stats.remote().result()
    stream = app["client"].generate(prompt_ids=_prompt(150, 6), max_tokens=300, ignore_eos=True, timeout_s=180)
    got = []
    try:
        for chunk in stream:
            got.extend(chunk.token_ids)
            if len(got) >= 3 and before is not None:
                (name,) = [
                    a["name"]
                    for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith(f"SERVE_REPLICA::{APP}#{DEPLOYMENT}#")
                ]
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
                before_id, before = before.incarnation, None
        assert len(got) == 300 and stream.result.finish_reason == "length"  # continued
    except Unavailable as exc:
        assert "unavailable" in str(exc).lower() or str(exc)
    ids, result = _generate(app["client"], _prompt(100, 7), 3)
    assert len(ids) == 3 and result.finish_reason == "length"
    after = _handle().stats.remote().result()
    assert after.incarnation != before_id
