"""`build_app(args) -> ray.serve.Application`: the flashpd application, validated at the edge.

Used by `serve run infra/serve.yaml` (import path `flashpd.services.app:build_app`, args from the
YAML) and by `flashpd serve`. The YAML/CLI args are checked by pydantic (unknown keys and bad
values raise, naming the field) and turned into frozen dataclasses for the workers.

    Router (ingress: OpenAI HTTP via Serve's proxy, gRPC on `grpc_port` from each replica)
      |-- PrefillServer  (engine in prefill role; autoscaled; PinnedWorkerRouter)
      '-- DecodeServer   (engine in decode role; autoscaled; PinnedWorkerRouter)
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flashpd.engine.llm_engine import EngineConfig
from flashpd.services.worker_common import WorkerConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingArgs(_Strict):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(4.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


class RoleArgs(_Strict):
    replicas: int | None = Field(1, ge=1, description="fixed replica count (or autoscaling)")
    autoscaling: AutoscalingArgs | None = None
    num_gpus: float = Field(0.0, ge=0)
    num_cpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(64, ge=1)
    num_blocks: int = Field(512, ge=1)
    num_slots: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    graceful_shutdown_timeout_s: float = Field(5.0, ge=0)
    num_threads: int = Field(1, ge=0, description="torch CPU threads per replica (0 = default)")

    def deployment_options(self) -> dict:
        opts = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": min(1.0, self.graceful_shutdown_timeout_s or 1.0),
            "health_check_period_s": 2.0,
        }
        if self.autoscaling is not None:
            opts["autoscaling_config"] = self.autoscaling.model_dump()
        else:
            opts["num_replicas"] = self.replicas
        return opts


class AppArgs(_Strict):
    checkpoint: str = Field(..., description="checkpoint directory (released format)")
    model_id: str = "flashpd-tiny"
    redis_url: str = Field(..., pattern=r"^rediss?://")
    grpc_port: int = Field(9000, ge=0, le=65535)
    grpc_host: str = "127.0.0.1"
    routing: Literal["affinity", "random", "round_robin"] = "affinity"
    swa_bounded_replay: bool = True
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    transfer_backend: Literal["nixl", "local"] = "nixl"
    kv_format: Literal["nvfp4", "fp8"] = "nvfp4"
    cache_salt: str = ""
    max_model_len: int | None = Field(None, ge=1, description="context limit (default: model's)")
    router_num_cpus: float = Field(0.0, ge=0)
    prefill: RoleArgs = RoleArgs()
    decode: RoleArgs = RoleArgs()

    @model_validator(mode="after")
    def _gpu_dtype(self) -> AppArgs:
        if self.device == "cuda" and self.dtype != "bfloat16":
            raise ValueError("dtype must be 'bfloat16' with device 'cuda' (the GPU path "
                             "computes in bfloat16)")
        return self

    def worker_config(self, role: str) -> WorkerConfig:
        r: RoleArgs = getattr(self, role)
        engine = EngineConfig(role=role, num_blocks=r.num_blocks, num_slots=r.num_slots,
                              max_num_batched_tokens=r.max_num_batched_tokens,
                              max_num_seqs=r.max_num_seqs,
                              swa_bounded_replay=self.swa_bounded_replay, dtype=self.dtype,
                              device=self.device, model_id=self.model_id,
                              cache_salt=self.cache_salt, num_threads=r.num_threads,
                              kv_format=self.kv_format)
        return WorkerConfig(self.checkpoint, self.model_id, engine, self.transfer_backend,
                            self.redis_url)


def build_app(args: dict):
    """Serve application builder (`import_path: flashpd.services.app:build_app`)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from flashpd.services.deployments import DecodeServer, PrefillServer
    from flashpd.services.router_deployment import Router

    parsed = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    pinned = RequestRouterConfig(
        request_router_class="flashpd.services.pinned_router:PinnedWorkerRouter")
    prefill = serve.deployment(PrefillServer, name="PrefillServer",
                               request_router_config=pinned,
                               **parsed.prefill.deployment_options())
    decode = serve.deployment(DecodeServer, name="DecodeServer", request_router_config=pinned,
                              **parsed.decode.deployment_options())
    router = serve.deployment(Router, name="Router", num_replicas=1,
                              ray_actor_options={"num_cpus": parsed.router_num_cpus},
                              graceful_shutdown_timeout_s=5.0, graceful_shutdown_wait_loop_s=1.0,
                              max_ongoing_requests=1024)
    return router.bind(
        parsed.model_dump(),
        prefill.bind(parsed.worker_config("prefill")),
        decode.bind(parsed.worker_config("decode")),
    )
