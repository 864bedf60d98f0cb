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
    dead = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    try:
        dead.ping()
        raise AssertionError("redis still answers after stop()")
    except redis.ConnectionError:
        pass
    finally:
        dead.close()
