"""ModelRunner: executes the scheduler's StepPlan on the model over the packed KV pools.

One step becomes at most two batched forwards:

    1. replay segments (rows [from, to) of a chunk that overlaps its request's replay range):
       global writes suppressed, windows clipped at the replay start (model_spec §11.3-§11.4);
    2. normal segments (the rest of every chunk), all requests in one batch.

A chunk that starts on a fresh slot first adopts the global KV already in its blocks (a prefix
hit, or the KV a prefill worker pushed): the state's counters are set to the replay end, and the
replay rebuilds windows and open-group rows. A replay the scheduler split across steps runs
piece by piece: before each piece the state's token cursor is moved to the piece's end.

The forward path (all layers vs the encoder path) comes from the plan; the runner returns FP32
logits rows only for chunks that need them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from flashpd.engine.kv_pools import KVPools, PagedSeqState
from flashpd.engine.policies import ForwardPath
from flashpd.engine.scheduler import PENDING_TOKEN, ScheduledChunk, StepPlan
from flashpd.model.model import LogitsRequest, Model, Replay, SeqInput, SeqPlan, TokenFeed


@dataclass(frozen=True)
class FedTokens:
    """The previous step's sampled ids on the device and each request's row in them."""

    tokens: torch.Tensor  # [n] int64
    row_of: dict[str, int]


@dataclass(frozen=True)
class StepOutput:
    logits: dict[str, torch.Tensor]  # request id -> FP32 [V] (model's device), needs_logits
    num_tokens: int  # rows computed (replay rows included)
    # with `ModelRunner.taps` on: request id -> (tap rows [n, n_taps*D], their positions) per
    # segment of the step (a replay piece and a normal piece are two), rows the decoder computed
    taps: dict[str, list[tuple[torch.Tensor, range]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: Model, pools: KVPools, decoder_rows: int | None = None):
        """decoder_rows: colocated prefill runs layers after the candidate source only on each
        chunk's last `decoder_rows` rows (the decoder-side bounded replay, §11.3); None = all."""
        self.model, self.pools, self.decoder_rows = model, pools, decoder_rows
        self._states: dict[str, PagedSeqState] = {}
        self._verify: frozenset[str] = frozenset()  # this step's speculative verifies
        self.taps = False  # return the DSpark tap rows of every segment (a drafter needs them)
        self._taps: dict[str, list[tuple[torch.Tensor, range]]] = {}
        self._tables: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ lifecycle
    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._states.pop(rid, None)
            self._tables.pop(rid, None)

    def state(self, request_id: str) -> PagedSeqState:
        return self._states[request_id]

    # ------------------------------------------------------------------ one step
    def patch_last_token(self, request_id: str, token_id: int) -> None:
        """The id of the state's last token, once the host has it: a step planned ahead read
        it on the device and its books recorded a placeholder (async scheduling)."""
        state = self._states.get(request_id)
        if state is not None:
            ids = state.lookback_ids()
            state.record_tokens(state.num_tokens, ids[:-1] + (int(token_id),))

    def truncate(self, request_id: str, num_tokens: int, lookback_ids: Sequence[int]) -> None:
        """Keep the first `num_tokens` tokens of a verified request's state (the rest were
        rejected drafts): `SeqState.truncate`."""
        self._states[request_id].truncate(num_tokens, lookback_ids)

    @torch.no_grad()
    def execute(
        self,
        plan: StepPlan,
        token_ids_of: dict[str, Sequence[int]],
        fed: FedTokens | None = None,
        verify: frozenset[str] = frozenset(),
    ) -> StepOutput:
        """token_ids_of: request id -> all known token ids (prompt + outputs), for replays.
        fed: where the ids of chunks holding `PENDING_TOKEN` are (the previous step's samples
        on the device; a plan from `Scheduler.schedule_ahead`).
        verify: requests whose chunk is a speculative verify ([anchor, drafts]): their state is
        marked for rollback (`truncate`) and their logits are every row's, [rows, V]."""
        self.forget(plan.freed_request_ids + plan.preempted_request_ids)
        replays, normals = [], []
        self._verify = verify
        for chunk in plan.chunks:
            state = self._prepare(chunk, token_ids_of[chunk.request_id])
            if chunk.request_id in verify:
                state.begin_speculation(chunk.num_tokens)
            split = chunk.start
            if chunk.replay is not None:
                split = min(chunk.end, chunk.replay.to_token)
                replays.append((chunk, state, chunk.start, split))
            if split < chunk.end:
                normals.append((chunk, state, split, chunk.end))
        out: dict[str, torch.Tensor] = {}
        rows = 0
        self._taps = {}
        if replays:
            rows += self._run(plan.path, replays, token_ids_of, out, replay=True)
        if normals:
            rows += self._run(plan.path, normals, token_ids_of, out, replay=False, fed=fed)
        return StepOutput(out, rows, self._taps)

    def _prepare(self, chunk: ScheduledChunk, known: Sequence[int]) -> PagedSeqState:
        rid = chunk.request_id
        table = self._tables.setdefault(rid, [])
        table[:] = chunk.block_ids  # same list object: the state sees growth
        if chunk.fresh_slot or rid not in self._states:
            state = PagedSeqState(self.pools, chunk.slot, table, self.model.dtype)
            self._states[rid] = state
            if chunk.start > 0 or chunk.replay is not None:
                # The blocks already hold global KV up to the replay end (or the chunk start).
                held = chunk.replay.to_token if chunk.replay is not None else chunk.start
                state.adopt_prefix(held, tuple(known[max(0, held - 3) : held]))
        return self._states[rid]

    def _run(self, path: ForwardPath, parts, token_ids_of, out, replay: bool, fed: FedTokens | None = None) -> int:
        ids, seqs, owners = [], [], []
        fed_seqs, fed_src = [], []
        for chunk, state, start, end in parts:
            known = token_ids_of[chunk.request_id]
            last = end == chunk.end and chunk.needs_logits
            logits = LogitsRequest.LAST if last else LogitsRequest.NONE
            every = not replay and chunk.request_id in self._verify
            if every:
                logits = LogitsRequest.ALL
            if replay:
                lookback = tuple(known[max(0, start - 3) : start])
                state.move_cursor(end, tuple(known[max(0, end - 3) : end]))
                plan = SeqPlan(
                    logits=logits, replay=Replay(lookback), decoder_rows=0 if path is ForwardPath.ENCODER else None
                )
            else:
                plan = self._normal_plan(path, logits, end - start)
            if chunk.token_ids == (PENDING_TOKEN,):  # sampled by the step before: on the device
                if replay or fed is None or chunk.request_id not in fed.row_of:
                    raise ValueError(f"no sampled id to read for {chunk.request_id!r}")
                fed_seqs.append(len(seqs))
                fed_src.append(fed.row_of[chunk.request_id])
                ids.append(0)  # a placeholder id: the forward reads the real one on the device
            else:
                ids.extend(known[start:end])
            seqs.append(SeqInput(state, start, end - start, plan))
            owners.append((chunk.request_id, last))
        feed = TokenFeed(fed.tokens, tuple(fed_seqs), tuple(fed_src)) if fed_seqs else None
        results = self._forward(torch.tensor(ids, dtype=torch.long), seqs, feed, owners)
        wanted = [
            (rid, logits[-1])
            for (rid, last), logits in zip(owners, results, strict=True)
            if last and rid not in self._verify
        ]
        if wanted:  # rows stay on the device: the sampler decides there, one copy per step
            rows = torch.stack([row for _, row in wanted]).float()
            out.update((rid, row) for (rid, _), row in zip(wanted, rows, strict=True))
        out.update(
            (rid, logits.float())
            for (rid, last), logits in zip(owners, results, strict=True)
            if last and rid in self._verify
        )
        return len(ids)

    def _forward(self, ids: torch.Tensor, seqs, feed, owners) -> list:
        """The model's forward (host ids); with `taps` on, each segment's tap rows are kept."""
        if not self.taps:
            return self.model.forward(ids, seqs, feed)
        results, taps = self.model.forward_taps(ids, seqs, feed)
        if taps is not None:
            for i, (rid, _) in enumerate(owners):
                values, positions = taps.of(i)
                if len(positions):
                    self._taps.setdefault(rid, []).append((values, positions))
        return results

    def _normal_plan(self, path: ForwardPath, logits: LogitsRequest, num_tokens: int) -> SeqPlan:
        if path is ForwardPath.ENCODER:
            return SeqPlan.encoder_only()
        if self.decoder_rows is not None and num_tokens > self.decoder_rows:
            return SeqPlan(logits=logits, decoder_rows=self.decoder_rows)
        return SeqPlan(logits=logits)
