"""The model forward on the GPU: `Model`'s own forward over kernel-format weights and packed pools.

`GpuModel` is the reference `Model` (model/model.py, the one forward in paper order) with

    weights    the checkpoint formats (engine/gpu/weights.py): FP8 E4M3 + UE8M0 32x32 tiles,
               MXFP4 experts, BF16 small tensors, dequantised in registers by the GEMM kernels
    kernels    the dispatcher's Triton implementation of every op that has one
               (`dispatch.fastest()`), BF16 compute
    KV         a paged backend: `prepare` adds `PagedTables` to the step (pool rows of every
               window key, entry write rows, key-row tables, open-group partners), the layer
               hooks below read and write packed records through them only, and `commit` moves
               the window records into the rings and the states' books after the step

so `compute` touches no host state: CUDA graphs capture it as it is (decode_graph.py).

    window KV    RoPE + FP8 record written into the layer's scratch rows; attention reads
                 ring ∪ scratch rows through one row list per query; the commit keeps the last
                 W-1 records of every sequence in its ring
    global KV    NVFP4 (or FP8) entries and MXFP4 index keys written in place into the blocks
                 (a ratio-2 source pools every row with its partner: the row before it or the
                 slot's stored open row; rows that close no group write nowhere)
    indexer      one paged scoring launch per index layer for the whole batch, then top-k /
                 candidate blocks / candidate-restricted top-k kernels
    attention    `sparse_attention_packed`: RoPE(q), window ∪ top-k records, sink, inverse RoPE

States must be `PagedSeqState`s over `KVPools` with window scratch rows >= the rows of one
forward (`KVPools.for_model` sizes them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  (before any kernel import)
# isort: on

from flashpd.engine.gpu.weights import GpuWeights, LayerWeights
from flashpd.engine.kv_pools import KVPools, PagedSeqState
from flashpd.kernels import dispatch
from flashpd.kernels.dense.triton import Weights
from flashpd.kernels.quant import ref as qref
from flashpd.model.config import LayerSpec, ModelConfig
from flashpd.model.kv_format import CompressedKVFormat
from flashpd.model.model import LayerRows, Model, SeqInput, Step
from flashpd.model.state import StateError


@dataclass
class PagedTables:
    """Pool rows of one step (device tensors the forward reads) and what the commit needs."""

    pools: KVPools
    scratch: torch.Tensor  # [T] int64 window scratch rows
    window_rows: torch.Tensor  # [U, T, W] int32: pool rows of each compute row's window keys
    window_of: dict[int, int]  # layer -> its table in window_rows (layers with equal spans share)
    seq_of: dict[tuple[bool, bool], torch.Tensor]  # rows kind -> [Tc] int32 key-table row
    key_rows: dict[int, torch.Tensor]  # src -> [B, N] int32 pool rows of visible entries
    entry_rows: dict[int, torch.Tensor]  # src -> [Ts] int64 entry write row (-1: none)
    from_stored: dict[int, torch.Tensor]  # ratio-2 src -> [Ts] bool: partner is the open row
    open_slots: dict[int, torch.Tensor]  # ratio-2 src -> [Ts] int64 slot of the row
    keep: dict[tuple[bool, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # commit
    open_keep: dict[int, tuple[torch.Tensor, torch.Tensor]]  # commit: (slots, seam rows)

    def tensors(self) -> list[torch.Tensor]:
        out = [self.scratch, self.window_rows]
        for group in (self.seq_of, self.key_rows, self.entry_rows, self.from_stored,
                      self.open_slots):
            out += [group[k] for k in sorted(group)]
        return out


class GpuModel(Model):
    """`Model` over `GpuWeights` and `PagedSeqState`s, computed by the Triton kernels."""

    stages_window_kv = True  # new window records go to scratch rows first (KVPools.for_model)

    def __init__(self, cfg: ModelConfig, weights: GpuWeights, hasher=None,
                 compressed_kv_format: CompressedKVFormat | str = "nvfp4",
                 decode_graphs: bool | None = None):
        """decode_graphs: decode steps and W-row replays through `DecodeGraphs` (None: when
        CUDA is present, captured as CUDA graphs; True without CUDA: the same path, eager)."""
        super().__init__(cfg, weights, torch.bfloat16, hasher, dispatch.fastest(),
                         compressed_kv_format)
        self._write_fmt = {"nvfp4": self.quant.FMT_NVFP4,
                           "fp8": self.quant.FMT_WINDOW_FP8}[self.kv_format.name]
        self._attn_fmt = {"nvfp4": self.attention.FMT_NVFP4,
                          "fp8": self.attention.FMT_FP8}[self.kv_format.name]
        self._e2m1 = qref.e2m1_decode(torch.arange(16, dtype=torch.uint8)).to(self.device)
        from flashpd.engine.gpu.decode_graph import DecodeGraphs

        use = torch.cuda.is_available() if decode_graphs is None else decode_graphs
        self.graphs = DecodeGraphs(self) if use else None

    # ------------------------------------------------------------------ load-time warm-up
    def warmup(self, rows: Sequence[int] | None = None) -> int:
        """Compile (and run once) the GEMM, MoE and attention kernel variants that `rows`-row
        calls take (default: the decode graph buckets and the W-row replay), so that the first
        request is not a compile. Returns the number of kernel calls made (0: no Triton)."""
        from flashpd.engine.gpu.decode_graph import BUCKETS

        cfg = self.cfg
        rows = tuple(sorted(set(BUCKETS) | {cfg.sliding_window})) if rows is None else rows
        calls = 0
        if hasattr(self.dense, "warmup"):
            weights = [self.w.head] if isinstance(self.w.head, Weights) else []
            for lw in self.w.layers:
                weights += [getattr(lw, f.name) for f in dataclasses.fields(lw)
                            if isinstance(getattr(lw, f.name), Weights)]
                if lw.engram is not None and isinstance(lw.engram.wkv, Weights):
                    weights.append(lw.engram.wkv)
            calls += self.dense.warmup(weights, rows=rows)
        if hasattr(self.moe_k, "warmup"):
            lw = next((lw for lw in self.w.layers if lw.experts is not None), None)
            if lw is not None:
                calls += self.moe_k.warmup(lw.experts, lw.shared, cfg.n_routed_experts,
                                           cfg.num_experts_per_tok, rows=rows,
                                           limit=cfg.swiglu_limit)
        if hasattr(self.attention, "warmup"):
            topk = tuple(sorted({0} | ({cfg.index_topk} if any(
                s.ratio > 0 for s in cfg.layers) else set())))
            calls += self.attention.warmup(cfg.num_heads, cfg.head_dim, cfg.rope_head_dim // 2,
                                           cfg.sliding_window, topk, self._attn_fmt, rows=rows)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return calls

    # ------------------------------------------------------------------ entry point
    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor,
                seqs: Sequence[SeqInput]) -> list[torch.Tensor | None]:
        if self.graphs is not None and self.graphs.eligible(seqs):
            return self.graphs.run(token_ids, seqs)
        return super().forward(token_ids, seqs)

    # ------------------------------------------------------------------ the step's tables
    def prepare(self, token_ids: torch.Tensor, seqs: Sequence[SeqInput], pad_to: int = 0,
                key_width_step: int = 0) -> Step:
        """`Model.prepare` + pool row tables. pad_to: extend a step whose layers all run on
        every row to that many rows (padding rows read nothing and write only scratch rows);
        key_width_step: round key-table widths up to a multiple of it (fewer graph shapes)."""
        for inp in seqs:
            if not isinstance(inp.state, PagedSeqState):
                raise TypeError("the GPU forward runs on PagedSeqState (engine KV pools)")
        pools = seqs[0].state.pools
        rows = max(token_ids.shape[0], pad_to)
        if rows > pools.window.shape[1] - pools.scratch_base:
            raise ValueError(f"{rows} rows in one forward, the pools have "
                             f"{pools.window.shape[1] - pools.scratch_base} window scratch rows")
        step = super().prepare(token_ids, seqs)
        if pad_to > token_ids.shape[0]:
            self._pad(step, pad_to)
        step.tables = _TableBuilder(self.cfg, pools, step, key_width_step).build(self.device)
        return step

    def _pad(self, step: Step, num_rows: int) -> None:
        pad = num_rows - step.token_ids.shape[0]
        step.token_ids = torch.cat((step.token_ids, step.token_ids.new_zeros(pad)))
        step.rows = {key: r.padded(num_rows) for key, r in step.rows.items()}
        step.hash_ids = {k: torch.cat((v, v.new_zeros(pad, v.shape[1])))
                         for k, v in step.hash_ids.items()}
        step.logit_rows = torch.arange(num_rows, device=self.device)

    def commit(self, step: Step) -> None:
        """Window records scratch -> rings, the open rows, then every state's books."""
        t, cfg = step.tables, self.cfg
        pools = t.pools
        for layers, src, dst in t.keep.values():
            if dst.numel():
                pools.window[layers[:, None], dst[None, :]] = pools.window[layers[:, None],
                                                                           src[None, :]]
        for src, (slots, seam_rows) in t.open_keep.items():
            if slots.numel():
                pools.open[slots, pools.open_row_of[src]] = step.outputs[("open", src)][seam_rows]
        cand = cfg.candidate_source_layer_id
        for spec in cfg.layers:
            for part in step.rows_of(spec, cand).compute_parts:
                state = part.seg.state
                if part.clip_window:
                    state.clip_window(spec.layer_id, part.first_pos)
                state.note_window_append(spec.layer_id, part.first_pos, part.c1 - part.c0)
        for src in cfg.kv_source_layer_ids:
            ratio = cfg.compress_ratios[src]
            for part in step.rows_of(cfg.layers[src], cand).parts:
                seg = part.seg
                if seg.replay is None:
                    first = seg.start_pos // ratio
                    seg.state.note_entries(src, first, seg.end_pos // ratio - first)
                if src in pools.open_row_of:
                    seg.state.mark_open_group(src, seg.end_pos % 2 == 1)
        super().commit(step)

    # ------------------------------------------------------------------ layer hooks
    def _lin(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        return self.dense.linear_weights(x.contiguous(), w, self.dtype)

    def _engram_inject(self, lw: LayerWeights, xs: torch.Tensor,
                       row_ids: torch.Tensor) -> torch.Tensor:
        rows = self.engram.gather_rows(lw.engram.table, row_ids)  # BF16 [Ts, C*row_dim], exact
        kv = self._lin(rows, lw.engram.wkv)  # [Ts, (S+1)*D]
        return self.engram.run_engram(xs, kv, lw.engram.qk, self.eps, inject=True)[0]

    def _moe(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        return self.moe_k.moe_quantized(h, lw.gate, lw.gate_bias, lw.experts, lw.shared,
                                        cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                                        cfg.swiglu_limit, cfg.gate_temp, cfg.norm_topk_prob)

    # ------------------------------------------------------------------ compressor (§4, §5.2)
    def _write_global_kv(self, spec: LayerSpec, lw: LayerWeights, x_seam: torch.Tensor,
                         rows: LayerRows, step: Step) -> None:
        """Latents of every seam row -> entries + index keys at the rows that close a group."""
        d, t, src = self.dense, step.tables, spec.layer_id
        pools = t.pools
        if spec.ratio == 2:
            ag = torch.stack((d.linear_fp32(x_seam, lw.comp_wkv),
                              d.linear_fp32(x_seam, lw.comp_wgate)), dim=1)  # [Ts, 2, c] FP32
            stored = pools.open[t.open_slots[src], pools.open_row_of[src]]  # [Ts, 2, c]
            prev = torch.where(t.from_stored[src][:, None, None], stored, ag.roll(1, 0))
            pooled = self.compressor.pool_two(prev[:, 0], prev[:, 1], ag[:, 0], ag[:, 1])
            latent = d.rms_norm(pooled.to(self.dtype), lw.comp_norm, self.eps)
            step.outputs[("open", src)] = ag
        else:
            latent = d.rms_norm(d.linear(x_seam, lw.comp_wkv), lw.comp_norm, self.eps)
        # entries are rotated at the position of their group's first token (§3.3, §12.7)
        entry_pos = rows.seam_positions // spec.ratio * spec.ratio
        rope = self.rope.rope_cos_sin(entry_pos, self.freqs_compress)
        keys = d.rms_norm(d.linear(latent, lw.idx_wk), lw.idx_k_norm, self.eps)  # [Ts, dI]
        write_rows = t.entry_rows[src]
        main, index = pools.main[src], pools.index[src]
        self.quant.write_unchecked(self._write_fmt, latent.contiguous(), write_rows,
                                   main.view(-1, main.shape[-1]), rope)
        self.quant.write_unchecked(self.quant.FMT_MXFP4, keys.contiguous(), write_rows,
                                   index.view(-1, index.shape[-1]), rope)

    # ------------------------------------------------------------------ attention (§3)
    def _attention(self, spec: LayerSpec, lw: LayerWeights, x: torch.Tensor, rows: LayerRows,
                   step: Step) -> torch.Tensor:
        cfg, d, t = self.cfg, self.dense, step.tables
        num_q = x.shape[0]
        rope = self.rope.rope_cos_sin(rows.positions, self._freqs(spec))  # [Tc, r/2] each
        c_q = d.rms_norm(self._lin(x, lw.wq_a), lw.q_norm, self.eps)  # [Tc, q_lora]
        q = self._lin(c_q, lw.wq_b).view(num_q, cfg.num_heads, cfg.head_dim)  # pre-RoPE
        kv = d.rms_norm(self._lin(x, lw.wkv), lw.kv_norm, self.eps)  # [Tc, d] pre-RoPE
        window_pool = t.pools.window[spec.layer_id]  # [rings + scratch, 528]
        self.quant.write_unchecked(self.quant.FMT_WINDOW_FP8, kv, t.scratch[:num_q],
                                   window_pool, rope)
        if lw.idx_wq_b is not None:
            self._select(spec, lw, x, c_q, rope, rows, step)
        comp_pool = comp_rows = None
        if spec.ratio > 0:
            main = t.pools.main[spec.kv_src]
            comp_pool = main.view(-1, main.shape[-1])
            comp_rows = _take(step, rows, "topk", spec.idx_src)
        o = self.attention.sparse_attention_packed(
            q, rope, window_pool, t.window_rows[t.window_of[spec.layer_id], :num_q], comp_pool, comp_rows,
            lw.sink, cfg.head_dim ** -0.5, comp_format=self._attn_fmt)  # [Tc, H, d]
        return self._lin(self._wo_a(o.view(num_q, cfg.o_groups, -1), lw.wo_a), lw.wo_b)

    def _wo_a(self, o: torch.Tensor, w: Weights) -> torch.Tensor:
        """Block-diagonal wo_a: o [T, G, H/G*d] -> z [T, G*o_lora] (group g through W_a[g]),
        one launch in [T, G, .] order (nothing gathered or transposed around the GEMM)."""
        return self.dense.block_diagonal(o, w).reshape(o.shape[0], -1)

    # ------------------------------------------------------------------ indexer (§5)
    def _select(self, spec: LayerSpec, lw: LayerWeights, x: torch.Tensor, c_q: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], rows: LayerRows, step: Step) -> None:
        """Score the packed index keys of every sequence in one launch (paged: each query reads
        its own sequence's rows), publish top-k as pool rows (and candidate blocks)."""
        cfg, d, t, ix = self.cfg, self.dense, step.tables, self.indexer
        q = self._index_query(lw, c_q, rope)  # [Tc, hI, dI] BF16 (MXFP4 values)
        scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
        head_w = (d.linear(x, lw.idx_proj).to(torch.float32) * scale).contiguous()  # [Tc, hI]
        key_rows, seq_of = t.key_rows[spec.kv_src], t.seq_of[rows.key]  # [B, N], [Tc]
        n_visible = ((rows.positions + 1) // spec.ratio).to(torch.int32)
        pool = t.pools.index[spec.kv_src]
        pool = pool.view(-1, pool.shape[-1])
        num_q, width = q.shape[0], key_rows.shape[1]
        blocks = None
        if width == 0:  # no entries anywhere yet (the first tokens of every sequence)
            ids = torch.full((num_q, cfg.index_topk), -1, dtype=torch.int64, device=self.device)
            if spec.is_candidate_source:
                blocks = torch.full((num_q, 0), -1, dtype=torch.int64, device=self.device)
        elif spec.uses_candidates:
            cand = _take(step, rows, "candidates", cfg.candidate_source_layer_id)
            ids = ix.index_topk_sparse_paged(q, head_w, pool, key_rows, seq_of, n_visible,
                                             cand, cfg.candidate_block_size, cfg.index_topk)
        else:
            scores = ix.index_scores_paged(q, head_w, pool, key_rows, seq_of, n_visible)
            if spec.is_candidate_source:
                blocks = ix.candidate_blocks(scores, n_visible, cfg.candidate_block_size,
                                             cfg.candidate_topk_blocks)
            ids = ix.select_topk(scores, cfg.index_topk)
        if width:
            picked = key_rows[seq_of.long()[:, None], ids.clamp_min(0).long()]
            ids = torch.where(ids >= 0, picked, -1)
        if blocks is not None:
            step.outputs[("candidates", spec.layer_id)] = (rows, blocks)
        step.outputs[("topk", spec.layer_id)] = (rows, ids.to(torch.int32))

    def _index_query(self, lw: LayerWeights, c_q: torch.Tensor,
                     rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q^I = MXFP4(RoPE(c_q . wq_b)) [T, hI, dI] as BF16 values (§5.1): the KV-write kernel
        rotates and packs each head row, the values are read back with device-resident tables
        (graph capture allows no host-to-device copies)."""
        cfg = self.cfg
        nh, di = cfg.index_n_heads, cfg.index_head_dim
        q = self._lin(c_q, lw.idx_wq_b).view(-1, di)  # [T*hI, dI]
        rec = torch.empty(q.shape[0], qref.mxfp4_record_bytes(di), dtype=torch.uint8,
                          device=q.device)
        rows = torch.arange(q.shape[0], device=q.device)
        head_rope = tuple(r.repeat_interleave(nh, dim=0).contiguous() for r in rope)
        self.quant.write_unchecked(self.quant.FMT_MXFP4, q, rows, rec, head_rope)
        codes = torch.stack((rec[:, :di // 2] & 0xF, rec[:, :di // 2] >> 4), dim=-1).long()
        scale = torch.exp2(rec[:, di // 2:].float() - 127.0)  # [N, dI/32] UE8M0
        values = self._e2m1[codes.view(-1, di // 32, 32)] * scale[:, :, None]
        return values.view(-1, nh, di).to(torch.bfloat16)


def _take(step: Step, rows: LayerRows, kind: str, layer: int) -> torch.Tensor:
    """What `layer` published (over its own rows), for `rows`' compute rows."""
    key = (kind, layer)
    if key not in step.outputs:
        raise RuntimeError(f"layer {layer} published no {kind}")
    src_rows, value = step.outputs[key]
    if src_rows.key[0] == rows.key[0]:  # compute rows depend only on "decoder layer?"
        return value
    full = value.new_full((step.token_ids.shape[0], value.shape[1]), -1)
    full[src_rows.compute_idx] = value
    return full[rows.compute_idx]


# ============================================================================ table builder
class _TableBuilder:
    """Host-side construction of `PagedTables` (vectorised over rows; one copy per tensor)."""

    def __init__(self, cfg: ModelConfig, pools: KVPools, step: Step, key_width_step: int):
        self.cfg, self.pools, self.step = cfg, pools, step
        self.num_rows = step.token_ids.shape[0]
        self.num_tables = len(step.segs) + self.num_rows - sum(s.num_tokens for s in step.segs)
        self.width_step = key_width_step

    def build(self, device: torch.device) -> PagedTables:
        cfg, pools, step = self.cfg, self.pools, self.step
        cand = cfg.candidate_source_layer_id
        kinds: dict[tuple[bool, bool], list[int]] = {}
        for spec in cfg.layers:
            kinds.setdefault(step.rows_of(spec, cand).key, []).append(spec.layer_id)
        windows, window_of, seq_of, keep = [], {}, {}, {}
        for key, layers in kinds.items():
            per_row = self._compute_rows(step.rows[key])
            tables, index = self._window(step.rows[key], layers, per_row)
            window_of.update((layer, len(windows) + i) for layer, i in index.items())
            windows += tables
            seq_of[key] = per_row["table"].to(torch.int32)
            keep[key] = self._keep(layers, per_row)
        window = torch.full((len(windows), self.num_rows, cfg.sliding_window), -1,
                            dtype=torch.int32)
        for i, table in enumerate(windows):
            window[i, :table.shape[0]] = table
        key_rows, entry_rows, from_stored, open_slots, open_keep = {}, {}, {}, {}, {}
        for src in cfg.kv_source_layer_ids:
            spec = cfg.layers[src]
            rows = step.rows_of(spec, cand)
            key_rows[src] = self._key_table(src)
            entry_rows[src], stored, slots = self._entry_rows(src, rows, key_rows[src])
            if src in pools.open_row_of:
                from_stored[src], open_slots[src] = stored, slots
                open_keep[src] = self._open_keep(rows)
        dev = lambda group: {k: v.to(device) for k, v in group.items()}  # noqa: E731
        return PagedTables(
            pools, (pools.scratch_base + torch.arange(self.num_rows)).to(device),
            window.to(device), window_of, dev(seq_of), dev(key_rows), dev(entry_rows), dev(from_stored),
            dev(open_slots),
            {k: tuple(x.to(device) for x in v) for k, v in keep.items()},
            {k: tuple(x.to(device) for x in v) for k, v in open_keep.items()})

    def _compute_rows(self, rows: LayerRows) -> dict[str, torch.Tensor]:
        """Per compute row: position, first position of its part, slot, key-table row, end."""
        pos, first, slot, table, end = [], [], [], [], []
        for part in rows.compute_parts:
            n, seg = part.c1 - part.c0, part.seg
            pos += range(part.first_pos, part.first_pos + n)
            first += [part.first_pos] * n
            slot += [seg.state.slot] * n
            table += [seg.index] * n
            end += [seg.end_pos] * n
        pad = rows.num_compute - len(pos)  # padding rows: position 0, an empty window, their
        num_segs = len(self.step.segs)  # own key-table rows
        pos += [0] * pad
        first += [0] * pad
        slot += [-1] * pad
        table += range(num_segs, num_segs + pad)
        end += [0] * pad
        return {k: torch.tensor(v, dtype=torch.long) for k, v in
                (("pos", pos), ("first", first), ("slot", slot), ("table", table), ("end", end))}

    def _window(self, rows: LayerRows, layers: list[int], per_row: dict[str, torch.Tensor]
                ) -> tuple[list[torch.Tensor], dict[int, int]]:
        """[Tc, W] pool rows per distinct window span of `layers` (and each layer's table):
        keys at or after the part's first position from this step's scratch rows, earlier ones
        from the slot's ring as far as the window holds them."""
        parts, w, ring = rows.compute_parts, self.cfg.sliding_window, self.pools.ring_rows
        distinct: dict[tuple[int, ...], int] = {}
        index = {}
        for layer in layers:
            row = []
            for part in parts:
                if part.clip_window:
                    row.append(part.first_pos)
                    continue
                start, held = part.seg.state.window_span(layer)
                if start + held != part.first_pos:
                    raise StateError(f"layer {layer}: window ends at {start + held}, segment "
                                     f"rows start at {part.first_pos} (replay needed?)")
                row.append(start)
            index[layer] = distinct.setdefault(tuple(row), len(distinct))
        counts = [p.c1 - p.c0 for p in parts]
        pos, first = per_row["pos"], per_row["first"]
        key_pos = pos[:, None] + torch.arange(w)[None, :] - (w - 1)  # [Tc, W]
        own = self.pools.scratch_base + torch.arange(len(pos))[:, None] + (key_pos - pos[:, None])
        ring_rows = per_row["slot"][:, None] * ring + key_pos.remainder(ring)
        mine = key_pos >= first[:, None]
        tables = []
        for starts in distinct:  # padding rows: start at their own position (nothing earlier)
            start = [v for v, n in zip(starts, counts, strict=True) for _ in range(n)]
            start = torch.cat((torch.tensor(start, dtype=torch.long), pos[len(start):]))  # [Tc]
            from_ring = torch.where(key_pos >= start[:, None], ring_rows, -1)
            tables.append(torch.where(mine, own, from_ring).to(torch.int32))
        return tables, index

    def _keep(self, layers: list[int], per_row: dict[str, torch.Tensor]):
        """(layers, scratch rows, ring rows): the last W-1 new records of every sequence."""
        ring = self.pools.ring_rows
        pos, slot = per_row["pos"], per_row["slot"]
        kept = (pos >= per_row["end"] - ring) & (slot >= 0)
        idx = torch.nonzero(kept).flatten()
        return (torch.tensor(layers, dtype=torch.long), self.pools.scratch_base + idx,
                slot[idx] * ring + pos[idx] % ring)

    def _key_table(self, src: int) -> torch.Tensor:
        """[B, N] pool rows of each sequence's entries visible by the step's end (-1 past)."""
        ratio = self.cfg.compress_ratios[src]
        counts = []
        for seg in self.step.segs:
            held, visible = seg.state.num_entries(src), seg.end_pos // ratio
            if seg.replay is not None and held < visible:
                raise StateError(f"replay: source {src} holds {held} entries, needs {visible}")
            if seg.replay is None and held != seg.start_pos // ratio:
                raise StateError(f"source {src}: {held} entries at position {seg.start_pos}")
            counts.append(visible)
        width = max(counts, default=0)
        if self.width_step:
            width = -(-max(width, 1) // self.width_step) * self.width_step
        table = torch.full((self.num_tables, width), -1, dtype=torch.int32)
        if width and self.step.segs:
            epb = self.pools.geometry.entries_per_block(src)
            for seg, n in zip(self.step.segs, counts, strict=True):
                seg.state.check_blocks(src, n)
            blocks = max(len(seg.state.block_table) for seg in self.step.segs)
            bt = torch.tensor([seg.state.block_table + [0] * (blocks - len(seg.state.block_table))
                               for seg in self.step.segs], dtype=torch.long)  # [B, blocks]
            e = torch.arange(width)
            rows = bt[:, (e // epb).clamp(max=blocks - 1)] * epb + e % epb  # [B, width]
            valid = e[None, :] < torch.tensor(counts)[:, None]
            table[:len(counts)] = torch.where(valid, rows, -1).to(torch.int32)
        return table

    def _entry_rows(self, src: int, rows: LayerRows, table: torch.Tensor):
        """Per seam row of the source: the pool row of the entry it closes (-1: none), whether
        its ratio-2 partner is the slot's stored open row, and its slot."""
        ratio = self.cfg.compress_ratios[src]
        entry, stored, slots, tables = [], [], [], []
        for part in rows.parts:
            seg = part.seg
            first = seg.start_pos + part.seam_first
            n = seg.end_pos - first
            if seg.replay is not None:  # the entries exist: nothing is written
                entry += [-1] * n
            else:
                if ratio == 2 and seg.state.has_open_group(src) != (seg.start_pos % 2 == 1):
                    present = seg.state.has_open_group(src)
                    raise StateError(f"source {src}: open-group row "
                                     f"{'present' if present else 'missing'} at position "
                                     f"{seg.start_pos}")
                entry += [p // ratio if (p + 1) % ratio == 0 else -1
                          for p in range(first, seg.end_pos)]
            stored += [True] + [False] * (n - 1)
            slots += [seg.state.slot] * n
            tables += [seg.index] * n
        pad = rows.num_seam - len(entry)
        entry += [-1] * pad
        stored += [False] * pad
        slots += [0] * pad
        tables += [0] * pad
        entry_t, b = torch.tensor(entry, dtype=torch.long), torch.tensor(tables, dtype=torch.long)
        width = table.shape[1]
        picked = table[b, entry_t.clamp(0, max(width - 1, 0))].long() if width else entry_t
        return (torch.where(entry_t >= 0, picked, -1), torch.tensor(stored),
                torch.tensor(slots, dtype=torch.long))

    def _open_keep(self, rows: LayerRows) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, seam rows) of the sequences whose last token leaves a ratio-2 group open."""
        slots, seam_rows = [], []
        for part in rows.parts:
            if part.seg.end_pos % 2 == 1:
                slots.append(part.seg.state.slot)
                seam_rows.append(part.s1 - 1)
        return torch.tensor(slots, dtype=torch.long), torch.tensor(seam_rows, dtype=torch.long)
