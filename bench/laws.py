"""The distributions of the AgentX-like workload, pinned at the published percentiles.

Every count is drawn from a `LogQuantiles` law: log(x) is piecewise linear in a standard normal z,
through the knots (0, ln p50), (z90, ln p90) and, when given, (z99, ln p99). A plain log-normal is
the one-slope case. Pinning p99 separately lets a law keep its published median and tail while its
mean stays at the published value (new input: median 1.7K, mean 3.8K, p99 47K is not log-normal).

    ln x
     |                         / slope_tail (p90 -> p99, continued past p99)
     |                 ______/
     |        ______/  slope_body (p50 -> p90, continued below the median)
     |_______/
     +-------|-------|-------|---- z
             0      z90     z99

`AgentShape` holds the laws at scale 1 (tokens, seconds); the generator divides them by the scale
knobs. Knots that the public figures do not give directly were fitted by simulation so that the
derived figures land on the published ones (comments name what each was fitted to).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Z90 = 1.2815515655446004  # standard normal quantile at 0.90
Z99 = 2.3263478740408408  # standard normal quantile at 0.99


@dataclass(frozen=True)
class LogQuantiles:
    """A log-normal-like law pinned at p50, p90 and optionally p99, clipped to [lo, hi]."""

    p50: float
    p90: float
    p99: float | None = None
    lo: float = 0.0
    hi: float | None = None  # None: unbounded

    def __post_init__(self) -> None:
        if not 0 < self.p50 < self.p90:
            raise ValueError(f"need 0 < p50 < p90, got {self.p50}, {self.p90}")
        if self.p99 is not None and not self.p90 < self.p99:
            raise ValueError(f"need p90 < p99, got {self.p90}, {self.p99}")
        if self.hi is not None and self.hi < self.lo:
            raise ValueError(f"need lo <= hi, got {self.lo}, {self.hi}")

    def from_z(self, z: np.ndarray) -> np.ndarray:
        """Maps standard normal draws to this law (before clipping)."""
        slope_body = math.log(self.p90 / self.p50) / Z90
        log_x = math.log(self.p50) + slope_body * z
        if self.p99 is not None:
            slope_tail = math.log(self.p99 / self.p90) / (Z99 - Z90)
            log_tail = math.log(self.p90) + slope_tail * (z - Z90)
            log_x = np.where(z > Z90, log_tail, log_x)
        return np.exp(log_x)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = self.from_z(rng.standard_normal(n))
        return np.clip(x, self.lo, math.inf if self.hi is None else self.hi)

    def sample_one(self, rng: np.random.Generator) -> float:
        return float(self.sample(rng, 1)[0])


@dataclass(frozen=True)
class UniformRange:
    lo: float
    hi: float

    def __post_init__(self) -> None:
        if not 0 <= self.lo <= self.hi:
            raise ValueError(f"need 0 <= lo <= hi, got {self.lo}, {self.hi}")

    def sample_one(self, rng: np.random.Generator) -> float:
        return float(rng.uniform(self.lo, self.hi))


def _law(*args: Any, **kwargs: Any) -> Any:
    return field(default_factory=lambda: LogQuantiles(*args, **kwargs))


def _range(lo: float, hi: float) -> Any:
    return field(default_factory=lambda: UniformRange(lo, hi))


@dataclass(frozen=True)
class AgentShape:
    """The AgentX-like workload at scale 1 (token counts in tokens, times in seconds)."""

    main_turns: LogQuantiles = _law(65, 330, lo=1)
    # new (uncached) input per turn; p90 and the 96K clip fitted to mean ~3.8K
    new_input_tokens: LogQuantiles = _law(1700, 6000, 47000, lo=1, hi=96_000)
    # main-agent output; p99 and the 32K clip fitted to mean ~1.4K
    main_output_tokens: LogQuantiles = _law(600, 3500, 12000, lo=1, hi=32_000)
    # sub-agent output (short tool calls); fitted so the median over all requests is ~450
    sub_output_tokens: LogQuantiles = _law(180, 1200, 5000, lo=1, hi=32_000)
    think_s: LogQuantiles = _law(4.9, 130.0, 3250.0, lo=0.0, hi=86_400.0)
    # system prompt + tool definitions of a coding agent
    system_prefix_tokens: LogQuantiles = _law(18_000, 28_000, lo=4_000, hi=60_000)
    # what a compaction leaves of the conversation
    summary_tokens: LogQuantiles = _law(10_000, 25_000, lo=2_000, hi=60_000)
    salt_tokens: int = 64
    context_cap_tokens: int = 1_000_000  # hard cap on prompt + output
    # Compaction: 12% of sessions run a 200K-window model that compacts at 150-200K; the rest
    # compact at 60-100% of the 1M cap. Fitted to main prompt p50 ~254K, p90 ~651K.
    short_window_share: float = 0.12
    short_window_compact_tokens: UniformRange = _range(150_000, 200_000)
    long_window_compact_tokens: UniformRange = _range(600_000, 1_000_000)
    subagent_tree_share: float = 0.445
    subagent_groups: LogQuantiles = _law(4, 10, lo=1, hi=40)
    # requests per sub-agent group; p90 fitted to sub-agent context p90 ~196K
    subagent_group_requests: LogQuantiles = _law(16, 40, lo=1, hi=400)

    def __post_init__(self) -> None:
        for name in ("short_window_share", "subagent_tree_share"):
            share = getattr(self, name)
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {share}")
        if self.salt_tokens < 1 or self.context_cap_tokens < 1:
            raise ValueError("salt_tokens and context_cap_tokens must be >= 1")
        for window in (self.short_window_compact_tokens, self.long_window_compact_tokens):
            if window.hi > self.context_cap_tokens:
                raise ValueError(f"compaction window {window} passes the context cap {self.context_cap_tokens}")

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> AgentShape:
        kinds = {f: type(v) for f, v in cls().__dict__.items()}
        unknown = set(raw) - set(kinds)
        if unknown:
            raise ValueError(f"unknown AgentShape fields: {sorted(unknown)}")
        values = {}
        for name, value in raw.items():
            kind = kinds[name]
            values[name] = kind(**value) if kind in (LogQuantiles, UniformRange) else kind(value)
        return cls(**values)
