"""A real redis-server on a free 127.0.0.1 port, shared by the services tests (emptied per test)."""

from __future__ import annotations

import pytest
import redis

from flashpd.services.redis_local import LocalRedis


@pytest.fixture(scope="session")
def redis_server():
    with LocalRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: LocalRedis) -> str:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
