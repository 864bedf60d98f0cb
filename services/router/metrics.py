"""Router metrics in the vLLM naming style (`<namespace>:<name>`, label `model_name`).

Prefix-cache hits are counted per request and per tier without double counting: a request counts
once under `prefill` if the prefill worker reused a prefix, once under `decode` if the decode
worker already held some chunks (both may apply), or once under `none`. Hit tokens follow the
same tiers.

Worker load (per worker and role, from the heartbeats the router reads from Redis; refreshed by
`observe_workers`): `kv_cache_blocks_used`, `kv_cache_blocks_total`, `kv_cache_usage_perc`,
`worker_num_requests_running`, `worker_num_requests_waiting`, `worker_batch_size` (sequences in
the worker's running batch), `num_queued_prefill_tokens`, `worker_draining`; labels `model_name`,
`role`, `worker_id`. A worker gone from the view disappears from the exposition.

`autoscaling_stats()` is what a router replica reports to Serve's autoscaler: requests in flight
and the p90 TTFT/ITL over the last `window_s` (0 when no request finished in the window).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from flashpd.services.api import FinalEvent, PrefillResult, WorkerStats

LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
ITL_BUCKETS_S = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
DECISION_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
BYTES_BUCKETS = tuple(float(2**k) for k in range(16, 34, 2))  # 64 KiB .. 8 GiB
AL_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 9.0)  # tokens/verify


class RecentWindow:
    """Samples of the last `window_s` seconds (clock injected), for recent quantiles."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s, self._clock = window_s, clock
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, value: float) -> None:
        self._samples.append((self._clock(), value))
        self._trim()

    def quantile(self, q: float) -> float | None:
        """Nearest-rank quantile of the window; None when it is empty."""
        self._trim()
        if not self._samples:
            return None
        values = sorted(v for _, v in self._samples)
        return values[max(0, math.ceil(q * len(values)) - 1)]

    def _trim(self) -> None:
        horizon = self._clock() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()


class WorkerLoadCollector:
    """Per-worker gauges from the latest view of worker stats (a custom Prometheus collector)."""

    GAUGES = (
        ("kv_cache_blocks_used", "KV blocks held by running or reserved sequences.", lambda w: w.kv_blocks_used),
        ("kv_cache_blocks_total", "KV blocks in the worker's pool.", lambda w: w.kv_blocks_total),
        (
            "kv_cache_usage_perc",
            "Fraction of KV blocks used (1 = full).",
            lambda w: w.kv_blocks_used / w.kv_blocks_total if w.kv_blocks_total else 0.0,
        ),
        ("worker_num_requests_running", "Sequences running on the worker.", lambda w: w.running),
        ("worker_num_requests_waiting", "Sequences waiting to be scheduled on the worker.", lambda w: w.waiting),
        ("worker_batch_size", "Sequences in the worker's running batch.", lambda w: w.running),
        ("num_queued_prefill_tokens", "Prompt tokens queued or running in prefill.", lambda w: w.queued_prefill_tokens),
        ("worker_draining", "1 while the worker takes no new requests.", lambda w: float(w.draining)),
    )

    def __init__(self, namespace: str, model: str) -> None:
        self._ns, self._model = namespace, model
        self.workers: tuple[WorkerStats, ...] = ()

    def collect(self):
        for name, doc, value in self.GAUGES:
            family = GaugeMetricFamily(f"{self._ns}:{name}", doc, labels=["model_name", "role", "worker_id"])
            for w in self.workers:
                family.add_metric([self._model, w.role, w.worker_id], float(value(w)))
            yield family


@dataclass(frozen=True)
class _Families:
    """Metric families named `<namespace>:<name>`, labelled by model_name (plus `extra`)."""

    namespace: str
    registry: CollectorRegistry

    def histogram(self, name: str, doc: str, buckets, extra: tuple[str, ...] = ()) -> Histogram:
        labels = ["model_name", *extra]
        return Histogram(f"{self.namespace}:{name}", doc, labels, buckets=buckets, registry=self.registry)

    def counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(f"{self.namespace}:{name}", doc, ["model_name", *extra], registry=self.registry)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"{self.namespace}:{name}", doc, ["model_name"], registry=self.registry)


class RouterMetrics:
    def __init__(
        self,
        model: str,
        *,
        registry: CollectorRegistry | None = None,
        namespace: str = "flashpd",
        window_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._model = model
        self.in_flight = 0
        self.recent_ttft = RecentWindow(window_s, clock)
        self.recent_itl = RecentWindow(window_s, clock)
        self.worker_load = WorkerLoadCollector(namespace, model)
        self.registry.register(self.worker_load)
        families = _Families(namespace, self.registry)
        self._latency_metrics(families)
        self._transfer_metrics(families)
        self._request_metrics(families)
        self._speculative_metrics(families)
        self.running = families.gauge("num_requests_running", "Requests in flight in this router.")

    def _latency_metrics(self, f: _Families) -> None:
        self.ttft = f.histogram("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS_S)
        self.itl = f.histogram("inter_token_latency_seconds", "Time between streamed tokens.", ITL_BUCKETS_S)
        self.e2e = f.histogram("e2e_request_latency_seconds", "Arrival to final message.", LATENCY_BUCKETS_S)
        self.decision = f.histogram(
            "router_decision_latency_seconds", "Routing decision (Redis lookup + policy).", DECISION_BUCKETS_S
        )

    def _transfer_metrics(self, f: _Families) -> None:
        self.transfer_latency = f.histogram(
            "kv_transfer_latency_seconds", "KV push prefill -> decode.", LATENCY_BUCKETS_S
        )
        self.transfer_bytes = f.counter("kv_transfer_bytes", "KV bytes pushed prefill -> decode.")
        self.transfer_bytes_per_request = f.histogram(
            "kv_transfer_request_bytes", "KV bytes pushed per request.", BYTES_BUCKETS
        )
        self.transfer_failures = f.counter("kv_transfer_failures", "Failed KV pushes.")

    def _request_metrics(self, f: _Families) -> None:
        """Per finished, refused, retried or migrated request."""
        self.cache_hits = f.counter("prefix_cache_hits", "Requests by prefix-cache tier hit.", ("tier",))
        self.cache_hit_tokens = f.counter("prefix_cache_hit_tokens", "Cached prompt tokens by tier.", ("tier",))
        self.prompt_tokens = f.counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = f.counter("generation_tokens", "Generated tokens.")
        self.success = f.counter("request_success", "Finished requests.", ("finished_reason",))
        self.errors = f.counter("request_errors", "Failed requests by status code.", ("code",))
        self.retries = f.counter("request_retries", "Attempts moved to another worker.", ("code",))
        self.migrations = f.counter(
            "stream_migrations",
            "Streams of a draining decode worker: moved to another one, or staying (nowhere to go).",
            ("outcome",),
        )
        self.migrated_bytes = f.counter("stream_migration_bytes", "KV bytes moved D -> D.")
        self.prefills = f.counter(
            "prefills", "Prefill calls that ran (first attempts and re-prefills after a failure)."
        )

    def _speculative_metrics(self, f: _Families) -> None:
        """The decode workers' verify books, per finished request."""
        self.spec_drafted = f.counter("spec_decode_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = f.counter("spec_decode_accepted_tokens", "Draft tokens accepted.")
        self.spec_steps = f.counter("spec_decode_verify_steps", "Sequence verify steps.")
        self.spec_length = f.histogram(
            "spec_decode_acceptance_length",
            "Per request: mean tokens emitted per verify (1 + accepted / steps).",
            AL_BUCKETS,
        )
        self.spec_forced = f.counter(
            "spec_decode_forced_requests",
            "Requests decoded under a benchmark's forced acceptance (outputs not the model's).",
        )

    def _l(self, **extra: str) -> dict[str, str]:
        return {"model_name": self._model, **extra}

    def on_start(self) -> None:
        self.in_flight += 1
        self.running.labels(**self._l()).inc()

    def on_route(self, seconds: float) -> None:
        self.decision.labels(**self._l()).observe(seconds)

    def on_tokens(self, num_tokens: int, since_last_s: float | None) -> None:
        """`since_last_s` None for the first token event (that one is TTFT)."""
        self.generation_tokens.labels(**self._l()).inc(num_tokens)
        if since_last_s is not None:
            itl_s = since_last_s / max(num_tokens, 1)
            self.itl.labels(**self._l()).observe(itl_s)
            self.recent_itl.add(itl_s)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.labels(**self._l()).observe(seconds)
        self.recent_ttft.add(seconds)

    def on_prefill(self, result: PrefillResult) -> None:
        self.prefills.labels(**self._l()).inc()
        self.transfer_latency.labels(**self._l()).observe(result.transfer_ms / 1e3)
        self.transfer_bytes.labels(**self._l()).inc(result.pushed_bytes)
        self.transfer_bytes_per_request.labels(**self._l()).observe(result.pushed_bytes)

    def on_migration(self, outcome: str, num_bytes: int = 0) -> None:
        self.migrations.labels(**self._l(outcome=outcome)).inc()
        if num_bytes:
            self.migrated_bytes.labels(**self._l()).inc(num_bytes)

    def on_transfer_failure(self) -> None:
        self.transfer_failures.labels(**self._l()).inc()

    def on_retry(self, code: str) -> None:
        self.retries.labels(**self._l(code=code)).inc()

    def on_final(self, final: FinalEvent) -> None:
        usage = final.usage
        self.e2e.labels(**self._l()).observe(final.timeline.e2e_ms / 1e3)
        self.prompt_tokens.labels(**self._l()).inc(usage.prompt_tokens)
        self.success.labels(**self._l(finished_reason=final.finish_reason)).inc()
        tiers = {"prefill": usage.cached_tokens_prefill, "decode": usage.cached_tokens_decode}
        for tier, tokens in tiers.items():
            if tokens > 0:
                self.cache_hits.labels(**self._l(tier=tier)).inc()
                self.cache_hit_tokens.labels(**self._l(tier=tier)).inc(tokens)
        if not any(tiers.values()):
            self.cache_hits.labels(**self._l(tier="none")).inc()
        self._on_speculative(usage)

    def _on_speculative(self, usage) -> None:
        if usage.forced_acceptance_length:
            self.spec_forced.labels(**self._l()).inc()
        if not usage.draft_steps:
            return
        self.spec_drafted.labels(**self._l()).inc(usage.draft_tokens)
        self.spec_accepted.labels(**self._l()).inc(usage.accepted_draft_tokens)
        self.spec_steps.labels(**self._l()).inc(usage.draft_steps)
        self.spec_length.labels(**self._l()).observe(1 + usage.accepted_draft_tokens / usage.draft_steps)

    def on_end(self, error_code: str | None) -> None:
        self.in_flight -= 1
        self.running.labels(**self._l()).dec()
        if error_code is not None:
            self.errors.labels(**self._l(code=error_code)).inc()

    def observe_workers(self, workers: Iterable[WorkerStats]) -> None:
        """Replace the per-worker load gauges with this view (live workers only)."""
        self.worker_load.workers = tuple(workers)

    def autoscaling_stats(self) -> dict[str, float]:
        return {
            "requests_running": float(self.in_flight),
            "ttft_p90_s": self.recent_ttft.quantile(0.9) or 0.0,
            "itl_p90_s": self.recent_itl.quantile(0.9) or 0.0,
        }

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
