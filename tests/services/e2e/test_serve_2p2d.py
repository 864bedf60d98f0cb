"""2 prefill + 2 decode replicas with bounded replay on: sessions stick to their decode worker,
and a session's later turns get decode-side prefix credit."""

from __future__ import annotations

import time

import pytest
import torch

from .conftest import deploy

pytestmark = pytest.mark.net
APP = "pd2"


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_two_by_two_sessions_stay_bound(ray_serve, ckpt_dir, redis_server):
    from ray import serve

    from flashpd_sdk import Client

    args = deploy(APP, ckpt_dir, redis_server.url, prefill={"replicas": 2}, decode={"replicas": 2})
    client = Client(f"127.0.0.1:{args['grpc_port']}")
    try:
        deadline = time.monotonic() + 60
        while client.health() != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.3)
        seen_decode: dict[str, set[str]] = {}
        for s in range(4):
            context = _prompt(140, 100 + s)
            for turn in range(2):
                stream = client.generate(
                    prompt_ids=context, max_tokens=4, ignore_eos=True, session_id=f"s{s}", timeout_s=120
                )
                ids = [t for c in stream for t in c.token_ids]
                r = stream.result
                seen_decode.setdefault(f"s{s}", set()).add(r.decode_worker)
                if turn == 1:
                    assert r.usage.cached_tokens_decode >= 128
                context = context + ids + _prompt(130, 200 + s)
        assert all(len(w) == 1 for w in seen_decode.values()), seen_decode
        assert len(set().union(*seen_decode.values())) == 2  # both decode workers used
    finally:
        client.close()
        serve.delete(APP)
