"""Speculative decoding: the drafter seam, drafting policy, acceptance and its books.

One speculative step (engine/llm_engine.py drives it; docs: ../shared/docs/dspark.md §3-§5):

    1. every eligible decode row proposes up to k drafts after its anchor (the token the
       target sampled last step, at position p): d_0 .. d_{k-1} at p+1 .. p+k;
    2. ONE target forward verifies all of them: each speculating sequence is a segment of
       1 + len(drafts) rows [anchor, d_0, ..] with logits for every row; sequences without
       drafts ride in the same batch as 1-row segments;
    3. acceptance (`accept`) per sequence -> the accepted drafts plus one target token (the
       correction at the first reject, or the bonus after the last draft);
    4. every state is rolled back to the committed rows (`SeqState.truncate`), the scheduler
       books 1 + accepted computed tokens, the blocks past the known tokens are released.

Acceptance is lossless:
    T = 0: accept while d_j == argmax p_j; emit argmax p_j at the first mismatch, argmax p_k
           after all drafts -> output token-identical to non-speculative greedy decoding.
    T > 0: token-level rejection sampling (Leviathan et al.): accept d_j with probability
           min(1, p_j(d_j) / q_j(d_j)); on a reject draw from norm(max(0, p_j - q_j)); after all
           drafts draw the bonus from p_k. p and q are both taken after the request's
           temperature / top-k / min-p / top-p (`sampling.filtered_probs`).

Drafters implement `Drafter` (below): `NgramDrafter` (prompt lookup, no weights; q one-hot) and
the model's DSpark drafter (`DSparkDrafterAdapter` over model/dspark.py).

Who speculates (`SpeculativeConfig`): a decode row whose request did not say
`speculative="off"`, asks for no logprobs and no grammar (guided rows ride as 1-row segments:
their mask depends on every accepted token, see README "Choices"), has room for at least one more
token than the draft, and only while the step has at most `max_batch` decode rows whose
contexts add up to at most `max_context_tokens` (a verify row reads its whole context's KV and
indexer keys, so long contexts move the crossover down).

Forced acceptance (`bench_forced_acceptance_length`, benchmarks only): the number of accepted
drafts follows a deterministic schedule whose mean is AL - 1, whatever the verify says, so the
speed of the bench preset's random weights can be measured at a target acceptance length. It is
refused unless the environment sets FLASHPD_BENCH_FORCED_ACCEPTANCE=1, logged at engine start
and reported in every output's usage.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from flashpd.model.dspark import greedy_choose

log = logging.getLogger(__name__)

METHODS = ("ngram", "dspark")
DRAFT_GRAPH_MODES = ("auto", "off", "static")  # SpeculativeConfig.draft_graphs
BENCH_ENV = "FLASHPD_BENCH_FORCED_ACCEPTANCE"
# The batch size above which a step does not speculate, from the H200 crossover (bench preset,
# 8K context, k = 5, forced acceptance 3.51, bench/results/h200/spec_summary.json at 92abfc8):
# total tok/s speculative / plain 1.70x at B = 1, 1.42x at 8, 1.11x at 16, 0.75x at 32, 0.58x at
# 64. Speculation pays through 16 and loses from 32 (each verify row reads MoE experts of its own).
DEFAULT_MAX_BATCH = 16
# The decode rows' contexts summed, above which a step does not speculate. Two H200 measurements
# with forced acceptance 3.51: the engine at 8K context (above) pays at 16 rows = 131K tokens and
# loses at 32 = 262K; through the served stack on AgentX-like sessions (~38K-token contexts,
# bench/results/agentx_h200, 5fac956) 1 / p90 ITL is 76.6 vs 63.0 tok/s/user at 4 streams =
# ~152K tokens and 32.5 vs 47.0 at 8 = ~300K. The bound sits between what paid and what lost.
DEFAULT_MAX_CONTEXT_TOKENS = 196_608


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_tokens: int = 5  # k: drafts per step (DSpark always drafts 5, §7)
    max_batch: int = DEFAULT_MAX_BATCH  # no speculation in a step with more decode rows
    max_context_tokens: int | None = DEFAULT_MAX_CONTEXT_TOKENS  # ... or longer contexts in all (None: no bound)
    ngram_min: int = 1  # prompt lookup: shortest suffix n-gram matched
    ngram_max: int = 4  # longest (tried first)
    bench_forced_acceptance_length: float | None = None  # AL = 1 + accepted drafts; bench only
    # DSpark greedy drafts through CUDA graphs: "auto" (when the drafter is on CUDA), "off"
    # (eager: the A/B baseline), "static" (the graphs' padded buffers without capture: CPU tests)
    draft_graphs: str = "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative.method must be one of {list(METHODS)}, got {self.method!r}")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"speculative.num_tokens must be in [1, 16], got {self.num_tokens}")
        if self.max_batch < 0:
            raise ValueError(f"speculative.max_batch must be >= 0, got {self.max_batch}")
        if self.max_context_tokens is not None and self.max_context_tokens < 0:
            raise ValueError(f"speculative.max_context_tokens must be >= 0 or null, got {self.max_context_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("speculative.ngram_min must be in [1, ngram_max]")
        if self.draft_graphs not in DRAFT_GRAPH_MODES:
            raise ValueError(
                f"speculative.draft_graphs must be one of {list(DRAFT_GRAPH_MODES)}, got {self.draft_graphs!r}"
            )
        al = self.bench_forced_acceptance_length
        if al is not None:
            if os.environ.get(BENCH_ENV) != "1":
                raise ValueError(
                    "speculative.bench_forced_acceptance_length is a benchmark "
                    f"mode (outputs are not the model's); set {BENCH_ENV}=1 to "
                    "enable it"
                )
            if not (isinstance(al, int | float) and 1.0 <= al <= self.num_tokens + 1):
                raise ValueError(
                    f"speculative.bench_forced_acceptance_length must be in [1, {self.num_tokens + 1}], got {al!r}"
                )

    @classmethod
    def from_dict(cls, d: Mapping | None) -> SpeculativeConfig | None:
        """From config data ({"method": ..., "num_tokens": ...}); None/{} = off. Unknown keys
        raise."""
        if not d:
            return None
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def handoff(self) -> dict:
        """What a prefill -> decode handoff must agree on (the decode side drafts; P only needs
        to know the pair agrees on it)."""
        return {"method": self.method, "num_tokens": self.num_tokens, "forced": self.bench_forced_acceptance_length}


# ============================================================================ the drafter seam
@dataclass(frozen=True)
class Proposal:
    """Drafts per sequence (0 .. k each) and the distribution each was drawn from:
    probs [B, k, V] FP32 or None when every draft is a point mass (q one-hot)."""

    tokens: list[list[int]]
    probs: torch.Tensor | None = None


# choose(logits [B, V] FP32, slot) -> (tokens [B], probs [B, V]): the engine's sampler applied
# to the drafter's logits with each row's request parameters (so q is filtered as p is)
Choose = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


class Drafter(Protocol):
    num_tokens: int
    uses_tap: bool  # needs the target's tap rows in `observe`

    def new_state(self, token_ids: list[int]) -> object:
        """Per-request state; `token_ids` is the request's live token list (prompt + outputs)."""

    def release(self, state: object) -> None:
        """The engine is done with `state` (request finished, preempted or its state restarts):
        whatever it holds goes back (a pooled drafter's row)."""

    def observe(self, states: Sequence[object], positions: Sequence[Sequence[int]], taps: torch.Tensor | None) -> None:
        """Committed rows only (never a rejected draft): their positions, and the target's tap
        rows for them (concatenated, in order) when `uses_tap`."""

    def propose(
        self, states: Sequence[object], anchors: Sequence[int], anchor_positions: Sequence[int], choose: Choose | None
    ) -> Proposal:
        """choose None: every row is greedy (argmax drafts, point masses), so a drafter may take
        its own argmax path (a CUDA graph) and return probs None."""

    def warm_up(self, max_batch: int) -> int:
        """Prepare what steps of up to `max_batch` speculating rows run (graphs), before traffic;
        returns how many things were built."""


@dataclass
class _NgramState:
    tokens: list[int]  # the request's own list: prompt + outputs
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # a copy of
    # tokens[:len(ids)] (tokens only grow: accepted ids are appended), extended as they grow

    def prefix(self, pos: int) -> np.ndarray:
        """tokens[:pos] as an int64 array, copying only the ids added since the last call."""
        have = self.ids.shape[0]
        if pos > have:
            grown = np.empty(max(pos, 2 * have), dtype=np.int64)
            grown[:have] = self.ids
            grown[have:pos] = self.tokens[have:pos]
            self.ids = grown[:pos]
        return self.ids[:pos]


class NgramDrafter:
    """Prompt lookup (vLLM's `ngram`): the continuation of the most recent earlier occurrence
    of the sequence's last n tokens (n from ngram_max down to ngram_min), up to k tokens.
    Needs no weights; every draft is a point mass."""

    uses_tap = False

    def __init__(self, num_tokens: int, ngram_min: int = 1, ngram_max: int = 4):
        self.num_tokens, self.ngram_min, self.ngram_max = num_tokens, ngram_min, ngram_max

    def new_state(self, token_ids: list[int]) -> _NgramState:
        return _NgramState(token_ids)

    def release(self, state: _NgramState) -> None:
        return None  # holds nothing beyond the object

    def warm_up(self, max_batch: int) -> int:
        return 0  # host lookups: nothing to build

    def observe(self, states, positions, taps) -> None:
        return None  # reads the request's token list directly

    def propose(self, states, anchors, anchor_positions, choose) -> Proposal:
        out = []
        for st, anchor, pos in zip(states, anchors, anchor_positions, strict=True):
            seq = np.append(st.prefix(pos), int(anchor))
            out.append(ngram_lookup(seq, self.num_tokens, self.ngram_min, self.ngram_max))
        return Proposal(out, None)


def ngram_lookup(seq: Sequence[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens following the latest earlier match of seq's last n tokens (largest n
    first); [] when nothing matches. Vectorised over the context (an 8K-token context in a
    Python loop cost ~15 ms per sequence and step)."""
    ids = np.asarray(seq, dtype=np.int64)
    size = ids.shape[0]
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = ids[size - n :]
        match = ids[: size - n] == tail[0]  # match[s]: ids[s:s + n] == tail, s < size - n
        for j in range(1, n):
            match &= ids[j : size - n + j] == tail[j]
        starts = np.flatnonzero(match)
        if starts.size:  # the latest match (the tail itself is excluded: s < size - n)
            start = int(starts[-1])
            return ids[start + n : start + n + k].tolist()
    return []


class DSparkDrafterAdapter:
    """The engine's `Drafter` over model/dspark.py's DSparkDrafter, pooled: every sequence's
    windows are rows of one `DrafterPool` (allocated once, `max_seqs` rows), so `observe` is one
    batched insert (`insert_pooled`) and `propose` one batched draft (`draft_pooled`), neither
    with a per-sequence device loop nor a device-to-host read besides the drafts themselves.

    Greedy batches (choose None) replay a CUDA graph per batch bucket, and inserts of up to W
    rows one per row bucket (engine/gpu/draft_graph.py), when `graphs` says so; a batch with a
    sampled request drafts eagerly with the engine's chooser (its q go to the rejection
    sampler), as does any batch or insert the graphs cannot take (counted in `counters`).
    graphs: "auto" (CUDA graphs when the drafter is on CUDA, else eager), "off" (eager),
    "static" (the graphs' padded static buffers without capture: the CPU tests of that path)."""

    uses_tap = True

    def __init__(self, drafter, max_seqs: int, graphs: str = "auto") -> None:
        if graphs not in DRAFT_GRAPH_MODES:
            raise ValueError(f"draft graphs must be one of {list(DRAFT_GRAPH_MODES)}, got {graphs!r}")
        self.drafter = drafter
        self.num_tokens = int(drafter.k)
        self.pool = drafter.new_pool(max_seqs)
        self.graphs = None
        on_cuda = torch.device(drafter.device).type == "cuda"
        if graphs == "static" or (graphs == "auto" and on_cuda):
            from flashpd.engine.gpu.draft_graph import DraftGraphs  # torch.cuda only when capturing

            self.graphs = DraftGraphs(drafter, self.pool, capture=graphs == "auto")
        self.time_device = False  # benchmarks: synchronise around each call so the times below
        # are the device's (off: host time; propose ends with its device-to-host read anyway)
        self.stats = {"proposes": 0, "graph": 0, "eager_sampled": 0, "eager_fallback": 0}
        self.stats.update(observes=0, observe_graph=0)
        self.seconds = {"propose": 0.0, "observe": 0.0}

    def new_state(self, token_ids: list[int]) -> object:
        return self.pool.acquire()

    def release(self, state) -> None:
        self.pool.release(state)

    def observe(self, states, positions, taps) -> None:
        if taps is None:
            raise ValueError("the DSpark drafter needs the target's tap rows")
        t0 = self._clock()
        plan = self.drafter.plan_insert(self.pool, states, positions, taps)  # host: checks, books
        if plan is not None:
            if self.graphs is not None and self.graphs.write(taps, plan):
                self.stats["observe_graph"] += 1
            else:  # eager: no graphs, more rows than a row bucket (a prompt's), or a failure
                self.drafter.insert_pooled(self.pool, states, positions, taps, plan)
        self.seconds["observe"] += self._clock() - t0
        self.stats["observes"] += 1

    def propose(self, states, anchors, anchor_positions, choose) -> Proposal:
        """choose None: every row is greedy (argmax drafts, point masses: probs None)."""
        self.drafter.check_host_draft(len(states), anchors, anchor_positions)
        t0 = self._clock()
        rows = [st.pool_row for st in states]
        tokens = None
        if choose is None and self.graphs is not None:
            tokens = self.graphs.run(rows, anchors, anchor_positions)
        if tokens is not None:
            self.stats["graph"] += 1
            proposal = Proposal(tokens.tolist(), None)
        else:
            self.stats["eager_sampled" if choose is not None else "eager_fallback"] += 1
            proposal = self._eager(rows, anchors, anchor_positions, choose)
        self.seconds["propose"] += self._clock() - t0
        self.stats["proposes"] += 1
        return proposal

    def _eager(self, rows, anchors, anchor_positions, choose) -> Proposal:
        dev = self.drafter.device
        inputs = torch.tensor([list(rows), list(anchors), list(anchor_positions)], dtype=torch.long).to(dev)
        out = self.drafter.draft_pooled(self.pool, inputs[0], inputs[1], inputs[2], choose or greedy_choose)
        return Proposal(out.tokens.tolist(), None if choose is None else out.probs)

    def warm_up(self, max_batch: int) -> int:
        """Build the graph of every bucket up to max_batch, then close the set (no capture on
        the request path). Returns the graphs built."""
        if self.graphs is None:
            return 0
        built = self.graphs.warm(max_batch)
        self.graphs.freeze()
        return built

    def counters(self) -> dict:
        out = {**self.stats, **{f"{k}_s": round(v, 6) for k, v in self.seconds.items()}}
        return {**out, **(self.graphs.counters() if self.graphs is not None else {})}

    def _clock(self) -> float:
        if self.time_device and torch.device(self.drafter.device).type == "cuda":
            torch.cuda.synchronize(self.drafter.device)
        return time.perf_counter()


# ============================================================================ acceptance
@dataclass(frozen=True)
class Verdict:
    tokens: tuple[int, ...]  # accepted drafts, then the target's token (correction or bonus)
    num_accepted: int


def accept_greedy(target_ids: Sequence[int], drafts: Sequence[int]) -> Verdict:
    """target_ids: argmax of each verify row [d + 1]; drafts [d]."""
    a = 0
    while a < len(drafts) and int(drafts[a]) == int(target_ids[a]):
        a += 1
    return Verdict(tuple(int(t) for t in drafts[:a]) + (int(target_ids[a]),), a)


def accept_sampled(p: torch.Tensor, q: torch.Tensor | None, drafts: Sequence[int], gen: torch.Generator) -> Verdict:
    """Token-level rejection sampling. p [d + 1, V] target probabilities (filtered), q [d, V]
    draft probabilities (filtered; None = point masses on the drafts), gen: the request's
    stream for this step (CPU)."""
    p = p.float().cpu()
    for j, d in enumerate(drafts):
        q_row = _point(p.shape[1], d) if q is None else q[j].float().cpu()
        u = float(torch.rand((), generator=gen))
        pj, qj = float(p[j, d]), float(q_row[d])
        if qj > 0 and u * qj <= pj:  # accept with probability min(1, p/q)
            continue
        residual = (p[j] - q_row).clamp_min(0)
        if float(residual.sum()) <= 0:  # p <= q everywhere: p itself (measure-zero in theory)
            residual = p[j]
        token = int(torch.multinomial(residual, 1, generator=gen))
        return Verdict(tuple(int(t) for t in drafts[:j]) + (token,), j)
    token = int(torch.multinomial(p[len(drafts)], 1, generator=gen))
    return Verdict(tuple(int(t) for t in drafts) + (token,), len(drafts))


def _point(vocab: int, token: int) -> torch.Tensor:
    row = torch.zeros(vocab)
    row[int(token)] = 1.0
    return row


class ForcedSchedule:
    """Accepted drafts per step for forced acceptance: a_t = floor((t+1) m) - floor(t m) with
    m = AL - 1, so the running mean hits m exactly at every step count that m·t is whole
    (AL 3.5: 2, 3, 2, 3, ...). One counter per request."""

    def __init__(self, acceptance_length: float):
        self.mean_accepted = acceptance_length - 1.0
        self._steps: dict[str, int] = {}

    def next(self, request_id: str, num_drafts: int) -> int:
        t = self._steps.get(request_id, 0)
        self._steps[request_id] = t + 1
        m = self.mean_accepted
        return min(num_drafts, math.floor((t + 1) * m + 1e-9) - math.floor(t * m + 1e-9))

    def forget(self, request_id: str) -> None:
        self._steps.pop(request_id, None)


# ============================================================================ books
ACCEPT_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17)  # tokens emitted per verify (AL)


@dataclass
class SpecStats:
    """Counters the worker exports (Prometheus) and each request's usage reports."""

    steps: int = 0  # steps that speculated
    verifies: int = 0  # sequence-verifies (one per speculating row per step)
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens emitted by verifies (accepted + 1 each, before stop cuts)
    length_counts: dict[int, int] = field(default_factory=dict)  # AL -> verifies
    skipped_batch: int = 0  # steps not speculated: batch above max_batch
    skipped_context: int = 0  # ... contexts summed above max_context_tokens

    def record(self, drafted: int, accepted: int) -> None:
        self.verifies += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += accepted + 1
        self.length_counts[accepted + 1] = self.length_counts.get(accepted + 1, 0) + 1

    @property
    def acceptance_length(self) -> float:
        return self.emitted / self.verifies if self.verifies else 0.0

    def snapshot(self) -> dict:
        return {
            "steps": self.steps,
            "verifies": self.verifies,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "acceptance_length": self.acceptance_length,
            "length_counts": dict(self.length_counts),
            "skipped_batch": self.skipped_batch,
            "skipped_context": self.skipped_context,
        }


def build_drafter(config: SpeculativeConfig, dspark=None, max_seqs: int = 1) -> Drafter:
    """The configured drafter. DSpark needs the checkpoint's drafter (`dspark`: a
    model/dspark.py DSparkDrafter built from its mtp.* tensors; engine/loading.py makes it);
    its pool holds the windows of `max_seqs` sequences (the engine's running requests)."""
    if config.method == "ngram":
        return NgramDrafter(config.num_tokens, config.ngram_min, config.ngram_max)
    drafter = dspark
    if drafter is None:
        raise ValueError(
            "speculative.method 'dspark' needs a checkpoint with the DSpark drafter "
            "(num_nextn_predict_layers > 0, mtp.* tensors)"
        )
    adapter = DSparkDrafterAdapter(drafter, max_seqs, config.draft_graphs)
    if adapter.num_tokens != config.num_tokens:
        raise ValueError(
            f"speculative.num_tokens {config.num_tokens} but the DSpark drafter "
            f"drafts {adapter.num_tokens} (dspark_block_size)"
        )
    return adapter


def log_forced(config: SpeculativeConfig) -> None:
    if config.bench_forced_acceptance_length is not None:
        log.warning(
            "BENCHMARK MODE: speculative.bench_forced_acceptance_length=%s — accepted "
            "drafts follow a fixed schedule, outputs are NOT the model's; never serve "
            "with this",
            config.bench_forced_acceptance_length,
        )
