"""Ray Serve's application-level autoscaling policy for flashpd (the decision itself is the pure
`services/autoscaling/policy.py`; the replicas' load reports are in `services/autoscaling/replicas.py`).

Set in the Serve config (Ray Serve calls it once per control-loop tick with every deployment's
`AutoscalingContext`):

    applications:
      - name: flashpd
        autoscaling_policy:
          policy_function: flashpd.services.autoscaling.serve:JointPolicy
          policy_kwargs: {decode_seqs_per_replica: 32, pd_ratio_min: 0.5, ...}
        args: {joint_autoscaling: true, ...}

Serve instantiates the class once with `policy_kwargs` (checked by `JointPolicyArgs`), then
applies each deployment's min/max bounds to the returned counts; `joint_autoscaling: true` sets
the deployments' own delays to 0 so the policy's delays are the only ones. This module runs in
the Serve controller: it imports no torch and no deployment code.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flashpd.services.autoscaling.policy import (
    Decision,
    Limits,
    PolicyConfig,
    Replicas,
    Signals,
    WorkerLoad,
    check_limits,
    decide,
)

log = logging.getLogger("ray.serve")  # Serve's logger: lands in the controller's log file

WORKER_METRICS = ("queued_prefill_tokens", "kv_blocks_used", "kv_blocks_total", "running", "waiting", "draining")
ROUTER_METRICS = ("requests_running", "ttft_p90_s", "itl_p90_s")
STATE_KEY = "flashpd_joint"


class JointPolicyArgs(BaseModel):
    """`policy_kwargs` of `JointPolicy` (services/autoscaling/policy.py says what each does)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_tokens_per_replica: float = Field(8192.0, gt=0)
    decode_seqs_per_replica: float = Field(32.0, gt=0)
    decode_kv_usage: float = Field(0.75, gt=0, le=1)
    router_requests_per_replica: float = Field(256.0, gt=0)
    ttft_target_s: float | None = Field(None, gt=0)
    itl_target_s: float | None = Field(None, gt=0)
    pd_ratio_min: float = Field(0.0, ge=0, description="prefill replicas per decode replica")
    pd_ratio_max: float | None = Field(None, gt=0, description="None: unbounded")
    upscale_delay_s: float = Field(0.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    drain_hold_seqs_per_replica: float = Field(8.0, ge=0)
    drain_hold_kv_usage: float = Field(0.5, gt=0, le=1)
    # "starting to stop": with the stack's Redis, a decode scale-down first marks the replica
    # Serve will stop draining and waits (at most drain_timeout_s) for its streams to move
    redis_url: str | None = None
    model_id: str | None = None
    drain_timeout_s: float = Field(60.0, gt=0)
    prefill_deployment: str = "PrefillServer"
    decode_deployment: str = "DecodeServer"
    router_deployment: str = "Router"

    @model_validator(mode="after")
    def _ratio(self):
        if self.pd_ratio_max is not None and self.pd_ratio_min > self.pd_ratio_max:
            raise ValueError("pd_ratio_min must be <= pd_ratio_max")
        return self

    def policy_config(self):
        data = self.model_dump(
            exclude={
                "prefill_deployment",
                "decode_deployment",
                "router_deployment",
                "redis_url",
                "model_id",
                "drain_timeout_s",
            }
        )
        data["pd_ratio_max"] = math.inf if self.pd_ratio_max is None else self.pd_ratio_max
        return PolicyConfig(**data)


class JointPolicy:
    """Application-level Serve autoscaling policy: one decision for router, prefill, decode."""

    def __init__(self, **policy_kwargs) -> None:
        self.args = JointPolicyArgs.model_validate(policy_kwargs)
        self.config = self.args.policy_config()
        self._marker = None  # (mark, unmark) on the stack's Redis, made at first use
        self._names = {
            "prefill": self.args.prefill_deployment,
            "decode": self.args.decode_deployment,
            "router": self.args.router_deployment,
        }

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        by_role = self._by_role(contexts)
        missing = set(self._names) - set(by_role)
        if missing:  # not this application's shape: leave every target where it is
            log.error(
                "JointPolicy: no deployment for %s in %s",
                sorted(missing),
                sorted(c.deployment_name for c in contexts.values()),
            )
            return _hold(contexts), {}
        limits = _limits({r: c for r, (_, c) in by_role.items()})
        try:
            check_limits(limits, self.config)
        except ValueError as exc:  # e.g. bounds lowered by target_capacity: hold, say why
            log.error("JointPolicy: holding every target: %s", exc)
            return _hold(contexts), {}
        signals = signals_from_contexts({r: c for r, (_, c) in by_role.items()})
        decode_id, decode_ctx = by_role["decode"]
        state = decode_ctx.policy_state.get(STATE_KEY)
        decision, state = decide(signals, self.config, limits, state, now=decode_ctx.current_time)
        decision = self._drain_first(decision, decode_ctx, state)
        if decision.replicas != signals.target or decision.notes:
            _log_decision(signals, decision)
        targets = {by_role[r][0]: decision.replicas.of(r) for r in by_role}
        return targets, {decode_id: {STATE_KEY: state}}

    def _by_role(self, contexts: dict) -> dict:
        """role -> (deployment id, its context), for this application's deployments."""
        by_role = {}
        for dep_id, ctx in contexts.items():
            for role, name in self._names.items():
                if ctx.deployment_name == name:
                    by_role[role] = (dep_id, ctx)
        return by_role

    def _drain_first(self, decision, decode_ctx, state: dict):
        """Hold a decode scale-down until the replica Serve will stop has drained
        (`services.drain.drain_before_scale_down`); its state rides in `state["drain"]`."""
        if self.args.redis_url is None or self.args.model_id is None:
            return decision
        from flashpd.services.drain import drain_before_scale_down, redis_marker

        if self._marker is None:
            self._marker = redis_marker(self.args.redis_url, self.args.model_id)
        mark, unmark = self._marker
        replicas = [rid.unique_id for rid in decode_ctx.running_replicas]
        decode, state["drain"], note = drain_before_scale_down(
            decision.replicas.decode,
            decode_ctx.target_num_replicas,
            replicas,
            decode_loads(decode_ctx),
            state.get("drain") or {},
            decode_ctx.current_time,
            mark=mark,
            unmark=unmark,
            timeout_s=self.args.drain_timeout_s,
        )
        if note is None:
            return decision
        return dataclasses.replace(
            decision, notes=(*decision.notes, note), replicas=dataclasses.replace(decision.replicas, decode=decode)
        )


def decode_loads(ctx) -> dict[str, WorkerLoad]:
    """Replica id -> its reported load, for the decode replicas that reported every metric."""
    per = ctx.aggregated_metrics or {}
    return {
        rid.unique_id: WorkerLoad(
            running=per["running"][rid], waiting=per["waiting"][rid], draining=per["draining"][rid] > 0
        )
        for rid in ctx.running_replicas
        if all(rid in per.get(m, {}) for m in ("running", "waiting", "draining"))
    }


def signals_from_contexts(ctx: dict) -> Signals:
    """`Signals` from the per-role AutoscalingContext (custom metrics per running replica)."""
    metrics = {role: c.aggregated_metrics or {} for role, c in ctx.items()}
    router = metrics["router"]
    router_ids = [rid for rid in ctx["router"].running_replicas if rid in router.get("requests_running", {})]
    return Signals(
        target=Replicas(**{r: c.target_num_replicas for r, c in ctx.items()}),
        running=Replicas(**{r: len(c.running_replicas) for r, c in ctx.items()}),
        prefill=_worker_loads(ctx["prefill"].running_replicas, metrics["prefill"]),
        decode=_worker_loads(ctx["decode"].running_replicas, metrics["decode"]),
        router_requests=sum(router["requests_running"][rid] for rid in router_ids),
        router_reports=len(router_ids),
        ttft_p90_s=_worst(router, router_ids, "ttft_p90_s"),
        itl_p90_s=_worst(router, router_ids, "itl_p90_s"),
    )


def _worker_loads(running_replicas, per_replica: dict) -> tuple[WorkerLoad, ...]:
    """The loads of the running replicas that reported every worker metric."""
    reported = [rid for rid in running_replicas if all(rid in per_replica.get(m, {}) for m in WORKER_METRICS)]
    return tuple(
        WorkerLoad(
            queued_prefill_tokens=per_replica["queued_prefill_tokens"][rid],
            kv_blocks_used=per_replica["kv_blocks_used"][rid],
            kv_blocks_total=per_replica["kv_blocks_total"][rid],
            running=per_replica["running"][rid],
            waiting=per_replica["waiting"][rid],
            draining=per_replica["draining"][rid] > 0,
        )
        for rid in reported
    )


def _worst(router: dict, router_ids: list, name: str) -> float | None:
    """The highest of the routers' reports of `name`; None when none reported a positive one."""
    values = [router[name][rid] for rid in router_ids if rid in router.get(name, {})]
    return max(values) if values and max(values) > 0 else None


def _limits(ctx: dict) -> Limits:
    """The replica bounds per role, as Serve adjusts them for `target_capacity`."""
    return Limits(
        min=Replicas(**{r: c.capacity_adjusted_min_replicas for r, c in ctx.items()}),
        max=Replicas(**{r: c.capacity_adjusted_max_replicas for r, c in ctx.items()}),
    )


def _log_decision(signals: Signals, decision: Decision) -> None:
    log.info(
        "JointPolicy: %s -> %s (demand %s) %s",
        signals.target,
        decision.replicas,
        decision.demand,
        "; ".join(decision.notes),
    )


def _hold(contexts: dict) -> dict:
    """Every deployment's target left where it is."""
    return {d: c.target_num_replicas for d, c in contexts.items()}
