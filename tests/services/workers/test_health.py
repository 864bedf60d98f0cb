"""Serve's replica health check tells the truth: it fails when the engine loop died, when a loop
hook (KV transfer progress) keeps failing, or when the Redis publisher stopped, so Serve
replaces the replica; Redis itself being away does not fail it."""

from __future__ import annotations

import asyncio
import time

import pytest

from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.services.decode.deployment import DecodeServer
from flashpd.services.decode.server import DecodeWorker
from flashpd.services.worker.common import WorkerConfig, new_worker_ref
from flashpd.services.worker.deployment import RedisPublisher

MODEL_ID = "flashpd-tiny"


def _deployment(model) -> DecodeServer:
    """A DecodeServer around an in-process worker (the Serve replica constructor loads a
    checkpoint and registers in Redis; both are seams this test does not need)."""
    ec = EngineConfig(role="decode", num_blocks=16, num_slots=4, model_id=MODEL_ID)
    wc = WorkerConfig("unused", MODEL_ID, ec, transfer_backend="local")
    server = object.__new__(DecodeServer)
    server.ref = new_worker_ref("decode")
    server.worker = DecodeWorker(LLMEngine(model, ec), wc, server.ref)
    server._publisher = None
    return server


def _until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return False


def _unhealthy(server) -> bool:
    try:
        server.check_health()
    except RuntimeError:
        return True
    return False


def test_health_fails_when_transfer_progress_keeps_failing_and_recovers(model_f32):
    server = _deployment(model_f32)
    try:
        server.check_health()
        real = server.worker.receiver.poll_completed
        server.worker.receiver.poll_completed = lambda: (_ for _ in ()).throw(RuntimeError("transport wedged"))
        assert _until(lambda: _unhealthy(server))
        with pytest.raises(RuntimeError, match="transport wedged"):
            server.check_health()
        server.worker.receiver.poll_completed = real
        assert _until(lambda: not _unhealthy(server))
    finally:
        asyncio.run(server.worker.close())


def test_health_fails_when_the_engine_loop_is_gone(model_f32):
    server = _deployment(model_f32)
    asyncio.run(server.worker.close())
    with pytest.raises(RuntimeError, match="engine loop"):
        server.check_health()


def test_health_fails_when_the_publisher_stopped_but_not_when_redis_is_away(model_f32):
    from flashpd.services.api import WorkerStats

    server = _deployment(model_f32)
    ref = server.ref
    stats = lambda: WorkerStats(ref.worker_id, ref.incarnation, "decode")  # noqa: E731
    # nothing listens on port 1: every round fails and is retried; the replica stays healthy
    server._publisher = RedisPublisher(
        "redis://127.0.0.1:1/0",
        MODEL_ID,
        ref,
        stats,
        lambda: [],
        lambda: [],
        0.01,
        op_timeout_s=0.2,
        max_backoff_s=0.05,
    )
    try:
        assert _until(lambda: server._publisher.failures >= 3)
        server.check_health()
        server._publisher.stop(ref)
        with pytest.raises(RuntimeError, match="publisher"):
            server.check_health()
    finally:
        asyncio.run(server.worker.close())
