"""The router's /metrics carries every worker's load (KV blocks, queue, batch) by role, and the
replicas report their load to Serve's autoscaler (the JointPolicy's inputs)."""

from __future__ import annotations

import time

import httpx
import pytest

from .conftest import deploy

pytestmark = pytest.mark.net
APP = "wm"


def _gauges(text: str, name: str) -> dict[str, float]:
    """role -> value of `flashpd:<name>` (one worker per role here)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(f"flashpd:{name}{{"):
            role = line.split('role="', 1)[1].split('"', 1)[0]
            out[role] = float(line.rsplit(" ", 1)[1])
    return out


def test_metrics_show_each_worker_load_by_role(ray_serve, ckpt_dir, redis_server):
    deploy(APP, ckpt_dir, redis_server.url, prefill={"num_blocks": 48}, decode={"num_blocks": 40})
    url = f"http://127.0.0.1:{ray_serve}/{APP}/metrics"
    deadline = time.monotonic() + 60
    total: dict[str, float] = {}
    while time.monotonic() < deadline:
        text = httpx.get(url, timeout=10).text
        total = _gauges(text, "kv_cache_blocks_total")
        if set(total) == {"prefill", "decode"}:
            break
        time.sleep(0.5)
    assert total == {"prefill": 48.0, "decode": 40.0}
    for name in (
        "kv_cache_blocks_used",
        "kv_cache_usage_perc",
        "worker_num_requests_running",
        "worker_num_requests_waiting",
        "worker_batch_size",
        "num_queued_prefill_tokens",
        "worker_draining",
    ):
        assert set(_gauges(text, name)) == {"prefill", "decode"}, name
    from ray import serve

    for name, blocks in (("PrefillServer", 48.0), ("DecodeServer", 40.0)):
        handle = serve.get_deployment_handle(name, app_name=APP)
        report = handle.record_autoscaling_stats.remote().result(timeout_s=30)
        assert report["kv_blocks_total"] == blocks and report["draining"] == 0.0
    router = serve.get_deployment_handle("Router", app_name=APP)
    report = router.record_autoscaling_stats.remote().result(timeout_s=30)
    assert set(report) == {"requests_running", "ttft_p90_s", "itl_p90_s"}
