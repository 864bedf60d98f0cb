"""Router metrics in the vLLM naming style (`<namespace>:<name>`, label `model_name`).

Prefix-cache hits are counted per request and per tier without double counting: a request counts
once under `prefill` if the prefill worker reused a prefix, once under `decode` if the decode
worker already held some chunks (both may apply), or once under `none`. Hit tokens follow the
same tiers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from flashpd.services.api import FinalEvent, PrefillResult

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS_S = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                 0.25, 0.5, 1.0, 2.5)
DECISION_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
BYTES_BUCKETS = tuple(float(2**k) for k in range(16, 34, 2))  # 64 KiB .. 8 GiB


class RouterMetrics:
    def __init__(self, model: str, *, registry: CollectorRegistry | None = None,
                 namespace: str = "flashpd") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._model = model
        ns, reg, labels = namespace, self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets, extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(f"{ns}:{name}", doc, labels + list(extra), buckets=buckets,
                             registry=reg)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{ns}:{name}", doc, labels + list(extra), registry=reg)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.",
                         LATENCY_BUCKETS_S)
        self.itl = hist("inter_token_latency_seconds", "Time between streamed tokens.",
                        ITL_BUCKETS_S)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to final message.",
                        LATENCY_BUCKETS_S)
        self.decision = hist("router_decision_latency_seconds",
                             "Routing decision (Redis lookup + policy).", DECISION_BUCKETS_S)
        self.transfer_latency = hist("kv_transfer_latency_seconds",
                                     "KV push prefill -> decode.", LATENCY_BUCKETS_S)
        self.transfer_bytes = counter("kv_transfer_bytes", "KV bytes pushed prefill -> decode.")
        self.transfer_bytes_per_request = hist("kv_transfer_request_bytes",
                                               "KV bytes pushed per request.", BYTES_BUCKETS)
        self.transfer_failures = counter("kv_transfer_failures", "Failed KV pushes.")
        self.cache_hits = counter("prefix_cache_hits", "Requests by prefix-cache tier hit.",
                                  ("tier",))
        self.cache_hit_tokens = counter("prefix_cache_hit_tokens", "Cached prompt tokens by tier.",
                                        ("tier",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter("request_success", "Finished requests.", ("finished_reason",))
        self.errors = counter("request_errors", "Failed requests by status code.", ("code",))
        self.retries = counter("request_retries", "Attempts moved to another worker.", ("code",))
        self.running = Gauge(f"{ns}:num_requests_running", "Requests in flight in this router.",
                             labels, registry=reg)

    def _l(self, **extra: str) -> dict[str, str]:
        return {"model_name": self._model, **extra}

    def on_start(self) -> None:
        self.running.labels(**self._l()).inc()

    def on_route(self, seconds: float) -> None:
        self.decision.labels(**self._l()).observe(seconds)

    def on_tokens(self, num_tokens: int, since_last_s: float | None) -> None:
        """`since_last_s` None for the first token event (that one is TTFT)."""
        self.generation_tokens.labels(**self._l()).inc(num_tokens)
        if since_last_s is not None:
            self.itl.labels(**self._l()).observe(since_last_s / max(num_tokens, 1))

    def on_first_token(self, seconds: float) -> None:
        self.ttft.labels(**self._l()).observe(seconds)

    def on_prefill(self, result: PrefillResult) -> None:
        self.transfer_latency.labels(**self._l()).observe(result.transfer_ms / 1e3)
        self.transfer_bytes.labels(**self._l()).inc(result.pushed_bytes)
        self.transfer_bytes_per_request.labels(**self._l()).observe(result.pushed_bytes)

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

    def on_end(self, error_code: str | None) -> None:
        self.running.labels(**self._l()).dec()
        if error_code is not None:
            self.errors.labels(**self._l(code=error_code)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
