"""The scheduler: a pure state machine. `schedule() -> StepPlan`, `update(plan, result) -> outputs`.

No phases: every running request's `num_computed_tokens` catches up with its known tokens
(prompt + outputs). One step mixes decodes (one token each) and prefill chunks under
`max_num_batched_tokens` and `max_num_seqs`:

    1. running requests, decodes first, then unfinished prefills, each FCFS; a long prompt takes
       what is left of the budget and continues next step (chunked prefill);
    2. then waiting requests, unless this step preempted someone: first those whose KV already
       arrived (decode role; they need no memory), then FCFS with head-of-line blocking (stop
       at the first that does not fit, so big requests are not starved by small ones).

When a running request cannot grow, the most recently arrived running request is preempted by
recompute: its blocks and slot are freed, it goes back to the waiting queue (in arrival order)
with its outputs kept, and later recomputes prompt + outputs from whatever prefix is cached.

Roles (colocated, prefill, decode) are strategy objects from `policies.py`.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flashpd.engine.kv_cache_manager import KVCacheManager
from flashpd.engine.policies import Admission, ColocatedRole, ForwardPath, RolePolicy
from flashpd.engine.request import FinishReason, Replay, Request, RequestOutput, RequestStatus
from flashpd.engine.sampling_params import SamplingParams

PENDING_TOKEN = -1  # a scheduled token whose id is sampled by the step before (schedule_ahead)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    history_tokens: int = 3  # ids before a chunk's start sent with it (Engram hashes 3 back)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.history_tokens < 0:
            raise ValueError(f"history_tokens must be >= 0, got {self.history_tokens}")


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens [start, end) of one request in this step."""

    request_id: str
    slot: int
    block_ids: tuple[int, ...]  # the whole block table, covering at least [0, end)
    start: int
    end: int
    token_ids: tuple[int, ...]  # the ids of [start, end)
    history_token_ids: tuple[int, ...]  # up to `history_tokens` ids just before start
    fresh_slot: bool  # reset the slot's private state before computing (new or reused slot)
    needs_logits: bool  # the chunk reaches the end of the known tokens: sample from the last row
    replay: Replay | None  # the request's replay range, when this chunk overlaps it
    sampling_params: SamplingParams | None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    path: ForwardPath  # which layers the runner executes for every chunk
    chunks: tuple[ScheduledChunk, ...]
    preempted_request_ids: tuple[str, ...]  # preempted while building this plan
    freed_request_ids: tuple[str, ...]  # lost slot and blocks since the previous plan

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)


class FinishSignal(enum.Enum):
    EOS = "eos"  # the runner sampled the EOS token (ignored for ignore_eos requests)
    STOP = "stop"  # the runner or detokenizer matched a stop condition (e.g. a stop string)


@dataclass(frozen=True)
class StepResult:
    # request id -> ids sampled this step, only for chunks with needs_logits
    sampled_token_ids: Mapping[str, Sequence[int]] = field(default_factory=dict)
    # request id -> signal about the last sampled token
    finish_signals: Mapping[str, FinishSignal] = field(default_factory=dict)
    # speculative verify: request id -> drafts accepted. The chunk's one row plus these many
    # draft rows are computed (the state kept them); the sampled ids are those drafts followed
    # by the target's token. Blocks past the request's known tokens are released.
    accepted_drafts: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Reservation:
    """Decode role: where the prefill worker writes the global KV this worker lacks."""

    request_id: str
    block_ids: tuple[int, ...]  # the whole block table, one block per prompt chunk
    num_cached_blocks: int  # block_ids[:num_cached_blocks] hold this worker's own prefix hit
    chunk_tokens: int
    num_kv_blocks: int | None = None  # blocks the KV arrives into (None: all; see PrefixPolicy)

    @property
    def missing_block_ids(self) -> tuple[int, ...]:
        """The blocks the sender writes: chunks of [0, kv_tokens) this worker lacks."""
        end = len(self.block_ids) if self.num_kv_blocks is None else self.num_kv_blocks
        return self.block_ids[self.num_cached_blocks : max(end, self.num_cached_blocks)]

    @property
    def first_missing_token(self) -> int:
        return self.num_cached_blocks * self.chunk_tokens


@dataclass(frozen=True)
class PausedKV:
    """A paused decode request: the blocks holding the global KV of its first `kv_tokens`
    tokens (what a continuation elsewhere needs) and every token it knows."""

    request_id: str
    kv_block_ids: tuple[int, ...]
    kv_tokens: int
    token_ids: tuple[int, ...]


def _by_arrival(request: Request) -> int:
    return request.arrival_order


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, role: RolePolicy | None = None) -> None:
        self.config = config
        self.kv = kv
        self.role: RolePolicy = ColocatedRole() if role is None else role
        if self.role.admission is Admission.RESERVE and kv.replay_tokens < 1:
            raise ValueError("the decode role needs replay_tokens >= 1 to produce its first logits")
        self._requests: dict[str, Request] = {}  # every request not yet forgotten
        self._waiting: list[Request] = []  # runnable, arrival order
        self._running: list[Request] = []  # arrival order
        self._awaiting_kv: dict[str, Request] = {}
        self._kv_held: dict[str, Request] = {}  # finished prefills, blocks not yet released
        self._freed_since_plan: list[str] = []
        self._next_arrival_order = 0
        self._next_step_id = 0
        self._outstanding: list[int] = []  # scheduled, not yet updated (oldest first; <= 2)
        self.num_preemptions = 0

    # ---- admission ------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if self.role.admission is not Admission.ADD:
            raise ValueError(f"the {self.role.name} role admits requests with reserve(), not add()")
        self._register(request)
        request.status = RequestStatus.WAITING
        bisect.insort(self._waiting, request, key=_by_arrival)

    def reserve(self, request: Request) -> Reservation | None:
        """Decode role: reserve blocks and a slot for the whole prompt, reusing this worker's own
        prefix hit; None (and nothing registered) when memory is short."""
        if self.role.admission is not Admission.RESERVE:
            raise ValueError(f"the {self.role.name} role has no reserve(); use add()")
        self._check_new(request)
        prompt = request.token_ids
        kv_tokens = request.kv_tokens
        hit = self.kv.lookup(prompt[:kv_tokens])  # outputs past kv_tokens are recomputed here
        allocation = self.kv.allocate(request.request_id, prompt, len(prompt) - hit.usable_tokens, hit)
        if allocation is None:
            return None
        self._register(request)
        request.status = RequestStatus.WAITING_FOR_KV
        request.num_cached_tokens = hit.hit_tokens
        self._awaiting_kv[request.request_id] = request
        return Reservation(
            request.request_id,
            allocation.block_ids,
            allocation.num_hit_blocks,
            self.kv.chunk_tokens,
            num_kv_blocks=self.kv.blocks_for_tokens(kv_tokens),
        )

    def kv_arrived(self, request_id: str) -> None:
        """Decode role: the prompt's global KV is in the reserved blocks. The request becomes
        runnable; its first chunk replays the last min(replay, N) prompt tokens."""
        request = self._awaiting_kv.pop(request_id, None)
        if request is None:
            raise KeyError(f"request {request_id!r} is not waiting for KV")
        kv_tokens = request.kv_tokens  # the prompt, or a continuation's original prompt
        self.kv.commit(request_id, request.token_ids, kv_tokens)
        replay_from = kv_tokens - min(self.kv.replay_tokens, kv_tokens)
        request.num_computed_tokens = replay_from
        request.replay = Replay(replay_from, kv_tokens)
        request.fresh_slot = True
        request.status = RequestStatus.WAITING
        bisect.insort(self._waiting, request, key=_by_arrival)

    def pause(self, request_id: str) -> PausedKV | None:
        """Decode role: take a running (or admitted) request out of the batch, keeping its
        blocks and slot, back to waiting for KV (a live migration's source). The blocks of
        [0, kv_tokens) hold the KV another worker needs to continue it. `kv_arrived` resumes
        it in place: it then replays from the prompt boundary and recomputes its outputs, as
        the other worker would. A step already launched for it is dropped at its update (its
        token is sampled again). None when it is not running or waiting with KV."""
        request = self._requests.get(request_id)
        if request is None or request.status not in (RequestStatus.RUNNING, RequestStatus.WAITING):
            return None
        if not self.kv.holds(request_id) or self.role.admission is not Admission.RESERVE:
            return None
        for queue in (self._waiting, self._running):
            if request in queue:
                queue.remove(request)
        request.status = RequestStatus.WAITING_FOR_KV
        request.replay = None
        self._awaiting_kv[request_id] = request
        self._freed_since_plan.append(request_id)  # the runner drops its state
        kv_blocks = self.kv.blocks_for_tokens(request.kv_tokens)
        return PausedKV(
            request_id, tuple(self.kv.block_table(request_id)[:kv_blocks]), request.kv_tokens, tuple(request.token_ids)
        )

    def abort(self, request_id: str) -> bool:
        """Forget the request and free everything it holds; False when it is unknown/finished."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        for queue in (self._waiting, self._running):
            if request in queue:
                queue.remove(request)
        self._awaiting_kv.pop(request_id, None)
        self._kv_held.pop(request_id, None)
        if self.kv.holds(request_id):
            self.kv.free(request_id)
        request.status = RequestStatus.FINISHED_ABORTED
        request.finish_reason = FinishReason.ABORT
        self._freed_since_plan.append(request_id)
        return True

    def release_kv(self, request_id: str) -> None:
        """Prefill role: the KV of a kv_ready request has been sent; free its blocks."""
        request = self._kv_held.pop(request_id, None)
        if request is None:
            raise KeyError(f"request {request_id!r} holds no finished KV")
        del self._requests[request_id]
        self.kv.free(request_id)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        if self._outstanding:
            raise RuntimeError(f"step {self._outstanding[0]} was scheduled but not updated")
        budget = self.config.max_num_batched_tokens
        chunks: dict[str, ScheduledChunk] = {}
        preempted: list[str] = []
        for request in self._running_by_priority():
            if request.status is not RequestStatus.RUNNING or budget == 0:
                continue
            num_tokens = min(request.num_uncomputed_tokens, budget, self._recompute_cap(request))
            budget += self._grow_or_preempt(request, num_tokens, chunks, preempted)
            if request.status is RequestStatus.RUNNING:
                chunks[request.request_id] = self._chunk(request, num_tokens)
                budget -= num_tokens
        if not preempted:
            self._admit_waiting(budget, chunks)
        return self._emit_plan(chunks, preempted)

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply one step's results; every non-empty plan must be updated exactly once."""
        if plan.chunks:
            expected = self._outstanding[0] if self._outstanding else None
            if plan.step_id != expected:
                raise RuntimeError(f"update for step {plan.step_id}, expected {expected}")
        self._check_result(plan, result)
        if plan.chunks:
            self._outstanding.pop(0)
        outputs = []
        for chunk in plan.chunks:
            request = self._requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted after the plan was made
            output = self._apply_chunk(request, chunk, result)
            if output is not None:
                outputs.append(output)
        return outputs

    def schedule_ahead(self, plan: StepPlan) -> StepPlan | None:
        """The plan after `plan` while `plan` is still computing (async scheduling). Every
        chunk of `plan` reaches the end of its request's known tokens and samples (a decode,
        a prompt's last chunk, a replay's end), so each request goes on with one decode token
        whose id the runner takes from `plan`'s samples on the device; waiting requests are
        admitted as `schedule` would (no preemption). None when that cannot be known ahead,
        and the caller updates `plan` and schedules normally: `plan` is not the only
        outstanding step, a chunk of it stops short of the known tokens, a running request is
        not in it, a request is within `history_tokens` of its start, or memory would need a
        preemption. Requests that reach `max_tokens` with `plan`'s token are left out; one
        that stops on `plan`'s token (EOS, a stop id, an abort) has its row computed and
        dropped: `update` skips finished requests. Prefix-cache lookups for admissions see the
        cache before `plan`'s blocks are committed (a hit may be shorter than after it)."""
        if self._outstanding != [plan.step_id] or not plan.chunks:
            return None
        chunks = {c.request_id: c for c in plan.chunks}
        running = {r.request_id for r in self._running}
        if running != set(chunks) or len(chunks) != len(plan.chunks):
            return None
        for chunk in plan.chunks:
            request = self._requests[chunk.request_id]
            replay = request.replay
            if (
                not chunk.needs_logits
                or chunk.end != request.num_tokens
                or (replay is not None and chunk.end < replay.to_token)
                or chunk.end < self.config.history_tokens
            ):
                return None
        ahead: dict[str, ScheduledChunk] = {}
        for chunk in plan.chunks:
            request = self._requests[chunk.request_id]
            assert request.max_tokens is not None  # sampled chunks belong to sampling roles
            if request.num_output_tokens + 1 >= request.max_tokens:
                continue  # plan's token is its last
            if self.kv.grow(request.request_id, chunk.end + 1) is None:
                return None  # blocks grown so far stay with their requests (needed next step)
            ahead[request.request_id] = self._chunk_ahead(request, chunk)
        self._admit_waiting(self.config.max_num_batched_tokens - len(ahead), ahead)
        if not ahead:
            return None
        return self._emit_plan(ahead, [])

    def _chunk_ahead(self, request: Request, chunk: ScheduledChunk) -> ScheduledChunk:
        """The decode chunk after `chunk`: token `chunk.end`, not yet sampled (id unknown)."""
        start = chunk.end
        return ScheduledChunk(
            request_id=request.request_id,
            slot=chunk.slot,
            block_ids=tuple(self.kv.block_table(request.request_id)),
            start=start,
            end=start + 1,
            token_ids=(PENDING_TOKEN,),
            history_token_ids=tuple(request.token_ids[start - self.config.history_tokens : start]),
            fresh_slot=False,
            needs_logits=self.role.needs_logits(request, start),  # the end, once chunk's id is in
            replay=None,
            sampling_params=request.sampling_params,
        )

    # ---- views ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    def running_context_tokens(self) -> int:
        """Tokens of every running request summed (its context at its next step)."""
        return sum(r.num_tokens for r in self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        """Whether a step can make progress: requests waiting to run or running. Requests
        waiting for KV or holding finished KV only move on kv_arrived / release_kv / abort."""
        return bool(self._waiting or self._running)

    def status(self, request_id: str) -> RequestStatus | None:
        request = self._requests.get(request_id)
        return None if request is None else request.status

    # ---- scheduling helpers ---------------------------------------------------------------

    def _running_by_priority(self) -> list[Request]:
        decodes = [r for r in self._running if r.num_uncomputed_tokens == 1]
        prefills = [r for r in self._running if r.num_uncomputed_tokens > 1]
        return decodes + prefills

    def _grow_or_preempt(
        self, request: Request, num_tokens: int, chunks: dict[str, ScheduledChunk], preempted: list[str]
    ) -> int:
        """Make room for `num_tokens` more tokens of `request`, preempting the most recently
        arrived running requests (possibly `request` itself). Returns the budget refunded by
        victims that were already in this step's plan."""
        refund = 0
        while self.kv.grow(request.request_id, request.num_computed_tokens + num_tokens) is None:
            victim = max(self._running, key=_by_arrival)
            dropped = chunks.pop(victim.request_id, None)
            refund += 0 if dropped is None else dropped.num_tokens
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                break
        return refund

    def _preempt(self, request: Request) -> None:
        self._running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.replay = None
        request.fresh_slot = False
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._freed_since_plan.append(request.request_id)
        bisect.insort(self._waiting, request, key=_by_arrival)

    def _admit_waiting(self, budget: int, chunks: dict[str, ScheduledChunk]) -> None:
        # Requests whose KV is already here (decode role, KV arrived) need no memory, so they go
        # first: queued behind a preempted request waiting for the memory they hold, they would
        # deadlock. The rest is strict FCFS: nobody overtakes a head that does not fit.
        holders = [r for r in self._waiting if self.kv.holds(r.request_id)]
        others = [r for r in self._waiting if not self.kv.holds(r.request_id)]
        for request in holders + others:
            if budget == 0 or len(self._running) >= self.config.max_num_seqs:
                return
            num_tokens = self._admit(request, budget)
            if num_tokens is None:
                return
            self._waiting.remove(request)
            request.status = RequestStatus.RUNNING
            bisect.insort(self._running, request, key=_by_arrival)
            chunks[request.request_id] = self._chunk(request, num_tokens)
            budget -= num_tokens

    def _admit(self, request: Request, budget: int) -> int | None:
        """Give `request` blocks and a slot; the number of tokens it computes now, or None."""
        if self.kv.holds(request.request_id):  # decode role: reserved, KV arrived
            want = min(request.num_uncomputed_tokens, self._recompute_cap(request))
            if request.replay is not None and budget < want <= self.config.max_num_batched_tokens:
                return None  # a replay that fits a step is not split: its rows round the same
                # on any worker (a continuation elsewhere replays it whole)
            num_tokens = min(want, budget)
            grown = self.kv.grow(request.request_id, request.num_computed_tokens + num_tokens)
            return None if grown is None else num_tokens
        hit = self.kv.lookup(self._lookup_ids(request))
        whole = request.num_tokens - hit.usable_tokens
        if self.role.name == "prefill" and budget < whole <= self.config.max_num_batched_tokens:
            return None  # a prompt that fits a step is not split: its KV is the same bytes
            # whatever else is batched (a continuation's prefill recomputes it exactly)
        num_tokens = min(whole, budget)
        allocation = self.kv.allocate(request.request_id, request.token_ids, num_tokens, hit)
        if allocation is None:
            return None
        request.num_computed_tokens = hit.usable_tokens
        has_replay = hit.hit_tokens > hit.usable_tokens
        request.replay = Replay(hit.usable_tokens, hit.hit_tokens) if has_replay else None
        request.fresh_slot = True
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit.usable_tokens
        return num_tokens

    def _recompute_cap(self, request: Request) -> int:
        """Decode role: tokens a request may compute in its next chunk. A continuation
        (`PrefixPolicy.kv_tokens`) or a paused request resumed in place recomputes outputs
        that were streamed the way the first worker computed them, so the rows round alike:
        the replay up to the prompt boundary alone, then one token per step."""
        if self.role.admission is not Admission.RESERVE:
            return request.num_uncomputed_tokens
        if request.num_computed_tokens < request.kv_tokens:
            return request.kv_tokens - request.num_computed_tokens
        return 1

    def _lookup_ids(self, request: Request) -> Sequence[int]:
        """The ids a prefix lookup may match: capped so the usable credit stays within the
        request's `max_credit_tokens` (a hit of credit + replay tokens earns that credit)."""
        cap = request.prefix.max_credit_tokens
        if cap is None:
            return request.token_ids
        return request.token_ids[: cap + self.kv.replay_tokens]

    def _chunk(self, request: Request, num_tokens: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_tokens
        replay = request.replay
        overlaps_replay = replay is not None and start < replay.to_token and end > replay.from_token
        history_start = max(0, start - self.config.history_tokens)
        return ScheduledChunk(
            request_id=request.request_id,
            slot=self.kv.slot(request.request_id),
            block_ids=tuple(self.kv.block_table(request.request_id)),
            start=start,
            end=end,
            token_ids=tuple(request.token_ids[start:end]),
            history_token_ids=tuple(request.token_ids[history_start:start]),
            fresh_slot=request.fresh_slot,
            needs_logits=self.role.needs_logits(request, end),
            replay=replay if overlaps_replay else None,
            sampling_params=request.sampling_params,
        )

    def _emit_plan(self, chunks: dict[str, ScheduledChunk], preempted: list[str]) -> StepPlan:
        plan = StepPlan(
            step_id=self._next_step_id,
            path=self.role.path,
            chunks=tuple(chunks.values()),
            preempted_request_ids=tuple(preempted),
            freed_request_ids=tuple(self._freed_since_plan),
        )
        self._freed_since_plan = []
        if plan.chunks:
            self._outstanding.append(plan.step_id)
        self._next_step_id += 1
        return plan

    # ---- update helpers -------------------------------------------------------------------

    def _apply_chunk(self, request: Request, chunk: ScheduledChunk, result: StepResult) -> RequestOutput | None:
        if request.num_computed_tokens != chunk.start:
            raise RuntimeError(
                f"request {request.request_id!r} computed {request.num_computed_tokens} tokens, "
                f"but the plan's chunk starts at {chunk.start}"
            )
        request.num_computed_tokens = chunk.end
        request.fresh_slot = False
        if request.replay is not None and chunk.end >= request.replay.to_token:
            request.replay = None
        self.kv.commit(request.request_id, request.token_ids, chunk.end)
        reason = self.role.finish_after_compute(request)
        if reason is not None:
            return self._finish(request, reason, ())
        if not chunk.needs_logits:
            return None
        new_token_ids, reason = self._append_sampled(request, result)
        if reason is not None:
            return self._finish(request, reason, new_token_ids)
        if request.request_id in result.accepted_drafts:
            self._book_verify(request, result.accepted_drafts[request.request_id])
        return self._output(request, new_token_ids)

    def _book_verify(self, request: Request, accepted: int) -> None:
        """A verify computed `accepted` draft rows past the chunk, now known tokens: count
        them (their full chunks become cacheable) and give back blocks the rejected drafts
        were given beyond the known tokens."""
        if not 0 <= accepted <= request.num_tokens - 1 - request.num_computed_tokens:
            raise ValueError(f"{accepted} accepted drafts for {request.request_id!r}")
        request.num_computed_tokens += accepted
        self.kv.commit(request.request_id, request.token_ids, request.num_computed_tokens)
        self.kv.shrink(request.request_id, request.num_tokens)

    def _append_sampled(self, request: Request, result: StepResult) -> tuple[tuple[int, ...], FinishReason | None]:
        sampled = result.sampled_token_ids[request.request_id]
        signal = result.finish_signals.get(request.request_id)
        signal_stops = signal is FinishSignal.STOP or (signal is FinishSignal.EOS and not request.ignore_eos)
        assert request.max_tokens is not None  # checked at admission by sampling roles
        new_token_ids = []
        for index, token_id in enumerate(sampled):
            request.token_ids.append(token_id)
            new_token_ids.append(token_id)
            is_last = index == len(sampled) - 1
            # A real stop beats the length cap when both happen on the same token.
            if token_id in request.stop_token_ids or (is_last and signal_stops):
                return tuple(new_token_ids), FinishReason.STOP
            if request.num_output_tokens >= request.max_tokens:
                return tuple(new_token_ids), FinishReason.LENGTH
        return tuple(new_token_ids), None

    def _finish(self, request: Request, reason: FinishReason, new_token_ids: tuple[int, ...]) -> RequestOutput:
        self._running.remove(request)
        request.status = reason.status
        request.finish_reason = reason
        kv_block_ids: tuple[int, ...] = ()
        if self.role.holds_kv_after(reason):
            kv_block_ids = tuple(self.kv.block_table(request.request_id))
            self.kv.release_slot(request.request_id)
            self._kv_held[request.request_id] = request
        else:
            self.kv.free(request.request_id)
            del self._requests[request.request_id]
        self._freed_since_plan.append(request.request_id)
        return self._output(request, new_token_ids, kv_block_ids)

    def _output(
        self, request: Request, new_token_ids: tuple[int, ...], kv_block_ids: tuple[int, ...] = ()
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finished=request.status.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            kv_block_ids=kv_block_ids,
        )

    def _check_result(self, plan: StepPlan, result: StepResult) -> None:
        """Reject a result that does not answer the plan, before anything is applied."""
        sampling = {chunk.request_id for chunk in plan.chunks if chunk.needs_logits}
        unexpected = (
            set(result.sampled_token_ids) | set(result.finish_signals) | set(result.accepted_drafts)
        ) - sampling
        if unexpected:
            raise ValueError(f"results for requests not sampled this step: {sorted(unexpected)}")
        missing = [
            request_id
            for request_id in sampling
            if request_id in self._requests and not result.sampled_token_ids.get(request_id)
        ]
        if missing:
            raise ValueError(f"requests {sorted(missing)} needed logits but got no token")

    # ---- registration ---------------------------------------------------------------------

    def _check_new(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already scheduled")
        if request.status is not RequestStatus.WAITING or request.num_output_tokens:
            raise ValueError(f"request {request.request_id!r} is not a fresh request")
        self.role.validate(request)
        needed_blocks = self.kv.blocks_for_tokens(self.role.max_known_tokens(request))
        if needed_blocks > self.kv.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs up to {needed_blocks} blocks; the pool has {self.kv.num_blocks}"
            )

    def _register(self, request: Request) -> None:
        self._check_new(request)
        request.arrival_order = self._next_arrival_order
        self._next_arrival_order += 1
        self._requests[request.request_id] = request
