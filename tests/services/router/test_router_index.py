"""The Redis index against a real redis-server: publish, lookup, sessions, deregister, liveness."""

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from flashpd.engine.events import AllCleared, BlockRemoved, BlockStored
from flashpd.services.api import WorkerRef, WorkerStats
from flashpd.services.router.index import IndexKeys, IndexPublisher, PrefixIndex, live_worker_stats

pytestmark = pytest.mark.net
MODEL = "tiny"
H = [f"{i:032x}" for i in range(10)]  # stand-ins for chained chunk hashes, in prompt order


def stats(role, wid, inc="i0", **kw):
    return WorkerStats(wid, inc, role, **kw)


def run(redis_url, scenario):
    async def main():
        client = aioredis.Redis.from_url(redis_url)
        try:
            await scenario(client, IndexPublisher(client, MODEL), PrefixIndex(client, MODEL))
        finally:
            await client.aclose()

    asyncio.run(main())


def test_lookup_counts_leading_chunks_per_worker(redis_url):
    async def scenario(r, pub, index):
        p0, d0, d1 = stats("prefill", "p0"), stats("decode", "d0"), stats("decode", "d1")
        for s in (p0, d0, d1):
            await pub.register(s)
        await pub.publish(p0.ref, [BlockStored(tuple(H[:5]))])
        await pub.publish(d0.ref, [BlockStored(tuple(H[:2]))])
        await pub.publish(d1.ref, [BlockStored((H[1], H[2]))])  # no chunk 0: no usable prefix
        view = await index.live_view()
        found = await index.lookup(H[:6], [w.ref for w in view.workers])
        assert found.hit_chunks == {p0.ref: 5, d0.ref: 2}

    run(redis_url, scenario)


def test_lookup_is_one_round_trip_and_stops_at_the_first_miss(redis_url):
    async def scenario(r, pub, index):
        d0, d1 = stats("decode", "d0"), stats("decode", "d1")
        for s in (d0, d1):
            await pub.register(s)
        many = [f"{i:032x}" for i in range(1000)]
        await pub.publish(d0.ref, [BlockStored(tuple(many[:3]))])
        await pub.publish(d1.ref, [BlockStored(tuple(many[:5]))])
        await index.lookup(many[:1], [d0.ref])  # first use loads the script (NOSCRIPT, load, retry)
        commands = await _monitored(r, index.lookup(many, [d0.ref, d1.ref], "s"))
        assert commands.count("SMISMEMBER") == 6  # chunks 0-5; chunk 5 is the first miss for both
        client_side = [c for c in commands if c != "SMISMEMBER"]
        # one round trip (bindings, prefix walk, draining marks), then our PING
        assert client_side == ["HGETALL", "EVALSHA", "SMEMBERS", "PING"]
        found = await index.lookup(many, [d0.ref, d1.ref])
        assert found.hit_chunks == {d0.ref: 3, d1.ref: 5}

    run(redis_url, scenario)


async def _monitored(r, awaitable) -> list[str]:
    """Command names Redis executed while `awaitable` ran (scripts' inner calls included)."""
    conn = redis.Redis.from_url(_url(r))
    commands = []
    with conn.monitor() as monitor:
        await awaitable
        await r.ping()
        for event in monitor.listen():
            commands.append(event["command"].split()[0].upper())
            if commands[-1] == "PING":
                break
    conn.close()
    return commands


def test_removed_chunks_and_all_cleared(redis_url):
    async def scenario(r, pub, index):
        d0 = stats("decode", "d0")
        await pub.register(d0)
        await pub.publish(d0.ref, [BlockStored(tuple(H[:4])), BlockRemoved((H[2],))])
        assert (await index.lookup(H[:4], [d0.ref])).hit_chunks == {d0.ref: 2}
        await pub.publish(d0.ref, [AllCleared(), BlockStored((H[0],))])
        assert (await index.lookup(H[:4], [d0.ref])).hit_chunks == {d0.ref: 1}
        keys = IndexKeys(MODEL)
        assert await r.smembers(keys.worker_chunks(d0.ref.key)) == {H[0].encode()}

    run(redis_url, scenario)


def test_chunk_keys_carry_ttls(redis_url):
    async def scenario(r, pub, index):
        d0 = stats("decode", "d0")
        pub = IndexPublisher(r, MODEL, chunk_ttl_s=120)
        await pub.register(d0)
        await pub.publish(d0.ref, [BlockStored((H[0],))])
        keys = IndexKeys(MODEL)
        assert 0 < await r.ttl(keys.chunk(H[0])) <= 120
        assert 0 < await r.ttl(keys.worker_chunks(d0.ref.key)) <= 120
        assert 0 < await r.pttl(keys.heartbeat(d0.ref.key)) <= 5000

    run(redis_url, scenario)


def test_deregister_removes_chunks_and_bindings_without_scanning(redis_url):
    async def scenario(r, pub, index):
        p0, d0, d1 = stats("prefill", "p0"), stats("decode", "d0"), stats("decode", "d1")
        for s in (p0, d0, d1):
            await pub.register(s)
        await pub.publish(d0.ref, [BlockStored(tuple(H[:3]))])
        await pub.publish(d1.ref, [BlockStored(tuple(H[:3]))])
        await index.bind_session("s-a", p0.ref, d0.ref, None)
        await index.bind_session("s-b", p0.ref, d1.ref, None)
        commands = await _monitored(r, pub.deregister(d0.ref))
        assert not {"SCAN", "KEYS"} & set(commands)
        assert (await index.lookup(H[:3], [d0.ref, d1.ref])).hit_chunks == {d1.ref: 3}
        found = await index.lookup([], [], "s-a")
        assert found.session is None
        assert (await index.lookup([], [], "s-b")).session.decode == d1.ref
        assert d0.ref not in {w.ref for w in (await index.live_view()).workers}

    run(redis_url, scenario)


def _url(r) -> str:
    kw = r.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"


def test_new_incarnation_replaces_the_old_one(redis_url):
    async def scenario(r, pub, index):
        old, new = stats("decode", "d0", "inc-old"), stats("decode", "d0", "inc-new")
        await pub.register(old)
        await pub.publish(old.ref, [BlockStored(tuple(H[:3]))])
        await pub.register(new)
        view = await index.live_view()
        assert [w.ref for w in view.workers] == [new.ref]
        assert (await index.lookup(H[:3], [old.ref, new.ref])).hit_chunks == {}

    run(redis_url, scenario)


def test_expired_heartbeat_marks_a_worker_dead_and_reap_cleans_it(redis_url):
    async def scenario(r, pub, index):
        short = IndexPublisher(r, MODEL, heartbeat_ttl_s=0.05)
        d0, d1 = stats("decode", "d0"), stats("decode", "d1")
        await short.register(d0)
        await pub.register(d1)
        await short.publish(d0.ref, [BlockStored((H[0],))])
        await asyncio.sleep(0.1)
        view = await index.live_view()
        assert [w.ref for w in view.workers] == [d1.ref] and view.dead == (d0.ref,)
        await index.reap(view.dead)
        assert (await index.live_view()).dead == ()
        assert await r.smembers(IndexKeys(MODEL).chunk(H[0])) == set()
        assert await short.heartbeat(d0) is True  # came back: re-registered, cache forgotten

    run(redis_url, scenario)


def test_session_binding_moves_and_old_reverse_entry_is_dropped(redis_url):
    async def scenario(r, pub, index):
        p0, d0, d1 = stats("prefill", "p0"), stats("decode", "d0"), stats("decode", "d1")
        index_short = PrefixIndex(r, MODEL, session_ttl_s=30)
        await index_short.bind_session("s", p0.ref, d0.ref, None)
        first = (await index_short.lookup([], [], "s")).session
        assert (first.prefill, first.decode) == (p0.ref, d0.ref)
        await index_short.bind_session("s", p0.ref, d1.ref, first)
        keys = IndexKeys(MODEL)
        assert await r.smembers(keys.worker_sessions(d0.ref.key)) == set()
        assert await r.smembers(keys.worker_sessions(d1.ref.key)) == {b"s"}
        assert 0 < await r.ttl(keys.session("s")) <= 30
        await pub.deregister(d0.ref)  # the old decode worker leaving must not drop the session
        assert (await index_short.lookup([], [], "s")).session.decode == d1.ref

    run(redis_url, scenario)


def test_lookup_returns_parent_binding(redis_url):
    async def scenario(r, pub, index):
        p0, d0 = stats("prefill", "p0"), stats("decode", "d0")
        await index.bind_session("parent", p0.ref, d0.ref, None)
        found = await index.lookup(H[:2], [], "child", "parent")
        assert found.session is None and found.parent_session.decode == d0.ref

    run(redis_url, scenario)


def test_keys_are_scoped_by_model_and_reject_braces():
    assert IndexKeys("flash").chunk("ab") == "fpd:{flash}:chunk:ab"
    with pytest.raises(ValueError):
        IndexKeys("a}b")
    assert WorkerRef.from_key("decode|d0|i0").worker_id == "d0"


def test_cancelling_a_caller_mid_redis_call_is_never_swallowed(redis_url):
    """redis-py can swallow a cancellation that lands mid-command; the index must not."""

    async def scenario(r, pub, index):
        d0 = stats("decode", "d0")
        await pub.register(d0)
        await pub.publish(d0.ref, [BlockStored(tuple(H))])

        async def busy():
            while True:
                await index.live_view()
                await index.lookup(H, [d0.ref], "s")

        for i in range(100):
            task = asyncio.create_task(busy())
            await asyncio.sleep((i % 10) * 0.0002)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=1.0)
            assert done, f"cancellation swallowed on try {i}"

    run(redis_url, scenario)


def test_lookup_recovers_when_redis_forgot_the_script(redis_url):
    async def scenario(r, pub, index):
        d0 = stats("decode", "d0")
        await pub.register(d0)
        await pub.publish(d0.ref, [BlockStored(tuple(H[:2]))])
        assert (await index.lookup(H, [d0.ref])).hit_chunks == {d0.ref: 2}
        await r.script_flush()
        assert (await index.lookup(H, [d0.ref])).hit_chunks == {d0.ref: 2}

    run(redis_url, scenario)


def test_live_worker_stats_reads_the_heartbeats_and_is_empty_without_redis(redis_url):
    async def scenario(r, pub, index):
        for w in (stats("prefill", "p0", running=2), stats("decode", "d0", kv_blocks_used=5)):
            await pub.register(w)
        got = await asyncio.to_thread(live_worker_stats, redis_url, MODEL)
        assert sorted((w.role, w.running, w.kv_blocks_used) for w in got) == [("decode", 0, 5), ("prefill", 2, 0)]
        assert await asyncio.to_thread(live_worker_stats, redis_url, "other-model") == []

    run(redis_url, scenario)
    dead = f"redis://127.0.0.1:{_closed_port()}/0"
    assert live_worker_stats(dead, MODEL, timeout_s=0.2) == []


def _closed_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
