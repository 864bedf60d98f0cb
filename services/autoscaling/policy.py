"""Joint, drain-safe autoscaling of the prefill, decode and router replica counts: a pure decision.

    decide(signals, config, state, now) -> (Decision, new_state)

No Ray, Redis or clock inside: the Serve adapter (`services/autoscaling/serve.py`) builds
`Signals` from the replicas' reported load and passes Serve's tick time as `now`; `state` is a
small JSON-able dict the adapter keeps in Serve's policy state between ticks.

Demand per role (each rounded up, then clamped to the role's [min, max]):

    prefill  = queued prefill tokens / prefill_tokens_per_replica
    decode   = max(sequences / decode_seqs_per_replica, KV blocks used / (kv_usage * blocks/replica))
    router   = requests in flight at routers / router_requests_per_replica

TTFT above its target adds a prefill replica when prefill has queued work (a decode replica when
decode has sequences waiting); ITL above its target adds a decode replica. The prefill count is
then held inside [pd_ratio_min * decode, pd_ratio_max * decode] (decode is raised for prefill's
sake, never lowered by the ratio).

Scale-up waits `upscale_delay_s` of continuous demand; scale-down waits `downscale_delay_s` of
continuous slack. Decode scale-down is drain-safe:
  - one replica per step, and the slack clock restarts after each step, so one drain runs at a time;
  - held while decode load per replica is above `drain_hold_seqs_per_replica` or its KV usage
    above `drain_hold_kv_usage` (the streams on the replica Serve will stop would have to finish
    inside its `graceful_shutdown_timeout_s`, and the remaining replicas would take the sessions);
  - held while any decode worker reports `draining`, while ITL is above target, and while some
    running replica has not reported its load yet.
Serve chooses which replica stops; what happens to it then is described in infra/README.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flashpd.services.api import DEPLOYMENT_ROLES as ROLES


@dataclass(frozen=True)
class WorkerLoad:
    """One prefill or decode replica's reported load (averaged over Serve's look-back window)."""

    queued_prefill_tokens: float = 0.0
    kv_blocks_used: float = 0.0
    kv_blocks_total: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    draining: bool = False


@dataclass(frozen=True)
class Replicas:
    prefill: int
    decode: int
    router: int

    def of(self, role: str) -> int:
        return getattr(self, role)


@dataclass(frozen=True)
class Limits:
    """Replica bounds per role (from each deployment's autoscaling config)."""

    min: Replicas
    max: Replicas

    def clamp(self, role: str, n: int) -> int:
        return max(self.min.of(role), min(self.max.of(role), n))


@dataclass(frozen=True)
class Signals:
    target: Replicas  # Serve's current target per role
    running: Replicas  # running replicas per role (reported or not)
    prefill: tuple[WorkerLoad, ...]  # one per running prefill replica that reported
    decode: tuple[WorkerLoad, ...]
    router_requests: float = 0.0  # requests in flight, summed over router replicas
    router_reports: int = 0  # router replicas that reported
    ttft_p90_s: float | None = None  # worst router's recent p90 (None: no recent requests)
    itl_p90_s: float | None = None


@dataclass(frozen=True)
class PolicyConfig:
    prefill_tokens_per_replica: float = 8192.0
    decode_seqs_per_replica: float = 32.0
    decode_kv_usage: float = 0.75
    router_requests_per_replica: float = 256.0
    ttft_target_s: float | None = None
    itl_target_s: float | None = None
    pd_ratio_min: float = 0.0  # prefill replicas per decode replica
    pd_ratio_max: float = math.inf
    upscale_delay_s: float = 0.0
    downscale_delay_s: float = 60.0
    drain_hold_seqs_per_replica: float = 8.0
    drain_hold_kv_usage: float = 0.5

    def __post_init__(self) -> None:
        positive = ("prefill_tokens_per_replica", "decode_seqs_per_replica", "router_requests_per_replica")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("decode_kv_usage", "drain_hold_kv_usage"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.pd_ratio_min <= self.pd_ratio_max:
            raise ValueError(f"pd_ratio_min ({self.pd_ratio_min}) must be in [0, pd_ratio_max ({self.pd_ratio_max})]")


@dataclass(frozen=True)
class Decision:
    replicas: Replicas
    demand: Replicas  # what the load asks for, before delays and holds
    notes: tuple[str, ...] = field(default=())  # why a role was held or adjusted


def check_limits(limits: Limits, config: PolicyConfig) -> None:
    """Every decode count in bounds must admit a prefill count inside the P:D ratio."""
    for role in ROLES:
        if limits.min.of(role) < 1 or limits.max.of(role) < limits.min.of(role):
            raise ValueError(
                f"{role} replica bounds must satisfy 1 <= min <= max, got "
                f"[{limits.min.of(role)}, {limits.max.of(role)}]"
            )
    for d in range(limits.min.decode, limits.max.decode + 1):
        lo, hi = _ratio_window(d, config)
        if max(lo, limits.min.prefill) > min(hi, limits.max.prefill):
            raise ValueError(
                f"with {d} decode replicas no prefill count in "
                f"[{limits.min.prefill}, {limits.max.prefill}] keeps the P:D ratio "
                f"in [{config.pd_ratio_min}, {config.pd_ratio_max}]"
            )


def demand(signals: Signals, config: PolicyConfig, limits: Limits) -> tuple[Replicas, list[str]]:
    """Replicas the current load asks for, inside bounds and the P:D ratio."""
    notes: list[str] = []
    queued = sum(w.queued_prefill_tokens for w in signals.prefill)
    p = math.ceil(queued / config.prefill_tokens_per_replica)
    d = _decode_for_load(signals.decode, config)
    r = math.ceil(signals.router_requests / config.router_requests_per_replica)
    p, d = _latency_boost(signals, config, p, d, prefill_queued=queued > 0, notes=notes)
    d = limits.clamp("decode", d)
    p = limits.clamp("prefill", p)
    lo, hi = _ratio_window(d, config)
    if p > hi and d < limits.max.decode:  # raise decode for prefill's sake
        d = limits.clamp("decode", max(d, math.ceil(p / config.pd_ratio_max)))
        notes.append("decode raised to keep P:D")
    p = _fit_ratio(p, d, config, limits)
    return Replicas(p, d, limits.clamp("router", r)), notes


def _decode_for_load(decode: tuple[WorkerLoad, ...], config: PolicyConfig) -> int:
    """Decode replicas for the sequences, or for the KV blocks they hold if that asks more."""
    seqs = sum(w.running + w.waiting for w in decode)
    d = math.ceil(seqs / config.decode_seqs_per_replica)
    used = sum(w.kv_blocks_used for w in decode)
    per_replica = _mean([w.kv_blocks_total for w in decode])
    if per_replica > 0:
        d = max(d, math.ceil(used / (config.decode_kv_usage * per_replica)))
    return d


def _latency_boost(
    signals: Signals, config: PolicyConfig, p: int, d: int, *, prefill_queued: bool, notes: list[str]
) -> tuple[int, int]:
    """One more replica past the current target of the role a latency over target points at."""
    if _over(signals.ttft_p90_s, config.ttft_target_s):
        if prefill_queued:
            p = max(p, signals.target.prefill + 1)
            notes.append("ttft over target with prefill queued: +1 prefill")
        if any(w.waiting > 0 for w in signals.decode):
            d = max(d, signals.target.decode + 1)
            notes.append("ttft over target with decode waiting: +1 decode")
    if _over(signals.itl_p90_s, config.itl_target_s):
        d = max(d, signals.target.decode + 1)
        notes.append("itl over target: +1 decode")
    return p, d


def decide(
    signals: Signals, config: PolicyConfig, limits: Limits, state: dict | None, now: float
) -> tuple[Decision, dict]:
    """One tick: the replica targets and the new state (`{role: {"since": t, "dir": +1|-1}}`)."""
    want, notes = demand(signals, config, limits)
    state = {role: dict((state or {}).get(role) or {}) for role in ROLES}
    held = _holds(signals, config)
    out = {}
    for role in ROLES:
        current, goal = signals.target.of(role), want.of(role)
        if goal < current and role in held:
            notes.append(f"{role} scale-down held: {held[role]}")
            goal = current
        out[role] = _step(role, current, goal, config, state[role], now)
    # Delays may leave one role behind the other: keep the ratio on the prefill side only, so
    # decode is never lowered (or raised) by this step.
    out["prefill"] = _fit_ratio(out["prefill"], out["decode"], config, limits)
    return Decision(Replicas(**out), want, tuple(notes)), state


def _holds(signals: Signals, config: PolicyConfig) -> dict[str, str]:
    held: dict[str, str] = {}
    if len(signals.prefill) < signals.running.prefill:
        held["prefill"] = "a running prefill replica has not reported"
    if signals.router_reports < signals.running.router:
        held["router"] = "a running router replica has not reported"
    decode = signals.decode
    if len(decode) < signals.running.decode:
        held["decode"] = "a running decode replica has not reported"
    elif any(w.draining for w in decode):
        held["decode"] = "a decode worker is draining"
    elif _over(signals.itl_p90_s, config.itl_target_s):
        held["decode"] = "itl over target"
    elif decode:
        seqs = _mean([w.running + w.waiting for w in decode])
        usage = sum(w.kv_blocks_used for w in decode) / max(1.0, sum(w.kv_blocks_total for w in decode))
        if seqs > config.drain_hold_seqs_per_replica:
            held["decode"] = f"{seqs:.1f} sequences per decode replica > {config.drain_hold_seqs_per_replica:g}"
        elif usage > config.drain_hold_kv_usage:
            held["decode"] = f"KV usage {usage:.2f} > {config.drain_hold_kv_usage:g}"
    if _over(signals.ttft_p90_s, config.ttft_target_s):
        held.setdefault("prefill", "ttft over target")
    return held


def _step(role: str, current: int, goal: int, config: PolicyConfig, st: dict, now: float) -> int:
    """Apply the up/down delays (state: since when the goal has pointed the same way)."""
    direction = (goal > current) - (goal < current)
    if direction == 0:
        st.clear()
        return current
    if st.get("dir") != direction:
        st.update(dir=direction, since=now)
    delay = config.upscale_delay_s if direction > 0 else config.downscale_delay_s
    if now - st["since"] < delay:
        return current
    st.clear()
    if direction < 0 and role == "decode":
        return current - 1  # one drain at a time; the slack clock restarts
    return goal


def _ratio_window(d: int, config: PolicyConfig) -> tuple[int, float]:
    lo = math.ceil(config.pd_ratio_min * d - 1e-9)
    hi = math.floor(config.pd_ratio_max * d + 1e-9) if math.isfinite(config.pd_ratio_max) else math.inf
    return lo, hi


def _fit_ratio(p: int, d: int, config: PolicyConfig, limits: Limits) -> int:
    lo, hi = _ratio_window(d, config)
    lo, hi = max(lo, limits.min.prefill), min(hi, limits.max.prefill)
    return int(min(max(p, lo), hi)) if lo <= hi else p


def _over(value: float | None, target: float | None) -> bool:
    return value is not None and target is not None and value > target


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
