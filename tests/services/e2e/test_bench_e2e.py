"""A short AgentX-like run against a local tiny deployment produces every metric and plot."""

from __future__ import annotations

import json
import time

import pytest

from .conftest import deploy

pytestmark = pytest.mark.net
APP = "benchapp"


def test_short_closed_loop_run_writes_metrics_and_plots(ray_serve, ckpt_dir, redis_server, tmp_path):
    from ray import serve

    from flashpd.bench.cli import Target, _run_targets
    from flashpd.bench.cpu_study import _bench_args
    from flashpd.bench.report import load_study, write_report
    from flashpd_sdk import Client

    args = deploy(APP, ckpt_dir, redis_server.url)
    target = f"127.0.0.1:{args['grpc_port']}"
    try:
        client = Client(target)
        deadline = time.monotonic() + 60
        while client.health() != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.3)
        client.close()
        ns = _bench_args(_Opts(out=str(tmp_path)), target)
        assert _run_targets(ns, [Target("tiny", target, 2)], [1], tmp_path) == 0
        report = write_report(tmp_path, load_study(tmp_path), 5.0, 5.0)
    finally:
        serve.delete(APP)
    text = open(report).read()
    for figure in ("tok/s/GPU", "TTFT", "ITL", "hit actual / ideal", "Goodput"):
        assert figure in text
    for plot in ("throughput_vs_interactivity", "ttft_cdf", "itl_cdf", "hit_rate_by_turn"):
        assert (tmp_path / "plots" / f"{plot}.png").stat().st_size > 1000
    records = [json.loads(line) for line in (tmp_path / "tiny" / "c1" / "records.jsonl").open()]
    assert records and all(r["error_type"] is None for r in records)
    assert any(r["phase"] == "measure" for r in records)


class _Opts:
    """The cpu_study options a short run needs."""

    def __init__(self, out: str):
        self.out, self.trees, self.scale, self.time_scale = out, 2, 2000, 200
        self.output_scale, self.max_turns, self.window_s = 100, 4, 8
        self.warmup_requests, self.concurrency, self.cap = 1, "1", 5.0
