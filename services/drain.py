"""`flashpd drain`: tell a decode replica it is about to stop ("starting to stop").

    flashpd drain --redis redis://127.0.0.1:6379 --model flashpd-small decode-worker-id --wait-s 60

Serve has no hook between deciding to stop a replica and stopping it, so the signal goes
through Redis: the replica's worker key is added to the model's draining set. From that moment
every router's placement skips the worker (the set is read per placement), and within one
heartbeat (0.5 s) the replica sees the mark and drains: each running stream moves to another
decode replica (live migration, no prefill, no client-visible error), streams with nowhere to
go finish in place. `--wait-s` waits until the replica holds no sequence; then it can be
stopped (scaled down, redeployed) without touching a stream. The joint autoscaling policy uses
the same mark before a decode scale-down (`services/autoscaling_serve.py`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from flashpd.services.api import WorkerRef, WorkerStats


def register(sub) -> None:
    p = sub.add_parser("drain", help="drain a decode replica (its streams move elsewhere)")
    p.add_argument("worker_id", help="the decode worker id (its Serve replica id)")
    p.add_argument("--redis", required=True, help="the stack's Redis URL")
    p.add_argument("--model", required=True, help="the served model id (Redis key prefix)")
    p.add_argument(
        "--wait-s", type=float, default=0.0, help="wait this long for the replica to hold no sequence (0: do not wait)"
    )
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        worker = asyncio.run(mark_draining(args.redis, args.model, args.worker_id))
    except LookupError as exc:
        print(f"flashpd drain: {exc}", file=sys.stderr)
        return 2
    print(f"marked {worker.key} draining")
    if args.wait_s <= 0:
        return 0
    idle_s = asyncio.run(wait_drained(args.redis, args.model, worker, args.wait_s))
    if idle_s is None:
        print(f"still holding sequences after {args.wait_s} s", file=sys.stderr)
        return 1
    print(f"drained in {idle_s:.2f} s")
    return 0


async def mark_draining(redis_url: str, model: str, worker_id: str) -> WorkerRef:
    """Add the live decode worker `worker_id` to the draining set; its ref."""
    from flashpd.services.router.index import PrefixIndex, router_redis

    redis = router_redis(redis_url)
    try:
        index = PrefixIndex(redis, model)
        view = await index.live_view()
        refs = [w.ref for w in view.workers if w.role == "decode" and w.worker_id == worker_id]
        if not refs:
            raise LookupError(f"no live decode worker {worker_id!r} for model {model!r}")
        await index.mark_draining(refs[0])
        return refs[0]
    finally:
        await redis.aclose()


async def wait_drained(
    redis_url: str, model: str, worker: WorkerRef, timeout_s: float, poll_s: float = 0.1
) -> float | None:
    """Seconds until `worker`'s heartbeat shows no sequence and no block in use (or it is
    gone); None when that did not happen within `timeout_s`."""
    from flashpd.services.router.index import PrefixIndex, router_redis

    redis = router_redis(redis_url)
    started = time.monotonic()
    try:
        index = PrefixIndex(redis, model)
        while time.monotonic() - started <= timeout_s:
            stats = {w.ref: w for w in (await index.live_view()).workers}.get(worker)
            if stats is None or _drained(stats):
                return time.monotonic() - started
            await asyncio.sleep(poll_s)
        return None
    finally:
        await redis.aclose()


def _drained(stats: WorkerStats) -> bool:
    return stats.draining and stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0


# ------------------------------------------------------------------ before a decode scale-down


def drain_before_scale_down(
    want: int,
    target: int,
    replicas: Sequence[str],
    loads: Mapping[str, object],
    state: dict,
    now: float,
    *,
    mark: Callable[[str], bool],
    unmark: Callable[[str], bool],
    timeout_s: float,
) -> tuple[int, dict, str | None]:
    """The joint policy's "starting to stop" for decode: (decode target, new state, note).

    When the policy wants fewer decode replicas than Serve's target, it first marks the replica
    Serve will stop draining (`mark`) and holds the target until that replica reports drained
    (`draining`, no running or waiting sequence; its streams moved away) or `timeout_s`
    passed; then it lowers the target by one. Serve picks the replica to stop: on one node the
    newest (`_get_replicas_to_stop` order), so the victim is the replica first seen last
    (`state["seen"]`). If the victim is still running `timeout_s` after the target went down
    (Serve stopped another one, e.g. on a node with fewer replicas), its mark is removed and
    it serves again (`unmark`). `loads`: replica id -> WorkerLoad (`running`, `waiting`,
    `draining`). Pure: the clock and Redis are the caller's."""
    seen = {r: state.get("seen", {}).get(r, now) for r in replicas}
    out = {"seen": seen}
    lowered = _still_lowered(state.get("lowered"), replicas, now, unmark=unmark, timeout_s=timeout_s)
    if lowered:
        out["lowered"] = lowered
    if want >= target or len(replicas) < 2:
        return want, out, None
    victim = state.get("victim")
    if victim not in replicas:
        return _mark_victim(max(replicas, key=lambda r: (seen[r], r)), target, out, now, mark)
    out.update(victim=victim, since=state["since"])
    if _load_drained(loads.get(victim)) or now - state["since"] >= timeout_s:
        out.pop("victim"), out.pop("since")
        out["lowered"] = {"victim": victim, "at": now}
        return target - 1, out, f"{victim} drained: decode {target} -> {target - 1}"
    return target, out, f"decode scale-down waits for {victim} to drain"


def _still_lowered(
    lowered: dict | None, replicas: Sequence[str], now: float, *, unmark: Callable[[str], bool], timeout_s: float
) -> dict | None:
    """The last lowering, unless its victim still runs `timeout_s` after it (Serve stopped
    another replica): then the victim is unmarked and serves again."""
    if lowered and lowered["victim"] in replicas and now - lowered["at"] >= timeout_s:
        unmark(lowered["victim"])
        return None
    return lowered


def _mark_victim(
    victim: str, target: int, out: dict, now: float, mark: Callable[[str], bool]
) -> tuple[int, dict, str | None]:
    """Mark the replica Serve will stop draining; the target holds meanwhile."""
    if not mark(victim):
        return target, out, f"decode scale-down held: marking {victim} draining failed"
    out.update(victim=victim, since=now)
    return target, out, f"decode scale-down waits for {victim} to drain"


def _load_drained(load) -> bool:
    """Draining with no running or waiting sequence (its streams moved away)."""
    return load is not None and load.draining and load.running == 0 and load.waiting == 0


def redis_marker(redis_url: str, model: str, timeout_s: float = 1.0):
    """(mark, unmark) by worker id for `drain_before_scale_down`, on a blocking Redis client
    (the policy runs inside Serve's controller); each returns False when Redis fails."""
    import redis as redis_sync

    from flashpd.services.router.index import IndexKeys

    keys = IndexKeys(model)

    def wkeys(client, worker_id: str) -> list[str]:
        names = [k.decode() if isinstance(k, bytes) else k for k in client.smembers(keys.workers)]
        return [k for k in names if WorkerRef.from_key(k).worker_id == worker_id]

    def apply(worker_id: str, add: bool) -> bool:
        client = redis_sync.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            found = wkeys(client, worker_id)
            for k in found:
                (client.sadd if add else client.srem)(keys.draining, k)
            return bool(found)
        except redis_sync.RedisError:
            return False
        finally:
            client.close()

    return (lambda w: apply(w, True)), (lambda w: apply(w, False))
