"""The DSpark drafter of DeepSeek-V4.1-Flash (shared/docs/dspark.md; choices in docs/dspark.md).

One parallel forward over a block of k slots, then a sequential Markov head:

    target tap  main_hidden [T, n_taps*D]  (Step.taps: stream means entering the tap layers)
    context     main_x = main_norm(main_proj(main_hidden))               [T, D]
                window_s[p % W] <- RoPE_p(kv_norm_s(wkv_s(main_x[p]))), FP8 fake-quant, s = 0..L-1
    block       ids [a, n, .., n] at positions p+1 .. p+k (a = anchor = the bonus token, n = noise)
                X = target.embed(ids) copied to S streams; carried pre = stream 0
                for s: V4.1 block (shifted mHC, DSparkAttention, MoE top-k_d of E_d + shared)
                x_k = collapse(X, last FFN pre)                          [k, D] (pre-norm)
                U_k = target.head(norm(x_k)) in FP32                     [k, V]
    Markov      prev = a; for j: L_j = U_j + H . E[prev]; (d_j, q_j) = choose(L_j, j); prev = d_j
    confidence  c_j = sigmoid(w . [x_j ; E[prev_j]])                     (prev_0 = a)

DSparkAttention (one per stage): the backbone's ratio-0 attention (q = wq_b(q_norm(wq_a(x))),
K = V = kv_norm(wkv(.)), RoPE base `rope_theta` without YaRN, FP8 fake-quant, per-head sink,
inverse RoPE, grouped wo_a, wo_b) whose keys are

    this stage's window slots holding positions max(0, p-W+1) .. p     (shared by all k queries)
    all k block slots (their K/V from the layer input, transient)      (bidirectional)

A slot is visible by the position it holds, so never-written slots (-1) and slots holding a
position outside [p-W+1, p] are masked (the TensorRT-LLM pitfall, dspark.md §6).

State: a `DrafterState` per sequence holds the L windows as position-indexed rings of W = 128
slots. Only committed positions are written (`insert_context`); `draft` reads them and never
writes, so a rejected draft needs no rollback and rewriting a position overwrites its own slot.

Two ways to run the same forward:

    per sequence (the spec)   insert_context(states, ...)      draft(states, ...)
                              a write per sequence              the states' windows stacked
    pooled (the engine's)     insert_pooled(pool, states, ...)  draft_pooled(pool, rows, ...)
                              = plan_insert (host) +            one gather by pool row
                                write_pooled (one scatter)

A `DrafterPool` holds every sequence's windows in one allocation ([S+2, L, W, d] and [S+2, W]:
S sequences, a padding row, a sink row); its states are views of their row, so both ways read
and write the same bytes, and `draft_pooled` and `write_pooled` (no host read, no validation,
fixed shapes per bucket) can be captured as CUDA graphs (engine/gpu/draft_graph.py). Both ways
call `context_kv`, `visible`, `block_pass` and `markov`: one forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from flashpd.model.checkpoint import Checkpoint, drafter_manifest, random_values
from flashpd.model.config import ModelConfig
from flashpd.model.model import Model, attention_query, output_projection, window_kv
from flashpd.model.weights import DrafterLayerWeights, DrafterWeights, drafter_weights_from, load_drafter_weights

# choose(L_j [B, V] FP32 logits, slot j) -> (tokens [B] int64, probs [B, V] FP32: the
# distribution the tokens were drawn from, after the request's processors)
Chooser = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
_T = TypeVar("_T")


class DrafterError(ValueError):
    """Bad input to the drafter (the message names the argument)."""


# ============================================================================ state and output
@dataclass
class DrafterState:
    """One sequence's drafter windows: L position-indexed rings of W slots (slot = pos % W).

    kv [L, W, d] holds each stage's context K = V (RoPE'd at its position, FP8 fake-quantised, in
    the model dtype); slot_pos [W] int64 the position each slot holds (-1 = never written), shared
    by the L stages (they are written together); end_pos = 1 + the highest position written.
    pool_row: the `DrafterPool` row kv and slot_pos view (None: storage of its own).
    """

    kv: torch.Tensor
    slot_pos: torch.Tensor
    end_pos: int = 0
    pool_row: int | None = None

    @property
    def window(self) -> int:
        return self.slot_pos.shape[0]

    @property
    def num_written(self) -> int:
        """Slots holding a position (<= W)."""
        return int((self.slot_pos >= 0).sum())

    def positions(self) -> list[int]:
        """Positions held, ascending."""
        return sorted(p for p in self.slot_pos.tolist() if p >= 0)


class DrafterPool:
    """Every sequence's drafter windows in one allocation, indexed by pool row:

        kv       [S+2, L, W, d]  row r: one sequence's L rings (model dtype)
        slot_pos [S+2, W] int64  the position each slot of row r holds (-1 = none)

    Rows 0 .. S-1 are handed out as `DrafterState`s viewing their row (`acquire`, `release`);
    row S (`pad_row`) is never handed out nor written: every slot -1 and K = V = 0, so nothing
    of it is visible, and a draft batch padded to a graph bucket pads with it; row S+1
    (`sink_row`) takes the writes of tap rows that are not kept (and of padding rows) and is
    never read. Allocated once: the addresses a captured graph reads (`key`) never change."""

    def __init__(self, num_seqs: int, num_layers: int, window: int, head_dim: int, dtype, device):
        if num_seqs < 1:
            raise DrafterError(f"a drafter pool needs at least one row, got num_seqs={num_seqs}")
        self.num_seqs, self.window = num_seqs, window
        self.kv = torch.zeros(num_seqs + 2, num_layers, window, head_dim, dtype=dtype, device=device)
        self.slot_pos = torch.full((num_seqs + 2, window), -1, dtype=torch.long, device=device)
        self._free = list(range(num_seqs - 1, -1, -1))  # pop(): row 0 first
        self._held: set[int] = set()

    @property
    def pad_row(self) -> int:
        return self.num_seqs

    @property
    def sink_row(self) -> int:
        return self.num_seqs + 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def key(self) -> tuple:
        """The memory a graph over this pool reads: (address, shape) of kv and slot_pos."""
        return tuple((t.data_ptr(), tuple(t.shape)) for t in (self.kv, self.slot_pos))

    def acquire(self) -> DrafterState:
        """A fresh state (nothing written) on a free row; raises when every row is held."""
        if not self._free:
            raise DrafterError(f"drafter pool full: all {self.num_seqs} rows hold a sequence")
        row = self._free.pop()
        self._held.add(row)
        self.slot_pos[row].fill_(-1)  # forget the row's last sequence (a device fill, no sync)
        return DrafterState(self.kv[row], self.slot_pos[row], 0, pool_row=row)

    def release(self, state: DrafterState) -> None:
        """Give `state`'s row back (once); the state must not be used after."""
        row = state.pool_row
        if row is None or row not in self._held:
            raise DrafterError(f"state of pool row {row} is not held by this pool")
        self._held.remove(row)
        self._free.append(row)
        state.pool_row = None


@dataclass(frozen=True)
class DraftOut:
    """One draft step of B sequences, k slots each."""

    tokens: torch.Tensor  # [B, k] int64: d_0 .. d_{k-1}, at positions anchor_pos + 1 ..
    probs: torch.Tensor  # [B, k, V] FP32: q_j, the distribution d_j was drawn from (chooser's)
    confidences: torch.Tensor  # [B, k] FP32: c_j ~ P(d_j accepted | d_<j accepted)


def greedy_choose(logits: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: argmax (lowest id on ties) and its one-hot distribution."""
    tokens = logits.argmax(dim=-1)  # [B]
    probs = torch.zeros_like(logits, dtype=torch.float32)
    probs.scatter_(1, tokens[:, None], 1.0)
    return tokens, probs


# ============================================================================ the drafter
class DSparkDrafter:
    """The drafter over dequantised `mtp.*` weights, with the target's embed, head and kernels."""

    def __init__(
        self, cfg: ModelConfig, weights: DrafterWeights, target: Model, kernels: Mapping[str, object] | None = None
    ):
        """kernels: op -> module overrides of the target's choice (training: STE fake quants)."""
        if cfg.dspark is None:
            raise DrafterError(f"config {cfg.name!r} has no drafter (num_nextn_predict_layers=0)")
        if (target.cfg.vocab_size, target.cfg.hidden_size) != (cfg.vocab_size, cfg.hidden_size):
            raise DrafterError("the drafter's vocabulary / hidden size differ from the target's")
        if len(weights.layers) != cfg.dspark.num_layers:
            raise DrafterError(f"{len(weights.layers)} drafter layers, config says {cfg.dspark.num_layers}")
        self.cfg, self.ds, self.target = cfg, cfg.dspark, target
        self.k = cfg.dspark.block_size  # drafts per step (5 released)
        self.window = cfg.sliding_window  # W = 128 context slots per stage
        self.device, self.dtype = target.device, target.dtype
        self.w = _to_device(weights, self.device)
        k = self.kernels = {**target.kernels, **(kernels or {})}  # op -> module
        self.dense, self.mhc, self.rope = k["dense"], k["mhc"], k["rope"]
        self.attention, self.moe_k = k["attention"], k["moe"]
        # RoPE of ratio-0 layers: base rope_theta (10000 released), no YaRN (dspark.md §2.3)
        self.freqs = self.rope.rope_frequencies(cfg.rope_head_dim, cfg.rope.theta, None).to(self.device)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, target: Model) -> DSparkDrafter | None:
        """None when the checkpoint stores no `mtp.*` tensor (the engine runs without one)."""
        if ckpt.cfg.dspark is None or not ckpt.drafter_tensors:
            return None
        return cls(ckpt.cfg, load_drafter_weights(ckpt.cfg, ckpt.drafter_tensors, target.dtype), target)

    @classmethod
    def random(cls, cfg: ModelConfig, target: Model, seed: int = 0) -> DSparkDrafter:
        """Random drafter weights made on the target's device in its dtype (benchmarks with
        forced acceptance): drawn as `write_random_checkpoint` draws them, not rounded to the
        FP8 / MXFP4 grids."""
        return cls(cfg, drafter_weights_from(cfg, _RandomReader(cfg, seed, target)), target)

    def new_state(self) -> DrafterState:
        d = self.cfg.head_dim
        kv = torch.zeros(self.ds.num_layers, self.window, d, dtype=self.dtype, device=self.device)
        slot_pos = torch.full((self.window,), -1, dtype=torch.long, device=self.device)
        return DrafterState(kv, slot_pos)

    def new_pool(self, num_seqs: int) -> DrafterPool:
        """Windows of up to `num_seqs` sequences in one allocation (the pooled path)."""
        return DrafterPool(num_seqs, self.ds.num_layers, self.window, self.cfg.head_dim, self.dtype, self.device)

    # ------------------------------------------------------------------ context insert (§3.1)
    def project_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """main_hidden [T, n_taps*D] -> main_x = main_norm(main_proj(.)) [T, D]."""
        d = self.dense
        return d.rms_norm(d.linear(taps.to(self.dtype), self.w.main_proj), self.w.main_norm, self.cfg.rms_norm_eps)

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tap rows [N, n_taps*D] at `positions` [N] -> every stage's context K = V [L, N, d]."""
        main_x = self.project_taps(taps)  # [N, D], shared by the L stages
        cos_sin = self.rope.rope_cos_sin(positions, self.freqs)
        return torch.stack([window_kv(self.kernels, self.cfg, lw.attn, main_x, cos_sin) for lw in self.w.layers])

    @torch.no_grad()
    def insert_context(
        self, states: Sequence[DrafterState], positions: Sequence[Sequence[int]], taps: torch.Tensor
    ) -> None:
        """Write committed positions' context K/V into every stage's window.

        taps [N, n_taps*D]: the tap rows of `positions[0]`, then `positions[1]`, ... (N rows in
        all). Each sequence's positions must ascend and not fall W or more behind its newest
        written position (that slot now holds a newer one). Rows of rejected drafts are never
        passed: the caller inserts committed positions only.
        """
        flat = self._check_insert(states, positions, taps)
        if not flat:
            return
        pos = torch.tensor(flat, dtype=torch.long, device=self.device)  # [N]
        kv = self.context_kv(taps.to(self.device), pos)  # [L, N, d]
        at = 0
        for state, ps in zip(states, positions, strict=True):
            keep = ps[-self.window :]  # older ones would be overwritten in this very call
            r0 = at + len(ps) - len(keep)
            slots = torch.tensor([p % self.window for p in keep], device=self.device)
            state.kv[:, slots] = kv[:, r0 : at + len(ps)]
            state.slot_pos[slots] = pos[r0 : at + len(ps)]
            state.end_pos = max(state.end_pos, keep[-1] + 1) if keep else state.end_pos
            at += len(ps)

    def _check_insert(
        self, states: Sequence[DrafterState], positions: Sequence[Sequence[int]], taps: torch.Tensor
    ) -> list[int]:
        if len(states) != len(positions):
            raise DrafterError(f"{len(states)} states, {len(positions)} position lists")
        width = len(self.ds.target_layer_ids) * self.cfg.hidden_size
        flat = [int(p) for ps in positions for p in ps]
        if taps.ndim != 2 or taps.shape != (len(flat), width):
            raise DrafterError(f"taps must be [{len(flat)}, {width}] (one row per position), got {list(taps.shape)}")
        for i, (state, ps) in enumerate(zip(states, positions, strict=True)):
            ps = list(ps)
            if any(p < 0 for p in ps) or ps != sorted(set(ps)):
                raise DrafterError(f"positions[{i}] must be distinct, ascending and >= 0")
            if ps and ps[0] < state.end_pos - self.window:
                raise DrafterError(
                    f"positions[{i}] starts at {ps[0]}, more than W = "
                    f"{self.window} behind the window's end {state.end_pos}"
                )
        return flat

    @torch.no_grad()
    def insert_pooled(
        self,
        pool: DrafterPool,
        states: Sequence[DrafterState],
        positions: Sequence[Sequence[int]],
        taps: torch.Tensor,
        plan: np.ndarray | None = None,
    ) -> None:
        """`insert_context` for states of `pool`, as one tensor program: `plan_insert` on the
        host (or its `plan`, already made: its books are done), one copy of the plan to the
        device, `write_pooled`."""
        plan = self.plan_insert(pool, states, positions, taps) if plan is None else plan
        if plan is not None:
            self.write_pooled(pool, taps.to(self.device), _upload(plan, self.device))

    def plan_insert(
        self, pool: DrafterPool, states: Sequence[DrafterState], positions: Sequence[Sequence[int]], taps: torch.Tensor
    ) -> np.ndarray | None:
        """The host half of `insert_pooled`: the reference's checks, the states' books
        (end_pos), and where each tap row goes -> int64 [4, N] (None: no row):

            plan[0]  the row's position (its RoPE)
            plan[1]  its target pool row, plan[2] the slot, plan[3] the position the slot then
                     holds: the rows the reference keeps (per entry the last W positions; of two
                     landing in one slot, the later) go to their sequence's row at pos % W, the
                     others to the sink row (slot i % W, holding -1)."""
        flat = self._check_insert(states, positions, taps)
        if not flat:
            return None
        if any(st.pool_row is None for st in states):
            raise DrafterError("insert_pooled takes states of the pool (DrafterPool.acquire)")
        pos = np.asarray(flat, dtype=np.int64)
        index = np.arange(pos.shape[0], dtype=np.int64)
        plan = np.stack([pos, np.full_like(pos, pool.sink_row), index % self.window, np.full_like(pos, -1)])
        rows, pool_rows = _pooled_writes(states, positions, self.window)  # the kept rows [M]
        plan[1, rows], plan[2, rows], plan[3, rows] = pool_rows, pos[rows] % self.window, pos[rows]
        for state, ps in zip(states, positions, strict=True):  # host books: no device read
            if len(ps):
                state.end_pos = max(state.end_pos, int(ps[-1]) + 1)
        return plan

    def write_pooled(self, pool: DrafterPool, taps: torch.Tensor, plan: torch.Tensor) -> None:
        """The device half of `insert_pooled`: taps [N, n_taps*D], plan [4, N] int64 on the
        device (`plan_insert`) -> every row's context K/V written to its target slot. No host
        read, fixed shapes: capturable (padding rows target the sink row)."""
        kv = self.context_kv(taps, plan[0])  # [L, N, d]
        pool.kv[plan[1], :, plan[2]] = kv.transpose(0, 1)  # [N, L, d]
        pool.slot_pos[plan[1], plan[2]] = plan[3]

    # ------------------------------------------------------------------ draft (§3.2-§3.4)
    @torch.no_grad()
    def draft(
        self,
        states: Sequence[DrafterState],
        anchors: torch.Tensor,
        anchor_positions: Sequence[int],
        choose: Chooser = greedy_choose,
    ) -> DraftOut:
        """anchors [B]: the bonus token of each sequence, at anchor_positions[b] (= p + 1, the
        context ends at p). Drafts the k tokens of positions p+2 .. p+k+1 from slots p+1 ..
        p+k. The windows are read only."""
        anchors = self._check_draft(states, anchors, anchor_positions)
        x, base = self.forward_block(states, anchors, anchor_positions)  # [B, k, D], [B, k, V]
        return self.markov(x, base, anchors, choose)

    def _check_draft(
        self, states: Sequence[DrafterState], anchors: torch.Tensor, anchor_positions: Sequence[int]
    ) -> torch.Tensor:
        if anchors.ndim != 1 or anchors.dtype != torch.long or anchors.shape[0] != len(states):
            raise DrafterError(f"anchors must be int64 [{len(states)}], got {anchors.dtype} {list(anchors.shape)}")
        if len(anchor_positions) != len(states):
            raise DrafterError(f"{len(anchor_positions)} anchor_positions for {len(states)} states")
        if any(int(p) < 0 for p in anchor_positions):
            raise DrafterError("anchor_positions must be >= 0")
        if anchors.numel() and (anchors.min() < 0 or anchors.max() >= self.cfg.vocab_size):
            raise DrafterError(f"anchor id outside [0, {self.cfg.vocab_size})")
        return anchors.to(self.device)

    def forward_block(
        self, states: Sequence[DrafterState], anchors: torch.Tensor, anchor_positions: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The parallel pass -> (pre-norm x [B, k, D], base logits U [B, k, V] FP32)."""
        first = torch.tensor([int(p) for p in anchor_positions], device=self.device)  # [B]
        ctx_kv, ctx_valid = self.context(states, first - 1)  # [L, B, W, d], [B, W]
        return self.block_pass(ctx_kv, ctx_valid, anchors, first)

    def block_pass(
        self, ctx_kv: torch.Tensor, ctx_valid: torch.Tensor, anchors: torch.Tensor, first: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block [a, n, .., n] at positions first[b] .. first[b]+k-1 over context keys
        ctx_kv [L, B, Wc, d] (any slot order) visible where ctx_valid [B, Wc]
        -> (pre-norm x [B, k, D], U [B, k, V] FP32)."""
        cfg, num_seqs, k = self.cfg, anchors.shape[0], self.k
        ids = torch.full((num_seqs, k), self.ds.noise_token_id, dtype=torch.long, device=self.device)
        ids[:, 0] = anchors  # [B, k]: [a, n, .., n]
        pos = (first[:, None] + torch.arange(k, device=self.device)).reshape(-1)  # [B*k]
        cos_sin = self.rope.rope_cos_sin(pos, self.freqs)  # [B*k, r/2] each
        embed = self.target.w.embed[ids.reshape(-1)]  # [B*k, D]
        streams = embed[:, None, :].expand(-1, cfg.hc_mult, -1).clone()  # [B*k, S, D]
        carried = torch.zeros(num_seqs * k, cfg.hc_mult, dtype=torch.float32, device=self.device)  # [B*k, S]
        carried[:, 0] = 1.0  # identity pre-mix: the first collapse is stream 0
        for s, lw in enumerate(self.w.layers):

            def attend(x: torch.Tensor, s: int = s, lw: DrafterLayerWeights = lw) -> torch.Tensor:
                return self._attention(lw, x, cos_sin, ctx_kv[s], ctx_valid)

            streams, carried = self._block(lw, streams, carried, attend)
        x = self.mhc.collapse(streams, carried)  # [B*k, D]: the last FFN pre, no hc_head
        h = self.dense.rms_norm(x, self.w.norm, cfg.rms_norm_eps)
        base = self.dense.linear_fp32(h, self.target.w.head)  # [B*k, V] FP32, target's head
        return x.reshape(num_seqs, k, -1), base.reshape(num_seqs, k, -1)

    def context(self, states: Sequence[DrafterState], last_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Window keys of each sequence whose context ends at last_pos[b] = p ->
        (kv [L, B, W, d], valid [B, W]): a slot is visible iff it holds a position in
        [max(0, p-W+1), p]; never-written slots hold -1 and are never visible."""
        kv = torch.stack([st.kv for st in states], dim=1)  # [L, B, W, d]
        held = torch.stack([st.slot_pos for st in states])  # [B, W]
        return kv, self.visible(held, last_pos)

    def visible(self, held: torch.Tensor, last_pos: torch.Tensor) -> torch.Tensor:
        """held [B, W] (slot positions, -1 = none), last_pos [B] = p -> [B, W]: the slot holds a
        position in [p-W+1, p] (never-written slots hold -1: never visible)."""
        p = last_pos[:, None]  # [B, 1]
        return (held >= 0) & (held <= p) & (held > p - self.window)

    def draft_pooled(
        self,
        pool: DrafterPool,
        pool_rows: torch.Tensor,
        anchors: torch.Tensor,
        anchor_positions: torch.Tensor,
        choose: Chooser = greedy_choose,
    ) -> DraftOut:
        """`draft` over pool rows: pool_rows, anchors, anchor_positions [B] int64 on the device
        (a row may be `pool.pad_row`: it sees only its block). No host read and no validation
        (the caller checks on the host, `check_host_draft`), fixed shapes: capturable."""
        ctx_kv = pool.kv[pool_rows].transpose(0, 1)  # [L, B, W, d]
        ctx_valid = self.visible(pool.slot_pos[pool_rows], anchor_positions - 1)  # [B, W]
        x, base = self.block_pass(ctx_kv, ctx_valid, anchors, anchor_positions)
        return self.markov(x, base, anchors, choose)

    def check_host_draft(self, num_states: int, anchors: Sequence[int], anchor_positions: Sequence[int]) -> None:
        """`draft`'s input checks on host integers (the pooled path reads nothing back)."""
        if len(anchors) != num_states or len(anchor_positions) != num_states:
            raise DrafterError(
                f"{len(anchors)} anchors / {len(anchor_positions)} anchor_positions for {num_states} states"
            )
        if any(int(p) < 0 for p in anchor_positions):
            raise DrafterError("anchor_positions must be >= 0")
        if any(not 0 <= int(a) < self.cfg.vocab_size for a in anchors):
            raise DrafterError(f"anchor id outside [0, {self.cfg.vocab_size})")

    def _block(
        self,
        lw: DrafterLayerWeights,
        streams: torch.Tensor,
        carried: torch.Tensor,
        attend: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One V4.1 block on every row (model_spec §2.4, the shifted mHC of Model._layer):
        streams [N, S, D], carried pre [N, S] -> (new streams, this layer's FFN pre)."""
        cfg, mhc = self.cfg, self.mhc
        iters, hc_eps, eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        a, f = lw.hc_attn, lw.hc_ffn
        _, pre_a, post_a, comb_a, x = mhc.expand_mix_collapse(
            None, streams, None, None, a.fn, a.base, a.scale, iters, hc_eps, eps, carried, lw.attn_norm
        )  # attention input from the carried pre
        y = attend(x)  # [N, D]
        streams, pre_f, post_f, comb_f, h = mhc.expand_mix_collapse(
            y, streams, post_a, comb_a, f.fn, f.base, f.scale, iters, hc_eps, eps, pre_a, lw.ffn_norm
        )  # FFN input from the attention site's pre
        m = lw.moe  # bias_vl unused: drafts are text
        out = self.moe_k.moe(
            h,
            m.gate,
            m.bias,
            m.experts,
            m.shared,
            self.ds.num_experts_per_tok,
            cfg.routed_scaling_factor,
            cfg.swiglu_limit,
            cfg.gate_temp,
            cfg.norm_topk_prob,
        )
        return mhc.expand(out, streams, post_f, comb_f), pre_f

    def _attention(
        self,
        lw: DrafterLayerWeights,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        ctx_kv: torch.Tensor,
        ctx_valid: torch.Tensor,
    ) -> torch.Tensor:
        """DSparkAttention: x [B*k, D] (normed), ctx_kv [B, W, d], ctx_valid [B, W] -> [B*k, D]."""
        cfg, aw, k = self.cfg, lw.attn, self.k
        _, q = attention_query(self.kernels, cfg, aw, x, cos_sin)  # [B*k, H, d]
        block_kv = window_kv(self.kernels, cfg, aw, x, cos_sin)  # [B*k, d], transient
        num_seqs, w = ctx_valid.shape
        keys = torch.cat((ctx_kv, block_kv.reshape(num_seqs, k, -1)), dim=1)  # [B, W+k, d]
        valid = torch.cat((ctx_valid, ctx_valid.new_ones(num_seqs, k)), dim=1)  # [B, W+k]
        keys = keys[:, None].expand(-1, k, -1, -1).reshape(num_seqs * k, w + k, -1)
        valid = valid[:, None].expand(-1, k, -1).reshape(num_seqs * k, w + k)
        o = self.attention.sparse_attention(q, keys, valid, aw.sink, cfg.head_dim**-0.5)
        o = self.rope.rotate(o, *cos_sin, inverse=True)  # [B*k, H, d]
        return output_projection(self.dense, cfg, aw, o)

    # ------------------------------------------------------------------ heads (§2.4)
    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """B(prev) = H . E[prev]: prev [B] -> [B, V] FP32."""
        return self.dense.linear_fp32(self.w.markov_embed[prev], self.w.markov_head)

    def confidence(self, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """c = sigmoid(w . [x ; E[prev]]): x [B, D] pre-norm, prev [B] -> [B] FP32."""
        dim = self.cfg.hidden_size
        w = self.w.confidence  # [D + r] FP32
        score = (x.to(torch.float32) * w[:dim]).sum(-1)
        score = score + (self.w.markov_embed[prev] * w[dim:]).sum(-1)
        return torch.sigmoid(score)

    def markov(self, x: torch.Tensor, base: torch.Tensor, anchors: torch.Tensor, choose: Chooser) -> DraftOut:
        """The sequential head over x [B, k, D], U [B, k, V]: L_j = U_j + B(prev_j)."""
        if anchors.shape[0] == 0:  # no sequence: nothing to choose
            empty = base.new_zeros(0, self.k)
            return DraftOut(empty.long(), base.new_zeros(0, self.k, base.shape[-1]), empty)
        prev, tokens, probs, conf = anchors, [], [], []
        for j in range(self.k):
            logits = base[:, j] + self.markov_bias(prev)  # [B, V] FP32
            token, prob = choose(logits, j)
            _check_choice(token, prob, logits)
            conf.append(self.confidence(x[:, j], prev))
            tokens.append(token.to(torch.long))
            probs.append(prob.to(torch.float32))
            prev = tokens[-1]
        return DraftOut(torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(conf, 1))


class _RandomReader:
    """`weights._Reader`'s interface over random values (`DSparkDrafter.random`)."""

    def __init__(self, cfg: ModelConfig, seed: int, target: Model):
        self.specs, self.seed, self.target = drafter_manifest(cfg), seed, target

    def _values(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return random_values(self.seed, name, self.specs[name], self.target.device, dtype)

    def plain(self, name: str) -> torch.Tensor:
        return self._values(name, self.target.dtype)

    def fp32(self, name: str) -> torch.Tensor:
        return self._values(name, torch.float32)

    def fp8(self, prefix: str) -> torch.Tensor:
        return self._values(prefix + ".weight", self.target.dtype)

    mxfp4 = fp8


def _check_choice(token: torch.Tensor, prob: torch.Tensor, logits: torch.Tensor) -> None:
    if token.shape != logits.shape[:1] or prob.shape != logits.shape:
        raise DrafterError(
            f"choose returned tokens {list(token.shape)} / probs {list(prob.shape)} for logits {list(logits.shape)}"
        )


def _pooled_writes(
    states: Sequence[DrafterState], positions: Sequence[Sequence[int]], window: int
) -> tuple[np.ndarray, np.ndarray]:
    """The rows `insert_pooled` writes, as the reference's sequential writes leave them: of each
    entry its last W positions, and of two rows landing in one (pool row, slot) the later one.
    -> (tap row indices [M], their pool rows [M]) int64, in no particular order."""
    lens = np.asarray([len(ps) for ps in positions], dtype=np.int64)
    ends = np.repeat(np.cumsum(lens), lens)  # [N]: one past each row's entry
    index = np.arange(int(lens.sum()), dtype=np.int64)
    owner = np.repeat(np.asarray([st.pool_row for st in states], dtype=np.int64), lens)
    pos = np.asarray([int(p) for ps in positions for p in ps], dtype=np.int64)
    kept = index[ends - index <= window]  # the last W of each entry
    key = owner[kept] * window + pos[kept] % window  # (pool row, slot)
    _, last = np.unique(key[::-1], return_index=True)  # the last writer of each key
    rows = kept[::-1][last]
    return rows, owner[rows]


def _upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host int64 values -> the device in one copy; on CUDA from pinned memory without waiting
    (the caching host allocator keeps the block until the copy has read it)."""
    host = torch.from_numpy(values)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _to_device(obj: _T, device: torch.device) -> _T:
    """A (nested) frozen dataclass of tensors, moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to_device(v, device) for v in obj)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(
            obj, **{f.name: _to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        )
    return obj
