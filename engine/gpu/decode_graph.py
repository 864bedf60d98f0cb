"""Decode steps of the GPU forward as replayable CUDA graphs.

A decode step (every sequence adds one token, no replay, no window clip) has the same kernel
sequence every time; only a few index tensors change. `DecodeGraphs` keeps those in static
buffers, captures one graph per (padded batch, key-table widths) and, per step:

    host    fill the buffers from the states: token ids, positions, Engram row ids, window
            rows per layer [L, B, W] (ring rows of positions < p, the scratch row of p),
            global-entry write rows per KV source (-1 when a ratio-2 token only opens its
            group), key-row tables per KV source [B, N] (N padded to a multiple of 1024)
    graph   the 40-layer forward on the buffers (GpuModel's layer pieces; the ratio-2
            compressor pools the stored open row with the token's own row for every sequence
            and writes only the closing ones) -> logits [B, V]
    after   outside the graph: window records scratch -> ring, new open rows into the open
            pool, then the states' books (windows, entry counts, open flags, token counters)

Everything the graph writes into the pools during a replay is a function of the buffers alone
(scratch rows, entry rows), so the warm-up runs before a capture may repeat it; the writes that
would not be idempotent (ring copies that overwrite a window row attention still reads, open
rows read by the same step) happen after the replay. Batches are padded to the next bucket
with rows that read nothing and write only scratch rows.

`capture=False` runs the same static path eagerly: the Triton interpreter on a CPU, and the
tests that compare it with `GpuModel.forward`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flashpd.engine.kv_pools import KVPools, PagedSeqState
from flashpd.kernels.attention import triton as attn_t
from flashpd.kernels.indexer import triton as index_t
from flashpd.kernels.quant import triton as quant_t
from flashpd.model.model import LogitsRequest, SeqInput
from flashpd.model.state import StateError

if TYPE_CHECKING:
    from flashpd.engine.gpu.forward import GpuModel

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KEY_WIDTH_STEP = 1024  # key-row tables are padded to a multiple of this (fewer captures)


@dataclass
class _Buffers:
    """Static inputs (filled per step) and outputs of one captured decode step."""

    ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    engram: dict[int, torch.Tensor]  # layer -> [B, C] int64
    window_rows: torch.Tensor  # [L, B, W] int32
    entry_rows: dict[int, torch.Tensor]  # src -> [B] int64 (-1: no entry this step)
    key_rows: dict[int, torch.Tensor]  # src -> [B, N] int32
    seq_of: torch.Tensor  # [B] int32 = arange
    scratch: torch.Tensor  # [B] int64 window scratch rows
    open_slots: torch.Tensor  # [B] int64 slot whose open row each sequence reads
    open_new: dict[int, torch.Tensor]  # src -> [B, 2, d] FP32: this token's (a, g)
    replay: bool = False  # a bounded replay of one sequence: rows = W positions, no writes
    logits: torch.Tensor | None = None  # [B, V] FP32 (decode only)


class DecodeGraphs:
    def __init__(self, model: GpuModel, capture: bool | None = None):
        self.model, self.cfg = model, model.cfg
        self.capture = torch.cuda.is_available() if capture is None else capture
        self._graphs: dict[tuple, tuple[object, _Buffers]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.num_captures = 0

    # ------------------------------------------------------------------ eligibility
    def eligible(self, seqs: Sequence[SeqInput]) -> bool:
        """Plain decode: one token per sequence, last-row logits, no replay, windows intact."""
        if not seqs or len(seqs) > BUCKETS[-1]:
            return False
        for inp in seqs:
            plan, state = inp.plan, inp.state
            if (inp.num_tokens != 1 or plan.replay is not None or plan.decoder_rows == 0
                    or plan.logits is not LogitsRequest.LAST
                    or not isinstance(state, PagedSeqState) or inp.start_pos != state.num_tokens
                    or inp.start_pos == 0):
                return False
            for layer in range(self.cfg.num_layers):
                start, held = state.window_span_or_none(layer)
                if start is None or start + held != inp.start_pos:
                    return False
        return True

    def replay_eligible(self, seqs: Sequence[SeqInput]) -> bool:
        """One sequence replaying exactly W rows through all layers, no logits (a prefix hit's
        or a pushed prompt's bounded replay)."""
        if len(seqs) != 1:
            return False
        inp = seqs[0]
        plan = inp.plan
        return (plan.replay is not None and inp.num_tokens == self.cfg.sliding_window
                and plan.decoder_rows is None and plan.logits is LogitsRequest.NONE
                and isinstance(inp.state, PagedSeqState)
                and inp.start_pos + inp.num_tokens == inp.state.num_tokens)

    @torch.no_grad()
    def run_replay(self, token_ids: torch.Tensor, inp: SeqInput) -> list[None]:
        state, cfg = inp.state, self.cfg
        pools = state.pools
        rows, end = inp.num_tokens, inp.start_pos + inp.num_tokens
        if rows > pools.window.shape[1] - pools.scratch_base:
            raise ValueError(f"replay of {rows} rows exceeds the pools' window scratch rows")
        for src in cfg.kv_source_layer_ids:
            needed = end // cfg.compress_ratios[src]
            if state.num_entries(src) < needed:
                raise StateError(f"replay: source {src} holds {state.num_entries(src)} entries, "
                                 f"needs {needed}")
        widths = {s: max(1, -(-(end // cfg.compress_ratios[s]) // KEY_WIDTH_STEP))
                  * KEY_WIDTH_STEP for s in cfg.kv_source_layer_ids}
        ids = token_ids.tolist()
        host = self._replay_inputs(ids, inp, widths, pools)
        key = ("replay", tuple(sorted(widths.items())))
        if key not in self._graphs:
            self._graphs[key] = self._build(rows, widths, pools, host, replay=True)
        graph, bufs = self._graphs[key]
        self._fill(bufs, host)
        if graph is None:
            self._compute(bufs, pools)
        else:
            graph.replay()
        self._after_replay(bufs, inp, ids, pools)
        return [None]

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def run(self, token_ids: torch.Tensor, seqs: Sequence[SeqInput]) -> list[torch.Tensor]:
        states = [inp.state for inp in seqs]
        pools = states[0].pools
        batch = next(b for b in BUCKETS if b >= len(seqs))
        if batch > pools.window.shape[1] - pools.scratch_base:
            raise ValueError(f"decode batch {batch} exceeds the pools' window scratch rows")
        positions = [inp.start_pos for inp in seqs]
        widths = {s: -(-max((p + 1) // self.cfg.compress_ratios[s] for p in positions)
                       // KEY_WIDTH_STEP) * KEY_WIDTH_STEP for s in self.cfg.kv_source_layer_ids}
        key = (batch, tuple(sorted(widths.items())))
        host = self._host_inputs(token_ids.tolist(), states, positions, batch, widths, pools)
        if key not in self._graphs:
            self._graphs[key] = self._build(batch, widths, pools, host)
        graph, bufs = self._graphs[key]
        self._fill(bufs, host)
        if graph is None:
            bufs.logits = self._compute(bufs, pools)
        else:
            graph.replay()
        self._after(bufs, states, positions, token_ids.tolist(), pools)
        return [bufs.logits[b:b + 1] for b in range(len(seqs))]

    def _build(self, batch: int, widths: dict[int, int], pools: KVPools, host: dict,
               replay: bool = False):
        """Buffers for `batch` rows (decode: one per sequence; replay: W rows of one sequence)
        and, on a GPU, the captured graph (two warm-up runs compile and allocate first)."""
        cfg, dev = self.cfg, self.model.device
        tables = 1 if replay else batch
        long = dict(dtype=torch.int64, device=dev)
        bufs = _Buffers(
            ids=torch.zeros(batch, **long), positions=torch.zeros(batch, **long),
            engram={s.layer_id: torch.zeros(batch, cfg.engram_hash_columns, **long)
                    for s in cfg.layers if s.has_engram},
            window_rows=torch.full((cfg.num_layers, batch, cfg.sliding_window), -1,
                                   dtype=torch.int32, device=dev),
            entry_rows={s: torch.full((batch,), -1, **long) for s in cfg.kv_source_layer_ids},
            key_rows={s: torch.full((tables, w), -1, dtype=torch.int32, device=dev)
                      for s, w in widths.items()},
            seq_of=(torch.zeros(batch, dtype=torch.int32, device=dev) if replay else
                    torch.arange(batch, dtype=torch.int32, device=dev)),
            scratch=pools.scratch_base + torch.arange(batch, **long),
            open_slots=torch.zeros(batch, **long),
            open_new={s: torch.zeros(batch, 2, cfg.head_dim, dtype=torch.float32, device=dev)
                      for s in pools.open_row_of}, replay=replay)
        self._fill(bufs, host)
        if not self.capture:
            return None, bufs
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile + allocate outside the capture
            for _ in range(2):
                self._compute(bufs, pools)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bufs.logits = self._compute(bufs, pools)
        self.num_captures += 1
        return graph, bufs

    # ------------------------------------------------------------------ host side
    def _host_inputs(self, ids: list[int], states: list[PagedSeqState], positions: list[int],
                     batch: int, widths: dict[int, int], pools: KVPools) -> dict:
        cfg, model = self.cfg, self.model
        num, w, ring = len(states), cfg.sliding_window, pools.ring_rows
        pos = torch.tensor(positions, dtype=torch.int64)
        slots = torch.tensor([s.slot for s in states], dtype=torch.int64)
        key_pos = pos[:, None] + torch.arange(w)[None, :] - (w - 1)  # [n, W]
        ring_rows = slots[:, None] * ring + key_pos.remainder(ring)
        own = (pools.scratch_base + torch.arange(num))[:, None].expand(-1, w)
        window = torch.full((cfg.num_layers, batch, w), -1, dtype=torch.int32)
        for layer in range(cfg.num_layers):
            start = torch.tensor([s.window_span(layer)[0] for s in states])[:, None]
            window[layer, :num] = torch.where(key_pos == pos[:, None], own, torch.where(
                key_pos >= start, ring_rows, -1)).to(torch.int32)
        window[:, num:, -1] = (pools.scratch_base + torch.arange(num, batch)).to(torch.int32)
        entry_rows, key_rows = {}, {}
        for src in cfg.kv_source_layer_ids:
            ratio = cfg.compress_ratios[src]
            rows = torch.full((batch,), -1, dtype=torch.int64)
            table = torch.full((batch, widths[src]), -1, dtype=torch.int32)
            for b, (state, p) in enumerate(zip(states, positions, strict=True)):
                closes = (p + 1) % ratio == 0
                if ratio == 2 and state.has_open_group(src) != closes:
                    raise StateError(f"source {src}: open-group row "
                                     f"{'missing' if closes else 'present'} at position {p}")
                visible = (p + 1) // ratio
                held = state.num_entries(src)
                if held != visible - (1 if closes else 0):
                    raise StateError(f"source {src}: {held} entries at position {p}")
                if visible:
                    table[b, :visible] = state.entry_rows(src, 0, visible).to(torch.int32)
                if closes:
                    rows[b] = int(table[b, visible - 1])
            entry_rows[src], key_rows[src] = rows, table
        engram = {}
        if model.hasher is not None:
            for spec in cfg.layers:
                if spec.has_engram:
                    out = torch.zeros(batch, cfg.engram_hash_columns, dtype=torch.int64)
                    for b, state in enumerate(states):
                        out[b] = model.hasher.hash_ids(spec.engram_index,
                                                       torch.tensor(ids[b:b + 1]),
                                                       list(state.lookback_ids()))[0]
                    engram[spec.layer_id] = out
        pad = batch - num
        return {"ids": torch.tensor(ids + [0] * pad), "positions": torch.cat(
            (pos, torch.zeros(pad, dtype=torch.int64))), "window": window,
            "entry_rows": entry_rows, "key_rows": key_rows, "engram": engram,
            "open_slots": torch.cat((slots, torch.zeros(pad, dtype=torch.int64)))}

    def _replay_inputs(self, ids: list[int], inp: SeqInput, widths: dict[int, int],
                       pools: KVPools) -> dict:
        cfg, model, state = self.cfg, self.model, inp.state
        rows, start = inp.num_tokens, inp.start_pos
        w = cfg.sliding_window
        pos = torch.arange(start, start + rows)
        key_pos = pos[:, None] + torch.arange(w)[None, :] - (w - 1)
        # windows clipped at the replay start: every key is one of the replay's own rows
        window = torch.where(key_pos >= start, pools.scratch_base + key_pos - start, -1)
        key_rows = {}
        for src in cfg.kv_source_layer_ids:
            table = torch.full((1, widths[src]), -1, dtype=torch.int32)
            n = (start + rows) // cfg.compress_ratios[src]
            if n:
                table[0, :n] = state.entry_rows(src, 0, n).to(torch.int32)
            key_rows[src] = table
        engram = {}
        if model.hasher is not None:
            lookback = list(inp.plan.replay.lookback_ids)
            engram = {spec.layer_id: model.hasher.hash_ids(spec.engram_index,
                                                             torch.tensor(ids), lookback)
                      for spec in cfg.layers if spec.has_engram}
        return {"ids": torch.tensor(ids), "positions": pos,
                "window": window.to(torch.int32)[None].expand(cfg.num_layers, -1, -1),
                "entry_rows": {}, "key_rows": key_rows, "engram": engram,
                "open_slots": torch.full((rows,), state.slot, dtype=torch.int64)}

    def _after_replay(self, bufs: _Buffers, inp: SeqInput, ids: list[int],
                      pools: KVPools) -> None:
        """Keep the last W-1 window rows in the ring, the rebuilt open rows, the books."""
        cfg, state = self.cfg, inp.state
        rows, start = inp.num_tokens, inp.start_pos
        end = start + rows
        keep = min(rows, pools.ring_rows)
        kept = torch.arange(rows - keep, rows)
        dst = torch.tensor([pools.ring_row(state.slot, start + int(r)) for r in kept],
                           device=pools.window.device)
        pools.window[:, dst] = pools.window[:, bufs.scratch[rows - keep:]]
        for layer in range(cfg.num_layers):
            state.clip_window(layer, start)
            state.note_window_append(layer, start, rows)
        for src, row in pools.open_row_of.items():
            odd = end % 2 == 1  # the lone token of a group left open at end - 1
            if odd:
                pools.open[state.slot, row] = bufs.open_new[src][rows - 1]
            state.mark_open_group(src, odd)
        history = tuple(inp.plan.replay.lookback_ids) + tuple(ids)
        state.record_tokens(max(end, state.num_tokens), history[-3:])

    @staticmethod
    def _fill(bufs: _Buffers, host: dict) -> None:
        bufs.ids.copy_(host["ids"])
        bufs.positions.copy_(host["positions"])
        bufs.window_rows.copy_(host["window"])
        bufs.open_slots.copy_(host["open_slots"])
        for src, rows in host["entry_rows"].items():
            bufs.entry_rows[src].copy_(rows)
        for src, table in host["key_rows"].items():
            bufs.key_rows[src].copy_(table)
        for layer, ids in host["engram"].items():
            bufs.engram[layer].copy_(ids)

    def _after(self, bufs: _Buffers, states: list[PagedSeqState], positions: list[int],
               ids: list[int], pools: KVPools) -> None:
        """Ring copies, open rows, then the states' books (outside the graph)."""
        num = len(states)
        dst = torch.tensor([pools.ring_row(s.slot, p) for s, p in zip(states, positions,
                                                                         strict=True)],
                           device=pools.window.device)
        pools.window[:, dst] = pools.window[:, bufs.scratch[:num]]
        slots = bufs.open_slots[:num]
        for src, row in pools.open_row_of.items():
            pools.open[slots, row] = bufs.open_new[src][:num]
        cfg = self.cfg
        for b, (state, p) in enumerate(zip(states, positions, strict=True)):
            for layer in range(cfg.num_layers):
                state.note_window_append(layer, p, 1)
            for src in cfg.kv_source_layer_ids:
                ratio = cfg.compress_ratios[src]
                closes = (p + 1) % ratio == 0
                if closes:
                    state.note_entries(src, p // ratio, 1)
                if src in pools.open_row_of:
                    state.mark_open_group(src, not closes)
            history = tuple(state.lookback_ids()) + (ids[b],)
            state.record_tokens(p + 1, history[-3:])

    # ------------------------------------------------------------------ the captured forward
    def _compute(self, bufs: _Buffers, pools: KVPools) -> torch.Tensor:
        model, cfg = self.model, self.cfg
        d, mhc = model.dense, model.mhc
        batch = bufs.ids.shape[0]
        streams = model.w.embed[bufs.ids][:, None, :].expand(
            batch, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre = torch.zeros(batch, cfg.hc_mult, dtype=torch.float32, device=model.device)
        pre[:, 0] = 1.0
        published: dict = {}
        for spec, lw in zip(cfg.layers, model.w.layers, strict=True):
            if lw.engram is not None:
                streams = model._engram_inject(lw, streams, bufs.engram[spec.layer_id])
            x = d.rms_norm(mhc.collapse(streams, pre), lw.attn_norm, model.eps)
            if spec.owns_compressor:
                self._compress(spec, lw, x, bufs, pools)
            pre_a, post_a, comb_a = model._mixes(streams, lw.hc_attn)
            y = self._attention(spec, lw, x, bufs, pools, published)
            streams = mhc.expand(y, streams, post_a, comb_a)
            pre_f, post_f, comb_f = model._mixes(streams, lw.hc_ffn)
            h = d.rms_norm(mhc.collapse(streams, pre_a), lw.ffn_norm, model.eps)
            streams = mhc.expand(model._moe(lw, h), streams, post_f, comb_f)
            pre = pre_f
        if bufs.replay:  # no logits: the replay only rebuilds windows and open rows
            return None
        h = d.rms_norm(mhc.collapse(streams, pre), model.w.norm, model.eps)
        return d.linear_fp32(h, model.w.head)

    def _compress(self, spec, lw, x: torch.Tensor, bufs: _Buffers, pools: KVPools) -> None:
        """One token per sequence: ratio 1 makes an entry; ratio 2 pools the stored open row
        with this token's and writes it where the token closes its group (rows -1 elsewhere)."""
        model, d, src = self.model, self.model.dense, spec.layer_id
        if bufs.replay:  # entries exist; a ratio-2 source rebuilds its open row (a, g)
            if spec.ratio == 2:
                a, g = d.linear_fp32(x, lw.comp_wkv), d.linear_fp32(x, lw.comp_wgate)
                bufs.open_new[src].copy_(torch.stack((a, g), dim=1))
            return
        if spec.ratio == 2:
            a, g = d.linear_fp32(x, lw.comp_wkv), d.linear_fp32(x, lw.comp_wgate)  # [B, c]
            stored = pools.open[bufs.open_slots, pools.open_row_of[src]]  # [B, 2, c]
            kv = torch.stack((stored[:, 0], a), dim=1)  # [B, 2, c]: (open row, this token)
            gate = torch.stack((stored[:, 1], g), dim=1)
            g_max = torch.maximum(gate[:, 0], gate[:, 1])
            e0, e1 = torch.exp(gate[:, 0] - g_max), torch.exp(gate[:, 1] - g_max)
            total = e0 + e1
            pooled = (e0 / total) * kv[:, 0] + (e1 / total) * kv[:, 1]
            latent = d.rms_norm(pooled.to(model.dtype), lw.comp_norm, model.eps)
            bufs.open_new[src].copy_(torch.stack((a, g), dim=1))
        else:
            latent = d.rms_norm(d.linear(x, lw.comp_wkv), lw.comp_norm, model.eps)
        entry_pos = (bufs.positions // spec.ratio) * spec.ratio
        rope = model.rope.rope_cos_sin(entry_pos, model.freqs_compress)
        keys = d.rms_norm(d.linear(latent, lw.idx_wk), lw.idx_k_norm, model.eps)
        rows = bufs.entry_rows[src]
        main, index = pools.main[src], pools.index[src]
        quant_t.write_unchecked(model._write_fmt, latent.contiguous(), rows,
                                main.view(-1, main.shape[-1]), rope)
        quant_t.write_unchecked(quant_t.FMT_MXFP4, keys.contiguous(), rows,
                                index.view(-1, index.shape[-1]), rope)

    def _attention(self, spec, lw, x: torch.Tensor, bufs: _Buffers, pools: KVPools,
                   published: dict) -> torch.Tensor:
        model, cfg, d = self.model, self.cfg, self.model.dense
        batch = x.shape[0]
        rope = model.rope.rope_cos_sin(bufs.positions, model._freqs(spec))
        c_q = d.rms_norm(model._lin(x, lw.wq_a), lw.q_norm, model.eps)
        q = model._lin(c_q, lw.wq_b).view(batch, cfg.num_heads, cfg.head_dim)
        kv = d.rms_norm(model._lin(x, lw.wkv), lw.kv_norm, model.eps)
        window_pool = pools.window[spec.layer_id]
        quant_t.write_unchecked(quant_t.FMT_WINDOW_FP8, kv, bufs.scratch, window_pool, rope)
        if lw.idx_wq_b is not None:
            self._select(spec, lw, x, c_q, rope, bufs, pools, published)
        comp_pool = comp_rows = None
        if spec.ratio > 0:
            main = pools.main[spec.kv_src]
            comp_pool, comp_rows = main.view(-1, main.shape[-1]), published[spec.idx_src]
        o = attn_t.sparse_attention_packed(q, rope, window_pool, bufs.window_rows[spec.layer_id],
                                           comp_pool, comp_rows, lw.sink, cfg.head_dim ** -0.5,
                                           comp_format=model._attn_fmt)
        return model._lin(model._wo_a(o.view(batch, cfg.o_groups, -1), lw.wo_a), lw.wo_b)

    def _select(self, spec, lw, x, c_q, rope, bufs: _Buffers, pools: KVPools,
                published: dict) -> None:
        model, cfg, d = self.model, self.cfg, self.model.dense
        q = model._index_query(lw, c_q, rope)
        scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
        head_w = (d.linear(x, lw.idx_proj).to(torch.float32) * scale).contiguous()
        key_rows = bufs.key_rows[spec.kv_src]
        n_visible = ((bufs.positions + 1) // spec.ratio).to(torch.int32)
        pool = pools.index[spec.kv_src]
        pool = pool.view(-1, pool.shape[-1])
        if spec.uses_candidates:
            ids = index_t.index_topk_sparse_paged(
                q, head_w, pool, key_rows, bufs.seq_of, n_visible,
                published["candidates"], cfg.candidate_block_size, cfg.index_topk)
        else:
            scores = index_t.index_scores_paged(q, head_w, pool, key_rows, bufs.seq_of,
                                                n_visible)
            if spec.is_candidate_source:
                published["candidates"] = index_t.candidate_blocks(
                    scores, n_visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
            ids = index_t.select_topk(scores, cfg.index_topk)
        picked = key_rows[bufs.seq_of.long()[:, None], ids.clamp_min(0).long()]
        published[spec.layer_id] = torch.where(ids >= 0, picked, -1).to(torch.int32)

