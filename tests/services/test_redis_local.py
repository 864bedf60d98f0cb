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


def test_free_ports_avoid_ray_worker_and_ephemeral_ports_and_never_repeat():
    """Picked outside Ray's worker ports and the kernel's ephemeral range (no process takes them
    between the pick and the server's bind), distinct within a process, free when handed out;
    a port already bound is never handed out."""
    from flashpd.services import redis_local

    held = []
    try:
        for _ in range(8):  # bind some ports of the range: none of them may come back
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", redis_local.free_port()))
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        ports = [redis_local.free_port() for _ in range(64)]
        assert len(set(ports)) == 64 and not set(ports) & taken
        assert all(redis_local.PORT_RANGE[0] <= p < redis_local.PORT_RANGE[1] for p in ports)
    finally:
        for s in held:
            s.close()
