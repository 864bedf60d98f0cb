import socket

import redis

from flashpd.services.redis_local import LocalRedis


def test_local_redis_serves_on_loopback_and_stops():
    server = LocalRedis().start()
    url, port = server.url, server.port
    assert url.startswith("redis://127.0.0.1:")
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    assert client.ping()
    client.close()
    server.stop()
    assert server.port is None
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens there any more
