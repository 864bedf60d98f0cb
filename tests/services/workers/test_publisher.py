"""The worker's Redis publisher survives a real Redis pause, kill and restart: it never dies,
and once a fresh empty Redis answers it re-registers the worker and re-publishes every chunk it
holds, so the router's prefix index comes back without restarting the worker."""

from __future__ import annotations

import time

import pytest
import redis

from flashpd.engine.events import AllCleared, BlockStored
from flashpd.services.api import WorkerRef, WorkerStats
from flashpd.services.redis_local import LocalRedis
from flashpd.services.router.index import IndexKeys
from flashpd.services.worker.deployment import RedisPublisher

MODEL = "flashpd-tiny"
RECOVERY_S = 10.0  # the bound for prefix hits to come back after a Redis restart


class FakeWorker:
    """The seam the publisher reads: stats, incremental cache events, a full cache snapshot."""

    def __init__(self):
        self.ref = WorkerRef("decode", "d-1", "inc-1")
        self.cached: list[str] = []
        self.pending: list = []

    def store(self, *hashes: str) -> None:
        self.cached += hashes
        self.pending.append(BlockStored(hashes))

    def stats(self) -> WorkerStats:
        return WorkerStats(self.ref.worker_id, self.ref.incarnation, "decode", kv_blocks_total=16)

    def drain(self):
        events, self.pending = self.pending, []
        return events

    def snapshot(self):
        self.pending = []
        return [AllCleared(), BlockStored(tuple(self.cached))]


def _eventually(condition, timeout_s: float = RECOVERY_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return True
        except redis.RedisError:
            pass
        time.sleep(0.05)
    return False


@pytest.fixture
def server():
    with LocalRedis() as s:
        yield s


def test_publisher_reregisters_and_republishes_after_redis_restart_and_pause(server):
    worker = FakeWorker()
    worker.store("h0", "h1")
    keys = IndexKeys(MODEL)
    client = redis.Redis.from_url(server.url, socket_timeout=1.0)

    def indexed(h: str) -> bool:
        return worker.ref.key.encode() in client.smembers(keys.chunk(h))

    def registered() -> bool:
        return client.exists(keys.heartbeat(worker.ref.key)) == 1

    pub = RedisPublisher(
        server.url,
        MODEL,
        worker.ref,
        worker.stats,
        worker.drain,
        worker.snapshot,
        interval_s=0.05,
        op_timeout_s=0.5,
        max_backoff_s=0.5,
    )
    try:
        assert _eventually(lambda: registered() and indexed("h0") and indexed("h1"))
        worker.store("h2")  # an incremental event
        assert _eventually(lambda: indexed("h2"))

        server.kill()
        failures = pub.failures
        assert _eventually(lambda: pub.failures > failures)
        worker.store("h3")  # stored while Redis is down
        server.restart()  # a fresh, empty Redis on the same port
        assert _eventually(lambda: registered() and all(indexed(h) for h in ("h0", "h1", "h2", "h3")))
        assert pub.health_error() is None

        server.pause()
        failures = pub.failures
        assert _eventually(lambda: pub.failures > failures)
        server.resume()
        worker.store("h4")
        assert _eventually(lambda: pub.registered and indexed("h4") and registered())
        assert pub.health_error() is None
    finally:
        pub.stop(worker.ref)
        client.close()
    assert pub.republished >= 3  # first registration, after the restart, after the pause


def test_publisher_notices_a_fresh_redis_without_seeing_an_error(server):
    """Redis replaced between two heartbeats (no failed call): the heartbeat finds the worker
    missing from the registry and re-publishes everything."""
    worker = FakeWorker()
    worker.store("a", "b")
    keys = IndexKeys(MODEL)
    client = redis.Redis.from_url(server.url, socket_timeout=1.0)
    pub = RedisPublisher(
        server.url, MODEL, worker.ref, worker.stats, worker.drain, worker.snapshot, interval_s=0.05, op_timeout_s=0.5
    )
    try:
        assert _eventually(lambda: client.sismember(keys.chunk("b"), worker.ref.key))
        client.flushall()  # what a restarted, empty Redis looks like to the publisher
        assert _eventually(
            lambda: (
                client.sismember(keys.chunk("a"), worker.ref.key) and client.sismember(keys.chunk("b"), worker.ref.key)
            )
        )
    finally:
        pub.stop(worker.ref)
        client.close()
