"""DeepSeek-V4.1-Flash text model forward, in paper order (model_spec §0.1), over a batch of segments.

One call runs a batch of sequence segments. Token ids of all segments are concatenated [T]; each
segment brings its state, its start position and an immutable `SeqPlan`. Dense work
(projections, mHC, MoE, Engram, head) runs over all rows at once; per-sequence work (window,
compressor, indexer, attention) runs per segment. A segment's numbers never depend on its batch
neighbours: every kernel is batch-invariant per row (kernels/dense/ref.py).

Rows a layer computes, per segment of T tokens (the forward modes of the plan):

    layers 0 .. cand-1 (encoder)       every row
    layer cand (candidate source)      seam (collapse + attn_norm) and global KV writes on every
                                       row; the rest of the layer on the decoder rows
    layers cand+1 .. L-1 (decoder)     the decoder rows: all, the last `decoder_rows`, or none

    full prefill / chunk / decode      SeqPlan()                     decoder rows = all
    encoder-only prefill               SeqPlan.encoder_only()        decoder rows = none
    decoder narrowing (§11.2-§11.3)    SeqPlan(decoder_rows=128)     decoder rows = last 128
    bounded replay (§11.3-§11.4)       replay_segment(...)           windows clipped at the segment
                                                                     start, global writes suppressed

A layer that computes rows [f, T) of a segment with f > 0, or any layer of a replay, clips its
window there: query t sees window positions [max(t - W + 1, start + f), t].

A forward is three calls: `prepare` (the step's static description: segments, rows per layer
kind, Engram ids, head rows, and whatever tables a backend adds), `compute` (the layers, reading
only the step) and `commit` (the states' books). The GPU path (engine/gpu) is this class with
other weights and its own `LayerOps` over packed pools; its CUDA graphs capture `compute` itself.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from flashpd.kernels import dispatch
from flashpd.kernels.rope.ref import Yarn
from flashpd.model.config import LayerGroup, LayerSpec, ModelConfig
from flashpd.model.kv_format import DEFAULT_KV_FORMAT, CompressedKVFormat, kv_format
from flashpd.model.state import DenseSeqState, OpenGroup, SeqState, StateError
from flashpd.model.weights import (
    AttentionWeights,
    CompressorWeights,
    IndexQueryWeights,
    LayerWeights,
    MixWeights,
    ModelWeights,
    load_weights,
)

if TYPE_CHECKING:
    from flashpd.model.checkpoint import Checkpoint
    from flashpd.model.engram import EngramHasher


# ============================================================================ plans
class LogitsRequest(enum.Enum):
    NONE = "none"
    LAST = "last"  # [1, V]: the segment's last row
    ALL = "all"  # [T, V]


@dataclass(frozen=True)
class Replay:
    """Bounded replay of positions the state already holds global KV for.

    Every layer's window is clipped at the segment start; compressed entries and index keys are
    read from the state, never written; the ratio-2 open-group rows are rebuilt.
    `lookback_ids`: the (up to 3) token ids before the segment, for Engram hashing.
    """

    lookback_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SeqPlan:
    """What one forward does for one sequence."""

    logits: LogitsRequest = LogitsRequest.LAST
    decoder_rows: int | None = None  # rows the decoder layers run on: None = all, 0 = none
    replay: Replay | None = None

    def __post_init__(self) -> None:
        if self.decoder_rows is not None and self.decoder_rows < 0:
            raise ValueError(f"decoder_rows must be >= 0, got {self.decoder_rows}")
        if self.decoder_rows == 0 and self.logits is not LogitsRequest.NONE:
            raise ValueError("an encoder-only plan (decoder_rows=0) produces no logits")

    @classmethod
    def encoder_only(cls) -> SeqPlan:
        """Layers before the candidate source, plus its seam and global KV writes (§11.2)."""
        return cls(logits=LogitsRequest.NONE, decoder_rows=0)


@dataclass(frozen=True)
class SeqInput:
    state: SeqState
    start_pos: int
    num_tokens: int
    plan: SeqPlan = field(default_factory=SeqPlan)


@dataclass(frozen=True)
class TokenFeed:
    """Token ids a forward reads on the device instead of from `token_ids` (async scheduling:
    the previous step's samples, before the host has them). Sequence `seqs[i]` of the forward
    is one decode row whose id is `tokens[src[i]]`; its `token_ids` entry is a placeholder
    (any valid id), and so is the id its state's books record (the caller corrects it once the
    host has the sample: `SeqState.record_tokens`). Each fed sequence needs a full lookback."""

    tokens: torch.Tensor  # [n] int64, on the model's device
    seqs: tuple[int, ...]
    src: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.seqs) != len(self.src):
            raise ValueError(f"{len(self.seqs)} fed sequences, {len(self.src)} source rows")


@dataclass(frozen=True)
class ReplaySegment:
    token_ids: tuple[int, ...]
    start_pos: int
    plan: SeqPlan


def replay_segment(
    prompt_ids: Sequence[int], end_pos: int, rows: int, logits: LogitsRequest = LogitsRequest.LAST
) -> ReplaySegment:
    """Replay positions [end_pos - rows, end_pos) of a prompt (clamped at 0).

    Decode side (§11.3): end_pos = len(prompt), rows = W. Encoder side after a prefix hit of H
    (§11.4): end_pos = H, rows = W, then continue normally from H. Exact: rows =
    exact_replay_rows(cfg).
    """
    if not 0 < end_pos <= len(prompt_ids):
        raise ValueError(f"replay end {end_pos} outside the prompt (length {len(prompt_ids)})")
    if rows < 1:
        raise ValueError(f"replay needs at least one row, got {rows}")
    start = max(0, end_pos - rows)
    lookback = tuple(int(t) for t in prompt_ids[max(0, start - 3) : start])
    return ReplaySegment(
        tuple(int(t) for t in prompt_ids[start:end_pos]), start, SeqPlan(logits=logits, replay=Replay(lookback))
    )


def exact_replay_rows(cfg: ModelConfig) -> int:
    """Rows after which a replay is exact: W + (L-1)(W-1) for L stacked window layers (§11.3).

    The last row's output needs every layer's input exact on its W-row window; each layer widens
    the needed range by W-1 rows. The rebuilt windows (last W-1 rows of every layer) need
    L(W-1) < W + (L-1)(W-1) rows.
    """
    w = cfg.sliding_window
    return w + (cfg.num_layers - 1) * (w - 1)


# ============================================================================ the step
@dataclass(frozen=True)
class Segment:
    """One sequence of the batch: its rows [offset, offset + num_tokens) of the batch."""

    index: int
    inp: SeqInput
    offset: int
    decoder_first: int  # first row (within the segment) the decoder layers compute

    @property
    def state(self) -> SeqState:
        return self.inp.state

    @property
    def num_tokens(self) -> int:
        return self.inp.num_tokens

    @property
    def start_pos(self) -> int:
        return self.inp.start_pos

    @property
    def end_pos(self) -> int:
        return self.inp.start_pos + self.inp.num_tokens

    @property
    def replay(self) -> Replay | None:
        return self.inp.plan.replay


@dataclass(frozen=True)
class Part:
    """The rows one layer touches in one segment.

    seam rows [seam_first, T): the layer input is formed (and global KV written);
    compute rows [first, T): attention, MoE, mHC. seam_first <= first.
    c0:c1 / s0:s1 locate them in the layer's compute / seam tensors.
    """

    seg: Segment
    first: int
    seam_first: int
    c0: int
    c1: int
    s0: int
    s1: int

    @property
    def first_pos(self) -> int:
        return self.seg.start_pos + self.first

    @property
    def clip_window(self) -> bool:
        return self.first > 0 or self.seg.replay is not None


class LayerRows:
    """Seam and compute rows of one kind of layer over the batch, as index tensors into [T].

    Layers of one kind (decoder layer?, owns a compressor?) touch the same rows. `everything`:
    seam = compute = all T rows (a decode step or a replay), so the forward skips the gathers.
    """

    def __init__(self, key: LayerGroup, segs: Sequence[Segment], device: torch.device, num_rows: int):
        self.key, self.parts = key, []
        decoder, owns_compressor = key
        c = s = 0
        seam_idx, compute_idx, compute_in_seam, positions, seam_positions = [], [], [], [], []
        for seg in segs:
            first = seg.decoder_first if decoder else 0
            seam_first = 0 if owns_compressor and seg.replay is None else first
            n_seam, n_comp = seg.num_tokens - seam_first, seg.num_tokens - first
            if n_seam == 0:
                continue
            part = Part(seg, first, seam_first, c, c + n_comp, s, s + n_seam)
            self.parts.append(part)
            seam_idx += range(seg.offset + seam_first, seg.offset + seg.num_tokens)
            compute_idx += range(seg.offset + first, seg.offset + seg.num_tokens)
            compute_in_seam += range(s + first - seam_first, s + n_seam)
            positions += range(part.first_pos, part.first_pos + n_comp)
            seam_positions += range(seg.start_pos + seam_first, seg.end_pos)
            c, s = c + n_comp, s + n_seam
        self.num_compute, self.num_seam = c, s
        self.compute_parts = [p for p in self.parts if p.c1 > p.c0]
        self.everything = c == s == num_rows
        if self.everything:  # every index is the identity, seam positions = compute positions
            self.seam_idx = self.compute_idx = self.compute_in_seam = torch.arange(num_rows, device=device)
            self.positions = self.seam_positions = _on(positions, device)
            return
        self.seam_idx = _on(seam_idx, device)  # [Ts]
        self.compute_idx = _on(compute_idx, device)  # [Tc]
        self.compute_in_seam = _on(compute_in_seam, device)  # [Tc]
        self.positions = _on(positions, device)  # [Tc] absolute positions of the compute rows
        self.seam_positions = _on(seam_positions, device)  # [Ts]

    def relabel(self, key: LayerGroup) -> LayerRows:
        """The same rows for another kind of layer (a step where both kinds touch the same)."""
        out = copy.copy(self)
        out.key = key
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [self.seam_idx, self.compute_idx, self.compute_in_seam, self.positions, self.seam_positions]

    def padded(self, num_rows: int, batch_rows: int) -> LayerRows:
        """The rows of a batch of `batch_rows` extended to `num_rows` with padding rows at
        position 0 (graph buckets). Rows covering the whole batch get every padding row; a kind
        with no compute rows (a decoder kind of an encoder-only step) gets them as seam rows
        when its seam is the whole batch (the candidate source: its compressor runs on them,
        writing nowhere, so the seam keeps one shape per bucket), else it stays empty."""
        pad = num_rows - batch_rows
        every = torch.arange(num_rows, device=self.positions.device)
        out = copy.copy(self)
        if self.everything:
            out.seam_idx = out.compute_idx = out.compute_in_seam = every
            out.positions = torch.cat((self.positions, self.positions.new_zeros(pad)))
            out.seam_positions = out.positions
            out.num_compute = out.num_seam = num_rows
            return out
        if self.num_compute:
            raise ValueError("only rows covering the whole batch, or computing none, can be padded")
        if self.num_seam == batch_rows:
            out.seam_idx = every
            out.seam_positions = torch.cat((self.seam_positions, self.seam_positions.new_zeros(pad)))
            out.num_seam = num_rows
        elif self.num_seam:
            raise ValueError("seam rows of part of the batch cannot be padded")
        return out


def _on(values: list[int], device: torch.device) -> torch.Tensor:
    """Built on the host, moved once."""
    return torch.tensor(values, dtype=torch.long).to(device)


class Published:
    """Per-forward results later layers reuse: top-k per index source, layer-cand candidates."""

    def __init__(self) -> None:
        self._rows: dict[tuple[int, str, int], tuple[int, torch.Tensor]] = {}

    def put(self, part: Part, kind: str, layer: int, value: torch.Tensor) -> None:
        self._rows[(part.seg.index, kind, layer)] = (part.first, value)

    def get(self, part: Part, kind: str, layer: int) -> torch.Tensor:
        """The published rows for this part's compute rows (a suffix of the publisher's)."""
        key = (part.seg.index, kind, layer)
        if key not in self._rows:
            raise RuntimeError(f"layer {layer} published no {kind} for sequence {part.seg.index}")
        first, value = self._rows[key]
        if part.first < first:
            raise RuntimeError(f"{kind} of layer {layer} start at row {first}, need {part.first}")
        return value[part.first - first :]


@dataclass(frozen=True)
class Taps:
    """The DSpark tap of one forward (shared/docs/dspark.md §2.1), from `Model.taps(step)`.

    `values` [Tc, n_taps * D] in the model dtype: per row the decoder layers compute (`rows`,
    those of the last tap layer; every earlier layer computed them too), the plain mean over the
    hc streams of the residual entering each layer of `dspark_target_layer_ids`, concatenated in
    that order. Rows are grouped by segment in batch order.
    """

    values: torch.Tensor
    rows: LayerRows

    def of(self, seg_index: int) -> tuple[torch.Tensor, range]:
        """Segment `seg_index`'s tap rows [n, n_taps * D] and their absolute positions."""
        for part in self.rows.parts:
            if part.seg.index == seg_index:
                return self.values[part.c0 : part.c1], range(part.first_pos, part.first_pos + part.c1 - part.c0)
        return self.values[:0], range(0)


@dataclass
class Step:
    """Everything one forward needs, built once before it (`Model.prepare`): the forward itself
    (`Model.compute`) reads only this, and the states' books move after it (`Model.commit`).

    `outputs` holds what `compute` leaves for the commit. A backend that needs more per step (the
    GPU path: pool row tables and the one device buffer every input views, engine/gpu/step.py)
    extends this class; `tensors` / `set_tensors` are what a CUDA graph's static step refills.
    """

    token_ids: torch.Tensor  # [T]
    segs: list[Segment]
    rows: dict[LayerGroup, LayerRows]
    hash_ids: dict[int, torch.Tensor]  # Engram layer -> [T, C]
    logit_rows: torch.Tensor  # [n] rows of the batch the head runs on
    logit_counts: list[int | None]  # per segment: rows of logits, None = not requested
    outputs: dict = field(default_factory=dict)
    published: Published = field(default_factory=Published)
    host_ids: torch.Tensor | None = None  # [T] token_ids on the host (hashes, the commit)

    def rows_of(self, spec: LayerSpec) -> LayerRows:
        return self.rows[spec.group]

    def tensors(self) -> list[torch.Tensor]:
        """The device inputs, in a fixed order (what a graph replay refills)."""
        out = [self.token_ids, self.logit_rows]
        for key in sorted(self.rows):
            out += self.rows[key].tensors()
        out += [self.hash_ids[k] for k in sorted(self.hash_ids)]
        return out

    def set_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Point the step at other tensors of the same shapes, in `tensors()` order."""
        tensors = list(tensors)
        self.token_ids, self.logit_rows = tensors[0], tensors[1]
        at = 2
        for key in sorted(self.rows):
            rows = self.rows[key]
            (rows.seam_idx, rows.compute_idx, rows.compute_in_seam, rows.positions, rows.seam_positions) = tensors[
                at : at + 5
            ]
            at += 5
        for k in sorted(self.hash_ids):
            self.hash_ids[k] = tensors[at]
            at += 1
        if at != len(tensors):
            raise ValueError(f"{len(tensors)} tensors for a step of {at}")

    def split_logits(self, logits: torch.Tensor | None) -> list[torch.Tensor | None]:
        out, at = [], 0
        for n in self.logit_counts:
            if n is None:
                out.append(None)
            else:
                out.append(logits[at : at + n])
                at += n
        return out


# ============================================================================ the layer ops
class LayerOps(Protocol):
    """The ops a layer needs from its backend: `Model` implements them over the reference
    kernels (readable torch, dequantised weights, `SeqState`s); the GPU model
    (engine/gpu/forward.py) implements them over the Triton kernels and packed KV pools. The
    layer itself (`Model._layer`: mHC mixing, norms, the order of the ops) is shared, so every
    backend runs the same forward. Each op reads only its arguments and the step."""

    def engram_inject(self, lw: LayerWeights, xs: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """xs [T, S, D] the hc streams + Engram table rows `row_ids` [T, C] -> xs with the gated
        Engram memory added (§6)."""
        ...

    def write_global_kv(
        self, spec: LayerSpec, lw: LayerWeights, x_seam: torch.Tensor, rows: LayerRows, step: Step
    ) -> None:
        """Compress the seam rows of every segment into the layer's global KV entries and index
        keys (§4, §5.2), in each segment's state (reference) or pool (GPU)."""
        ...

    def attend(self, spec: LayerSpec, lw: LayerWeights, x: torch.Tensor, rows: LayerRows, step: Step) -> torch.Tensor:
        """x [Tc, D] (normed attention input) -> attention output [Tc, D]: the sliding window,
        and for ratio > 0 layers the indexer's top-k of the global KV (§3, §5)."""
        ...

    def moe_ffn(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """h [Tc, D] -> the shared expert + the gated routed experts' output [Tc, D] (§7)."""
        ...


# ============================================================================ the model
class Model:
    """The forward over dequantised weights; kernels come from the dispatcher by name."""

    stages_window_kv = False  # the paged GPU forward stages new window records in scratch rows

    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights,
        dtype: torch.dtype,
        hasher: EngramHasher | None = None,
        kernels: Mapping[str, str] | None = None,
        compressed_kv_format: CompressedKVFormat | str = DEFAULT_KV_FORMAT,
    ):
        if cfg.engram_layer_ids and hasher is None:
            raise ValueError("config has Engram layers: an EngramHasher is required")
        if len(weights.layers) != cfg.num_layers:
            raise ValueError(f"{len(weights.layers)} layer weights for {cfg.num_layers} layers")
        self.cfg, self.w, self.dtype, self.hasher = cfg, weights, dtype, hasher
        self.device = weights.embed.device
        k = self.kernels = dispatch.select(kernels)  # op -> module (shared with the drafter)
        self.dense, self.quant, self.rope = k["dense"], k["quant"], k["rope"]
        self.mhc, self.engram, self.attention = k["mhc"], k["engram"], k["attention"]
        self.compressor, self.indexer, self.moe_k = k["compressor"], k["indexer"], k["moe"]
        self._init_rope(cfg)
        self.kv_format = kv_format(compressed_kv_format)
        # the DSpark tap (`taps`): recorded when the config has a drafter; () switches it off
        self.tap_layer_ids: tuple[int, ...] = cfg.dspark.target_layer_ids if cfg.dspark else ()

    def _init_rope(self, cfg: ModelConfig) -> None:
        """RoPE tables on the model's device: main (ratio-0 layers) and compressed (§3.3)."""
        rope = cfg.rope
        yarn = Yarn(rope.yarn_factor, rope.yarn_beta_fast, rope.yarn_beta_slow, rope.yarn_original_max_position)
        self.freqs_main = self.rope.rope_frequencies(cfg.rope_head_dim, rope.theta, None).to(self.device)
        self.freqs_compress = self.rope.rope_frequencies(cfg.rope_head_dim, rope.compress_theta, yarn).to(self.device)
        self.eps = cfg.rms_norm_eps

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: Checkpoint,
        dtype: torch.dtype = torch.bfloat16,
        kernels: Mapping[str, str] | None = None,
        compressed_kv_format: CompressedKVFormat | str = DEFAULT_KV_FORMAT,
    ) -> Model:
        """From a `flashpd.model.checkpoint.Checkpoint` (raw tensors, dequantised here once)."""
        hasher = None
        if ckpt.cfg.engram_layer_ids:
            from flashpd.model.engram import EngramHasher

            hasher = EngramHasher.from_tokenizer(ckpt.cfg, ckpt.tokenizer_path)
        weights = load_weights(ckpt.cfg, ckpt.tensors, dtype)
        return cls(ckpt.cfg, weights, dtype, hasher, kernels, compressed_kv_format)

    def new_state(self) -> DenseSeqState:
        return DenseSeqState(self.cfg, self.dtype, self.device)

    # ------------------------------------------------------------------ entry points
    def run(
        self, state: SeqState, token_ids: Sequence[int], plan: SeqPlan | None = None, start_pos: int | None = None
    ) -> torch.Tensor | None:
        """One sequence: `forward` with a batch of one (start defaults to state.num_tokens)."""
        plan = plan or SeqPlan()
        start = state.num_tokens if start_pos is None else start_pos
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        return self.forward(ids, [SeqInput(state, start, len(ids), plan)])[0]

    def run_replay(self, state: SeqState, segment: ReplaySegment) -> torch.Tensor | None:
        return self.run(state, segment.token_ids, segment.plan, segment.start_pos)

    @torch.no_grad()
    def forward(
        self, token_ids: torch.Tensor, seqs: Sequence[SeqInput], feed: TokenFeed | None = None
    ) -> list[torch.Tensor | None]:
        """token_ids [T] (segments concatenated) -> per sequence FP32 logits [1|T, V] or None.
        feed: rows whose ids are read on the device (`TokenFeed`)."""
        return self.forward_taps(token_ids, seqs, feed)[0]

    @torch.no_grad()
    def forward_taps(
        self, token_ids: torch.Tensor, seqs: Sequence[SeqInput], feed: TokenFeed | None = None
    ) -> tuple[list[torch.Tensor | None], Taps | None]:
        """`forward`, plus the step's DSpark tap (`taps`; None without a drafter)."""
        step = self.prepare(token_ids, seqs)
        if feed is not None:
            self.apply_feed(step, feed)
        logits = self.compute(step)
        self.commit(step)
        return step.split_logits(logits), self.taps(step)

    def prepare(self, token_ids: torch.Tensor, seqs: Sequence[SeqInput], device: torch.device | None = None) -> Step:
        """The step's static description: segments, rows per layer kind, Engram ids, head rows.
        device: where its tensors go (default: the model's; a backend that moves them in one
        copy builds them on the host)."""
        device = self.device if device is None else device
        host_ids = token_ids.cpu()  # one copy: validation, Engram hashes and the commit read it
        token_ids = token_ids.to(device)
        segs = self._segments(host_ids, seqs)
        cfg, num_rows = self.cfg, token_ids.shape[0]
        rows = {}
        same = all(seg.decoder_first == 0 for seg in segs)  # every kind: every row (decode)
        for spec in cfg.layers:
            key = spec.group
            if key not in rows:
                rows[key] = (
                    next(iter(rows.values())).relabel(key) if same and rows else LayerRows(key, segs, device, num_rows)
                )
        picks, counts = [], []
        for seg in segs:
            request = seg.inp.plan.logits
            end = seg.offset + seg.num_tokens
            first = {LogitsRequest.NONE: end, LogitsRequest.LAST: end - 1, LogitsRequest.ALL: seg.offset}[request]
            picks += range(first, end)
            counts.append(None if request is LogitsRequest.NONE else end - first)
        return Step(
            token_ids,
            segs,
            rows,
            self._engram_ids(host_ids, segs, device),
            _on(picks, device),
            counts,
            host_ids=host_ids,
        )

    def apply_feed(self, step: Step, feed: TokenFeed, into: Step | None = None) -> None:
        """Write the fed rows' ids and Engram row ids into `into`'s tensors (default: `step`;
        a graph's static step, laid out as `step`), on the device, after `prepare`: the ids
        are gathered from `feed.tokens` and hashed there with each row's lookback ids."""
        into = step if into is None else into
        if not feed.seqs:
            return
        dev = into.token_ids.device
        segs = [step.segs[i] for i in feed.seqs]
        if any(seg.num_tokens != 1 or seg.replay is not None for seg in segs):
            raise ValueError("a fed sequence must be one decode row")
        src = torch.tensor(feed.src, dtype=torch.long).to(feed.tokens.device, non_blocking=True)
        dst = torch.tensor([seg.offset for seg in segs], dtype=torch.long).to(dev, non_blocking=True)
        tokens = feed.tokens.index_select(0, src).to(dev)
        into.token_ids.index_copy_(0, dst, tokens)
        layers = [spec for spec in self.cfg.layers if spec.has_engram]
        if not layers:
            return
        lookbacks = [self._lookback(seg) for seg in segs]
        if any(len(lb) != self.hasher.max_shift for lb in lookbacks):
            raise ValueError("a fed sequence needs a full Engram lookback")
        windows = torch.cat(
            (torch.tensor(lookbacks, dtype=torch.long).to(dev, non_blocking=True), tokens[:, None]), dim=1
        )
        hashed = self.hasher.hash_windows([spec.engram_index for spec in layers], windows)
        for spec, rows in zip(layers, hashed, strict=True):
            into.hash_ids[spec.layer_id].index_copy_(0, dst, rows)

    def compute(self, step: Step) -> torch.Tensor | None:
        """The layers in paper order over the step's rows -> FP32 logits [n, V] (None if n = 0)."""
        cfg = self.cfg
        num_rows = step.token_ids.shape[0]
        embed = self.w.embed[step.token_ids]  # [T, D]
        streams = embed[:, None, :].expand(num_rows, cfg.hc_mult, cfg.hidden_size).clone()
        carried_pre = torch.zeros(num_rows, cfg.hc_mult, dtype=torch.float32, device=self.device)  # [T, S]
        carried_pre[:, 0] = 1.0  # layer 0: one-hot, the first attention input is e_p (§2.4)
        step.published, step.outputs = Published(), {}
        taps: list[torch.Tensor] = []
        for spec, lw in zip(cfg.layers, self.w.layers, strict=True):
            if spec.layer_id in self.tap_layer_ids:  # () without a drafter: no cost
                taps.append(self._tap(streams, step))
            rows = step.rows_of(spec)
            if rows.num_seam:
                streams, carried_pre = self._layer(spec, lw, rows, streams, carried_pre, step)
        if taps:  # in `outputs`: a graph replay hands the caller's step the static buffer
            step.outputs["taps"] = torch.cat(taps, dim=-1)  # [Tc, n_taps*D]
        if step.logit_rows.numel() == 0:
            return None
        idx = step.logit_rows
        h = self.mhc.collapse(streams[idx], carried_pre[idx])  # layer L-1's FFN pre
        h = self.dense.rms_norm(h, self.w.norm, self.eps)
        return self.dense.linear_fp32(h, self.w.head)  # [n, V] FP32

    def taps(self, step: Step) -> Taps | None:
        """The DSpark tap `compute` left in the step (None: the model records none). Its values
        may be a graph's static buffer: consume them before the next forward."""
        values = step.outputs.get("taps")
        return None if values is None else Taps(values, self._tap_rows(step))

    def _tap_rows(self, step: Step) -> LayerRows:
        """The rows the tap covers: those the last tap layer computes."""
        return step.rows_of(self.cfg.layers[self.tap_layer_ids[-1]])

    def _tap(self, streams: torch.Tensor, step: Step) -> torch.Tensor:
        """streams [T, S, D] entering a tap layer -> plain stream mean of the tap rows [Tc, D]."""
        rows = self._tap_rows(step)
        x = streams if rows.everything else streams[rows.compute_idx]  # [Tc, S, D]
        return x.to(torch.float32).mean(dim=1).to(streams.dtype)  # FP32 sum, one rounding

    def commit(self, step: Step) -> None:
        """After the step: the states' token counters and lookback ids."""
        ids = (step.token_ids if step.host_ids is None else step.host_ids).tolist()
        for seg in step.segs:
            self._record_tokens(seg, ids[seg.offset : seg.offset + seg.num_tokens])

    # ------------------------------------------------------------------ batch setup
    def _segments(self, token_ids: torch.Tensor, seqs: Sequence[SeqInput]) -> list[Segment]:
        if token_ids.ndim != 1 or token_ids.dtype != torch.long:
            raise ValueError("token_ids must be a 1-D int64 tensor")
        if sum(s.num_tokens for s in seqs) != token_ids.shape[0]:
            raise ValueError(
                f"segments cover {sum(s.num_tokens for s in seqs)} tokens, token_ids has {token_ids.shape[0]}"
            )
        if len({id(s.state) for s in seqs}) != len(seqs):
            raise ValueError("a state appears twice in one batch")
        if token_ids.numel() and (token_ids.min() < 0 or token_ids.max() >= self.cfg.vocab_size):
            raise ValueError(f"token id outside [0, {self.cfg.vocab_size})")
        segs, offset = [], 0
        for i, inp in enumerate(seqs):
            self._check_segment(inp)
            rows = inp.plan.decoder_rows
            first = 0 if rows is None else inp.num_tokens - min(rows, inp.num_tokens)
            if inp.plan.logits is LogitsRequest.ALL and first:
                raise ValueError("logits for all rows need the decoder on all rows")
            segs.append(Segment(i, inp, offset, first))
            offset += inp.num_tokens
        return segs

    def _check_segment(self, inp: SeqInput) -> None:
        if inp.num_tokens < 1:
            raise ValueError("a segment needs at least one token")
        if getattr(inp.state, "dtype", self.dtype) != self.dtype:
            raise ValueError(f"state dtype {inp.state.dtype} != model dtype {self.dtype}")
        held = inp.state.num_tokens
        end = inp.start_pos + inp.num_tokens
        if inp.plan.replay is None:
            if inp.start_pos != held:
                raise StateError(f"segment starts at {inp.start_pos}, state holds {held} tokens")
        elif inp.start_pos < 0 or end != held:
            raise StateError(f"replay of [{inp.start_pos}, {end}) must end where the state ends ({held})")
        if end > self.cfg.max_position_embeddings:
            raise ValueError(f"position {end - 1} beyond max_position_embeddings")

    def _lookback(self, seg: Segment) -> tuple[int, ...]:
        ids = seg.replay.lookback_ids if seg.replay else seg.state.lookback_ids()
        if len(ids) != min(3, seg.start_pos):
            raise StateError(f"{len(ids)} lookback ids for a segment starting at {seg.start_pos}")
        return tuple(ids)

    def _engram_ids(
        self, token_ids: torch.Tensor, segs: list[Segment], device: torch.device | None = None
    ) -> dict[int, torch.Tensor]:
        """Per Engram layer: row ids [T, C] of every row (token_ids on the host).

        A row's hash reads only the `max_shift` ids before it, so the segments with a full
        lookback are hashed in one call over [lookback_0, tokens_0, lookback_1, tokens_1, ...]
        (the lookback rows are dropped); a segment near its sequence's start (shorter lookback,
        padded) is hashed on its own."""
        layers = [spec for spec in self.cfg.layers if spec.has_engram]
        if not layers:
            return {}
        shift = self.hasher.max_shift
        lookbacks = [list(self._lookback(s)) for s in segs]
        full = [i for i, lb in enumerate(lookbacks) if len(lb) == shift]
        short = [i for i, lb in enumerate(lookbacks) if len(lb) != shift]
        ids = token_ids.tolist()
        joined, keep, dst = [], [], []  # host lists: one tensor each, not two per segment
        for i in full:
            s = segs[i]
            joined += lookbacks[i]
            joined += ids[s.offset : s.offset + s.num_tokens]
            keep += [False] * shift + [True] * s.num_tokens
            dst += range(s.offset, s.offset + s.num_tokens)
        if full:
            joined_t = torch.tensor(joined, dtype=torch.long)
            keep_t, dst_t = torch.tensor(keep), torch.tensor(dst, dtype=torch.long)
        indices = [spec.engram_index for spec in layers]  # every layer from one pass over the ids
        hashed = self.hasher.hash_ids_layers(indices, joined_t, []) if full else None
        shorts = {
            i: self.hasher.hash_ids_layers(
                indices, token_ids[segs[i].offset : segs[i].offset + segs[i].num_tokens], lookbacks[i]
            )
            for i in short
        }
        out = {}
        for j, spec in enumerate(layers):
            rows = torch.empty(token_ids.shape[0], self.hasher.num_columns, dtype=torch.long)
            if full:
                rows[dst_t] = hashed[j][keep_t]
            for i in short:
                s = segs[i]
                rows[s.offset : s.offset + s.num_tokens] = shorts[i][j]
            out[spec.layer_id] = rows.to(self.device if device is None else device)  # [T, C]
        return out

    def _record_tokens(self, seg: Segment, ids: list[int]) -> None:
        history = self._lookback(seg) + tuple(ids[-3:])
        end = seg.start_pos + seg.num_tokens
        seg.state.record_tokens(max(end, seg.state.num_tokens), history[-3:])

    # ------------------------------------------------------------------ one layer (§2.4)
    def _layer(
        self,
        spec: LayerSpec,
        lw: LayerWeights,
        rows: LayerRows,
        streams: torch.Tensor,
        carried_pre: torch.Tensor,
        step: Step,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer over its seam / compute rows -> (new streams [T, S, D], carried pre [T, S]).

        A layer over every row returns its own FFN pre as the carried pre (no copy); one over
        some rows writes them into `carried_pre` (and `streams`) in place."""
        d, every = self.dense, rows.everything
        # seam rows are ascending batch rows: as many as the batch means all of them, in order
        # (the candidate source of an encoder-only prefill), so nothing is gathered
        seam_all = every or rows.num_seam == streams.shape[0]
        xs = streams if seam_all else streams[rows.seam_idx]  # [Ts, S, D]
        if lw.engram is not None:  # 1. Engram before the mixes; they see the injected streams
            ids = step.hash_ids[spec.layer_id]
            xs = self.engram_inject(lw, xs, ids if seam_all else ids[rows.seam_idx])
        # 3. (seam) attention input = attn_norm(collapse(X, carried pre)); when every row
        # computes, one fused mHC step also gives 2. (the attention site's mixes)
        pre_in = carried_pre if seam_all else carried_pre[rows.seam_idx]
        mixes_a = None
        if every:
            _, *mixes_a, x_seam = self._mhc_step(None, xs, None, None, lw.hc_attn, pre_in, lw.attn_norm)
        else:
            x_seam = d.rms_norm(self.mhc.collapse(xs, pre_in), lw.attn_norm, self.eps)  # [Ts, D]
        if spec.owns_compressor:  # §3.7 steps 2-4: global entries and index keys
            self.write_global_kv(spec, lw, x_seam, rows, step)
        if rows.num_compute == 0:
            return streams, carried_pre
        xc = xs if every else xs[rows.compute_in_seam]  # [Tc, S, D]
        pre_a, post_a, comb_a = mixes_a or self._mixes(xc, lw.hc_attn)  # 2.
        x = x_seam if every else x_seam[rows.compute_in_seam]
        y = self.attend(spec, lw, x, rows, step)
        # 4. write-back, 5. the FFN site's mixes, 6. ffn_norm(collapse): one fused mHC step
        xc, pre_f, post_f, comb_f, h = self._mhc_step(y, xc, post_a, comb_a, lw.hc_ffn, pre_a, lw.ffn_norm)
        out = self.mhc.expand(self.moe_ffn(lw, h), xc, post_f, comb_f)  # 7.
        if every:
            return out, pre_f  # 8.
        streams[rows.compute_idx] = out
        carried_pre[rows.compute_idx] = pre_f  # 8.
        return streams, carried_pre

    def engram_inject(self, lw: LayerWeights, xs: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        table_rows = lw.engram.table.rows(row_ids, self.dtype)
        return self.engram.engram_inject(xs, table_rows, lw.engram.wkv, lw.engram.qk, self.eps)

    def moe_ffn(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        cfg, m = self.cfg, lw.moe
        return self.moe_k.moe(
            h,
            m.gate,
            m.bias,
            m.experts,
            m.shared,
            cfg.num_experts_per_tok,
            cfg.routed_scaling_factor,
            cfg.swiglu_limit,
            cfg.gate_temp,
            cfg.norm_topk_prob,
        )

    def _mhc_step(self, y, streams, post, comb, mw: MixWeights, pre_in, norm_weight):
        """mhc.expand_mix_collapse: (X', pre, post, comb, rms_norm(collapse(X', pre_in)))."""
        cfg = self.cfg
        return self.mhc.expand_mix_collapse(
            y,
            streams,
            post,
            comb,
            mw.fn,
            mw.base,
            mw.scale,
            cfg.hc_sinkhorn_iters,
            cfg.hc_eps,
            self.eps,
            pre_in,
            norm_weight,
        )

    def _mixes(self, streams: torch.Tensor, mw: MixWeights) -> tuple[torch.Tensor, ...]:
        cfg = self.cfg
        return self.mhc.hc_mixes(streams, mw.fn, mw.base, mw.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps, self.eps)

    def _freqs(self, spec: LayerSpec) -> torch.Tensor:
        return self.freqs_compress if spec.ratio > 0 else self.freqs_main

    # ------------------------------------------------------------------ compressor (§4, §5.2)
    def write_global_kv(
        self, spec: LayerSpec, lw: LayerWeights, x_seam: torch.Tensor, rows: LayerRows, step: Step
    ) -> None:
        """Compress the seam rows of every segment and append entries + index keys (§4, §5.2)."""
        cw = lw.compressor
        if spec.ratio == 2:
            projected = self.compressor.gated_projection(x_seam, cw.wkv, cw.wgate)  # FP32 [Ts, d]
        else:
            latents_all = self.compressor.project(x_seam, cw.wkv, cw.norm, self.eps)  # [Ts, d]
        for part in rows.parts:
            if part.seg.replay is not None:
                self._replay_open_group(spec, part, projected if spec.ratio == 2 else None)
                continue
            if spec.ratio == 2:
                latents = self._close_groups(spec.layer_id, cw.norm, part, projected)  # [G, d]
            else:
                latents = latents_all[part.s0 : part.s1]  # [G, d]
            if latents.shape[0]:
                first_entry = (part.seg.start_pos + part.seam_first) // spec.ratio
                kv, keys = self._entries(cw, latents, first_entry, spec.ratio)
                part.seg.state.append_entries(spec.layer_id, first_entry, kv, keys)

    def _close_groups(
        self, src: int, norm: torch.Tensor, part: Part, projected: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Ratio 2: pool the part's rows after the carried open-group row -> latents [G, d]."""
        state, first_pos = part.seg.state, part.seg.start_pos + part.seam_first
        open_in = state.open_group(src)
        if (open_in is not None) != (first_pos % 2 == 1):
            raise StateError(
                f"source {src}: open-group row {'present' if open_in else 'missing'} at position {first_pos}"
            )
        kv32, gate32 = (t[part.s0 : part.s1] for t in projected)
        state.note_group_rows(src, first_pos, kv32, gate32)  # a verify's rollback (speculation)
        pooled, open_out = self.compressor.pool_pairs(kv32, gate32, open_in)
        state.set_open_group(src, open_out)
        return self.compressor.latent(pooled, norm, self.eps, self.dtype)

    def _replay_open_group(
        self, spec: LayerSpec, part: Part, projected: tuple[torch.Tensor, torch.Tensor] | None
    ) -> None:
        """Replay writes no entries (they exist); a ratio-2 source rebuilds its open row."""
        state, end_pos = part.seg.state, part.seg.start_pos + part.seg.num_tokens
        needed = end_pos // spec.ratio
        if state.num_entries(spec.layer_id) < needed:
            raise StateError(
                f"replay: source {spec.layer_id} holds {state.num_entries(spec.layer_id)} entries, needs {needed}"
            )
        if projected is not None:
            last = part.s1 - 1  # the lone token of a group left open at end_pos - 1
            kv32, gate32 = projected
            state.set_open_group(
                spec.layer_id, OpenGroup(kv32[last].clone(), gate32[last].clone()) if end_pos % 2 else None
            )

    def _entries(
        self, cw: CompressorWeights, latents: torch.Tensor, first_entry: int, ratio: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE latents [G, d] -> (main KV [G, d] NVFP4, index keys [G, dI] MXFP4)."""
        d = self.dense
        # entries are rotated at the position of their group's first token (§3.3, §12.7)
        entry_pos = (first_entry + torch.arange(latents.shape[0], device=self.device)) * ratio
        cos, sin = self.rope.rope_cos_sin(entry_pos, self.freqs_compress)
        keys = d.rms_norm(d.linear(latents, cw.index_wk), cw.index_k_norm, self.eps)  # [G, dI]
        keys = self.quant.fake_quant_mxfp4(self.rope.rotate(keys, cos, sin))
        fake_quant = getattr(self.quant, self.kv_format.fake_quant)  # NVFP4 by default
        kv = fake_quant(self.rope.rotate(latents, cos, sin))
        return kv, keys

    # ------------------------------------------------------------------ attention (§3)
    def attend(self, spec: LayerSpec, lw: LayerWeights, x: torch.Tensor, rows: LayerRows, step: Step) -> torch.Tensor:
        """x [Tc, D] (normed attention input) -> attention output [Tc, D]."""
        cfg, aw = self.cfg, lw.attn
        pos = rows.positions
        cos, sin = self.rope.rope_cos_sin(pos, self._freqs(spec))  # [Tc, r/2] FP32
        c_q, q = attention_query(self.kernels, cfg, aw, x, (cos, sin))  # [Tc, q_lora], [Tc, H, d]
        kv = window_kv(self.kernels, cfg, aw, x, (cos, sin))  # [Tc, d]
        if lw.index_query is not None:  # index sources have ratio > 0: same (compress) table
            self._select_keys(spec, lw.index_query, x, c_q, (cos, sin), rows, step.published)
        outs = []
        for part in rows.compute_parts:
            keys, valid = self._window(spec.layer_id, part, kv[part.c0 : part.c1], pos[part.c0 : part.c1])  # [t, W, d]
            if spec.ratio > 0:
                entries = part.seg.state.entries(spec.kv_src).kv  # [N, d]
                topk = step.published.get(part, "topk", spec.idx_src)  # [t, K]
                ck, cvalid = self.attention.compressed_keys(entries, topk)  # [t, K, d]
                keys, valid = torch.cat((keys, ck), 1), torch.cat((valid, cvalid), 1)
            outs.append(self.attention.sparse_attention(q[part.c0 : part.c1], keys, valid, aw.sink, cfg.head_dim**-0.5))
        o = torch.cat(outs)  # [Tc, H, d]
        o = self.rope.rotate(o, cos, sin, inverse=True)
        return self._output_projection(aw, o)

    def _window(
        self, layer: int, part: Part, kv_new: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Window keys of the part's queries; appends the new window KV to the state."""
        state = part.seg.state
        if part.clip_window:
            state.clip_window(layer, part.first_pos)
        win = state.window(layer)
        if win.end_pos != part.first_pos:
            raise StateError(
                f"layer {layer}: window ends at {win.end_pos}, segment rows start at {part.first_pos} (replay needed?)"
            )
        buffer = torch.cat((win.kv, kv_new))  # positions win.start_pos ..
        keys, valid = self.attention.window_keys(buffer, win.start_pos, positions, self.cfg.sliding_window)
        state.append_window(layer, part.first_pos, kv_new)
        return keys, valid

    def _output_projection(self, aw: AttentionWeights, o: torch.Tensor) -> torch.Tensor:
        """o [Tc, H, d] -> grouped wo_a (block-diagonal, §3.6) -> wo_b -> [Tc, D]."""
        return output_projection(self.dense, self.cfg, aw, o)

    # ------------------------------------------------------------------ indexer (§5)
    def _select_keys(
        self,
        spec: LayerSpec,
        iw: IndexQueryWeights,
        x: torch.Tensor,
        c_q: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        rows: LayerRows,
        published: Published,
    ) -> None:
        """Score the kv source's index keys, publish top-k (and candidates at the source)."""
        cfg, d = self.cfg, self.dense
        pos, num_q = rows.positions, x.shape[0]
        q = d.linear(c_q, iw.wq_b).reshape(num_q, cfg.index_n_heads, cfg.index_head_dim)
        q = self.quant.fake_quant_mxfp4(self.rope.rotate(q, *cos_sin))  # [Tc, hI, dI]
        scale = cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5  # 1/64 released
        head_w = d.linear(x, iw.weights_proj).to(torch.float32) * scale  # [Tc, hI]
        for part in rows.compute_parts:
            keys = part.seg.state.entries(spec.kv_src).keys  # [N, dI]
            n_visible = (pos[part.c0 : part.c1] + 1) // spec.ratio  # [t]
            scores = self.indexer.index_scores(
                q[part.c0 : part.c1], head_w[part.c0 : part.c1], keys, n_visible
            )  # [t, N] FP32
            allowed = None
            if spec.is_candidate_source:
                published.put(
                    part,
                    "candidates",
                    spec.layer_id,
                    self.indexer.candidate_mask(scores, n_visible, cfg.candidate_block_size, cfg.candidate_topk_blocks),
                )
            if spec.uses_candidates:
                allowed = published.get(part, "candidates", cfg.candidate_source_layer_id)
            published.put(part, "topk", spec.layer_id, self.indexer.select_topk(scores, cfg.index_topk, allowed))


# ============================================================================ shared pieces
# Attention arithmetic the backbone (ratio-0 and compressed layers alike) and the DSpark drafter
# (model/dspark.py) share; `kernels` maps op family -> module (`dispatch.select`).
def attention_query(
    kernels: Mapping,
    cfg: ModelConfig,
    aw: AttentionWeights,
    x: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (normed) -> (c_q [T, q_lora], RoPE'd q [T, H, d]); no per-head q norm (§12.4)."""
    d = kernels["dense"]
    c_q = d.rms_norm(d.linear(x, aw.wq_a), aw.q_norm, cfg.rms_norm_eps)  # [T, q_lora]
    q = d.linear(c_q, aw.wq_b).reshape(x.shape[0], cfg.num_heads, cfg.head_dim)  # [T, H, d]
    return c_q, kernels["rope"].rotate(q, *cos_sin)


def window_kv(
    kernels: Mapping,
    cfg: ModelConfig,
    aw: AttentionWeights,
    x: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """x [T, D] -> window K = V [T, d]: kv_norm(wkv(x)), RoPE, FP8 UE8M0 fake-quant (§6.1)."""
    d = kernels["dense"]
    kv = d.rms_norm(d.linear(x, aw.wkv), aw.kv_norm, cfg.rms_norm_eps)  # [T, d]
    return kernels["quant"].fake_quant_fp8_ue8m0(kernels["rope"].rotate(kv, *cos_sin))


def output_projection(dense, cfg: ModelConfig, aw: AttentionWeights, o: torch.Tensor) -> torch.Tensor:
    """o [T, H, d] (inverse-RoPE'd) -> grouped wo_a (block-diagonal, §3.6) -> wo_b -> [T, D]."""
    groups = o.reshape(o.shape[0], cfg.o_groups, -1)  # [T, G, (H/G)*d]
    wo_a = aw.wo_a.reshape(cfg.o_groups, cfg.o_lora_rank, -1)  # [G, o_lora, (H/G)*d]
    z = torch.cat([dense.linear(groups[:, g], wo_a[g]) for g in range(cfg.o_groups)], dim=-1)
    return dense.linear(z, aw.wo_b)  # [T, D]


def load_model(
    path: str,
    dtype: torch.dtype = torch.bfloat16,
    kernels: Mapping[str, str] | None = None,
    compressed_kv_format: CompressedKVFormat | str = DEFAULT_KV_FORMAT,
) -> Model:
    """Load a checkpoint directory and build the model in `dtype`."""
    from flashpd.model.checkpoint import load_checkpoint

    return Model.from_checkpoint(load_checkpoint(path), dtype, kernels, compressed_kv_format)
