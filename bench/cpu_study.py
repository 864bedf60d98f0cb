"""The AgentX-like A/B study on CPU with the tiny preset, end to end through the real stack.

For each server configuration in turn: deploy it on a local Ray instance (2 prefill + 2 decode
replicas, Redis index, NIXL over loopback), run the closed-loop driver over the concurrency
sweep with the same workload and seed, delete it. Then write the markdown + PNG report.

    unshare -n sh -c 'ip link set lo up && python -m flashpd.bench.cpu_study --out bench/results/cpu_tiny'

"GPUs" in the per-GPU figures are the worker processes (prefill + decode replicas).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

CONFIGS = {
    "all_on": {},
    "no_swa_bounded_replay": {"swa_bounded_replay": False},
    "no_affinity": {"routing": "random"},
    "fp8_compressed_kv": {"kv_format": "fp8"},
}


def _bench_args(ns: argparse.Namespace, target: str) -> argparse.Namespace:
    """The `flashpd bench ab` arguments for this study."""
    from flashpd.bench.cli import register

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    register(sub)
    return parser.parse_args(
        [
            "bench",
            "ab",
            "--target",
            f"x={target}",
            "--gpus",
            "4",
            "--out",
            ns.out,
            "--seed",
            "0",
            "--trees",
            str(ns.trees),
            "--scale",
            str(ns.scale),
            "--time-scale",
            str(ns.time_scale),
            "--output-scale",
            str(ns.output_scale),
            "--max-turns",
            str(ns.max_turns),
            "--vocab-lo",
            "3",
            "--vocab-hi",
            "500",
            "--window-s",
            str(ns.window_s),
            "--warmup-requests",
            str(ns.warmup_requests),
            "--concurrency",
            ns.concurrency,
            "--cap",
            str(ns.cap),
            "--no-progress",
            "--request-timeout-s",
            "300",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    import ray
    from ray import serve

    from flashpd.bench.cli import Target, _run_targets, parse_concurrency
    from flashpd.bench.report import load_study, write_report
    from flashpd.bench.workload import add_tree_args
    from flashpd.services.app import build_app
    from flashpd.services.cli import tiny_checkpoint, wait_healthy
    from flashpd.services.redis_local import LocalRedis, free_port
    from flashpd_sdk import Client

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/cpu_tiny")
    add_tree_args(ap)
    ap.add_argument("--window-s", type=float, default=60)
    ap.add_argument("--warmup-requests", type=int, default=2)
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--cap", type=float, default=5.0, help="interactivity cap for CPU goodput")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ns = ap.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    study = Path(ns.out)
    study.mkdir(parents=True, exist_ok=True)
    ckpt = tiny_checkpoint()
    with LocalRedis() as redis:
        ray.init(
            address="local",
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        try:
            for name in ns.configs.split(","):
                port = free_port()
                args = {
                    "checkpoint": ckpt,
                    "model_id": "flashpd-tiny",
                    "redis_url": redis.url,
                    "grpc_port": port,
                    "cache_salt": name,
                    "prefill": {"replicas": 2, "num_blocks": 1024},
                    "decode": {"replicas": 2, "num_blocks": 1024},
                    **CONFIGS[name],
                }
                t0 = time.monotonic()
                serve.run(build_app(args), name=name, route_prefix=f"/{name}")
                client = Client(f"127.0.0.1:{port}")
                wait_healthy(client)
                client.close()
                print(f"[{name}] deployed in {time.monotonic() - t0:.0f} s", flush=True)
                bargs = _bench_args(ns, f"127.0.0.1:{port}")
                target = Target(name, f"127.0.0.1:{port}", 4)
                _run_targets(bargs, [target], parse_concurrency(ns.concurrency), study)
                serve.delete(name)
        finally:
            serve.shutdown()
            ray.shutdown()
    path = write_report(study, load_study(study), ns.cap, 5.0)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
