"""Aggregates of one run's records, goodput over a sweep, and A/B ratios.

Which records feed which figure:

    latency percentiles, hit rates   requests started in the window (phase MEASURE), no error
    throughput                       every token that arrived inside the window, from any request:
                                     output tokens at their arrival times, a request's prompt
                                     (cached included) at its first token
    coverage                         |union of request [start, end] within the window| / window
    errors                           MEASURE requests that failed

Interactivity is reported two ways: 1 / p90(inter-token latency), and 1 / p90(e2e / output tokens)
per request. Goodput at a cap is the best throughput per GPU over the sweep among points whose
interactivity (each definition) is at least the cap and whose p90 TTFT is at most the limit.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from flashpd.bench.records import Phase, RequestRecord, RunMeta

INTERACTIVITY_DEFS = ("itl", "e2e")
THROUGHPUT_DEFS = ("total", "output")


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        if len(values) == 0:
            return cls(math.nan, math.nan, math.nan)
        p50, p90, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
        return cls(float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class RunMetrics:
    name: str
    concurrency: int
    num_gpus: int
    window_s: float  # measured window length
    requests: int  # started in the window
    errors: int
    errors_by_type: dict[str, int]
    input_tokens: int  # prompt tokens (cached included) credited inside the window
    output_tokens: int  # output tokens that arrived inside the window
    total_tok_s_per_gpu: float  # (input incl. cached + output) / window / GPUs
    output_tok_s_per_gpu: float
    interactivity_itl_tok_s: float  # 1 / p90(ITL)
    interactivity_e2e_tok_s: float  # 1 / p90(e2e / output tokens)
    ttft_s: Percentiles
    itl_s: Percentiles
    e2e_s: Percentiles
    hit_rate_actual: float  # server-reported cached / prompt tokens
    hit_rate_ideal: float  # workload's ideal cached / prompt tokens, same requests
    prompt_tokens: int  # over the requests the hit rates use
    cached_tokens: int
    cached_tokens_prefill: int
    cached_tokens_decode: int
    coverage: float
    interrupted: bool = False
    aborted_reason: str | None = None

    def interactivity(self, definition: str) -> float:
        return {"itl": self.interactivity_itl_tok_s, "e2e": self.interactivity_e2e_tok_s}[definition]

    def throughput(self, definition: str) -> float:
        return {"total": self.total_tok_s_per_gpu, "output": self.output_tok_s_per_gpu}[definition]


def aggregate(meta: RunMeta, records: Sequence[RequestRecord]) -> RunMetrics:
    window = _window(meta)
    window_s = window[1] - window[0]
    measured = [r for r in records if r.phase is Phase.MEASURE]
    done = [r for r in measured if r.ok]
    input_tokens, output_tokens = _tokens_in_window(records, window)
    per_gpu_s = max(window_s, 1e-12) * meta.num_gpus
    itl = [gap for r in done for gap in r.itl_s]
    per_token = [r.e2e_s / r.output_tokens for r in done if r.output_tokens > 0]
    hits = [r for r in done if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in hits)
    return RunMetrics(
        name=meta.name,
        concurrency=meta.concurrency,
        num_gpus=meta.num_gpus,
        window_s=window_s,
        requests=len(measured),
        errors=len(measured) - len(done),
        errors_by_type=dict(Counter(r.error_type for r in measured if not r.ok)),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        total_tok_s_per_gpu=(input_tokens + output_tokens) / per_gpu_s if window_s > 0 else 0.0,
        output_tok_s_per_gpu=output_tokens / per_gpu_s if window_s > 0 else 0.0,
        interactivity_itl_tok_s=_inverse(Percentiles.of(itl).p90),
        interactivity_e2e_tok_s=_inverse(Percentiles.of(per_token).p90),
        ttft_s=Percentiles.of([r.ttft_s for r in done if r.ttft_s is not None]),
        itl_s=Percentiles.of(itl),
        e2e_s=Percentiles.of([r.e2e_s for r in done]),
        hit_rate_actual=_ratio(sum(r.cached_tokens or 0 for r in hits), prompt),
        hit_rate_ideal=_ratio(sum(r.ideal_cached_tokens for r in hits), prompt),
        prompt_tokens=prompt,
        cached_tokens=sum(r.cached_tokens or 0 for r in hits),
        cached_tokens_prefill=sum(r.cached_tokens_prefill or 0 for r in hits),
        cached_tokens_decode=sum(r.cached_tokens_decode or 0 for r in hits),
        coverage=_coverage(records, window),
        interrupted=meta.interrupted,
        aborted_reason=meta.aborted_reason,
    )


def _window(meta: RunMeta) -> tuple[float, float]:
    if meta.window_start_s is None or meta.window_end_s is None:
        return (0.0, 0.0)
    return (meta.window_start_s, max(meta.window_start_s, meta.window_end_s))


def _inverse(seconds: float) -> float:
    if math.isnan(seconds):
        return math.nan
    return math.inf if seconds <= 0 else 1.0 / seconds


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def _tokens_in_window(records: Iterable[RequestRecord], window: tuple[float, float]) -> tuple[int, int]:
    lo, hi = window
    input_tokens = output_tokens = 0
    for r in records:
        times = np.asarray(r.token_times_s())
        if times.size == 0:
            continue
        output_tokens += int(np.count_nonzero((times >= lo) & (times < hi)))
        if lo <= times[0] < hi:
            input_tokens += r.prompt_tokens
    return input_tokens, output_tokens


def _coverage(records: Iterable[RequestRecord], window: tuple[float, float]) -> float:
    lo, hi = window
    if hi <= lo:
        return 0.0
    spans = sorted((max(r.start_s, lo), min(r.end_s, hi)) for r in records if r.end_s > lo and r.start_s < hi)
    covered_s, reach = 0.0, lo
    for start, end in spans:
        if end > reach:
            covered_s += end - max(start, reach)
            reach = end
    return covered_s / (hi - lo)


@dataclass(frozen=True)
class Goodput:
    interactivity: str  # "itl" or "e2e"
    throughput: str  # "total" or "output"
    tok_s_per_gpu: float | None  # None: no sweep point meets both limits
    concurrency: int | None


def goodput(
    points: Sequence[RunMetrics], min_interactivity_tok_s: float = 150.0, max_ttft_p90_s: float = 5.0
) -> list[Goodput]:
    """For each (interactivity, throughput) definition, the best point meeting both limits."""
    out = []
    for inter in INTERACTIVITY_DEFS:
        eligible = [
            p for p in points if p.interactivity(inter) >= min_interactivity_tok_s and p.ttft_s.p90 <= max_ttft_p90_s
        ]
        for thru in THROUGHPUT_DEFS:
            best = max(eligible, key=lambda p, t=thru: p.throughput(t), default=None)
            out.append(
                Goodput(
                    inter,
                    thru,
                    None if best is None else best.throughput(thru),
                    None if best is None else best.concurrency,
                )
            )
    return out


@dataclass(frozen=True)
class TurnHitRate:
    turns: str  # bucket label, e.g. "4-7"
    requests: int
    actual: float
    ideal: float


def hit_rate_by_turn(records: Iterable[RequestRecord]) -> list[TurnHitRate]:
    """Token-weighted hit rates of measured requests, by turn-index bucket 0, 1, 2-3, 4-7, ..."""
    sums: dict[int, list[int]] = {}  # bucket -> [requests, prompt, cached, ideal]
    for r in records:
        if r.phase is not Phase.MEASURE or not r.ok or r.cached_tokens is None:
            continue
        acc = sums.setdefault(_turn_bucket(r.turn_index), [0, 0, 0, 0])
        acc[0] += 1
        acc[1] += r.prompt_tokens
        acc[2] += r.cached_tokens
        acc[3] += r.ideal_cached_tokens
    return [TurnHitRate(_bucket_label(b), n, _ratio(c, p), _ratio(i, p)) for b, (n, p, c, i) in sorted(sums.items())]


def _turn_bucket(turn_index: int) -> int:
    return 0 if turn_index == 0 else turn_index.bit_length()


def _bucket_label(bucket: int) -> str:
    if bucket <= 1:
        return str(bucket)
    lo = 1 << (bucket - 1)
    return f"{lo}-{2 * lo - 1}"


RATIO_FIELDS = (
    "total_tok_s_per_gpu",
    "output_tok_s_per_gpu",
    "interactivity_itl_tok_s",
    "interactivity_e2e_tok_s",
    "hit_rate_actual",
    "coverage",
)


@dataclass(frozen=True)
class Comparison:
    name: str
    baseline: str
    concurrency: int
    ratios: dict[str, float] = field(default_factory=dict)  # other / baseline
    latency_ratios: dict[str, float] = field(default_factory=dict)  # p90s, other / baseline


def compare(baseline: RunMetrics, other: RunMetrics) -> Comparison:
    if baseline.concurrency != other.concurrency:
        raise ValueError(f"compare points at the same concurrency, got {baseline.concurrency} and {other.concurrency}")
    ratios = {f: _ratio(getattr(other, f), getattr(baseline, f)) for f in RATIO_FIELDS}
    latency = {
        f"{f}_p90": _ratio(getattr(other, f).p90, getattr(baseline, f).p90) for f in ("ttft_s", "itl_s", "e2e_s")
    }
    return Comparison(other.name, baseline.name, other.concurrency, ratios, latency)
