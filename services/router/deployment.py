"""The Router deployment: Serve ingress for OpenAI HTTP, plus a gRPC server per replica.

On replica start (`__serve_build_asgi_app__`, awaited by Serve after the constructor) it opens
Redis, builds the placement (index + policy) and the orchestrator over the prefill/decode
deployment handles (or the colocated one, `mode: colocated`), starts the gRPC frontend on `grpc_port` (SO_REUSEPORT lets several router
replicas on one host share it) and returns the FastAPI app Serve's HTTP proxy serves.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence

from ray import serve

from flashpd.services.api import (
    Event,
    InternalRequest,
    MigrationResult,
    PrefillResult,
    Ticket,
    Unavailable,
    WorkerRef,
    WorkerStats,
)
from flashpd.services.router.auth import ApiKeys, TlsFiles
from flashpd.services.router.convert import ModelTable, ServedModel, deepseek_chat_prompt
from flashpd.services.worker.pinned_router import TARGET_KWARG

log = logging.getLogger(__name__)


class HFTokenizer:
    """The router's tokenizer protocol over an HF `tokenizers.Tokenizer`."""

    def __init__(self, tok) -> None:
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """User-visible text: special tokens (chat markers, EOS) never show."""
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        return self.encode(deepseek_chat_prompt(messages))


class PinnedEndpoint:
    """One worker (by id) reached through its deployment's handle and PinnedWorkerRouter."""

    def __init__(self, handle, worker: WorkerRef) -> None:
        self._handle, self._kw = handle, {TARGET_KWARG: worker.worker_id}
        self._stream = handle.options(stream=True)

    async def reserve(self, req: InternalRequest) -> Ticket:
        return await self._handle.reserve.remote(req, **self._kw)

    async def start(self, req: InternalRequest) -> bool:
        return await self._handle.start.remote(req, **self._kw)

    async def run(self, req: InternalRequest, ticket: Ticket) -> PrefillResult:
        return await self._handle.run.remote(req, ticket, **self._kw)

    async def generate(self, req: InternalRequest) -> AsyncIterator[Event]:
        gen = self._stream.generate.remote(req, **self._kw)
        try:
            async for event in gen:
                yield event
        finally:
            gen.cancel()

    async def abort(self, request_id: str) -> bool:
        return await self._handle.abort.remote(request_id, **self._kw)

    async def migrate_out(self, request_id: str, ticket: Ticket) -> MigrationResult:
        return await self._handle.migrate_out.remote(request_id, ticket, **self._kw)

    async def resume(self, request_id: str) -> bool:
        return await self._handle.resume.remote(request_id, **self._kw)

    async def drain(self, deadline_s: float) -> int:
        return await self._handle.drain.remote(deadline_s, **self._kw)

    async def stats(self) -> WorkerStats:
        return await self._handle.stats.remote(**self._kw)


class PinnedDirectory:
    """Endpoints of the served mode's deployments (a role the mode lacks has no handle)."""

    def __init__(self, prefill_handle, decode_handle, colocated_handle=None) -> None:
        self._handles = {"prefill": prefill_handle, "decode": decode_handle, "colocated": colocated_handle}

    def _endpoint(self, worker: WorkerRef) -> PinnedEndpoint:
        handle = self._handles.get(worker.role)
        if handle is None:
            raise Unavailable(f"no {worker.role} deployment in this application ({worker.key})")
        return PinnedEndpoint(handle, worker)

    def prefill(self, worker: WorkerRef) -> PinnedEndpoint:
        return self._endpoint(worker)

    def decode(self, worker: WorkerRef) -> PinnedEndpoint:
        return self._endpoint(worker)

    def colocated(self, worker: WorkerRef) -> PinnedEndpoint:
        return self._endpoint(worker)


@serve.ingress()
class Router:
    def __init__(self, args: dict, prefill_handle, decode_handle, colocated_handle=None) -> None:
        """The handles of the served mode's workers: prefill + decode (disaggregated), or
        colocated alone (`args["mode"] == "colocated"`, the other two None)."""
        self.args = args
        self._prefill, self._decode, self._colocated = prefill_handle, decode_handle, colocated_handle
        self.grpc = None

    async def __serve_build_asgi_app__(self):
        from flashpd.services.router.http_app import build_http_app

        a = self.args
        models = self._load_model()
        self._build_orchestrator(a["model_id"])
        keys = ApiKeys.load(env_var=a.get("api_keys_env", "FLASHPD_API_KEYS"), file=a.get("api_keys_file"))
        tls = TlsFiles.from_paths(a.get("tls_cert_file"), a.get("tls_key_file"))
        await self._start_grpc(models, keys, tls)
        return build_http_app(self.orchestrator, models, self.tokenizer, self.metrics, api_keys=keys)

    def _load_model(self) -> ModelTable:
        """The served model's table (context, vocabulary) and the tokenizer, from the checkpoint."""
        from flashpd.engine.loading import load_tokenizer, model_config

        a = self.args
        cfg = model_config(a["checkpoint"])
        tok = load_tokenizer(a["checkpoint"])
        if tok is None:
            raise ValueError(f"checkpoint {a['checkpoint']} ships no tokenizer.json")
        self.tokenizer = HFTokenizer(tok)
        context = min(a.get("max_model_len") or cfg.max_position_embeddings, cfg.max_position_embeddings)
        return ModelTable([ServedModel(a["model_id"], context, cfg.vocab_size)])

    def _build_orchestrator(self, model: str) -> None:
        from flashpd.services.router.index import PrefixIndex, router_redis
        from flashpd.services.router.metrics import RouterMetrics
        from flashpd.services.router.orchestrator import Orchestrator, OrchestratorConfig
        from flashpd.services.router.placement import Placement
        from flashpd.services.router.policy import make_policy

        a = self.args
        self.redis = router_redis(a["redis_url"])  # retried reconnects, socket timeouts
        placement = Placement(
            PrefixIndex(self.redis, model),
            make_policy(a["routing"]),
            model=model,
            cache_salt=a["cache_salt"],
            mode=a.get("mode", "disaggregated"),
        )
        self.metrics = RouterMetrics(model)
        directory = PinnedDirectory(self._prefill, self._decode, self._colocated)
        config = OrchestratorConfig(overlap_reserve=a.get("overlap_reserve", True))
        self.orchestrator = Orchestrator(
            {model: placement}, directory, self.tokenizer, metrics=self.metrics, config=config
        )

    async def _start_grpc(self, models: ModelTable, keys: ApiKeys, tls: TlsFiles | None) -> None:
        from flashpd.services.router.grpc_server import start_grpc_server

        a = self.args
        self.grpc = await start_grpc_server(
            self.orchestrator,
            models,
            self.tokenizer,
            host=a["grpc_host"],
            port=a["grpc_port"],
            metrics=self.metrics,
            api_keys=keys,
            tls=tls,
        )
        log.info(
            "flashpd router: gRPC on %s:%d (%s, %s)",
            a["grpc_host"],
            self.grpc.port,
            "TLS" if tls else "plaintext",
            f"{len(keys)} API keys" if len(keys) else "no auth",
        )

    async def grpc_port(self) -> int:
        return self.grpc.port if self.grpc is not None else -1

    async def __del__(self) -> None:
        if self.grpc is not None:
            await self.grpc.stop(1.0)
        redis = getattr(self, "redis", None)
        if redis is not None:
            await redis.aclose()
