"""Joint autoscaling on Ray's simulated multi-node cluster, on CPU: a load ramp up and down.

    python -m flashpd.bench.autoscale_cpu --out bench/results/autoscale_cpu

Starts `ray.cluster_utils.AutoscalingCluster` (the fake multi-node provider: each "node" is a
local raylet) with a CPU-0 head and two worker node types, `prefill_node` and `decode_node`, each
carrying a custom resource (`flashpd_prefill` / `flashpd_decode`) that the matching replicas ask
for, so the Ray autoscaler adds and removes nodes per role as Serve's replica targets move. A
password-protected Redis on loopback; the application deployed from a Serve config through
`serve run --non-blocking` with the application-level `JointPolicy`; the AgentX-like closed-loop
driver (bench/driver.py) replays session trees at a ramp of concurrency levels. Every `--sample-s`
it records load, replica counts, nodes, TTFT p90 and failed requests, then writes
`report.md`, `timeline.jsonl`, `records.jsonl` and PNG plots.

`--report-only` re-writes the report from those files. The cluster's start and stop run `ray stop --force`, which ends every Ray process it can see:
so the driver re-executes itself in fresh PID + network namespaces (loopback only), where it can
see only its own processes.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

NS_FLAG = "FLASHPD_AUTOSCALE_PRIVATE_NS"
PASSWORD_ENV = "FLASHPD_REDIS_PASSWORD"
APP = "flashpd"
# The fake provider's config keys (Ray's fake_multi_node/example.yaml, which the Ray 2.60 wheel
# does not ship although AutoscalingCluster reads it).
FAKE_BASE = {
    "cluster_name": "fake_multinode",
    "max_workers": 8,
    "provider": {
        "type": "fake_multinode",
        "use_node_id_as_ip": True,
        "disable_node_updaters": True,
        "disable_launch_config_check": True,
    },
    "head_node_type": "ray.head.default",
    "auth": {},
    "upscaling_speed": 1.0,
    "idle_timeout_minutes": 0.1,
    "docker": {},
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
}
NODE_TYPES = {
    "prefill_node": {
        "resources": {"CPU": 1, "flashpd_prefill": 1},
        "node_config": {},
        "min_workers": 0,
        "max_workers": 3,
    },
    "decode_node": {
        "resources": {"CPU": 1, "flashpd_decode": 1},
        "node_config": {},
        "min_workers": 0,
        "max_workers": 3,
    },
}
POLICY_KWARGS = {
    "prefill_tokens_per_replica": 256,
    "decode_seqs_per_replica": 2,
    "decode_kv_usage": 0.75,
    "router_requests_per_replica": 3,
    "ttft_target_s": 10.0,
    "pd_ratio_min": 0.5,
    "pd_ratio_max": 2.0,
    "upscale_delay_s": 0.0,
    "downscale_delay_s": 20.0,
    "drain_hold_seqs_per_replica": 1.5,
    "drain_hold_kv_usage": 0.6,
}


def serve_config(checkpoint: str, grpc_port: int, http_port: int, redis_port: int) -> dict:
    scaling = {"metrics_interval_s": 1.0, "look_back_period_s": 4.0}
    role = {"num_cpus": 0, "num_blocks": 1024, "num_slots": 32, "max_ongoing_requests": 64}
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [
            {
                "name": APP,
                "route_prefix": "/",
                "import_path": "flashpd.services.app:build_app",
                "runtime_env": {"env_vars": {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}},
                "autoscaling_policy": {
                    "policy_function": "flashpd.services.autoscaling.serve:JointPolicy",
                    "policy_kwargs": POLICY_KWARGS,
                },
                "args": {
                    "checkpoint": checkpoint,
                    "model_id": "flashpd-tiny",
                    "redis_url": f"redis://127.0.0.1:{redis_port}/0",
                    "redis_password_env": PASSWORD_ENV,
                    "grpc_host": "127.0.0.1",
                    "grpc_port": grpc_port,
                    "max_model_len": 2048,
                    "joint_autoscaling": True,
                    "router": {
                        "num_cpus": 0,
                        "graceful_shutdown_timeout_s": 60,
                        "autoscaling": {"min_replicas": 1, "max_replicas": 2, **scaling},
                    },
                    "prefill": {
                        **role,
                        "resources": {"flashpd_prefill": 1},
                        "graceful_shutdown_timeout_s": 60,
                        "autoscaling": {"min_replicas": 1, "max_replicas": 3, **scaling},
                    },
                    "decode": {
                        **role,
                        "resources": {"flashpd_decode": 1},
                        "graceful_shutdown_timeout_s": 120,
                        "autoscaling": {"min_replicas": 1, "max_replicas": 3, **scaling},
                    },
                },
            }
        ],
    }


def _reexec_in_private_namespaces() -> int:
    """Run this module again in new PID + network namespaces (loopback up)."""
    inner = " ".join(["exec", sys.executable, "-m", "flashpd.bench.autoscale_cpu", *map(_quote, sys.argv[1:])])
    env = dict(os.environ, **{NS_FLAG: "1"})
    return subprocess.call(
        ["unshare", "-n", "-p", "-f", "--mount-proc", "sh", "-c", f"ip link set lo up && {inner}"], env=env
    )


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\"'\"'") + "'"


def _make_cluster(idle_timeout_minutes: float):
    from ray.cluster_utils import AutoscalingCluster

    class SimulatedCluster(AutoscalingCluster):
        def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
            config = json.loads(json.dumps(FAKE_BASE))
            config["available_node_types"] = json.loads(json.dumps(worker_node_types))
            config["available_node_types"]["ray.head.default"] = {
                "resources": dict(head_resources),
                "node_config": {},
                "max_workers": 0,
            }
            config.update(config_kwargs)
            return config

    return SimulatedCluster(
        head_resources={"CPU": 0},
        worker_node_types=NODE_TYPES,
        idle_timeout_minutes=idle_timeout_minutes,
        max_workers=6,
    )


class RedisWithPassword:
    def __init__(self, port: int, password: str) -> None:
        self.port, self.password = port, password
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> RedisWithPassword:
        import redis

        self._proc = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--requirepass",
                self.password,
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password)
        for _ in range(100):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.1)
        raise RuntimeError("redis-server did not start")

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)


class CountingBackend:
    """Wraps the SDK backend: requests in flight right now, for the timeline."""

    def __init__(self, inner) -> None:
        self.inner, self.in_flight = inner, 0

    async def generate(self, call, on_tokens):
        self.in_flight += 1
        try:
            return await self.inner.generate(call, on_tokens)
        finally:
            self.in_flight -= 1

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class Sample:
    t_s: float
    level: int  # closed-loop lanes of the current stage
    in_flight: int
    prefill: int  # running replicas
    decode: int
    router: int
    prefill_target: int  # replicas Serve keeps (running + starting)
    decode_target: int
    decode_stopping: int  # decode replicas draining (graceful shutdown)
    prefill_nodes: int
    decode_nodes: int
    ttft_p90_s: float | None  # over requests finished in the last `window` seconds
    finished: int  # cumulative
    failed: int  # cumulative


def _replicas() -> dict[str, tuple[int, int, int]]:
    """Per deployment: (running, wanted = all but stopping, stopping) replicas."""
    from ray import serve

    app = serve.status().applications.get(APP)
    out = {}
    if app is None:
        return out
    for name, dep in app.deployments.items():
        states = {str(getattr(k, "value", k)): v for k, v in dep.replica_states.items()}
        stopping = states.get("STOPPING", 0)
        out[name] = (states.get("RUNNING", 0), sum(states.values()) - stopping, stopping)
    return out


def _nodes() -> dict[str, int]:
    import ray

    counts = {"prefill": 0, "decode": 0}
    for node in ray.nodes():
        if node["Alive"]:
            for role in counts:
                if node["Resources"].get(f"flashpd_{role}", 0) > 0:
                    counts[role] += 1
    return counts


async def _sampler(
    samples: list, state: dict, backend: CountingBackend, t0: float, period_s: float, window_s: float
) -> None:
    while True:
        now = time.monotonic() - t0
        reps = await asyncio.to_thread(_replicas)
        nodes = await asyncio.to_thread(_nodes)
        recent = sorted(
            r.ttft_s for t, r in state["records"] if now - window_s <= t <= now and r.ok and r.ttft_s is not None
        )
        p90 = recent[max(0, -(-9 * len(recent) // 10) - 1)] if recent else None
        failed = sum(1 for _, r in state["records"] if not r.ok)

        def rep(name, i, reps=reps):
            return reps.get(name, (0, 0, 0))[i]

        samples.append(
            Sample(
                now,
                state["level"],
                backend.in_flight,
                rep("PrefillServer", 0),
                rep("DecodeServer", 0),
                rep("Router", 0),
                rep("PrefillServer", 1),
                rep("DecodeServer", 1),
                rep("DecodeServer", 2),
                nodes["prefill"],
                nodes["decode"],
                p90,
                len(state["records"]),
                failed,
            )
        )
        s = samples[-1]
        print(
            f"[{now:6.0f}s] lanes {s.level} in-flight {s.in_flight} P {s.prefill}/"
            f"{s.prefill_target} D {s.decode}/{s.decode_target} (stopping {s.decode_stopping}) nodes P{s.prefill_nodes} "
            f"D{s.decode_nodes} ttft_p90 {p90} done {s.finished} failed {failed}",
            flush=True,
        )
        await asyncio.sleep(period_s)


async def _ramp(ns, workload, samples: list) -> list:
    from flashpd.bench.backend import SdkBackend
    from flashpd.bench.driver import DriverConfig, run_closed_loop

    backend = CountingBackend(SdkBackend.connect(ns.target))
    t0 = time.monotonic()
    state: dict = {"level": 0, "records": []}
    sampler = asyncio.create_task(_sampler(samples, state, backend, t0, ns.sample_s, 30.0))

    def on_record(record) -> None:
        state["records"].append((time.monotonic() - t0, record))

    for epoch, level in enumerate(int(x) for x in ns.levels.split(",")):
        state["level"] = level
        config = DriverConfig.for_time_scale(
            ns.time_scale,
            concurrency=level,
            window_s=ns.stage_s,
            warmup_requests=0,
            request_timeout_s=300.0,
            drain_timeout_s=300.0,
            seed=0,
            salt_epoch=epoch,
            show_progress=False,
            handle_sigint=False,
        )
        await run_closed_loop(
            workload, backend, config, name=f"stage{epoch}-c{level}", target=ns.target, num_gpus=1, on_record=on_record
        )
    state["level"] = 0
    await asyncio.sleep(ns.tail_s)  # idle: replicas and nodes go back down
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    await backend.aclose()
    return state["records"]


def _wait_serving(timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reps = _replicas()
        if len(reps) == 3 and all(running >= 1 for running, _, _ in reps.values()):
            return
        time.sleep(1.0)
    raise TimeoutError(f"deployments not running after {timeout_s} s: {_replicas()}")


def _policy_log(ray_tmp: str) -> list[str]:
    """The JointPolicy's decision lines from the Serve controller's log."""
    lines = []
    for path in sorted(glob.glob(f"{ray_tmp}/ray/session_2*/logs/serve/controller_*.log")):
        with open(path, errors="replace") as f:
            lines += [line.strip() for line in f if "JointPolicy:" in line]
    return lines


def _deploy(config: dict, workdir: Path) -> None:
    path = workdir / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    subprocess.check_call([shutil.which("serve") or "serve", "run", str(path), "--non-blocking", "--address", "auto"])


def main(argv: list[str] | None = None) -> int:
    from flashpd.bench.workload import add_tree_args

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/autoscale_cpu")
    ap.add_argument("--levels", default="1,3,6,3,1", help="closed-loop lanes per stage")
    ap.add_argument("--stage-s", type=float, default=60.0)
    ap.add_argument("--tail-s", type=float, default=90.0)
    ap.add_argument("--sample-s", type=float, default=2.0)
    add_tree_args(ap)
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="re-write report.md and the plot from the files of a previous run in --out",
    )
    ns = ap.parse_args(argv)
    if ns.report_only:
        return _report_from_files(Path(ns.out))
    if os.environ.get(NS_FLAG) != "1":
        return _reexec_in_private_namespaces()
    import ray

    from flashpd.bench.workload import WorkloadConfig, generate_workload
    from flashpd.services.cli import tiny_checkpoint, wait_healthy
    from flashpd.services.redis_local import free_port
    from flashpd_sdk import Client

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ[PASSWORD_ENV] = secrets.token_hex(16)  # every node's workers inherit it
    ckpt = tiny_checkpoint()
    workload = generate_workload(
        WorkloadConfig(
            seed=0,
            num_trees=ns.trees,
            scale=ns.scale,
            time_scale=ns.time_scale,
            output_scale=ns.output_scale,
            max_turns=ns.max_turns,
            vocab_lo=3,
            vocab_hi=500,
        )
    )
    grpc_port, http_port = free_port(), free_port()
    ns.target = f"127.0.0.1:{grpc_port}"
    cluster = _make_cluster(idle_timeout_minutes=0.25)
    samples: list[Sample] = []
    with (
        tempfile.TemporaryDirectory(prefix="fpd") as tmp,
        RedisWithPassword(free_port(), os.environ[PASSWORD_ENV]) as redis_server,
    ):
        os.environ["RAY_TMPDIR"] = tmp  # this run's Ray session (and logs) under tmp
        cluster.start()
        try:
            ray.init(address="auto", log_to_driver=False, configure_logging=False)
            t0 = time.monotonic()
            _deploy(serve_config(ckpt, grpc_port, http_port, redis_server.port), Path(tmp))
            client = Client(ns.target)
            wait_healthy(client, timeout_s=600.0)
            client.close()
            _wait_serving()  # a worker is in Redis before Serve routes to it: wait for both
            print(f"deployed in {time.monotonic() - t0:.0f} s", flush=True)
            load_started = time.strftime("%H:%M:%S")
            records = asyncio.run(_ramp(ns, workload, samples))
            policy_lines = _policy_log(tmp)
        finally:
            ray.shutdown()
            cluster.shutdown()
    (out / "timeline.jsonl").write_text("".join(json.dumps(asdict(s)) + "\n" for s in samples))
    (out / "records.jsonl").write_text("".join(json.dumps({"t_end_s": t, **r.to_json()}) + "\n" for t, r in records))
    (out / "policy.log").write_text("".join(line + "\n" for line in policy_lines))
    run = {k: v for k, v in vars(ns).items() if k not in ("out", "report_only")}
    (out / "run.json").write_text(
        json.dumps({"args": run, "policy_kwargs": POLICY_KWARGS, "load_started": load_started}, indent=1) + "\n"
    )
    return _report_from_files(out)


def _report_from_files(out: Path) -> int:
    from flashpd.bench.autoscale_report import write_report
    from flashpd.bench.records import RequestRecord

    run = json.loads((out / "run.json").read_text())
    samples = [Sample(**json.loads(line)) for line in (out / "timeline.jsonl").open()]
    records = []
    for line in (out / "records.jsonl").open():
        row = json.loads(line)
        records.append((row.pop("t_end_s"), RequestRecord.from_json(row)))
    policy_lines = (out / "policy.log").read_text().splitlines()
    path = write_report(out, samples, records, run["args"], run["policy_kwargs"], policy_lines, run["load_started"])
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
