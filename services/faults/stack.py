"""A flashpd stack to break: local Redis, Ray (127.0.0.1), the Serve application, and handles to
kill its replicas, pause or kill its Redis and read its workers' stats.

Replicas are killed with `ray.kill` on the Serve replica actor (`SERVE_REPLICA::<app>#<deployment>
#<replica id>` in namespace "serve"; the replica id is the flashpd worker id), which ends the
process at once, as SIGKILL does; Serve starts a replacement. Worker stats come from the workers'
Redis heartbeats (what the router sees), read with a short timeout.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

from flashpd.services.api import WorkerStats
from flashpd.services.redis_local import LOOPBACK, LocalRedis, free_port

DEPLOYMENTS = {"prefill": "PrefillServer", "decode": "DecodeServer", "colocated": "ColocatedServer"}
MODEL_ID = "flashpd-tiny"


@dataclass(frozen=True)
class StackConfig:
    prefill_replicas: int = 2
    decode_replicas: int = 2
    num_blocks: int = 512
    max_model_len: int = 4096
    app_name: str = "faults"
    extra_args: dict = field(default_factory=dict)  # more build_app args (e.g. role limits)
    mode: str = "disaggregated"  # or "colocated": `colocated_replicas` workers, no prefill/decode
    colocated_replicas: int = 2

    def worker_counts(self) -> dict[str, int]:
        """The live workers per role a ready stack has."""
        if self.mode == "colocated":
            return {"colocated": self.colocated_replicas}
        return {"prefill": self.prefill_replicas, "decode": self.decode_replicas}


def start_ray() -> int:
    """Ray on 127.0.0.1 and Serve's HTTP proxy on a free loopback port (with the router's
    header guard, as `flashpd serve` sets it up); returns that port."""
    import ray
    from ray import serve

    from flashpd.services.router import http_guard

    os.environ.setdefault(http_guard.CALLBACK_ENV, http_guard.CALLBACK_PATH)  # as flashpd serve
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local",
        _node_ip_address=LOOPBACK,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    http_port = free_port()
    serve.start(http_options={"host": LOOPBACK, "port": http_port})
    return http_port


def stop_ray() -> None:
    import ray
    from ray import serve

    with contextlib.suppress(Exception):
        serve.shutdown()
    with contextlib.suppress(Exception):
        ray.shutdown()


class FaultStack:
    """One deployed flashpd application (call `deploy()`; `undeploy()` removes it)."""

    def __init__(
        self, checkpoint: str, redis_server: LocalRedis, http_port: int, config: StackConfig = StackConfig()
    ) -> None:
        self.checkpoint, self.redis_server, self.config = checkpoint, redis_server, config
        self.http_url = f"http://{LOOPBACK}:{http_port}"
        self.grpc_port = free_port()
        self.grpc_target = f"{LOOPBACK}:{self.grpc_port}"
        self.killed: list[str] = []  # worker ids killed so far

    def app_args(self) -> dict:
        c = self.config
        role = {"num_blocks": c.num_blocks}
        args = {
            "checkpoint": self.checkpoint,
            "model_id": MODEL_ID,
            "redis_url": self.redis_server.url,
            "grpc_port": self.grpc_port,
            "max_model_len": c.max_model_len,
            "mode": c.mode,
            **{r: dict(role, replicas=n) for r, n in c.worker_counts().items()},
        }
        for key, value in c.extra_args.items():
            if isinstance(value, dict) and isinstance(args.get(key), dict):
                args[key] = {**args[key], **value}
            else:
                args[key] = value
        return args

    def deploy(self, timeout_s: float = 300.0) -> FaultStack:
        from ray import serve

        from flashpd.services.app import build_app

        serve.run(build_app(self.app_args()), name=self.config.app_name, route_prefix="/")
        self.wait_ready(timeout_s)
        return self

    def undeploy(self) -> None:
        from ray import serve

        with contextlib.suppress(Exception):
            serve.delete(self.config.app_name)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until gRPC health is SERVING and every replica heartbeats in Redis."""
        from flashpd_sdk import Client

        want = self.config.worker_counts()
        deadline = time.monotonic() + timeout_s
        with Client(self.grpc_target) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    if client.health(timeout_s=2.0) == "SERVING" and self._counts() == want:
                        return
                time.sleep(0.5)
        raise TimeoutError(f"stack not ready within {timeout_s} s (workers {self._counts()})")

    def _counts(self) -> dict[str, int]:
        counts = dict.fromkeys(self.config.worker_counts(), 0)
        for w in self.worker_stats():
            counts[w.role] = counts.get(w.role, 0) + 1
        return counts

    # ------------------------------------------------------------------------------- stats

    def worker_stats(self, timeout_s: float = 1.0) -> list[WorkerStats]:
        """Live workers' heartbeats (empty when Redis does not answer)."""
        from flashpd.services.router.index import live_worker_stats

        return live_worker_stats(self.redis_server.url, MODEL_ID, timeout_s)

    def blocks_held(self) -> int:
        """KV blocks in use by requests (not free, not merely cached) over all live workers."""
        return sum(w.kv_blocks_used for w in self.worker_stats())

    def wait_idle(self, timeout_s: float, *, poll_s: float = 0.25) -> float | None:
        """Seconds until no worker holds a block or runs a request (None: not within timeout);
        heartbeats lag by up to a heartbeat interval."""
        started = time.monotonic()
        while time.monotonic() - started <= timeout_s:
            stats = self.worker_stats()
            if stats and all(w.kv_blocks_used == 0 and w.running == 0 and w.waiting == 0 for w in stats):
                return time.monotonic() - started
            time.sleep(poll_s)
        return None

    # ------------------------------------------------------------------------------ faults

    def replica_actors(self, role: str) -> dict[str, str]:
        """worker id -> Serve replica actor name, for the live replicas of `role`."""
        import ray

        prefix = f"SERVE_REPLICA::{self.config.app_name}#{DEPLOYMENTS[role]}#"
        return {
            a["name"][len(prefix) :]: a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)
        }

    async def drain_replica(self, worker_id: str) -> None:
        """Mark a decode replica draining (what `flashpd drain` and the autoscaler do): routers
        stop placing on it at once, and it moves its streams away within a heartbeat."""
        from flashpd.services.drain import mark_draining

        await mark_draining(self.redis_server.url, MODEL_ID, worker_id)

    def kill_replica(self, role: str, worker_id: str) -> str:
        """Kill one replica's process at once (Serve replaces it)."""
        import ray

        name = self.replica_actors(role)[worker_id]
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        self.killed.append(worker_id)
        return worker_id
