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

Guided decoding (`SamplingParams.guided`: JSON mode, JSON schema, enforced tool calls) needs
`grammar` (`engine/grammar.py`, built from the tokenizer by `load_engine`): each guided request
holds a matcher; every step that samples a guided row fills its token bitmask from the matcher
(the sampler masks the logits) and feeds the sampled id back. A step with guided rows is not
followed by one planned ahead (async scheduling): the next mask needs this step's id on the
host, so those steps run synchronously (measured in `bench/grammar_mask.py`).

Speculative decoding (`EngineConfig.speculative`, engine/speculative.py): a step whose decode
rows are at most `max_batch` drafts for its eligible rows, extends their chunks to
[anchor, drafts], verifies them all in the one forward, accepts, rolls every state back to the
committed rows (`SeqState.truncate`) and books the accepted drafts with the scheduler
(`StepResult.accepted_drafts`). Such steps are not followed by one planned ahead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from flashpd.engine.gpu.decode_graph import width_classes
from flashpd.engine.grammar import GrammarBackend, GrammarError
from flashpd.engine.kv_cache_manager import KVCacheManager
from flashpd.engine.kv_pools import KVPools
from flashpd.engine.policies import ROLES, role_from_name
from flashpd.engine.request import FinishReason, PrefixPolicy, Request
from flashpd.engine.runner import FedTokens, ModelRunner
from flashpd.engine.sampling import PendingSamples, Sampler, SamplingParams, filtered_probs
from flashpd.engine.sampling_params import GuidedDecoding
from flashpd.engine.scheduler import (
    PENDING_TOKEN,
    FinishSignal,
    PausedKV,
    Reservation,
    Scheduler,
    SchedulerConfig,
    StepPlan,
    StepResult,
)
from flashpd.engine.speculative import (
    ForcedSchedule,
    Proposal,
    SpecStats,
    SpeculativeConfig,
    Verdict,
    accept_greedy,
    accept_sampled,
    build_drafter,
    log_forced,
)
from flashpd.kernels import dispatch
from flashpd.model.kv_format import DEFAULT_KV_FORMAT, KVFormatName
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
    kv_format: KVFormatName = DEFAULT_KV_FORMAT.name  # compressed main KV (model/kv_format.py)
    # op -> kernel implementation over the device's default (CPU: every op's torch reference;
    # GPU: `dispatch.fastest()`), e.g. {"mhc": "ref", "indexer": "ref"}: the A/B baseline's
    # unfused mHC and reference indexer (infra/serve.h200.baseline.yaml)
    kernel_impls: Mapping[str, str] = field(default_factory=dict)
    num_threads: int = 0  # torch CPU threads for this process (0 = leave torch's default)
    async_scheduling: bool = True  # plan + launch step N+1 before step N's ids reach the host
    # The longest context served (None: unbounded here, the router enforces its own limit).
    max_model_len: int | None = None
    # With decode graphs: key tables sized to context classes growing by this ratio from 4,096
    # tokens up to the context limit (max_model_len, else the model's positions), every class
    # captured at warm-up so a step at a new width captures nothing on the request path
    # (engine/gpu/decode_graph.py says why 2); 0: widths step by 1,024 key entries, a capture
    # per new width (a missing graph after warm-up then runs eagerly).
    graph_width_ratio: int = 2
    # speculative decoding (engine/speculative.py): None = off; a dict is parsed strictly
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):
            object.__setattr__(self, "speculative", SpeculativeConfig.from_dict(self.speculative))
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError("speculative must be a SpeculativeConfig, a dict or None")
        if not isinstance(self.kernel_impls, Mapping):
            raise ValueError(f"kernel_impls must map op -> implementation, got {self.kernel_impls!r}")
        try:
            dispatch.check_impls(self.kernel_impls)
        except ValueError as e:
            raise ValueError(f"kernel_impls: {e}") from None
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {self.role!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("num_blocks", "num_slots", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if (
            not isinstance(self.graph_width_ratio, int)
            or self.graph_width_ratio == 1
            or not 0 <= self.graph_width_ratio <= 16
        ):
            raise ValueError(
                f"graph_width_ratio must be 0 (linear width steps) or 2..16, got {self.graph_width_ratio!r}"
            )


@dataclass
class RequestStats:
    arrival_s: float
    prompt_tokens: int
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_s is None else 1e3 * (self.first_token_s - self.arrival_s)


@dataclass
class _Launched:
    """A step whose forward and sampling are launched, not yet applied."""

    plan: StepPlan
    rids: list[str]  # the sampled rows, in order
    pending: PendingSamples | None = None  # the batched samples (ids on the device)
    samples: dict = field(default_factory=dict)  # sampled row by row (the batch raised)
    errors: dict[str, str] = field(default_factory=dict)  # per-request sampling failures
    fed_rids: tuple[str, ...] = ()  # requests whose ids this step read from the step before


@dataclass(frozen=True)
class _Draft:
    tokens: tuple[int, ...]
    probs: object = None  # [k, V] FP32 q rows, or None (point masses)


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
    # speculative decoding, this request so far: drafts verified and accepted; the forced
    # acceptance length when a benchmark forced it (outputs are then not the model's)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_steps: int = 0  # verifies (acceptance length = 1 + accepted / steps)
    forced_acceptance_length: float | None = None


class LLMEngine:
    def __init__(
        self,
        model: Model,
        config: EngineConfig,
        eos_token_id: int | None = None,
        grammar: GrammarBackend | None = None,
        dspark=None,
    ):
        """dspark: the checkpoint's DSpark drafter (model/dspark.py), for speculative.method
        "dspark"."""
        self.model, self.config = model, config
        cfg = model.cfg
        graphs = getattr(model, "graphs", None)  # the GPU model's decode graphs
        if graphs is not None and config.graph_width_ratio:  # engines may share a model
            limit = config.max_model_len or cfg.max_position_embeddings
            graphs.add_width_classes(width_classes(limit, config.graph_width_ratio))
        self.replay_tokens = cfg.sliding_window if config.swa_bounded_replay else exact_replay_rows(cfg)
        self.kv = KVCacheManager(
            config.num_blocks,
            config.num_slots,
            128,
            namespace=f"{config.model_id}|{config.cache_salt}",
            replay_tokens=self.replay_tokens,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs), self.kv, role_from_name(config.role)
        )
        if model.kv_format.name != config.kv_format:
            raise ValueError(
                f"kv_format {config.kv_format!r} but the model fake-quantises compressed KV as {model.kv_format.name!r}"
            )
        # issue 12 (helper F): the pools take the KV format object and window scratch rows
        # from the model's declared capability (Model.stages_window_kv)
        self.pools = KVPools.for_model(
            model, config.num_blocks, config.num_slots, config.device, max_rows=config.max_num_batched_tokens
        )
        narrowing = cfg.sliding_window if (config.swa_bounded_replay and config.role == "colocated") else None
        self.runner = ModelRunner(model, self.pools, decoder_rows=narrowing)
        self.sampler = Sampler(config.seed)
        self.eos_token_id = eos_token_id
        self.grammar = grammar
        self._matchers: dict[str, object] = {}  # guided request -> its grammar matcher
        self._requests: dict[str, Request] = {}
        self._params: dict[str, SamplingParams] = {}
        self.stats: dict[str, RequestStats] = {}
        self.num_steps = 0
        self._inflight: _Launched | None = None  # launched ahead, applied by the next step()
        self.num_ahead_steps = 0  # steps planned and launched ahead (async scheduling)
        self.last_wait_s = 0.0  # host time the last step spent waiting for the device's ids
        # Called as hook(request_id, kv_block_ids, final_tokens) for each kv_ready of a step
        # BEFORE the step's kernels are waited for: the KV of the first `final_tokens` prompt
        # tokens (the chunks before this step's) is in the pools, the rest not yet. A prefill
        # worker builds its KV push there, overlapping the device's last chunk, and posts it at
        # kv_ready.
        self.kv_pending_hooks: list = []
        # device marks after each launched step's kernels (this step's, the one before): the
        # hooks run once the one before is reached, so `final_tokens` of KV is really written
        self._step_marks: tuple = (None, None)
        self._init_speculation(config.speculative, dspark)

    def _init_speculation(self, spec: SpeculativeConfig | None, dspark) -> None:
        self.spec, self.spec_stats = spec, SpecStats()
        self._spec_usage: dict[str, list[int]] = {}  # request -> [drafted, accepted, steps]
        self.drafter = self.forced = None
        if spec is None:
            return
        if self.config.role == "prefill":
            raise ValueError("speculative: a prefill worker samples no tokens; configure it on the decode workers")
        self.drafter = build_drafter(spec, dspark, max_seqs=self.config.max_num_seqs)
        if self.drafter.uses_tap and not getattr(self.model, "tap_layer_ids", ()):
            raise ValueError(
                "the drafter reads the target's tap, but the model records none (Model.tap_layer_ids is empty)"
            )
        self.runner.taps = self.drafter.uses_tap
        self._drafter_states: dict[str, object] = {}
        self._draft_gen = torch.Generator().manual_seed(self.config.seed + 1)
        if spec.bench_forced_acceptance_length is not None:
            self.forced = ForcedSchedule(spec.bench_forced_acceptance_length)
        log_forced(spec)

    # ------------------------------------------------------------------ admission
    def add_request(
        self,
        request_id: str,
        prompt_ids,
        params: SamplingParams,
        session_id: str | None = None,
        prefix: PrefixPolicy | None = None,
    ) -> None:
        request = self._new_request(request_id, prompt_ids, params, session_id, prefix)
        self.scheduler.add(request)

    def reserve(
        self,
        request_id: str,
        prompt_ids,
        params: SamplingParams,
        session_id: str | None = None,
        prefix: PrefixPolicy | None = None,
    ) -> Reservation | None:
        """Decode role: blocks for the whole prompt (own prefix hit reused); None when full.
        `prefix.kv_tokens`: a continuation (see `PrefixPolicy`)."""
        request = self._new_request(request_id, prompt_ids, params, session_id, prefix)
        reservation = self.scheduler.reserve(request)
        if reservation is None:
            self._drop(request_id)
        return reservation

    def kv_arrived(self, request_id: str) -> None:
        self.scheduler.kv_arrived(request_id)

    def pause(self, request_id: str) -> PausedKV | None:
        """Decode role: take a request out of the batch, holding its KV (`Scheduler.pause`);
        `kv_arrived` resumes it, `abort` frees it."""
        paused = self.scheduler.pause(request_id)
        if paused is not None:
            self.runner.forget([request_id])
            self._forget_drafts([request_id])
        return paused

    def release_kv(self, request_id: str) -> None:
        self.scheduler.release_kv(request_id)
        self._drop(request_id)

    def abort(self, request_id: str) -> bool:
        found = self.scheduler.abort(request_id)
        self._drop(request_id)
        return found

    def has_unfinished(self) -> bool:
        """Requests waiting or running. A step launched ahead whose requests have all finished
        or been aborted since is not work: the next `step()` completes it (its rows dropped)."""
        return self.scheduler.has_unfinished()

    def _new_request(self, request_id, prompt_ids, params, session_id, prefix: PrefixPolicy | None = None) -> Request:
        ids = [int(t) for t in prompt_ids]
        bad = [t for t in ids if not 0 <= t < self.model.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: token id {bad[0]} outside [0, {self.model.cfg.vocab_size})")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        request = Request(request_id, ids, params, session_id=session_id, arrival_time=time.monotonic(), prefix=prefix)
        if params is not None and params.guided is not None:
            self._matchers[request_id] = self._new_matcher(params.guided, ids)
        self._requests[request_id] = request
        self._params[request_id] = params
        self.stats[request_id] = RequestStats(time.monotonic(), len(ids))
        while len(self.stats) > MAX_REQUEST_STATS:  # a long-running worker keeps the newest
            del self.stats[next(iter(self.stats))]
        return request

    def _new_matcher(self, guided: GuidedDecoding, prompt_ids: list[int]):
        """A matcher that has accepted the earlier attempt's output (the prompt's tail)."""
        if self.grammar is None:
            raise GrammarError("needs a tokenizer on the worker (guided decoding)", field=guided.field)
        if guided.replay_tokens > len(prompt_ids):
            raise GrammarError(f"replay_tokens {guided.replay_tokens} exceeds the prompt", field=guided.field)
        replay = prompt_ids[len(prompt_ids) - guided.replay_tokens :]
        return self.grammar.matcher(guided, replay)

    def _drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        for table in (self._requests, self._params):
            table.pop(request_id, None)
        self.sampler.forget(request_id)
        self.runner.forget([request_id])
        self._spec_usage.pop(request_id, None)
        if self.spec is not None:
            self._release_drafter_state(request_id)
            if self.forced is not None:
                self.forced.forget(request_id)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[EngineOutput]:
        """One batched forward's outputs. A failure is contained: a request whose sampling
        fails ends alone with finish_reason "error"; a forward that raises ends the requests of
        its plan (the forward is batched, so the culprit cannot be told apart), and the engine
        goes on.

        Async scheduling (`EngineConfig.async_scheduling`): when every chunk of a step ends
        with a sample, the next step is planned (`Scheduler.schedule_ahead`, admissions
        included) and launched before this one's ids reach the host; its rows read those ids
        on the device. The host's planning, tables
        and launch then overlap the device's forward, and a call returns the outputs of the
        step launched one call before. A request that stops on a token (EOS, a stop id, an
        abort between calls) has one more row computed and dropped."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            plan = self.scheduler.schedule()
            if not plan.chunks:
                self.runner.forget(plan.freed_request_ids + plan.preempted_request_ids)
                return []
            drafts = self._drafts(plan) if self.spec is not None else {}
            if drafts:
                return self._speculative_step(plan, drafts)
            try:
                launched = self._launch(plan)
            except Exception as exc:  # noqa: BLE001 - contained: the plan's requests fail
                return self._forward_failed(plan, exc)
        ahead_failed: tuple | None = None
        if (
            self.config.async_scheduling
            and launched.pending is not None
            and not any(r in self._matchers for r in launched.rids)
            and not self._may_speculate_next()
        ):
            ahead = self.scheduler.schedule_ahead(launched.plan)
            if ahead is not None:
                try:
                    self._inflight = self._launch(ahead, launched)
                    self.num_ahead_steps += 1
                except Exception as exc:  # noqa: BLE001 - fails after this step's update
                    ahead_failed = (ahead, exc)
        outputs = self._complete(launched)
        if ahead_failed is not None:
            outputs += self._forward_failed(*ahead_failed)
        return outputs

    def _launch(self, plan: StepPlan, before: _Launched | None = None) -> _Launched:
        """Run the plan's forward and launch its sampling (no wait for the device). before:
        the step whose samples are this plan's pending ids (a plan made ahead)."""
        fed = None
        if before is not None:
            fed = FedTokens(before.pending.tokens, {r: i for i, r in enumerate(before.rids)})
        known = {c.request_id: self._requests[c.request_id].token_ids for c in plan.chunks}
        self._forget_drafts(plan.freed_request_ids + plan.preempted_request_ids)
        out = self.runner.execute(plan, known, fed)
        if self.kv_pending_hooks:
            self._step_marks = (self._step_marks[1], self._new_step_mark())
        self._observe(out, {})
        rids = [c.request_id for c in plan.chunks if c.request_id in out.logits]
        fed_rids = tuple(c.request_id for c in plan.chunks if c.token_ids == (PENDING_TOKEN,))
        launched = _Launched(plan, rids, fed_rids=fed_rids)
        if rids:
            self._launch_sampling(launched, out.logits)
        return launched

    def _launch_sampling(self, launched: _Launched, logits_by_rid) -> None:
        rids = launched.rids
        params = [self._params[r] for r in rids]
        out_logits = logits_by_rid
        try:
            logits = torch.stack([out_logits[r] for r in rids])
            bitmask = (
                self.grammar.fill_bitmask([self._matchers.get(r) for r in rids])
                if self._matchers and self.grammar is not None
                else None
            )
            launched.pending = self.sampler.launch(logits, rids, params, bitmask)
        except Exception:  # noqa: BLE001 - retried row by row to find the failing request(s)
            launched.samples, launched.errors = self._sample_rows(rids, out_logits, params)

    def _complete(self, launched: _Launched) -> list[EngineOutput]:
        """Wait for the step's ids, correct what a step launched after it recorded for them,
        and apply the step to the scheduler -> its outputs."""
        samples = launched.samples
        if launched.pending is not None:
            t0 = time.perf_counter()
            samples = dict(zip(launched.rids, launched.pending.result(), strict=True))
            self.last_wait_s = time.perf_counter() - t0
        if self._inflight is not None:
            for rid in self._inflight.fed_rids:
                if rid in samples:
                    self.runner.patch_last_token(rid, samples[rid].token_id)
        failed = self._fail_requests(launched.errors)
        result = StepResult(
            sampled_token_ids={r: [s.token_id] for r, s in samples.items()}, finish_signals=self._signals(samples)
        )
        outputs = self.scheduler.update(launched.plan, result)
        self.num_steps += 1
        ready = [o for o in outputs if o.finish_reason == FinishReason.KV_READY]
        if ready:
            self._run_kv_pending_hooks(ready, {c.request_id: c.start for c in launched.plan.chunks})
            self._wait_for_kv_writes()
        return failed + [self._to_output(o, samples.get(o.request_id)) for o in outputs]

    def _new_step_mark(self):
        """A device event after the kernels launched so far (None on the CPU: its forward ran
        synchronously)."""
        if not (str(self.config.device).startswith("cuda") and torch.cuda.is_available()):
            return None
        mark = torch.cuda.Event()
        mark.record(torch.cuda.current_stream(torch.device(self.config.device)))
        return mark

    def _run_kv_pending_hooks(self, ready, starts: dict[str, int]) -> None:
        before = self._step_marks[0]
        if before is not None:  # the earlier chunks' kernels (this step's may still run)
            before.synchronize()
        for hook in list(self.kv_pending_hooks):
            for o in ready:
                try:
                    hook(o.request_id, tuple(o.kv_block_ids), starts.get(o.request_id, 0))
                except Exception:  # noqa: BLE001 - an optimisation: kv_ready is delivered anyway
                    log.exception("kv-pending hook %r failed on %s", hook, o.request_id)

    def _wait_for_kv_writes(self) -> None:
        """kv_ready promises the KV is in the pools: wait for the step's kernels on the device.
        A prefill-role step samples nothing, so nothing else waited for it. Without this wait the
        KV push is posted while the last chunk's writes may still be queued. UCX's cuda_ipc copy
        runs on a stream of its own and is not ordered after them."""
        if str(self.config.device).startswith("cuda") and torch.cuda.is_available():
            torch.cuda.current_stream(torch.device(self.config.device)).synchronize()

    def _forward_failed(self, plan: StepPlan, exc: Exception) -> list[EngineOutput]:
        log.error("forward of step %d failed; failing its %d request(s)", plan.step_id, len(plan.chunks), exc_info=exc)
        errors = {
            c.request_id: f"forward failed: {type(exc).__name__}: {exc}"
            for c in plan.chunks
            if c.request_id in self._requests
        }
        return self._fail(plan, errors)

    def _sample_rows(self, rids: list[str], logits_by_rid, params) -> tuple[dict, dict[str, str]]:
        """Samples of the rows one by one, and an error message per request whose sampling
        raised (after the batched launch raised)."""
        samples, errors = {}, {}
        for rid, p in zip(rids, params, strict=True):
            try:
                row = logits_by_rid[rid][None]
                matcher = self._matchers.get(rid)
                bitmask = None if matcher is None else self.grammar.fill_bitmask([matcher])
                samples[rid] = self.sampler.sample(row, [rid], [p], bitmask)[0]
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
            outputs.append(EngineOutput(rid, (), True, "error", prompt, produced, 0, error=message))
        return outputs

    def _signals(self, samples) -> dict[str, FinishSignal]:
        signals = (
            {}
            if self.eos_token_id is None
            else {rid: FinishSignal.EOS for rid, s in samples.items() if s.token_id == self.eos_token_id}
        )
        for rid, s in samples.items():
            matcher = self._matchers.get(rid)
            if matcher is None:
                continue
            # the grammar is done (or refused a token: only an all-masked row can): stop here
            try:
                done = not matcher.accept_token(s.token_id) or matcher.is_terminated()
            except Exception:  # noqa: BLE001 - contained: this request stops, the loop goes on
                log.exception("grammar of %s refused token %d", rid, s.token_id)
                done = True
            if done:
                signals.setdefault(rid, FinishSignal.STOP)
        return signals

    def _to_output(self, o, sample) -> EngineOutput:
        now = time.monotonic()
        st = self.stats.get(o.request_id)
        if st is not None and o.new_token_ids:
            st.first_token_s = st.first_token_s or now
            st.token_times_s.append(now)
        reason = o.finish_reason.value if o.finish_reason is not None else None
        logprobs = (sample,) if sample is not None and self._wants_logprobs(o.request_id) else ()
        drafted, accepted, steps = self._spec_usage.get(o.request_id, (0, 0, 0))
        forced = None if self.spec is None else self.spec.bench_forced_acceptance_length
        if o.finished and reason != "kv_ready":
            self._drop(o.request_id)
        return EngineOutput(
            o.request_id,
            tuple(o.new_token_ids),
            o.finished,
            reason,
            o.num_prompt_tokens,
            o.num_output_tokens,
            o.num_cached_tokens,
            logprobs,
            tuple(o.kv_block_ids),
            draft_tokens=drafted,
            accepted_draft_tokens=accepted,
            draft_steps=steps,
            forced_acceptance_length=forced,
        )

    def _wants_logprobs(self, request_id: str) -> bool:
        p = self._params.get(request_id)
        return p is not None and p.logprobs > 0

    # ------------------------------------------------------------------ speculation
    def _may_speculate_next(self) -> bool:
        """Whether the next step could speculate: then it is not launched ahead (a verify
        needs the anchor on the host to draft from, and rolls states back after it)."""
        if self.spec is None or self.scheduler.num_running > self.spec.max_batch:
            return False
        bound = self.spec.max_context_tokens
        return bound is None or self.scheduler.running_context_tokens() <= bound

    def _drafts(self, plan: StepPlan) -> dict[str, _Draft]:
        """`_propose`, contained: drafting is an optimisation, so a drafter that raises costs
        this step its drafts (logged), never a request or the loop."""
        try:
            return self._propose(plan)
        except Exception:  # noqa: BLE001 - contained: the step runs without drafts
            log.exception("drafting failed; step %d runs without speculation", plan.step_id)
            self._forget_drafts([c.request_id for c in plan.chunks])
            return {}

    def _propose(self, plan: StepPlan) -> dict[str, _Draft]:
        """Drafts for the plan's eligible decode rows (the policy: `engine/speculative.py`)."""
        decodes = [c for c in plan.chunks if c.needs_logits and c.num_tokens == 1]
        if len(decodes) > self.spec.max_batch:
            self.spec_stats.skipped_batch += 1
            return {}
        bound = self.spec.max_context_tokens
        if bound is not None and sum(c.start + 1 for c in decodes) > bound:
            self.spec_stats.skipped_context += 1
            return {}
        room = {c.request_id: self._draft_room(c) for c in decodes}
        chunks = [c for c in decodes if room[c.request_id] > 0]
        if not chunks:
            return {}
        rids = [c.request_id for c in chunks]
        states = [self._drafter_state(r) for r in rids]
        params = [self._params[r] for r in rids]
        # every row greedy: no chooser (argmax drafts; a drafter may replay a graph for them)
        choose = None if all(p.greedy for p in params) else (lambda logits, slot: self._choose(logits, params))
        proposal = self.drafter.propose(states, [c.token_ids[0] for c in chunks], [c.start for c in chunks], choose)
        return self._trim_drafts(rids, proposal, room)

    def _draft_room(self, chunk) -> int:
        """Drafts this decode row may verify: 0 unless it may speculate; at most k and one
        fewer than the tokens it may still emit."""
        rid = chunk.request_id
        request, params = self._requests.get(rid), self._params.get(rid)
        if (
            request is None
            or params is None
            or params.speculative == "off"
            or params.logprobs
            or rid in self._matchers
            or chunk.replay is not None
            or chunk.fresh_slot
            or chunk.token_ids[0] == PENDING_TOKEN
            or chunk.end != request.num_tokens
        ):
            return 0
        left = params.max_tokens - request.num_output_tokens - 1
        return max(0, min(self.spec.num_tokens, left))

    def _drafter_state(self, rid: str) -> object:
        if rid not in self._drafter_states:
            self._drafter_states[rid] = self.drafter.new_state(self._requests[rid].token_ids)
        return self._drafter_states[rid]

    def _choose(self, logits: torch.Tensor, params: list[SamplingParams]):
        """The drafter's sampler: each row's request filters applied (q as p will be), a draw
        from the engine's draft stream (argmax for greedy requests)."""
        probs = filtered_probs(logits, params)
        host = probs.cpu()
        tokens = torch.multinomial(host, 1, generator=self._draft_gen)[:, 0]
        greedy = torch.tensor([p.greedy for p in params])
        tokens = torch.where(greedy, host.argmax(-1), tokens)
        return tokens.to(logits.device), probs

    def _trim_drafts(self, rids, proposal: Proposal, room) -> dict[str, _Draft]:
        out = {}
        for i, rid in enumerate(rids):
            tokens = list(proposal.tokens[i])[: room[rid]]
            if self.forced is not None:
                pad = tokens[-1] if tokens else self._requests[rid].token_ids[-1]
                tokens += [pad] * (room[rid] - len(tokens))  # forced: always k (bench)
            if tokens:
                probs = None if proposal.probs is None else proposal.probs[i, : len(tokens)]
                out[rid] = _Draft(tuple(int(t) for t in tokens), probs)
        return out

    def _speculative_step(self, plan: StepPlan, drafts: dict[str, _Draft]) -> list[EngineOutput]:
        """Draft rows extend their chunk ([anchor, drafts]); one forward verifies them all;
        acceptance; states rolled back to the committed rows; the scheduler books it all."""
        known = {c.request_id: self._requests[c.request_id].token_ids for c in plan.chunks}
        chunks, verify = [], {}
        for c in plan.chunks:
            d = drafts.get(c.request_id)
            if d is not None and self.kv.grow(c.request_id, c.end + len(d.tokens)) is not None:
                known[c.request_id] = known[c.request_id] + list(d.tokens)
                c = replace(
                    c,
                    end=c.end + len(d.tokens),
                    token_ids=c.token_ids + d.tokens,
                    block_ids=tuple(self.kv.block_table(c.request_id)),
                )
                verify[c.request_id] = (c, d)
            chunks.append(c)
        self._forget_drafts(plan.freed_request_ids + plan.preempted_request_ids)
        try:
            out = self.runner.execute(replace(plan, chunks=tuple(chunks)), known, None, frozenset(verify))
        except Exception as exc:  # noqa: BLE001 - contained: the plan's requests fail
            return self._forward_failed(plan, exc)
        rids = [c.request_id for c in plan.chunks if c.request_id in out.logits and c.request_id not in verify]
        launched = _Launched(plan, rids)
        if rids:
            self._launch_sampling(launched, out.logits)
        verdicts = self._verify_all(verify, out.logits, known, launched.errors)
        self._observe(out, verdicts, set(verify))
        return self._complete_speculative(launched, verdicts)

    def _forget_drafts(self, request_ids) -> None:
        """Drop drafter states of requests that lost their slot (preempted, paused, freed): a
        recompute inserts their positions afresh."""
        if self.spec is not None:
            for rid in request_ids:
                self._release_drafter_state(rid)

    def _release_drafter_state(self, rid: str) -> None:
        state = self._drafter_states.pop(rid, None)
        if state is not None:
            self.drafter.release(state)

    def _observe(self, out, verdicts: dict[str, Verdict], verified: set[str] = frozenset()):
        """Hand the drafter the committed rows of this step (their taps): every computed row,
        but of a verify only the anchor and the accepted drafts (nothing of a failed one)."""
        if self.drafter is None or not self.drafter.uses_tap or not out.taps:
            return
        try:
            states, positions, rows = [], [], []
            for rid, pieces in out.taps.items():
                if rid not in self._requests or (rid in verified and rid not in verdicts):
                    continue
                for values, pos in pieces:
                    if rid in verdicts:
                        keep = 1 + verdicts[rid].num_accepted
                        values, pos = values[:keep], pos[:keep]
                    states.append(self._drafter_state(rid))  # a full pool raises here
                    positions.append(list(pos))
                    rows.append(values)
            if states:
                self.drafter.observe(states, positions, torch.cat(rows))
        except Exception:  # noqa: BLE001 - contained: those requests' drafter state restarts
            log.exception("the drafter refused this step's context rows; its states restart")
            self._forget_drafts(list(out.taps))

    def _verify_all(self, verify, logits_by_rid, known, errors) -> dict[str, Verdict]:
        verdicts = {}
        argmax = self._greedy_targets(verify, logits_by_rid)
        for rid, (chunk, draft) in verify.items():
            try:
                verdict = self._verify_row(rid, logits_by_rid[rid], draft, argmax.get(rid))
                verdict = self._cut_at_eos(rid, verdict)
                n = chunk.start + 1 + verdict.num_accepted  # the anchor and accepted drafts
                self.runner.truncate(rid, n, known[rid][n - 3 : n])
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                log.exception("speculative verify of %s failed", rid)
                errors[rid] = f"speculative verify failed: {type(exc).__name__}: {exc}"
                continue
            verdicts[rid] = verdict
            usage = self._spec_usage.setdefault(rid, [0, 0, 0])
            usage[0] += len(draft.tokens)
            usage[1] += verdict.num_accepted
            usage[2] += 1
            self.spec_stats.record(len(draft.tokens), verdict.num_accepted)
        self.spec_stats.steps += 1
        return verdicts

    def _greedy_targets(self, verify, logits_by_rid) -> dict[str, list[int]]:
        """Every greedy verify's row argmaxes, with one device-to-host copy for the step."""
        rids = [rid for rid in verify if self._params[rid].greedy]
        if not rids:
            return {}
        flat = torch.cat([logits_by_rid[rid].argmax(-1) for rid in rids]).tolist()
        out, at = {}, 0
        for rid in rids:
            n = logits_by_rid[rid].shape[0]
            out[rid], at = flat[at : at + n], at + n
        return out

    def _verify_row(self, rid: str, rows: torch.Tensor, draft: _Draft, argmax: list[int] | None) -> Verdict:
        """rows [d + 1, V] FP32: the target's logits after the anchor and each draft;
        argmax: their argmaxes (greedy requests)."""
        params, drafts = self._params[rid], list(draft.tokens)
        if self.forced is not None:  # benchmark: the schedule decides, the target's token ends
            a = self.forced.next(rid, len(drafts))
            if argmax is not None:
                return Verdict(tuple(drafts[:a]) + (argmax[a],), a)
            gen = self.sampler.verify_generator(rid, params, 1)
            p = filtered_probs(rows[a : a + 1], [params]).cpu()
            token = int(torch.multinomial(p[0], 1, generator=gen))
            return Verdict(tuple(drafts[:a]) + (token,), a)
        if argmax is not None:
            return accept_greedy(argmax, drafts)
        p = filtered_probs(rows, [params] * rows.shape[0])
        gen = self.sampler.verify_generator(rid, params, len(drafts) + 1)
        return accept_sampled(p, draft.probs, drafts, gen)

    def _cut_at_eos(self, rid: str, verdict: Verdict) -> Verdict:
        """Nothing after an EOS is emitted (unless the request ignores EOS)."""
        eos = self.eos_token_id
        if eos is None or self._params[rid].ignore_eos or eos not in verdict.tokens:
            return verdict
        i = verdict.tokens.index(eos)
        return Verdict(verdict.tokens[: i + 1], min(verdict.num_accepted, i))

    def _complete_speculative(self, launched: _Launched, verdicts: dict[str, Verdict]) -> list[EngineOutput]:
        samples = launched.samples
        if launched.pending is not None:
            samples = dict(zip(launched.rids, launched.pending.result(), strict=True))
        failed = self._fail_requests(launched.errors)
        signals = self._signals(samples)
        eos = self.eos_token_id
        signals.update(
            (rid, FinishSignal.EOS) for rid, v in verdicts.items() if eos is not None and v.tokens[-1] == eos
        )
        sampled = {r: [s.token_id] for r, s in samples.items()}
        sampled.update((rid, list(v.tokens)) for rid, v in verdicts.items())
        result = StepResult(
            sampled_token_ids=sampled,
            finish_signals=signals,
            accepted_drafts={rid: v.num_accepted for rid, v in verdicts.items()},
        )
        outputs = self.scheduler.update(launched.plan, result)
        self.num_steps += 1
        return failed + [self._to_output(o, samples.get(o.request_id)) for o in outputs]

    # ------------------------------------------------------------------ views
    def usage(self) -> dict[str, int]:
        return dict(self.kv.usage(), running=self.scheduler.num_running, waiting=self.scheduler.num_waiting)

    def graph_counters(self) -> dict[str, int | float]:
        """The decode graphs' counters (captures, builds, eager misses after the warm-up,
        seconds building); {} without graphs."""
        graphs = getattr(self.model, "graphs", None)
        return graphs.counters() if graphs is not None else {}

    def drain_cache_events(self):
        return self.kv.drain_events()

    def drain_cache_snapshot(self):
        """Every cached chunk as events, replacing pending ones (re-publish after index loss)."""
        return self.kv.drain_snapshot()
