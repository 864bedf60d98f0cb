"""LLMEngine: scheduler + KV cache manager + runner + sampler, one step at a time.

    engine.add_request(rid, prompt_ids, SamplingParams(...))     colocated / prefill roles
    engine.reserve(rid, prompt_ids, params) -> Reservation       decode role, then kv_arrived(rid)
    outputs = engine.step()                                      one batched forward
    engine.abort(rid)

`EngineConfig.swa_bounded_replay` (on by default) selects the replay length after a prefix hit
or a P->D handoff: the 128-token bounded replay, or, when off, the exact replay of the full
receptive field (`exact_replay_rows`: W + (L-1)(W-1) rows), whose outputs equal a cold run.
With it on, colocated prefill chunks also run the decoder layers only on their last 128 rows.

The engine streams token ids and stops on EOS (unless `ignore_eos`) and `stop_token_ids`; text
and stop strings belong to whoever detokenizes (`engine.detokenizer.TextStream`: the router, the
CLI), which aborts the request when a stop string matches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from flashpd.engine.kv_cache_manager import KVCacheManager
from flashpd.engine.kv_pools import KVPools
from flashpd.engine.policies import ROLES, role_from_name
from flashpd.engine.request import Request
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import Sampler, SamplingParams
from flashpd.engine.scheduler import (
    FinishSignal,
    Reservation,
    Scheduler,
    SchedulerConfig,
    StepResult,
)
from flashpd.model.model import Model, exact_replay_rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
log = logging.getLogger(__name__)
MAX_REQUEST_STATS = 10_000  # per-request timing records kept (oldest dropped first)


@dataclass(frozen=True)
class EngineConfig:
    role: str = "colocated"
    num_blocks: int = 512
    num_slots: int = 64
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    swa_bounded_replay: bool = True
    dtype: str = "float32"
    device: str = "cpu"
    model_id: str = "flashpd-tiny"
    cache_salt: str = ""
    seed: int = 0
    kv_format: str = "nvfp4"  # compressed main KV: "nvfp4" (trained format) or "fp8"
    num_threads: int = 0  # torch CPU threads for this process (0 = leave torch's default)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {self.role!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("num_blocks", "num_slots", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class RequestStats:
    arrival_s: float
    prompt_tokens: int
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_s is None else 1e3 * (self.first_token_s - self.arrival_s)


@dataclass(frozen=True)
class EngineOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "kv_ready"
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    logprobs: tuple = ()  # SampleOutput per new token when requested
    kv_block_ids: tuple[int, ...] = ()  # prefill role, kv_ready
    error: str | None = None  # finish_reason "error": why this request (alone) failed


class LLMEngine:
    def __init__(self, model: Model, config: EngineConfig, eos_token_id: int | None = None):
        self.model, self.config = model, config
        cfg = model.cfg
        self.replay_tokens = cfg.sliding_window if config.swa_bounded_replay else exact_replay_rows(cfg)
        self.kv = KVCacheManager(config.num_blocks, config.num_slots, 128,
                                 namespace=f"{config.model_id}|{config.cache_salt}",
                                 replay_tokens=self.replay_tokens)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs),
            self.kv, role_from_name(config.role))
        if model.kv_format.name != config.kv_format:
            raise ValueError(f"kv_format {config.kv_format!r} but the model fake-quantises "
                             f"compressed KV as {model.kv_format.name!r}")
        # issue 12 (helper F): the pools take the KV format object and window scratch rows
        # from the model's declared capability (Model.stages_window_kv)
        self.pools = KVPools.for_model(model, config.num_blocks, config.num_slots, config.device,
                                       max_rows=config.max_num_batched_tokens)
        narrowing = cfg.sliding_window if (config.swa_bounded_replay and config.role == "colocated") else None
        self.runner = ModelRunner(model, self.pools, decoder_rows=narrowing)
        self.sampler = Sampler(config.seed)
        self.eos_token_id = eos_token_id
        self._requests: dict[str, Request] = {}
        self._params: dict[str, SamplingParams] = {}
        self.stats: dict[str, RequestStats] = {}
        self.num_steps = 0

    # ------------------------------------------------------------------ admission
    def add_request(self, request_id: str, prompt_ids, params: SamplingParams,
                    session_id: str | None = None) -> None:
        request = self._new_request(request_id, prompt_ids, params, session_id)
        self.scheduler.add(request)

    def reserve(self, request_id: str, prompt_ids, params: SamplingParams,
                session_id: str | None = None) -> Reservation | None:
        """Decode role: blocks for the whole prompt (own prefix hit reused); None when full."""
        request = self._new_request(request_id, prompt_ids, params, session_id)
        reservation = self.scheduler.reserve(request)
        if reservation is None:
            self._drop(request_id)
        return reservation

    def kv_arrived(self, request_id: str) -> None:
        self.scheduler.kv_arrived(request_id)

    def release_kv(self, request_id: str) -> None:
        self.scheduler.release_kv(request_id)
        self._drop(request_id)

    def abort(self, request_id: str) -> bool:
        found = self.scheduler.abort(request_id)
        self._drop(request_id)
        return found

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _new_request(self, request_id, prompt_ids, params, session_id) -> Request:
        ids = [int(t) for t in prompt_ids]
        bad = [t for t in ids if not 0 <= t < self.model.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: token id {bad[0]} outside [0, {self.model.cfg.vocab_size})")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        request = Request(request_id, ids, params, session_id=session_id,
                          arrival_time=time.monotonic())
        self._requests[request_id] = request
        self._params[request_id] = params
        self.stats[request_id] = RequestStats(time.monotonic(), len(ids))
        while len(self.stats) > MAX_REQUEST_STATS:  # a long-running worker keeps the newest
            del self.stats[next(iter(self.stats))]
        return request

    def _drop(self, request_id: str) -> None:
        for table in (self._requests, self._params):
            table.pop(request_id, None)
        self.sampler.forget(request_id)
        self.runner.forget([request_id])

    # ------------------------------------------------------------------ one step
    def step(self) -> list[EngineOutput]:
        """One batched forward. A failure is contained: a request whose sampling fails ends
        alone with finish_reason "error"; a forward that raises ends the requests of its plan
        (the forward is batched, so the culprit cannot be told apart), and the engine goes on."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            self.runner.forget(plan.freed_request_ids + plan.preempted_request_ids)
            return []
        try:
            known = {c.request_id: self._requests[c.request_id].token_ids for c in plan.chunks}
            out = self.runner.execute(plan, known)
        except Exception as exc:  # noqa: BLE001 - contained: the plan's requests fail, not the loop
            log.exception("forward of step %d failed; failing its %d request(s)",
                          plan.step_id, len(plan.chunks))
            errors = {c.request_id: f"forward failed: {type(exc).__name__}: {exc}"
                      for c in plan.chunks}
            return self._fail(plan, errors)
        rids = [c.request_id for c in plan.chunks if c.request_id in out.logits]
        samples, errors = self._sample(rids, out.logits)
        failed = self._fail_requests(errors)
        result = StepResult(
            sampled_token_ids={r: [s.token_id for s in [samples[r]]] for r in samples},
            finish_signals=self._signals(samples))
        outputs = self.scheduler.update(plan, result)
        self.num_steps += 1
        return failed + [self._to_output(o, samples.get(o.request_id)) for o in outputs]

    def _sample(self, rids: list[str], logits_by_rid) -> tuple[dict, dict[str, str]]:
        """Samples per request id, and an error message per request whose sampling raised."""
        if not rids:
            return {}, {}
        try:
            logits = torch.stack([logits_by_rid[r] for r in rids])
            params = [self._params[r] for r in rids]
            return dict(zip(rids, self.sampler.sample(logits, rids, params), strict=True)), {}
        except Exception:  # noqa: BLE001 - retried row by row to find the failing request(s)
            pass
        samples, errors = {}, {}
        for rid in rids:
            try:
                row = logits_by_rid[rid][None]
                samples[rid] = self.sampler.sample(row, [rid], [self._params[rid]])[0]
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                log.exception("sampling for %s failed", rid)
                errors[rid] = f"sampling failed: {type(exc).__name__}: {exc}"
        return samples, errors

    def _fail(self, plan, errors: dict[str, str]) -> list[EngineOutput]:
        failed = self._fail_requests(errors)
        self.scheduler.update(plan, StepResult())  # closes the step; failed requests are gone
        self.num_steps += 1
        return failed

    def _fail_requests(self, errors: dict[str, str]) -> list[EngineOutput]:
        outputs = []
        for rid, message in errors.items():
            request = self._requests.get(rid)
            prompt = 0 if request is None else request.num_prompt_tokens
            produced = 0 if request is None else request.num_output_tokens
            self.scheduler.abort(rid)
            self._drop(rid)
            outputs.append(EngineOutput(rid, (), True, "error", prompt, produced, 0,
                                        error=message))
        return outputs

    def _signals(self, samples) -> dict[str, FinishSignal]:
        if self.eos_token_id is None:
            return {}
        return {rid: FinishSignal.EOS for rid, s in samples.items()
                if s.token_id == self.eos_token_id}

    def _to_output(self, o, sample) -> EngineOutput:
        now = time.monotonic()
        st = self.stats.get(o.request_id)
        if st is not None and o.new_token_ids:
            st.first_token_s = st.first_token_s or now
            st.token_times_s.append(now)
        reason = o.finish_reason.value if o.finish_reason is not None else None
        logprobs = (sample,) if sample is not None and self._wants_logprobs(o.request_id) else ()
        if o.finished and reason != "kv_ready":
            self._drop(o.request_id)
        return EngineOutput(o.request_id, tuple(o.new_token_ids), o.finished, reason,
                            o.num_prompt_tokens, o.num_output_tokens, o.num_cached_tokens,
                            logprobs, tuple(o.kv_block_ids))

    def _wants_logprobs(self, request_id: str) -> bool:
        p = self._params.get(request_id)
        return p is not None and p.logprobs > 0

    # ------------------------------------------------------------------ views
    def usage(self) -> dict[str, int]:
        return dict(self.kv.usage(), running=self.scheduler.num_running,
                    waiting=self.scheduler.num_waiting)

    def drain_cache_events(self):
        return self.kv.drain_events()

    def drain_cache_snapshot(self):
        """Every cached chunk as events, replacing pending ones (re-publish after index loss)."""
        return self.kv.drain_snapshot()
