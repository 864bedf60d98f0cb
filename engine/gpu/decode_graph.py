"""Decode steps and W-row replays of the GPU forward as replayable CUDA graphs.

A graph captures `GpuModel.compute` itself (the one forward, model/model.py) over a `Step`
whose tensors are static buffers. Per call:

    host    `GpuModel.prepare` builds the step on the host (padded to the batch bucket,
            key tables as wide as the step's context *class* needs, see below) and moves it in
            one host-to-device copy; the graph captured for that shape has its static buffers
            laid out the same way in one device buffer, refilled by one copy
    graph   the key-row tables expanded from the block table, the forward -> logits [bucket, V]
    after   `GpuModel.commit`: window records scratch -> ring, new open rows, the books

Eligible (`DecodeGraphs.kind`): plain decode (every sequence adds one token, last-row logits, no
replay), a bounded replay of one sequence over exactly W rows without logits, a turn: one
sequence adding 2..W rows through all layers with last-row logits (a new turn after a prefix
hit, a short prompt), padded to the next bucket (`graph_turns_from_env`; the rows are otherwise
thousands of eager launches), and a speculative verify: every sequence adds the same
2..MAX_VERIFY_ROWS rows (anchor + drafts) with logits for every row, unpadded (one graph per
sequence count and row count: padding rows would add MoE expert reads of their own; at batch 1
on the H200 the step padded from 6 to 8 rows spent ~16.5 ms on the device against 9.7 for a
1-row decode). A verify graph is checked once at capture against the eager forward over the
same buffers; one that disagrees is dropped and verifies run eagerly from then on (logged).

The P/D roles' first-hit steps (PD_KINDS, `graph_pd_from_env`: FLASHPD_GRAPH_PD=0 runs them
eagerly; on the H200 each was ~1,000 eager launches, 146-250 ms wall for 56-75 ms of kernels):
    pd replay        the decode role's first step after the KV arrived: the prompt's last W
                     rows replayed through all layers with the last row's logits
    encoder replay   the prefill role's prefix hit: W rows replayed on the encoder path
                     (decoder_rows=0, no logits)
    encoder turn     the rows after it, 2..W on the encoder path, padded to the next bucket: the
                     decoder kinds compute no row; the candidate source's seam (its compressor)
                     takes the padding rows, which close no entry and write nowhere
A graph's key holds the first sequence's (logits, decoder rows), so these never share a graph
with the colocated replay and turn. A turn, verify or P/D kind whose capture fails is logged
and that kind runs eagerly from then on (the engine loads and serves); a decode or plain replay
capture failure is raised.

Everything the graph writes into the pools is a function of the buffers alone (window scratch
rows; entry and index-key rows, -1 for padding and replay rows), so the warm-up runs before a
capture may repeat it; the writes that would not be idempotent (ring copies, open rows) happen
in the commit. Padding rows read nothing and write only scratch rows.

Width classes. A graph's key tables have one width per context *class*: the smallest of
`width_classes` (tokens: WIDTH_CLASS_BASE_TOKENS x ratio^k, the last one the context limit) at
least the step's context, so a class holds every context up to it and a limit of 139,264
tokens is 7 classes at ratio 2 (4K .. 128K, 136K). Ratio 2 bounds the padding at 2x the
context; the padding costs a -inf store per padded column and the key-row expansion (the
indexer kernels stop at each row's visible count), under a millisecond at 128K, while each
class multiplies the graphs to capture at load (ratio 4: 4 classes, up to 4x padding). Without
classes (`graph_width_ratio` 0) widths step by KEY_WIDTH_STEP entries: a capture per new width.

Whenever a graph other than a verify is built, the same step is also prepared and built at
every other class that holds its context (`_siblings`: same buffers, the forward is idempotent
over the pools), so the warm-up, which runs each shape once, leaves a graph for every shape at
every class. `freeze(pools)` (the end of the warm-up) closes the set for those pools: from then
on a step of any kind but verify whose graph is missing runs eagerly (`graph_misses`, logged
once per key) instead of capturing on the request path; verify graphs stay lazy (captured on
first use: their key also holds the sequence and row counts, too many to warm).

`capture=False` runs the same path eagerly (the Triton interpreter on a CPU); `num_builds`
counts the graphs built either way.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from flashpd.engine.gpu.tables import views
from flashpd.engine.kv_pools import PagedSeqState
from flashpd.model.model import LogitsRequest, SeqInput, Step, TokenFeed

if TYPE_CHECKING:
    from flashpd.engine.gpu.forward import GpuModel

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KEY_WIDTH_STEP = 1024  # key-row tables are padded to a multiple of this (fewer captures)
WIDTH_CLASS_BASE_TOKENS = 4096  # the smallest context class (1,024 ratio-4 entries)
DEFAULT_WIDTH_RATIO = 2  # context classes grow by this factor (see the module docstring)
MAX_VERIFY_ROWS = 17  # anchor + up to 16 drafts (SpeculativeConfig.num_tokens <= 16)
TURNS_ENV = "FLASHPD_GRAPH_TURNS"  # 0: turns (<= W rows) run eagerly (the A/B baseline)
# 0: the P/D roles' first-hit steps run eagerly (the decode role's W-row replay with last-row
# logits, the prefill role's encoder-only replay and turn): the A/B baseline, a field escape hatch
PD_ENV = "FLASHPD_GRAPH_PD"

# Step kinds (`DecodeGraphs.kind`).
DECODE, TURN, VERIFY = "decode", "turn", "verify"
REPLAY = "replay"  # W rows, no logits, all layers (a colocated prefix hit's bounded replay)
PD_REPLAY = "pd replay"  # W rows, last-row logits, all layers (the decode role's first step)
ENCODER_REPLAY = "encoder replay"  # W rows, encoder-only (the prefill role's hit)
ENCODER_TURN = "encoder turn"  # 2..W new rows, encoder-only (the prefill role's turn)
PD_KINDS = frozenset({PD_REPLAY, ENCODER_REPLAY, ENCODER_TURN})
PADDED_KINDS = frozenset({DECODE, TURN, ENCODER_TURN})  # rows padded to the next bucket
# kinds whose capture failure (or a verify graph's disagreement) is logged and the kind then
# runs eagerly; a decode or plain replay capture failure is raised (load fails loudly)
FALLBACK_KINDS = frozenset({TURN, VERIFY, *PD_KINDS})


def _switch_from_env(name: str, environ: Mapping[str, str] | None) -> bool:
    text = (os.environ if environ is None else environ).get(name, "1")
    if text not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return text == "1"


def graph_turns_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether turns go through graphs: FLASHPD_GRAPH_TURNS, read when the graphs are built
    (engine load), validated (0 or 1; unset: on)."""
    return _switch_from_env(TURNS_ENV, environ)


def graph_pd_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the P/D first-hit kinds (PD_KINDS) go through graphs: FLASHPD_GRAPH_PD, read
    when the graphs are built (engine load), validated (0 or 1; unset: on)."""
    return _switch_from_env(PD_ENV, environ)


log = logging.getLogger(__name__)


def width_classes(limit_tokens: int, ratio: int, base_tokens: int = WIDTH_CLASS_BASE_TOKENS) -> tuple[int, ...]:
    """Context classes in tokens: base, base*ratio, ... below limit_tokens, then limit_tokens
    itself; () for ratio 0 (linear width steps)."""
    if ratio == 0:
        return ()
    if ratio < 2 or limit_tokens < 1 or base_tokens < 1:
        raise ValueError(f"width classes need ratio 0 or >= 2 and positive sizes, got {ratio}, {limit_tokens}")
    out, c = [], base_tokens
    while c < limit_tokens:
        out.append(c)
        c *= ratio
    return (*out, limit_tokens)


class DecodeGraphs:
    def __init__(self, model: GpuModel, capture: bool | None = None):
        self.model, self.cfg = model, model.cfg
        self.capture = torch.cuda.is_available() if capture is None else capture
        self._graphs: dict[tuple, tuple[object, Step]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.num_captures = 0  # CUDA graphs captured
        self.num_builds = 0  # graphs built (captured, or with capture=False their static buffers)
        self.capture_s = 0.0  # seconds spent building graphs (warm-up runs + capture)
        self.graph_misses = 0  # steps of any kind but verify run eagerly after freeze: no graph
        self._missed: set[tuple] = set()
        self._frozen: set[tuple] = set()  # pools_key of the pools whose graph set is closed
        self._failed: set[str] = set()  # FALLBACK_KINDS whose capture failed: eager from then on
        self.num_verify_replays = 0
        self.runs: dict[str, int] = {}  # kind -> steps run through the graphs (eager misses not)
        self.turns = graph_turns_from_env()
        self.pd = graph_pd_from_env()
        # context classes (tokens, ascending; () = linear width steps): set by the engines
        # over this model (`add_width_classes`, EngineConfig.graph_width_ratio)
        self.width_classes: tuple[int, ...] = ()

    def add_width_classes(self, classes: Sequence[int]) -> None:
        """Engines over one model may have different limits: the union of their classes."""
        self.width_classes = tuple(sorted(set(self.width_classes) | set(classes)))

    @property
    def _failed_turns(self) -> bool:
        return TURN in self._failed

    @property
    def _failed_verify(self) -> bool:
        return VERIFY in self._failed

    def width_class(self, context_tokens: int) -> int:
        """The smallest class holding `context_tokens` (0: none, a linear width step)."""
        return next((c for c in self.width_classes if c >= context_tokens), 0)

    def freeze(self, pools) -> None:
        """Close the graph set of `pools` (after the warm-up): a missing graph of any kind but
        verify then runs eagerly instead of capturing on the request path."""
        self._frozen.add(pools_key(pools))

    def counters(self) -> dict[str, int | float]:
        return {
            "graph_captures": self.num_captures,
            "graph_builds": self.num_builds,
            "graph_misses": self.graph_misses,
            "graph_capture_s": round(self.capture_s, 3),
            # P/D first-hit steps run through a graph (a profile shows whether a turn took one)
            "graph_runs_pd": sum(self.runs.get(kind, 0) for kind in PD_KINDS),
        }

    # ------------------------------------------------------------------ eligibility
    def eligible(self, seqs: Sequence[SeqInput]) -> bool:
        return self.kind(seqs) is not None

    def kind(self, seqs: Sequence[SeqInput]) -> str | None:
        """The graph kind of a step (None: it runs eagerly): a kind switched off (the env
        switches) or failed at capture is None."""
        if self._decode(seqs):
            return DECODE
        kind = self._single(seqs)
        if kind is None and self._verify(seqs):
            kind = VERIFY
        if kind is None or kind in self._failed:
            return None
        if (kind == TURN and not self.turns) or (kind in PD_KINDS and not self.pd):
            return None
        return kind

    def _decode(self, seqs: Sequence[SeqInput]) -> bool:
        """Plain decode: one token per sequence, last-row logits, no replay."""
        return 0 < len(seqs) <= BUCKETS[-1] and all(
            inp.num_tokens == 1
            and inp.plan.replay is None
            and inp.plan.decoder_rows != 0
            and inp.plan.logits is LogitsRequest.LAST
            and isinstance(inp.state, PagedSeqState)
            and inp.start_pos == inp.state.num_tokens > 0
            for inp in seqs
        )

    def _single(self, seqs: Sequence[SeqInput]) -> str | None:
        """One sequence through all layers or the encoder path only (decoder_rows None or 0):
        a replay of exactly W rows (no logits or, all layers, the last row's) or a turn adding
        2..W rows (all layers: last-row logits; encoder-only: none)."""
        if len(seqs) != 1 or not isinstance(seqs[0].state, PagedSeqState):
            return None
        inp = seqs[0]
        plan, w = inp.plan, self.cfg.sliding_window
        if plan.decoder_rows not in (None, 0):
            return None
        encoder = plan.decoder_rows == 0  # logits NONE (SeqPlan refuses any other)
        if plan.replay is not None:
            if inp.num_tokens != w:
                return None
            if encoder:
                return ENCODER_REPLAY
            return {LogitsRequest.NONE: REPLAY, LogitsRequest.LAST: PD_REPLAY}.get(plan.logits)
        if not 1 < inp.num_tokens <= w or inp.start_pos != inp.state.num_tokens:
            return None
        if encoder:
            return ENCODER_TURN
        return TURN if plan.logits is LogitsRequest.LAST else None

    def _verify(self, seqs: Sequence[SeqInput]) -> bool:
        """A speculative step's verify: every sequence adds the same 2..MAX_VERIFY_ROWS rows
        through all layers with logits for every row, no replay, and the padded rows fit the
        pools' scratch rows."""
        if not 0 < len(seqs) <= BUCKETS[-1]:
            return False
        n = seqs[0].num_tokens
        if not 1 < n <= MAX_VERIFY_ROWS or not isinstance(seqs[0].state, PagedSeqState):
            return False
        pools = seqs[0].state.pools
        if len(seqs) * n > pools.window.shape[1] - pools.scratch_base:
            return False
        return all(
            inp.num_tokens == n
            and inp.plan.replay is None
            and inp.plan.decoder_rows is None
            and inp.plan.logits is LogitsRequest.ALL
            and isinstance(inp.state, PagedSeqState)
            and inp.start_pos == inp.state.num_tokens > 0
            for inp in seqs
        )

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def run(
        self, token_ids: torch.Tensor, seqs: Sequence[SeqInput], feed: TokenFeed | None = None
    ) -> list[torch.Tensor | None]:
        return self.run_step(token_ids, seqs, feed)[0]

    @torch.no_grad()
    def run_step(
        self, token_ids: torch.Tensor, seqs: Sequence[SeqInput], feed: TokenFeed | None = None
    ) -> tuple[list[torch.Tensor | None], Step]:
        """`run`, plus the step it ran (its `outputs` are the graph's: the DSpark tap)."""
        model = self.model
        kind = self.kind(seqs)
        if kind is None:
            raise ValueError("a step no graph kind takes (check `eligible` first)")
        if kind in PADDED_KINDS:
            rows = next(b for b in BUCKETS if b >= (len(seqs) if kind == DECODE else seqs[0].num_tokens))
        elif kind == VERIFY:  # unpadded: padding rows would route to experts of their own (the
            rows = token_ids.shape[0]  # MoE reads); the key holds the sequence count anyway
        else:
            rows = seqs[0].num_tokens
        shape = (kind, rows)
        context = max(inp.start_pos + inp.num_tokens for inp in seqs)
        step = self._prepare(token_ids, seqs, shape, self.width_class(context))
        key = self._key(step, shape, seqs)
        if key not in self._graphs:
            if kind != VERIFY and key[-1] in self._frozen:  # closed set: no capture on the request path
                self._miss(key, kind)
                step = model.prepare(token_ids, seqs)
                return self._eager(step, feed), step
            if not self._build_or_fall_back(step, key, kind):
                step = model.prepare(token_ids, seqs)
                return self._eager(step, feed), step
            if kind != VERIFY:
                self._siblings(token_ids, seqs, shape, context)
        self.runs[kind] = self.runs.get(kind, 0) + 1
        graph, static, nbytes = self._graphs[key]
        if kind == VERIFY:
            self.num_verify_replays += 1
        if step.buffer is not None and step.input_bytes == nbytes:
            static.buffer.copy_(step.buffer[:nbytes])  # every input in one copy
        else:
            for dst, src in zip(static.tensors(), step.tensors(), strict=True):
                dst.copy_(src)
        if feed is not None:  # ids sampled by the step before, still on the device
            model.apply_feed(step, feed, into=static)
        if graph is None:
            logits = model.compute(static)
        else:
            graph.replay()
            logits = static.outputs["logits"]
        step.outputs = static.outputs
        model.commit(step)
        return step.split_logits(logits), step

    def _prepare(self, token_ids: torch.Tensor, seqs: Sequence[SeqInput], shape: tuple, width_class: int) -> Step:
        kind, rows = shape
        # a turn (all layers or encoder-only) keeps its own logit rows (none encoder-only) and
        # gets `rows` key-table rows whatever its row count: one graph per bucket
        return self.model.prepare(
            token_ids,
            seqs,
            pad_to=rows,
            key_width_step=KEY_WIDTH_STEP,
            pad_logits=kind in (DECODE, VERIFY),
            key_width_tokens=width_class,
        )

    def _key(self, step: Step, shape: tuple, seqs: Sequence[SeqInput]) -> tuple:
        """What a graph is recorded against: the step's shape and table layout, the key-table
        widths, the first sequence's (logits, decoder rows) (a replay with and without logits,
        all layers or encoder-only) and (last) the pools. `_miss` reads key[2] and key[5]."""
        kind, rows = shape
        tables = step.tables
        plan = seqs[0].plan
        key = (
            kind == DECODE,
            kind in (TURN, ENCODER_TURN),
            rows,
            tuple(tables.window_of[layer] for layer in range(self.cfg.num_layers)),
            tables.window_spec.shape[0],
            tuple(sorted(tables.key_width.items())),
            (plan.logits.value, plan.decoder_rows),
        )
        if kind == VERIFY:  # every input's shape: sequences and rows vary within one row bucket
            key += ("verify", len(seqs), tuple(tuple(t.shape) for t in step.tensors()))
        return (*key, pools_key(tables.pools))

    def _build_or_fall_back(self, step: Step, key: tuple, kind: str) -> bool:
        """Build the graph of `key`; False when a FALLBACK_KINDS step cannot be captured (logged
        once; that kind runs eagerly from then on)."""
        t0 = time.perf_counter()
        try:
            # the graphs whose logits are sampled on the request path's first token or a verify
            # are checked once against the eager forward over the same buffers
            self._graphs[key] = self._build(step, check=kind in (VERIFY, PD_REPLAY))
        except Exception:  # noqa: BLE001 - a fall-back kind that cannot be captured runs eagerly
            if kind not in FALLBACK_KINDS:
                raise
            self._fail(kind)
            return False
        finally:
            self.capture_s += time.perf_counter() - t0
        return True

    def _fail(self, kind: str) -> None:
        """Log (with the exception being handled) and mark `kind`: it runs eagerly from now on."""
        log.exception("%s graph capture failed; %s steps run eagerly from now on", kind, kind)
        self._failed.add(kind)

    def _siblings(self, token_ids: torch.Tensor, seqs: Sequence[SeqInput], shape: tuple, context: int) -> None:
        """The step just built, prepared and built at every other class holding its context
        (before the step's commit: the same pool contents, the same writes). A fall-back kind
        failing here is marked failed (its later steps run eagerly; this one has its graph)."""
        kind = shape[0]
        for c in self.width_classes:
            if c < context:
                continue
            step = self._prepare(token_ids, seqs, shape, c)
            other = self._key(step, shape, seqs)
            if other not in self._graphs and other[-1] not in self._frozen:
                t0 = time.perf_counter()
                try:
                    self._graphs[other] = self._build(step)
                except Exception:  # noqa: BLE001 - as in `_build_or_fall_back`
                    if kind not in FALLBACK_KINDS:
                        raise
                    self._fail(kind)
                    return
                finally:
                    self.capture_s += time.perf_counter() - t0

    def _miss(self, key: tuple, kind: str) -> None:
        self.graph_misses += 1
        if key not in self._missed:
            self._missed.add(key)
            log.warning(
                "no %s graph for %d rows, key widths %s after warm-up: running it eagerly (no capture on the request path)",
                kind,
                key[2],
                dict(key[5]),
            )

    def _eager(self, step: Step, feed: TokenFeed | None) -> list[torch.Tensor | None]:
        """The forward of a prepared step without a graph (as `Model.forward_taps`)."""
        model = self.model
        if feed is not None:
            model.apply_feed(step, feed)
        logits = model.compute(step)
        model.commit(step)
        return step.split_logits(logits)

    def _build(self, step: Step, check: bool = False):
        """A step of static buffers shaped like `step` (views of one device buffer laid out as
        the step's, so a call refills every input with one copy) and, on a GPU, the graph of the
        forward over them (two warm-up runs compile and allocate first)."""
        inputs = step.tensors()
        nbytes = step.input_bytes if step.buffer is not None else 0
        static = copy.copy(step)
        static.rows = {k: copy.copy(r) for k, r in step.rows.items()}
        static.hash_ids = dict(step.hash_ids)
        static.tables = copy.copy(step.tables)
        for name in ("seq_of", "entry_rows", "from_stored", "open_slots"):
            setattr(static.tables, name, dict(getattr(step.tables, name)))
        static.tables.key_rows = {}
        static.outputs = {}
        if nbytes:
            static.buffer = step.buffer[:nbytes].clone()
            static.set_tensors(views(static.buffer, inputs, [_offset(t) for t in inputs]))
        else:
            static.buffer = None
            static.set_tensors([t.clone() for t in inputs])
        self.num_builds += 1
        if not self.capture:
            return None, static, nbytes
        model = self.model
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile + allocate outside the capture
            for _ in range(2):
                eager = model.compute(static)
        torch.cuda.current_stream().wait_stream(stream)
        eager = None if eager is None else eager.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static.outputs = {}
            static.outputs["logits"] = model.compute(static)
        self.num_captures += 1
        if check:  # the same buffers again (the forward is idempotent over the pools)
            graph.replay()
            real = sum(seg.num_tokens for seg in static.segs)  # padding rows are not compared
            mismatch = logits_mismatch(static.outputs["logits"][:real], eager[:real])
            if mismatch:
                raise RuntimeError(f"graph disagrees with the eager forward: {mismatch}")
        return graph, static, nbytes


def logits_mismatch(graph: torch.Tensor | None, eager: torch.Tensor | None) -> str:
    """'' when a graph's logits agree with the eager forward's over the same inputs (the same
    argmax per row, values within 1% of the largest magnitude), else what differs."""
    if graph is None or eager is None:
        return "" if graph is None and eager is None else "one side has no logits"
    if graph.shape != eager.shape:
        return f"shapes {tuple(graph.shape)} vs {tuple(eager.shape)}"
    g, e = graph.float(), eager.float()
    if not torch.isfinite(g).all():
        return "non-finite logits"
    scale = e.abs().max().clamp_min(1e-6)
    diff = (g - e).abs().max()
    if diff > 1e-2 * scale:
        return f"max |diff| {float(diff):.3g} over max |logit| {float(scale):.3g}"
    if not torch.equal(g.argmax(-1), e.argmax(-1)):
        return "argmax differs"
    return ""


def pools_key(pools) -> tuple:
    """The memory a graph recorded against `pools` reads and writes: every pool tensor's
    (address, shape). A graph replays only over the pools it was captured with; two engines
    over one model (colocated engines, a drafter) get graphs of their own, and pools freed and
    re-allocated at the same addresses with the same shapes may reuse them."""
    tensors = [*pools.main.values(), *pools.index.values(), pools.window, pools.open]
    return tuple((t.data_ptr(), tuple(t.shape)) for t in tensors)


def _offset(t: torch.Tensor) -> int:
    """Byte offset of a view into its (uint8) buffer."""
    return t.storage_offset() * t.element_size()
