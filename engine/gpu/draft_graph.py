"""DSpark drafts and context inserts as replayable CUDA graphs, one per bucket.

The drafter's step (model/dspark.py `DSparkDrafter.draft_pooled`: gather the windows by pool
row, the 3-layer block pass, the head, the Markov loop over k slots) is some two thousand small
ops; eagerly their launch cost is most of a step at batch 1. Per draft (`run`):

    host    pool rows, anchors and anchor positions of B sequences, padded to the batch bucket
            (the pool's pad row, the noise id, position 0) -> one [3, bucket] int64 copy into
            the graph's static input
    graph   draft_pooled(pool, rows, anchors, positions, greedy_choose) -> tokens [bucket, k]
    after   tokens[:B] -> host: the step's one device-to-host read (the verify needs them there)

Per context insert (`write`, the committed rows of a step: 1 .. k+1 per sequence):

    host    `plan_insert`'s [4, N] plan, padded to the row bucket (position 0, the sink row,
            slots N .. bucket-1, holding -1) -> one copy; the N tap rows -> the static taps
    graph   write_pooled(pool, taps, plan): context K/V of every row into its target slot

Row buckets stop at W (the sink slots of one call stay distinct); a longer insert (a prompt's
rows) runs eagerly, as every insert of vLLM's does.

Greedy only: a greedy draft is the argmax of L_j (`greedy_choose`), a function of the inputs.
A sampled request's draft is drawn by the engine's chooser on the host with the request's
generator, so a batch holding one runs `draft_pooled` eagerly (`DSparkDrafterAdapter` counts it).

A graph is recorded against the pool and the drafter it reads (`key`: kind, bucket,
`DrafterPool.key`, the drafter's identity), captured after two warm-up runs (compiles,
allocations) and checked once against those eager runs over the same inputs: a draft's tokens
equal and confidences within 1e-3; an insert's sink-row K/V within 1e-3 of the largest.
A capture that raises or disagrees is logged with its traceback, counted in `failures`, and
every later call runs eagerly (`run` returns None): the serving path never breaks, and
bench/spec_decode.py turns a failure into a non-zero exit. `freeze` (after the warm-up) closes
the set: a bucket without a graph then runs eagerly (`misses`) instead of capturing on the
request path.

`capture=False` runs the same static-buffer path without CUDA graphs (the CPU tests: the padded
bucket is what the graph would replay).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flashpd.model.dspark import DrafterPool, DraftOut, DSparkDrafter, greedy_choose

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode batch buckets (decode_graph.BUCKETS)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # tap rows of one context insert (<= W)
CONF_TOLERANCE = 1e-3  # capture check: |graph - eager| confidences (sigmoid outputs)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: capture=False (static path, eager)
    inputs: torch.Tensor  # [3, bucket] int64: pool rows, anchors, anchor positions
    out: DraftOut  # the static outputs (tokens [bucket, k], ...)


@dataclass
class _Write:
    graph: torch.cuda.CUDAGraph | None
    plan: torch.Tensor  # [4, bucket] int64 (`plan_insert`'s rows)
    taps: torch.Tensor  # [bucket, n_taps * D] in the drafter's dtype


class DraftGraphs:
    """Greedy drafts of `drafter` over `pool`, one static program per batch bucket, and its
    context inserts, one per row bucket."""

    def __init__(self, drafter: DSparkDrafter, pool: DrafterPool, capture: bool, buckets: Sequence[int] = BUCKETS):
        self.drafter, self.pool, self.capture = drafter, pool, capture
        # the batch buckets below the pool's row count, then the row count itself (a batch
        # never holds more sequences than the pool)
        self.buckets = tuple(b for b in buckets if b < pool.num_seqs) + (min(pool.num_seqs, buckets[-1]),)
        self.row_buckets = tuple(b for b in ROW_BUCKETS if b <= drafter.window)
        self._graphs: dict[tuple, _Graph] = {}
        self._writes: dict[tuple, _Write] = {}
        self._mempool = torch.cuda.graph_pool_handle() if capture else None
        self.failed = False  # a capture raised or disagreed: eager from then on
        self.frozen = False
        self.failures = 0  # captures that raised or disagreed
        self.misses = 0  # calls without a graph after freeze (eager)
        self.replays = 0  # drafts served by a static program (a graph on CUDA)
        self.write_replays = 0  # context inserts served by a static program
        self.num_captures = 0
        self.capture_s = 0.0

    def bucket(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def key(self, bucket: int, kind: str = "draft") -> tuple:
        return (kind, bucket, self.pool.key(), id(self.drafter))

    def row_bucket(self, num_rows: int) -> int | None:
        return next((b for b in self.row_buckets if b >= num_rows), None)

    def counters(self) -> dict:
        return {
            "graph_replays": self.replays,
            "write_graph_replays": self.write_replays,
            "graph_captures": self.num_captures,
            "graph_failures": self.failures,
            "graph_misses": self.misses,
            "graph_capture_s": round(self.capture_s, 3),
            "graph_failed": self.failed,
        }

    # ------------------------------------------------------------------ one call
    @torch.no_grad()
    def run(self, pool_rows: Sequence[int], anchors: Sequence[int], positions: Sequence[int]) -> torch.Tensor | None:
        """Greedy drafts [B, k] int64 on the host, or None: no static program for this batch
        (too large, capture failed, or a bucket missing after freeze); the caller runs eagerly."""
        bucket = self.bucket(len(pool_rows))
        if bucket is None or self.failed:
            return None
        key = self.key(bucket)
        entry = self._graphs.get(key)
        if entry is None:
            if self.frozen:
                self.misses += 1
                return None
            entry = self._build(bucket)
            if entry is None:
                return None
        entry.inputs.copy_(self._host_inputs(bucket, pool_rows, anchors, positions), non_blocking=True)
        if entry.graph is None:
            out = self._program(entry.inputs)
        else:
            entry.graph.replay()
            out = entry.out
        self.replays += 1
        return out.tokens[: len(pool_rows)].cpu()

    @torch.no_grad()
    def write(self, taps: torch.Tensor, plan: np.ndarray) -> bool:
        """A planned context insert (`plan_insert`: plan [4, N], taps [N, n_taps*D]) through
        the row bucket's static program; False: none (too many rows, a capture failed, a bucket
        missing after freeze), the caller writes eagerly."""
        num = plan.shape[1]
        bucket = self.row_bucket(num)
        if bucket is None or self.failed:
            return False
        entry = self._writes.get(self.key(bucket, "write"))
        if entry is None:
            if self.frozen:
                self.misses += 1
                return False
            entry = self._build_write(bucket)
            if entry is None:
                return False
        entry.plan.copy_(self._host_plan(bucket, plan), non_blocking=True)
        entry.taps[:num].copy_(taps)
        if entry.graph is None:
            self.drafter.write_pooled(self.pool, entry.taps, entry.plan)
        else:
            entry.graph.replay()
        self.write_replays += 1
        return True

    def warm(self, max_batch: int) -> int:
        """Build every program a step of up to `max_batch` speculating sequences takes (the
        engine's warm-up): drafts of each batch bucket, inserts of each row bucket up to
        max_batch * (k+1) rows. Returns how many were built."""
        built = 0
        rows = max(max_batch, 1) * (self.drafter.k + 1)
        for bucket in self.buckets:  # up to the first bucket holding max_batch sequences
            if self.failed:
                break
            if self.key(bucket) not in self._graphs and self._build(bucket) is not None:
                built += 1
            if bucket >= max_batch:
                break
        for bucket in self.row_buckets:
            if self.failed:
                break
            if self.key(bucket, "write") not in self._writes and self._build_write(bucket) is not None:
                built += 1
            if bucket >= rows:
                break
        return built

    def freeze(self) -> None:
        self.frozen = True

    # ------------------------------------------------------------------ building
    def _host_inputs(self, bucket: int, pool_rows, anchors, positions) -> torch.Tensor:
        """[3, bucket] int64 (pinned on CUDA): the real rows, then padding rows (the pad row
        sees nothing, the noise id at position 0)."""
        host = torch.empty(3, bucket, dtype=torch.long, pin_memory=self.capture)
        num = len(pool_rows)
        host[0, :num] = torch.as_tensor(list(pool_rows), dtype=torch.long)
        host[1, :num] = torch.as_tensor(list(anchors), dtype=torch.long)
        host[2, :num] = torch.as_tensor(list(positions), dtype=torch.long)
        host[0, num:] = self.pool.pad_row
        host[1, num:] = self.drafter.ds.noise_token_id
        host[2, num:] = 0
        return host

    def _host_plan(self, bucket: int, plan: np.ndarray) -> torch.Tensor:
        """[4, bucket] int64 (pinned on CUDA): the plan's rows, then padding rows (position 0,
        the sink row at slots N .. bucket-1, holding -1: distinct from the plan's sink slots)."""
        num = plan.shape[1]
        host = torch.empty(4, bucket, dtype=torch.long, pin_memory=self.capture)
        host[:, :num] = torch.from_numpy(plan)
        host[0, num:] = 0
        host[1, num:] = self.pool.sink_row
        host[2, num:] = torch.arange(num, bucket)
        host[3, num:] = -1
        return host

    def _program(self, inputs: torch.Tensor) -> DraftOut:
        return self.drafter.draft_pooled(self.pool, inputs[0], inputs[1], inputs[2], greedy_choose)

    def _build(self, bucket: int) -> _Graph | None:
        """The bucket's static program (captured on CUDA); None when the capture failed."""
        t0 = time.perf_counter()
        inputs = self._host_inputs(bucket, [], [], []).to(self.pool.kv.device)  # all padding
        try:
            entry = self._capture(inputs) if self.capture else _Graph(None, inputs, self._program(inputs))
        except Exception:  # noqa: BLE001 - an optimisation: eager drafts from now on, loudly
            self.failed = True
            self.failures += 1
            log.exception("DSpark draft graph capture failed (bucket %d): drafts run eagerly from now on", bucket)
            return None
        finally:
            self.capture_s += time.perf_counter() - t0
        self._graphs[self.key(bucket)] = entry
        return entry

    def _build_write(self, bucket: int) -> _Write | None:
        """The row bucket's static insert (captured on CUDA); None when the capture failed."""
        t0 = time.perf_counter()
        device = self.pool.kv.device
        width = len(self.drafter.ds.target_layer_ids) * self.drafter.cfg.hidden_size
        plan = self._host_plan(bucket, np.zeros((4, 0), dtype=np.int64)).to(device)  # all padding
        taps = torch.zeros(bucket, width, dtype=self.drafter.dtype, device=device)
        try:
            graph = self._capture_write(plan, taps) if self.capture else None
        except Exception:  # noqa: BLE001 - an optimisation: eager inserts from now on, loudly
            self.failed = True
            self.failures += 1
            log.exception("DSpark insert graph capture failed (%d rows): drafting runs eagerly from now on", bucket)
            return None
        finally:
            self.capture_s += time.perf_counter() - t0
        entry = self._writes[self.key(bucket, "write")] = _Write(graph, plan, taps)
        return entry

    def _capture_write(self, plan: torch.Tensor, taps: torch.Tensor) -> torch.cuda.CUDAGraph:
        """Capture an insert of padding rows (they write the sink row only), checked: random taps
        written eagerly and by the graph leave the same sink-row K/V."""
        taps.copy_(torch.randn(taps.shape, generator=torch.Generator().manual_seed(0)).to(taps))
        sink = self.pool.kv[self.pool.sink_row]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.drafter.write_pooled(self.pool, taps, plan)
        torch.cuda.current_stream().wait_stream(stream)
        eager = sink.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            self.drafter.write_pooled(self.pool, taps, plan)
        self.num_captures += 1
        sink.zero_()
        graph.replay()
        scale = eager.float().abs().max().clamp_min(1e-6)
        diff = (sink.float() - eager.float()).abs().max()
        if not float(diff) <= 1e-3 * float(scale):  # NaN fails too
            raise RuntimeError(f"insert graph disagrees with the eager insert: {float(diff):.3g}")
        return graph

    def _capture(self, inputs: torch.Tensor) -> _Graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile + allocate outside the capture
            for _ in range(2):
                eager = self._program(inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            out = self._program(inputs)
        self.num_captures += 1
        graph.replay()  # the same inputs again: the program only reads the pool
        mismatch = draft_mismatch(out, eager)
        if mismatch:
            raise RuntimeError(f"draft graph disagrees with the eager drafter: {mismatch}")
        return _Graph(graph, inputs, out)


def draft_mismatch(graph: DraftOut, eager: DraftOut) -> str:
    """'' when a graph's drafts agree with the eager drafter's over the same inputs."""
    if graph.tokens.shape != eager.tokens.shape:
        return f"shapes {tuple(graph.tokens.shape)} vs {tuple(eager.tokens.shape)}"
    if not torch.equal(graph.tokens, eager.tokens):
        return "tokens differ"
    diff = (graph.confidences - eager.confidences).abs().max() if graph.confidences.numel() else 0.0
    if not float(diff) <= CONF_TOLERANCE:  # NaN fails too
        return f"confidences differ by {float(diff):.3g}"
    return ""
