"""`build_app(args) -> ray.serve.Application`: the flashpd application, validated at the edge.

Used by `serve run infra/serve.yaml` (import path `flashpd.services.app:build_app`, args from the
YAML) and by `flashpd serve`. The YAML/CLI args are checked by pydantic (unknown keys and bad
values raise, naming the field) and turned into frozen dataclasses for the workers.

    Router (ingress: OpenAI HTTP via Serve's proxy, gRPC on `grpc_port` from each replica)
      |-- PrefillServer  (engine in prefill role; autoscaled; PinnedWorkerRouter)
      '-- DecodeServer   (engine in decode role; autoscaled; PinnedWorkerRouter)

or, with `mode: colocated` (one engine prefills and decodes; no KV transfer):

    Router (the same front ends and routing)
      '-- ColocatedServer (engine in colocated role; `colocated` section; PinnedWorkerRouter)

A config is one mode: `mode: colocated` with a `prefill` or `decode` section, or a `colocated`
section without `mode: colocated`, is refused naming the field.

With `joint_autoscaling: true` the three deployments are scaled together by the application-level
policy `flashpd.services.autoscaling.serve:JointPolicy` (set as the Serve application's
`autoscaling_policy`, its `policy_kwargs` checked by its `JointPolicyArgs`); each role's
`autoscaling` then only gives its replica bounds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import ClassVar, Literal
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flashpd.engine.llm_engine import EngineConfig
from flashpd.engine.speculative import BENCH_ENV, DEFAULT_MAX_BATCH, DEFAULT_MAX_CONTEXT_TOKENS, SpeculativeConfig
from flashpd.kernels import dispatch
from flashpd.model.kv_format import DEFAULT_KV_FORMAT, KVFormatName
from flashpd.services.api import DEPLOYMENT_ROLES, ServingMode
from flashpd.services.worker.common import WorkerConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpeculativeArgs(_Strict):
    """Speculative decoding on the decode workers (engine/speculative.py)."""

    method: Literal["dspark", "ngram"] = "dspark"
    num_tokens: int = Field(5, ge=1, le=16, description="drafts per step (DSpark: 5)")
    max_batch: int = Field(
        DEFAULT_MAX_BATCH,
        ge=0,
        description="no speculation in a step with more decode rows (provisional default; see the README)",
    )
    max_context_tokens: int | None = Field(
        DEFAULT_MAX_CONTEXT_TOKENS,
        ge=0,
        description="no speculation in a step whose decode rows' contexts add up to more (null: no bound)",
    )
    ngram_min: int = Field(1, ge=1)
    ngram_max: int = Field(4, ge=1)
    bench_forced_acceptance_length: float | None = Field(
        None,
        description="BENCHMARK ONLY: accept drafts on a fixed schedule of this mean "
        f"acceptance length; refused unless {BENCH_ENV}=1",
    )
    draft_graphs: Literal["auto", "off"] = Field(
        "auto", description="DSpark greedy drafts through CUDA graphs (auto: on a GPU) or eagerly (off)"
    )

    @model_validator(mode="after")
    def _engine_rules(self) -> SpeculativeArgs:
        self.engine_config()  # the engine's rules (forced acceptance needs the bench env)
        return self

    def engine_config(self) -> SpeculativeConfig:
        return SpeculativeConfig(**self.model_dump())


class AutoscalingArgs(_Strict):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(4.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)
    metrics_interval_s: float = Field(2.0, gt=0, description="replica load report period")
    look_back_period_s: float = Field(10.0, gt=0, description="load averaging window")

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


Bundle = dict[str, float]


class _Placement(_Strict):
    """Where a replica runs: Ray resources, custom node resources, placement-group bundles."""

    num_gpus: float = Field(0.0, ge=0)
    num_cpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources, e.g. {flashpd_decode: 1} to land on decode nodes"
    )
    placement_group_bundles: list[Bundle] | None = Field(
        None,
        description="one replica spanning several bundles (e.g. GPUs); the replica actor itself takes the first bundle",
    )
    placement_group_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = None

    @model_validator(mode="after")
    def _bundles(self):
        bundles = self.placement_group_bundles
        if bundles is None:
            if self.placement_group_strategy is not None:
                raise ValueError("placement_group_strategy needs placement_group_bundles")
            return self
        if not bundles or any(not b or any(v < 0 for v in b.values()) for b in bundles):
            raise ValueError("placement_group_bundles must be non-empty bundles of non-negative resources")
        need = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        short = {k: v for k, v in need.items() if v > bundles[0].get(k, 0.0)}
        if short:
            raise ValueError(f"placement_group_bundles[0] must hold the replica's own resources; missing {short}")
        return self

    def placement_options(self) -> dict:
        opts: dict = {"ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}}
        if self.resources:
            opts["ray_actor_options"]["resources"] = dict(self.resources)
        if self.placement_group_bundles is not None:
            opts["placement_group_bundles"] = [dict(b) for b in self.placement_group_bundles]
            opts["placement_group_strategy"] = self.placement_group_strategy or "STRICT_PACK"
        return opts


def _scaling_options(replicas: int | None, autoscaling: AutoscalingArgs | None, joint: bool) -> dict:
    if autoscaling is None:
        return {"num_replicas": replicas}
    config = autoscaling.model_dump()
    if joint:  # the joint policy applies its own delays; Serve must pass its decisions through
        config.update(upscale_delay_s=0.0, downscale_delay_s=0.0)
    return {"autoscaling_config": config}


class RoleArgs(_Placement):
    replicas: int | None = Field(1, ge=1, description="fixed replica count (or autoscaling)")
    autoscaling: AutoscalingArgs | None = None
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="Serve calls a replica takes at once (default: max_num_seqs + "
        "max_queued_requests + a margin, so queued reserves never starve running streams)",
    )
    max_queued_requests: int = Field(
        1024,
        ge=0,
        description="decode reserves waiting for KV capacity before a refusal "
        "(RESOURCE_EXHAUSTED / 429 with retry-after)",
    )
    retry_after_s: float = Field(1.0, gt=0, description="retry-after hint sent with a refusal")
    num_blocks: int = Field(512, ge=1)
    num_slots: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    graceful_shutdown_timeout_s: float = Field(5.0, ge=0)
    num_threads: int = Field(1, ge=0, description="torch CPU threads per replica (0 = default)")

    # Serve slots kept free of queued reserves, beyond one per running stream (aborts, stats,
    # health calls).
    SPARE_CALLS: ClassVar[int] = 8

    def ongoing_limit(self) -> int:
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        return self.max_num_seqs + self.max_queued_requests + self.SPARE_CALLS

    def queue_limit(self) -> int:
        """Reserves that may wait inside a replica: each holds a Serve slot while it waits, so
        the queue never takes the slots that admitted streams need for their generate calls."""
        room = self.ongoing_limit() - self.max_num_seqs - self.SPARE_CALLS
        return max(0, min(self.max_queued_requests, room))

    def deployment_options(self, joint: bool = False) -> dict:
        return {
            "max_ongoing_requests": self.ongoing_limit(),
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": min(1.0, self.graceful_shutdown_timeout_s or 1.0),
            "health_check_period_s": 2.0,
            **self.placement_options(),
            **_scaling_options(self.replicas, self.autoscaling, joint),
        }


class RouterArgs(_Placement):
    replicas: int | None = Field(1, ge=1)
    autoscaling: AutoscalingArgs | None = None
    max_ongoing_requests: int = Field(1024, ge=1)
    graceful_shutdown_timeout_s: float = Field(5.0, ge=0)

    def deployment_options(self, joint: bool = False) -> dict:
        return {
            "max_ongoing_requests": self.max_ongoing_requests,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": 1.0,
            **self.placement_options(),
            **_scaling_options(self.replicas, self.autoscaling, joint),
        }


class AppArgs(_Strict):
    checkpoint: str = Field(
        ...,
        description="checkpoint directory (released format), or "
        "random:<preset>[:<seed>] (weights generated on the GPU)",
    )
    model_id: str = "flashpd-tiny"
    redis_url: str | None = Field(
        None,
        pattern=r"^rediss?://",
        description="redis:// or rediss:// (TLS); no password in it when a redis_password_* source is set",
    )
    redis_url_env: str | None = Field(None, description="environment variable holding the URL")
    redis_password_env: str | None = Field(None, description="environment variable holding the Redis password")
    redis_password_file: str | None = Field(None, description="file holding the Redis password")
    grpc_port: int = Field(9000, ge=0, le=65535)
    grpc_host: str = Field("127.0.0.1", description="the one interface gRPC listens on")
    api_keys_env: str | None = Field(
        "FLASHPD_API_KEYS", description="environment variable with comma-separated API keys (none set: no auth)"
    )
    api_keys_file: str | None = Field(None, description="file with one API key per line")
    tls_cert_file: str | None = Field(
        None, description="PEM chain: gRPC serves TLS only (HTTPS: Serve's http_options.ssl_certfile/ssl_keyfile)"
    )
    tls_key_file: str | None = Field(None, description="PEM key for tls_cert_file")
    routing: Literal["affinity", "random", "round_robin"] = "affinity"
    overlap_reserve: bool = Field(
        True,
        description="the router starts the prefill's compute alongside the decode reservation "
        "(the ticket is only needed for the KV push); false: reserve, then prefill",
    )
    swa_bounded_replay: bool = True
    async_scheduling: bool = Field(
        True,
        description="decode workers plan and launch step N+1 "
        "before step N's ids reach the host (host work overlaps "
        "the device); one dropped row per stop",
    )
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    transfer_backend: Literal["nixl", "local"] = "nixl"
    kv_format: KVFormatName = DEFAULT_KV_FORMAT.name
    kernel_impls: dict[str, str] = Field(
        default_factory=dict,
        description="op -> kernel implementation over the device's default (GPU: Triton where an "
        "op has it), e.g. {mhc: ref, indexer: ref}: the torch references (the A/B baseline)",
    )
    cache_salt: str = ""
    max_model_len: int | None = Field(None, ge=1, description="context limit (default: model's)")
    graph_width_ratio: int = Field(
        2,
        ge=0,
        le=16,
        description="GPU: key tables sized to context classes growing by this ratio from "
        "4,096 tokens to the context limit, all captured at warm-up (no capture at a new "
        "width); 0: widths step by 1,024 key entries (1 is refused)",
    )
    kv_lease_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="how long a decode reservation "
        "waits for its KV (prefill queueing included) before its blocks "
        "are freed; both roles use it",
    )
    kv_push_early: bool = Field(
        False,
        description="prefill: write the KV of a prompt's chunks before its last one while the last "
        "computes, so the push at the prompt's end moves one chunk (off: one push at the end)",
    )
    joint_autoscaling: bool = Field(
        False, description="scaled by the application-level JointPolicy: every role needs `autoscaling` bounds"
    )
    speculative: SpeculativeArgs | None = Field(
        None, description="speculative decoding on the decode workers (null: off)"
    )
    mode: ServingMode = Field(
        "disaggregated",
        description="disaggregated: prefill + decode workers, KV pushed P -> D; colocated: one "
        "worker role that prefills and decodes (the `colocated` section), no KV transfer",
    )
    router: RouterArgs = RouterArgs()
    prefill: RoleArgs = RoleArgs()
    decode: RoleArgs = RoleArgs()
    colocated: RoleArgs | None = Field(None, description="the colocated workers (mode: colocated only)")

    @model_validator(mode="after")
    def _one_mode(self) -> AppArgs:
        """A config serves one mode; mixing the roles is refused naming the field."""
        if self.mode == "disaggregated":
            if self.colocated is not None:
                raise ValueError(
                    "colocated: a colocated section needs `mode: colocated` (this config serves "
                    "disaggregated through its prefill and decode sections)"
                )
            return self
        mixed = sorted({"prefill", "decode"} & self.model_fields_set)
        if mixed:
            raise ValueError(
                f"{', '.join(mixed)}: mode colocated serves with the `colocated` workers only; "
                "remove the prefill/decode sections or set `mode: disaggregated`"
            )
        if self.joint_autoscaling:
            raise ValueError(
                "joint_autoscaling: the joint policy scales prefill against decode; with mode "
                "colocated give `colocated.autoscaling` (Serve's own policy) instead"
            )
        return self

    @property
    def colocated_args(self) -> RoleArgs:
        """The colocated workers' section (defaults when the config gives none)."""
        return self.colocated if self.colocated is not None else RoleArgs()

    def worker_roles(self) -> tuple[str, ...]:
        """The worker deployments this config serves with."""
        return ("colocated",) if self.mode == "colocated" else ("prefill", "decode")

    @field_validator("kernel_impls")
    @classmethod
    def _registered_kernels(cls, impls: dict[str, str]) -> dict[str, str]:
        dispatch.check_impls(impls)  # ValueError: pydantic names the field
        return impls

    @model_validator(mode="after")
    def _tls_pair(self) -> AppArgs:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        return self

    @model_validator(mode="after")
    def _random_weights(self) -> AppArgs:
        from flashpd.engine.loading import random_source

        if random_source(self.checkpoint) is not None and self.device != "cuda":
            raise ValueError("checkpoint random:<preset> needs device 'cuda' (the weights are generated on the GPU)")
        return self

    @model_validator(mode="after")
    def _width_ratio(self) -> AppArgs:
        if self.graph_width_ratio == 1:
            raise ValueError("graph_width_ratio must be 0 (linear width steps) or 2..16, got 1")
        return self

    @model_validator(mode="after")
    def _gpu_dtype(self) -> AppArgs:
        if self.device == "cuda" and self.dtype != "bfloat16":
            raise ValueError("dtype must be 'bfloat16' with device 'cuda' (the GPU path computes in bfloat16)")
        return self

    @model_validator(mode="after")
    def _redis_source(self) -> AppArgs:
        if (self.redis_url is None) == (self.redis_url_env is None):
            raise ValueError("give exactly one of redis_url and redis_url_env")
        if self.redis_password_env is not None and self.redis_password_file is not None:
            raise ValueError("give at most one of redis_password_env and redis_password_file")
        return self

    @model_validator(mode="after")
    def _joint(self) -> AppArgs:
        if self.joint_autoscaling and self.mode == "disaggregated":
            missing = [r for r in DEPLOYMENT_ROLES if getattr(self, r).autoscaling is None]
            if missing:
                raise ValueError(f"joint_autoscaling needs `autoscaling` bounds for {missing}")
        return self

    def resolved_redis_url(
        self, environ: Mapping[str, str] = os.environ, read_file: Callable[[str], str] | None = None
    ) -> str:
        """The URL the router and workers connect with, password filled in from its source."""
        url = self.redis_url
        if url is None:
            url = environ.get(self.redis_url_env or "", "")
            if not url.startswith(("redis://", "rediss://")):
                raise ValueError(f"redis_url_env: ${self.redis_url_env} must hold a redis:// or rediss:// URL")
        password = None
        if self.redis_password_env is not None:
            password = environ.get(self.redis_password_env)
            if not password:
                raise ValueError(f"redis_password_env: ${self.redis_password_env} is unset")
        elif self.redis_password_file is not None:
            password = (read_file or _read_text)(self.redis_password_file).strip()
            if not password:
                raise ValueError(f"redis_password_file: {self.redis_password_file} is empty")
        return url if password is None else _with_password(url, password)

    def worker_config(self, role: str, redis_url: str | None = None) -> WorkerConfig:
        if role not in self.worker_roles():
            raise ValueError(f"role {role!r} is not served in mode {self.mode} (roles: {self.worker_roles()})")
        r: RoleArgs = self.colocated_args if role == "colocated" else getattr(self, role)
        spec = None if self.speculative is None else self.speculative.engine_config()
        return WorkerConfig(
            self.checkpoint,
            self.model_id,
            self._engine_config(role, r, spec if role in ("decode", "colocated") else None),
            self.transfer_backend,
            redis_url or self.resolved_redis_url(),
            lease_s=self.kv_lease_s,
            max_queued_requests=r.queue_limit(),
            retry_after_s=r.retry_after_s,
            speculative=None if spec is None else spec.handoff(),
            push_early=self.kv_push_early,
        )

    def _engine_config(self, role: str, r: RoleArgs, spec: SpeculativeConfig | None) -> EngineConfig:
        """The engine of a `role` worker; `spec`: speculative decoding (the roles that sample)."""
        return EngineConfig(
            role=role,
            num_blocks=r.num_blocks,
            num_slots=r.num_slots,
            max_num_batched_tokens=r.max_num_batched_tokens,
            max_num_seqs=r.max_num_seqs,
            swa_bounded_replay=self.swa_bounded_replay,
            dtype=self.dtype,
            device=self.device,
            model_id=self.model_id,
            cache_salt=self.cache_salt,
            num_threads=r.num_threads,
            kv_format=self.kv_format,
            kernel_impls=self.kernel_impls,
            async_scheduling=self.async_scheduling,
            max_model_len=self.max_model_len,
            graph_width_ratio=self.graph_width_ratio,
            speculative=spec,
        )


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def _with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"))


def build_app(args: dict):
    """Serve application builder (`import_path: flashpd.services.app:build_app`)."""
    from ray import serve

    from flashpd.services.autoscaling.replicas import (
        ReportingColocatedServer,
        ReportingDecodeServer,
        ReportingPrefillServer,
        ReportingRouter,
    )

    parsed = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    joint = parsed.joint_autoscaling
    redis_url = parsed.resolved_redis_url()
    if parsed.mode == "colocated":
        colocated = _worker_deployment(ReportingColocatedServer, "ColocatedServer", parsed.colocated_args, False)
        router = serve.deployment(ReportingRouter, name="Router", **parsed.router.deployment_options(False))
        worker = colocated.bind(parsed.worker_config("colocated", redis_url))
        return router.bind({**parsed.model_dump(), "redis_url": redis_url}, None, None, worker)
    prefill = _worker_deployment(ReportingPrefillServer, "PrefillServer", parsed.prefill, joint)
    decode = _worker_deployment(ReportingDecodeServer, "DecodeServer", parsed.decode, joint)
    router = serve.deployment(ReportingRouter, name="Router", **parsed.router.deployment_options(joint))
    return router.bind(
        {**parsed.model_dump(), "redis_url": redis_url},
        prefill.bind(parsed.worker_config("prefill", redis_url)),
        decode.bind(parsed.worker_config("decode", redis_url)),
    )


def _worker_deployment(cls: type, name: str, role: RoleArgs, joint: bool):
    """A worker role's deployment; its replicas are reached through the pinned-worker router
    (a request may name the replica it must reach)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    pinned = RequestRouterConfig(request_router_class="flashpd.services.worker.pinned_router:PinnedWorkerRouter")
    return serve.deployment(cls, name=name, request_router_config=pinned, **role.deployment_options(joint))
