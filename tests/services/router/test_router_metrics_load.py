"""Router metrics: per-worker load gauges at /metrics and the autoscaling report (recent p90)."""

from __future__ import annotations

from flashpd.services.api import WorkerStats
from flashpd.services.router.metrics import RecentWindow, RouterMetrics


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _stats(worker_id: str, role: str, **kw) -> WorkerStats:
    return WorkerStats(worker_id, "inc-1", role, **kw)


def test_worker_gauges_per_worker_and_role():
    m = RouterMetrics("m")
    m.observe_workers(
        [
            _stats("d0", "decode", kv_blocks_used=30, kv_blocks_total=120, running=5, waiting=2),
            _stats("p0", "prefill", queued_prefill_tokens=4096, running=1, draining=True),
        ]
    )
    text = m.exposition().decode()
    for line in (
        'flashpd:kv_cache_blocks_used{model_name="m",role="decode",worker_id="d0"} 30.0',
        'flashpd:kv_cache_blocks_total{model_name="m",role="decode",worker_id="d0"} 120.0',
        'flashpd:kv_cache_usage_perc{model_name="m",role="decode",worker_id="d0"} 0.25',
        'flashpd:worker_num_requests_running{model_name="m",role="decode",worker_id="d0"} 5.0',
        'flashpd:worker_num_requests_waiting{model_name="m",role="decode",worker_id="d0"} 2.0',
        'flashpd:worker_batch_size{model_name="m",role="decode",worker_id="d0"} 5.0',
        'flashpd:num_queued_prefill_tokens{model_name="m",role="prefill",worker_id="p0"} 4096.0',
        'flashpd:worker_draining{model_name="m",role="prefill",worker_id="p0"} 1.0',
        'flashpd:kv_cache_usage_perc{model_name="m",role="prefill",worker_id="p0"} 0.0',
    ):
        assert line in text, line


def test_a_worker_gone_from_the_view_leaves_the_exposition():
    m = RouterMetrics("m")
    m.observe_workers([_stats("d0", "decode"), _stats("d1", "decode")])
    m.observe_workers([_stats("d1", "decode")])
    text = m.exposition().decode()
    assert 'worker_id="d1"' in text and 'worker_id="d0"' not in text


def test_recent_window_drops_old_samples():
    clock = Clock()
    w = RecentWindow(10.0, clock)
    for v in (5.0, 1.0, 2.0):
        w.add(v)
    assert w.quantile(0.9) == 5.0
    clock.t = 10.5
    assert w.quantile(0.9) is None
    w.add(3.0)
    assert w.quantile(0.5) == 3.0


def test_recent_window_quantile_is_nearest_rank():
    w = RecentWindow(60.0, Clock())
    for v in range(1, 11):
        w.add(float(v))
    assert (w.quantile(0.9), w.quantile(0.5), w.quantile(1.0)) == (9.0, 5.0, 10.0)


def test_autoscaling_stats_report_in_flight_and_recent_latency():
    clock = Clock()
    m = RouterMetrics("m", window_s=30.0, clock=clock)
    assert m.autoscaling_stats() == {"requests_running": 0.0, "ttft_p90_s": 0.0, "itl_p90_s": 0.0}
    m.on_start()
    m.on_start()
    m.on_first_token(0.4)
    m.on_tokens(1, None)
    m.on_tokens(2, 0.1)  # two tokens in 0.1 s: 0.05 s each
    m.on_end(None)
    assert m.autoscaling_stats() == {"requests_running": 1.0, "ttft_p90_s": 0.4, "itl_p90_s": 0.05}
    clock.t = 31.0
    assert m.autoscaling_stats()["ttft_p90_s"] == 0.0
