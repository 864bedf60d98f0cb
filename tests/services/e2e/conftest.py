"""One local Ray instance per test session (bound to 127.0.0.1) and helpers to deploy flashpd.

These tests start real Ray, Redis, NIXL and gRPC; run them inside a loopback-only namespace
(scripts/test.sh does)."""

from __future__ import annotations

import os

import pytest

from flashpd.services.redis_local import LocalRedis, free_port
from flashpd.services.router import http_guard


@pytest.fixture(scope="session")
def redis_server():
    """The e2e stacks' own redis-server: their replicas outlive each test and keep heartbeating,
    so they must not share a server with the in-process tests (which would see their workers)."""
    with LocalRedis() as server:
        yield server


@pytest.fixture(scope="session")
def ray_serve():
    import ray
    from ray import serve

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault(http_guard.CALLBACK_ENV, http_guard.CALLBACK_PATH)  # as flashpd serve
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    http_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    yield http_port
    serve.shutdown()
    ray.shutdown()


def deploy(name: str, ckpt_dir: str, redis_url: str, **overrides) -> dict:
    """Deploy one flashpd application; returns its args (with the gRPC port)."""
    from ray import serve

    from flashpd.services.app import build_app

    args = {
        "checkpoint": ckpt_dir,
        "model_id": "flashpd-tiny",
        "redis_url": redis_url,
        "grpc_port": free_port(),
        "max_model_len": 2048,
        "prefill": {"num_blocks": 64, "num_slots": 16},
        "decode": {"num_blocks": 64, "num_slots": 16},
    }
    if overrides.get("mode") == "colocated":  # one worker role: no prefill/decode sections
        del args["prefill"], args["decode"]
        args["colocated"] = {"num_blocks": 64, "num_slots": 16}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(args.get(key), dict):
            args[key] = {**args[key], **value}
        else:
            args[key] = value
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    return args
