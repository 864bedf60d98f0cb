"""The whole product on one GPU machine, from a Serve config in infra/ (scripts/gpu_stack.sh).

    python -m flashpd.services.gpu_stack [--config infra/serve.h200.yaml] [--http-port 8000]

starts a redis-server on loopback, Ray on 127.0.0.1 with the machine's GPUs, and the config's
application (router + prefill + decode; on one H200 the two workers share the GPU through
fractional `num_gpus`; or router + colocated workers with `mode: colocated`). It returns "ready"
only once every worker loaded and warmed its engine (Serve counts a replica as started when its constructor, load + warm-up, returned),
each heartbeats in Redis, gRPC health says SERVING and HTTP /health answers. Then it serves
until SIGINT/SIGTERM, and stops Serve, Ray and Redis.

Checked before anything starts (`check_config`, also run by the CPU tests): Serve's own schema,
flashpd's `AppArgs`, one application, fixed replica counts, and that the replicas' GPU
fractions fit the GPUs given; the args are checked with the config's `runtime_env.env_vars` in
effect (a benchmark flag such as FLASHPD_BENCH_FORCED_ACCEPTANCE is what allows its setting).
Those variables are exported before Ray starts, so every replica inherits them (the transport
policy FLASHPD_KV_TRANSPORTS among them).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass

import yaml

from flashpd.services.app import AppArgs
from flashpd.services.stack_logs import error_excerpts, ray_logs_dir

DEFAULT_CONFIG = "infra/serve.h200.yaml"
LOOPBACK = "127.0.0.1"
DEPLOYMENTS = {"prefill": "PrefillServer", "decode": "DecodeServer", "colocated": "ColocatedServer"}


@dataclass(frozen=True)
class StackConfig:
    args: dict  # the application's `args` (redis_url_env still unresolved)
    env: dict[str, str]  # runtime_env.env_vars
    app_name: str
    http_port: int
    replicas: dict[str, int]  # role -> fixed replica count (the router and the mode's workers)
    gpus: float  # GPUs the replicas ask for together


def check_config(path: str, num_gpus: int = 1) -> StackConfig:
    """Validate a Serve config for this launcher; raises ValueError naming what is wrong."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(raw)
    apps = raw.get("applications") or []
    if len(apps) != 1:
        raise ValueError(f"{path}: need exactly one application, got {len(apps)}")
    app = apps[0]
    env = {str(k): str(v) for k, v in ((app.get("runtime_env") or {}).get("env_vars") or {}).items()}
    with _config_env(env):  # the args are checked as the replicas will see them (BENCH_ENV among them)
        args = AppArgs.model_validate(app["args"])
    if args.redis_url_env is None:
        raise ValueError(f"{path}: args.redis_url_env must name the variable this launcher sets")
    replicas, gpus = _fixed_replicas(path, args)
    if gpus > num_gpus + 1e-9:
        raise ValueError(f"{path}: replicas ask for {gpus:g} GPUs, the machine has {num_gpus}")
    if args.device == "cuda" and gpus <= 0:
        raise ValueError(f"{path}: device cuda but no replica asks for a GPU")
    http_port = int((raw.get("http_options") or {}).get("port", 8000))
    return StackConfig(dict(app["args"]), env, app.get("name", "flashpd"), http_port, replicas, gpus)


@contextlib.contextmanager
def _config_env(env: dict[str, str]):
    """The process environment as `_export_env` will leave it (the caller's variables win), for
    the duration of a check only: nothing is left set afterwards."""
    added = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _fixed_replicas(path: str, args: AppArgs) -> tuple[dict[str, int], float]:
    """role -> replica count, and the GPUs they ask for together; every role of the config's
    mode needs a fixed count."""
    replicas, gpus = {}, 0.0
    for role in ("router", *args.worker_roles()):
        r = args.colocated_args if role == "colocated" else getattr(args, role)
        if r.autoscaling is not None or r.replicas is None:
            raise ValueError(f"{path}: {role} needs a fixed `replicas` count here")
        replicas[role] = r.replicas
        gpus += r.replicas * r.num_gpus
    return replicas, gpus


class GpuStack:
    """A started stack: addresses, worker heartbeats, replica kills (for fault runs)."""

    def __init__(self, config: StackConfig, redis_url: str, http_port: int):
        self.config, self.redis_url = config, redis_url
        self.args = AppArgs.model_validate(config.args)
        self.http_url = f"http://{LOOPBACK}:{http_port}"
        self.grpc_target = f"{LOOPBACK}:{self.args.grpc_port}"
        self.model_id = self.args.model_id

    def errors(self, max_bytes: int = 200_000) -> list[str]:
        """The error excerpts of this session's replicas and workers (`error_excerpts`)."""
        return error_excerpts(ray_logs_dir(), max_bytes=max_bytes)

    def worker_stats(self, timeout_s: float = 1.0) -> list:
        from flashpd.services.router.index import live_worker_stats

        return live_worker_stats(self.redis_url, self.model_id, timeout_s)

    def counts(self) -> dict[str, int]:
        """Live workers per role of the mode (a worker of another role counts under its own)."""
        counts = dict.fromkeys(self.args.worker_roles(), 0)
        for w in self.worker_stats():
            counts[w.role] = counts.get(w.role, 0) + 1
        return counts

    def blocks_held(self) -> int:
        return sum(w.kv_blocks_used for w in self.worker_stats())

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until gRPC health is SERVING, HTTP /health answers and every worker
        heartbeats; raises TimeoutError."""
        from flashpd_sdk import Client

        want = {r: self.config.replicas[r] for r in self.args.worker_roles()}
        t0 = time.monotonic()
        with Client(self.grpc_target) as client:
            while time.monotonic() - t0 < timeout_s:
                with contextlib.suppress(Exception):
                    if (
                        client.health(timeout_s=2.0) == "SERVING"
                        and self.counts() == want
                        and _http_ok(self.http_url + "/health")
                    ):
                        return time.monotonic() - t0
                time.sleep(0.5)
        raise TimeoutError(f"stack not ready within {timeout_s} s (workers {self.counts()})")

    def kv_transports(self) -> dict[str, str]:
        """Decode peer -> the UCX transport the prefill replica's pushes used (read back);
        empty in colocated mode (no KV moves)."""
        from ray import serve

        if self.args.mode == "colocated":
            return {}
        handle = serve.get_deployment_handle(DEPLOYMENTS["prefill"], self.config.app_name)
        return handle.kv_transports.remote().result(timeout_s=30)

    def push_records(self) -> list[dict]:
        """The prefill replica's last KV pushes: hop, post, wire and total ms, bytes (none in
        colocated mode)."""
        from ray import serve

        if self.args.mode == "colocated":
            return []
        handle = serve.get_deployment_handle(DEPLOYMENTS["prefill"], self.config.app_name)
        return handle.push_records.remote().result(timeout_s=30)

    def replica_actors(self, role: str) -> dict[str, str]:
        """worker id -> Serve replica actor name, for the live replicas of `role`."""
        import ray

        prefix = f"SERVE_REPLICA::{self.config.app_name}#{DEPLOYMENTS[role]}#"
        return {
            a["name"][len(prefix) :]: a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)
        }

    def kill_replica(self, role: str, worker_id: str) -> None:
        """End one replica's process at once, as SIGKILL does (Serve starts a replacement)."""
        import ray

        name = self.replica_actors(role)[worker_id]
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2.0) as r:
        return r.status == 200


GPU_RELEASE_WAIT_S = 120.0  # a stack torn down just before may still hold its replicas' memory


def gpu_processes(run=subprocess.run) -> list[tuple[int, int]] | None:
    """(pid, MiB) of every process holding GPU memory (nvidia-smi); None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    procs = []
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 2 and cells[0].isdigit() and cells[1].isdigit():
            procs.append((int(cells[0]), int(cells[1])))
    return procs


def wait_gpu_released(
    log=print, timeout_s: float = GPU_RELEASE_WAIT_S, query=gpu_processes, sleep=time.sleep, clock=time.monotonic
) -> list[tuple[int, int]]:
    """Wait until no process holds GPU memory (the replicas of a stack stopped just before exit
    asynchronously, and two more copies of the weights would not fit beside theirs), at most
    `timeout_s`; -> what is still held (logged: the stack then starts anyway, and its replicas'
    errors will say if memory ran out)."""
    end = clock() + timeout_s
    held = query() or []
    if held:
        log(f"gpu_stack: waiting for {len(held)} process(es) to release GPU memory: {held}")
    while held and clock() < end:
        sleep(1.0)
        held = query() or []
    if held:
        log(f"gpu_stack: WARNING: starting while GPU memory is still held after {timeout_s:.0f} s: {held}")
    return held


@contextlib.contextmanager
def gpu_stack(
    config_path: str = DEFAULT_CONFIG,
    *,
    num_gpus: int | None = None,
    http_port: int | None = None,
    ready_timeout_s: float = 900.0,
    log=print,
):
    """Start Redis, Ray and the application; yield a ready GpuStack; stop everything."""
    import ray
    from ray import serve

    from flashpd.services.redis_local import LocalRedis

    gpus = num_gpus if num_gpus is not None else _visible_gpus()
    config = check_config(config_path, gpus)
    port = http_port or config.http_port
    t0 = time.monotonic()
    if gpus:
        wait_gpu_released(log)
    redis_server = LocalRedis().start()
    try:
        _export_env(config, redis_server.url)
        _start_ray_serve(gpus, port)
        log(
            f"gpu_stack: redis {redis_server.url}, ray with {gpus} GPU(s), deploying "
            f"{config_path} ({config.replicas}, {config.gpus:g} GPU)"
        )
        yield _deploy(config, redis_server.url, port, ready_timeout_s, log=log, started_s=t0)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
        redis_server.stop()


def _deploy(
    config: StackConfig, redis_url: str, port: int, ready_timeout_s: float, *, log, started_s: float
) -> GpuStack:
    """Run the application and wait until it serves (`started_s`: when the launch began)."""
    from ray import serve

    from flashpd.services.app import build_app

    serve.run(build_app(config.args), name=config.app_name, route_prefix="/")
    stack = GpuStack(config, redis_url, port)
    waited = stack.wait_ready(ready_timeout_s)
    log(
        f"gpu_stack: ready in {time.monotonic() - started_s:.1f} s (load + warm-up; health after "
        f"{waited:.1f} s of waiting): HTTP {stack.http_url}/v1, gRPC {stack.grpc_target}"
    )
    return stack


def _export_env(config: StackConfig, redis_url: str) -> None:
    """The environment the replicas inherit: the config's variables (the caller's win), the
    Redis URL, and the HTTP guard's callback."""
    from flashpd.services.router import http_guard

    for key, value in config.env.items():
        os.environ.setdefault(key, value)
    os.environ[config.args["redis_url_env"]] = redis_url
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault(http_guard.CALLBACK_ENV, http_guard.CALLBACK_PATH)


def _start_ray_serve(gpus: int, http_port: int) -> None:
    """A local Ray on loopback with `gpus` GPUs, and Serve's HTTP proxy on `http_port`."""
    import ray
    from ray import serve

    ray.init(
        address="local",
        _node_ip_address=LOOPBACK,
        num_gpus=gpus,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    serve.start(http_options={"host": LOOPBACK, "port": http_port})


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashpd.services.gpu_stack", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--http-port", type=int, default=None)
    p.add_argument("--check", action="store_true", help="validate the config and exit")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to give Ray (default: visible)")
    a = p.parse_args(argv)
    if a.check:
        c = check_config(a.config, a.gpus if a.gpus is not None else 1)
        print(f"{a.config}: ok ({c.replicas}, {c.gpus:g} GPU)")
        return 0
    stop = threading.Event()
    with gpu_stack(a.config, num_gpus=a.gpus, http_port=a.http_port):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
