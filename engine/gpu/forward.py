"""The model forward on the GPU: `Model`'s own forward over kernel-format weights and packed pools.

`GpuModel` is the reference `Model` (model/model.py, the one forward in paper order) with

    weights    the checkpoint formats (engine/gpu/weights.py): FP8 E4M3 + UE8M0 32x32 tiles,
               MXFP4 experts, BF16 small tensors, dequantised in registers by the GEMM kernels
    kernels    the dispatcher's Triton implementation of every op that has one
               (`dispatch.fastest()`), BF16 compute; `kernel_impls` names others for some ops
               (the A/B baseline: {"mhc": "ref", "indexer": "ref"}, the torch references)
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
from collections.abc import Mapping, Sequence

import torch

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  (before any kernel import)
# isort: on

from flashpd.engine.gpu.step import GpuStep
from flashpd.engine.gpu.tables import HostPack, PagedTables, TableBuilder  # noqa: F401
from flashpd.engine.gpu.weights import GpuWeights, LayerWeights
from flashpd.engine.hashing import CHUNK_TOKENS
from flashpd.engine.kv_pools import KVPools, PagedSeqState
from flashpd.kernels import dispatch, tuning
from flashpd.kernels.dense.triton import Weights
from flashpd.model.config import LayerGroup, LayerSpec, ModelConfig
from flashpd.model.kv_format import DEFAULT_KV_FORMAT, CompressedKVFormat
from flashpd.model.model import LayerRows, Model, SeqInput, Step, TokenFeed

# Prompt rows the load-time warm-up runs through the forward (the bench's prefill chunk; a
# chunk of that size then compiles nothing new).
PREFILL_WARMUP_ROWS = 8192
# Context of the two sequences whose decode steps the warm-up runs (>= 2 top-k slices of the
# bench preset's ratio-1 rows, so the small-batch indexer path compiles too).
DECODE_WARMUP_CONTEXT = 4096
# Row counts past the graph buckets whose GEMM and MoE variants the warm-up compiles too: a step
# of several sequences' turns or prompt chunks lands there (the decode phase of the H200 engine
# bench compiled 3 such variants after load before these were warmed). A prefix hit's prefill
# computes its bounded replay (128 rows) plus the new tokens, so 128-1,024 rows are common and
# any count: every 64 there, and beside each count one 8 below it, because Triton specialises a
# row count divisible by 16 apart from one that is not (bench/pd_session.py on the H200 at
# d05f5f2: a session turn of 456 rows compiled 5 MoE-sort and GEMM variants, 2.97 s, after a
# warm-up of 384 and 512 only).
_WARMUP_ROW_GRID = (*range(192, 1025, 64), 1536, 2048, 3072, 4096, 6144)
WARMUP_EXTRA_ROWS = tuple(sorted({r for base in _WARMUP_ROW_GRID for r in (base - 8, base)}))


# Model's kernel attributes (one per dispatch op), bound to the model's launch configs.
_KERNEL_ATTRS = ("dense", "quant", "rope", "mhc", "engram", "attention", "compressor", "indexer", "moe_k")


class GpuModel(Model):
    """`Model` over `GpuWeights` and `PagedSeqState`s, computed by the Triton kernels."""

    stages_window_kv = True  # new window records go to scratch rows first (KVPools.for_model)

    def __init__(
        self,
        cfg: ModelConfig,
        weights: GpuWeights,
        hasher=None,
        compressed_kv_format: CompressedKVFormat | str = DEFAULT_KV_FORMAT,
        decode_graphs: bool | None = None,
        kernel_impls: Mapping[str, str] | None = None,
    ):
        """decode_graphs: decode steps, W-row replays and turns through `DecodeGraphs` (None: when
        CUDA is present, captured as CUDA graphs; True without CUDA: the same path, eager).
        kernel_impls: op -> registered implementation over `dispatch.fastest()` (None: none),
        e.g. {"mhc": "ref"}: every implementation has the reference's names and signatures."""
        impls = dict(kernel_impls or {})
        dispatch.check_impls(impls)
        kernels = {**dispatch.fastest(), **impls}
        super().__init__(cfg, weights, torch.bfloat16, hasher, kernels, compressed_kv_format)
        # The launch configs: the table's entry for this GPU with the FLASHPD_* overrides (the
        # one read of them, validated), given to every kernel call through the bound ops.
        self.kernel_configs = tuning.load(self.device)
        for attr in _KERNEL_ATTRS:
            setattr(self, attr, dispatch.bind(getattr(self, attr), self.kernel_configs))
        if self.kv_format.kernel_code is None:
            raise ValueError(f"the Triton kernels cannot store {self.kv_format.name!r} KV")
        # One record code for the quant writer and the attention reader (FMT_* of both kernels).
        self._write_fmt = self._attn_fmt = self.kv_format.kernel_code
        from flashpd.engine.gpu.decode_graph import DecodeGraphs

        use = torch.cuda.is_available() if decode_graphs is None else decode_graphs
        self.graphs = DecodeGraphs(self) if use else None
        self.pack = HostPack(self.device)
        self.layer_kinds: dict[LayerGroup, tuple[int, ...]] = {}
        for spec in cfg.layers:  # rows kind -> its layers (Step.rows_of)
            self.layer_kinds[spec.group] = self.layer_kinds.get(spec.group, ()) + (spec.layer_id,)
        kinds: dict[LayerGroup, tuple[list[int], list[int]]] = {}
        for src in cfg.kv_source_layer_ids:  # rows kind -> (kv sources, their ratio-2 ones)
            spec = cfg.layers[src]
            srcs, opens = kinds.setdefault(spec.group, ([], []))
            srcs.append(src)
            if cfg.compress_ratios[src] == 2:
                opens.append(src)
        self._source_kinds = [(k, tuple(v[0]), tuple(v[1])) for k, v in kinds.items()]

    # ------------------------------------------------------------------ load-time warm-up
    def warmup(self, rows: Sequence[int] | None = None, prefill_rows: int | None = None) -> int:
        """Compile (and run once) the GEMM, MoE and attention kernel variants that `rows`-row
        calls take (default: the decode graph buckets and the W-row replay; the layers' GEMMs
        and MoE also WARMUP_EXTRA_ROWS), then every kernel variant of a prefill
        (`warm_prefill`, prefill_rows tokens; None: PREFILL_WARMUP_ROWS, 0: none) and of decode
        steps at one and two sequences (`warm_decode`, with the
        prefill), so that the first request is not a compile. Returns the number of kernel
        calls made (0: no Triton); `warmup_s` holds the seconds of each part."""
        import time

        from flashpd.engine.gpu.decode_graph import BUCKETS

        t0 = time.perf_counter()

        cfg = self.cfg
        gemm_rows = rows
        if rows is None:
            rows = tuple(sorted(set(BUCKETS) | {cfg.sliding_window}))
            gemm_rows = tuple(sorted(set(rows) | set(WARMUP_EXTRA_ROWS)))
        calls = 0
        if hasattr(self.dense, "warmup"):
            weights = []
            for lw in self.w.layers:
                weights += [
                    getattr(lw, f.name) for f in dataclasses.fields(lw) if isinstance(getattr(lw, f.name), Weights)
                ]
                if lw.engram is not None and isinstance(lw.engram.wkv, Weights):
                    weights.append(lw.engram.wkv)
            calls += self.dense.warmup(weights, rows=gemm_rows)
            if isinstance(self.w.head, Weights):  # logits: the sampled rows only
                calls += self.dense.warmup([self.w.head], rows=rows)
        if hasattr(self.moe_k, "warmup"):
            lw = next((lw for lw in self.w.layers if lw.experts is not None), None)
            if lw is not None:
                calls += self.moe_k.warmup(
                    lw.experts,
                    lw.shared,
                    cfg.n_routed_experts,
                    cfg.num_experts_per_tok,
                    rows=gemm_rows,
                    limit=cfg.swiglu_limit,
                )
        if hasattr(self.attention, "warmup"):
            topk = tuple(sorted({0} | ({cfg.index_topk} if any(s.ratio > 0 for s in cfg.layers) else set())))
            calls += self.attention.warmup(
                cfg.num_heads, cfg.head_dim, cfg.rope_head_dim // 2, cfg.sliding_window, topk, self._attn_fmt, rows=rows
            )
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        prefill_rows = PREFILL_WARMUP_ROWS if prefill_rows is None else prefill_rows
        t2 = t1
        if prefill_rows:
            calls += self.warm_prefill(min(prefill_rows, cfg.max_position_embeddings // 2))
            t2 = time.perf_counter()
            calls += self.warm_decode(min(DECODE_WARMUP_CONTEXT, prefill_rows))
        self.warmup_s = {"kernels": t1 - t0, "prefill": t2 - t1, "decode": time.perf_counter() - t2}
        return calls

    @torch.no_grad()
    def warm_prefill(self, num_rows: int) -> int:
        """Run the real forward on a synthetic prompt in scratch pools (nothing else touched):
        `num_rows` rows from position 0, then a continuation chunk with an odd row count past
        the window (ring rows, earlier entries, row counts that are not a multiple of 16: the
        other integer specialisations of the kernels). Compiles what a first prompt of that
        chunk size would. Returns the number of forwards run."""
        cfg = self.cfg
        more = min(num_rows // 2, cfg.sliding_window) + 1 | 1
        total = num_rows + more

        def calls():
            pools = KVPools.for_model(self, -(-total // CHUNK_TOKENS) + 1, 1, self.device, num_rows)
            state = PagedSeqState(pools, 0, list(range(pools.num_blocks)), self.dtype)
            ids = torch.randint(10, cfg.vocab_size - 10, (total,), generator=torch.Generator().manual_seed(0))
            return [
                (ids[:num_rows], [SeqInput(state, 0, num_rows)]),
                (ids[num_rows:], [SeqInput(state, num_rows, more)]),
            ]

        return self._run_scratch(calls)

    @torch.no_grad()
    def warm_decode(self, context: int) -> int:
        """Run decode steps on two synthetic sequences of `context` tokens in scratch pools
        (one prompt forward for both, then a decode step of one of them and one of both), eagerly
        as the graphs replay them: compiles the decode-size variants the kernel warm-ups do not
        cover (indexer scoring and top-k, mHC, norms, KV writes), so that neither the first
        request's decode step nor the graph captured for it is a compile. Returns the number of
        forwards run."""
        cfg = self.cfg
        per = -(-(context + 2) // CHUNK_TOKENS) + 1

        def calls():
            pools = KVPools.for_model(self, 2 * per, 2, self.device, 2 * context)
            a, b = (PagedSeqState(pools, i, list(range(i * per, (i + 1) * per)), self.dtype) for i in range(2))
            ids = torch.randint(10, cfg.vocab_size - 10, (2 * context,), generator=torch.Generator().manual_seed(1))
            return [
                (ids, [SeqInput(a, 0, context), SeqInput(b, 0, context)]),
                (ids[:1], [SeqInput(a, context, 1)]),
                (ids[:2], [SeqInput(a, context + 1, 1), SeqInput(b, context, 1)]),
            ]

        return self._run_scratch(calls)

    def _run_scratch(self, make_calls) -> int:
        """Run the (token ids, seqs) forwards `make_calls()` builds over scratch pools, eagerly
        (never graphed), then free the pools. Returns the number of forwards."""
        calls = make_calls()
        graphs, self.graphs = self.graphs, None
        try:
            for ids, seqs in calls:
                self.forward(ids.to(self.device), seqs)
        finally:
            self.graphs = graphs
        count = len(calls)
        del calls
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return count

    # ------------------------------------------------------------------ entry point
    @torch.no_grad()
    def forward(
        self, token_ids: torch.Tensor, seqs: Sequence[SeqInput], feed: TokenFeed | None = None
    ) -> list[torch.Tensor | None]:
        if self.graphs is not None and self.graphs.eligible(seqs):
            return self.graphs.run(token_ids, seqs, feed)
        return super().forward(token_ids, seqs, feed)

    def forward_taps(self, token_ids: torch.Tensor, seqs: Sequence[SeqInput], feed: TokenFeed | None = None):
        """`forward` with the DSpark tap: through the graphs where they take the step (the
        tap is then the graph's static output: consumed before the next forward)."""
        if self.graphs is not None and self.graphs.eligible(seqs):
            logits, step = self.graphs.run_step(token_ids, seqs, feed)
            taps = self.taps(step)  # a view of the graph's static buffer: the next replay
            # overwrites it, and the engine keeps taps across steps
            return logits, None if taps is None else dataclasses.replace(taps, values=taps.values.clone())
        return super().forward_taps(token_ids, seqs, feed)

    # ------------------------------------------------------------------ the step's tables
    def prepare(
        self,
        token_ids: torch.Tensor,
        seqs: Sequence[SeqInput],
        pad_to: int = 0,
        key_width_step: int = 0,
        pad_logits: bool = True,
        key_width_tokens: int = 0,
    ) -> GpuStep:
        """`Model.prepare` as a `GpuStep` + pool row tables, all built on the host and moved to
        the device in one copy (the step's tensors view `step.buffer`). pad_to: extend a step whose layers all
        run on every row, or on none (an encoder-only step's decoder kinds), to that many rows (padding rows read nothing and write only scratch
        rows); key_width_step: round key-table widths up to a multiple of it (fewer graph
        shapes); key_width_tokens: key tables at least as wide as that context needs (one
        shape for every context up to it); pad_logits: padding rows get logits too (a decode bucket), else only the
        step's own logit rows and `pad_to` key-table rows whatever the padding (a padded
        turn: one graph per bucket, not per row count)."""
        for inp in seqs:
            if not isinstance(inp.state, PagedSeqState):
                raise TypeError("the GPU forward runs on PagedSeqState (engine KV pools)")
        pools = seqs[0].state.pools
        rows = max(token_ids.shape[0], pad_to)
        if rows > pools.window.shape[1] - pools.scratch_base:
            raise ValueError(
                f"{rows} rows in one forward, the pools have "
                f"{pools.window.shape[1] - pools.scratch_base} window scratch rows"
            )
        step = GpuStep.of(super().prepare(token_ids, seqs, device=torch.device("cpu")))
        if pad_to > token_ids.shape[0]:
            self._pad(step, pad_to, pad_logits)
        step.tables = TableBuilder(
            self.cfg,
            pools,
            step,
            key_width_step,
            self.layer_kinds,
            min_tables=0 if pad_logits else pad_to,
            key_width_tokens=key_width_tokens,
        ).build()
        inputs, commit = step.tensors(), step.tables.commit_tensors()
        step.buffer, moved, offsets = self.pack.upload(inputs + commit)
        step.input_bytes = offsets[len(inputs)]  # the commit's tensors come after the inputs
        step.set_tensors(moved[: len(inputs)])
        step.tables.set_commit_tensors(moved[len(inputs) :])
        return step

    def _pad(self, step: Step, num_rows: int, logits: bool = True) -> None:
        """Padding rows after the step's rows; logits: every row's (a decode bucket), else the
        step's logit rows stay as they are (a padded turn: its last real row, or none: an
        encoder-only turn, whose decoder kinds compute no row, `LayerRows.padded`)."""
        batch_rows = step.token_ids.shape[0]
        pad = num_rows - batch_rows
        step.token_ids = torch.cat((step.token_ids, step.token_ids.new_zeros(pad)))
        done: dict[int, LayerRows] = {}  # kinds sharing rows share the padded ones
        for key, r in step.rows.items():
            p = done.get(id(r.positions))
            if p is None:
                p = done[id(r.positions)] = r.padded(num_rows, batch_rows)
            step.rows[key] = p if p.key == key else p.relabel(key)
        step.hash_ids = {k: torch.cat((v, v.new_zeros(pad, v.shape[1]))) for k, v in step.hash_ids.items()}
        if logits:
            step.logit_rows = torch.arange(num_rows, device=step.token_ids.device)

    def compute(self, step: Step) -> torch.Tensor | None:
        """The key-row tables expanded on the device (inside a captured graph), the layers."""
        step.tables.materialise()
        return super().compute(step)

    def commit(self, step: Step) -> None:
        """Window records scratch -> rings, the open rows, then every state's books (once per
        sequence and distinct span, not per layer)."""
        t = step.tables
        pools = t.pools
        if t.num_keep:
            flat = pools.window.view(-1, pools.window.shape[-1])
            flat.index_copy_(0, t.keep_dst, flat.index_select(0, t.keep_src))
        for src, (slots, seam_rows) in t.open_keep.items():
            if t.num_open_keep[src]:
                pools.open[slots, pools.open_row_of[src]] = step.outputs[("open", src)][seam_rows]
        # kinds whose rows are the same objects (a decode step: all of them) are walked once
        merged: dict[int, tuple[LayerRows, list[int], list[int], list[int]]] = {}
        for key, layers in self.layer_kinds.items():
            rows = step.rows[key]
            entry = merged.setdefault(id(rows.parts), (rows, [], [], []))
            entry[1].extend(layers)
        for key, srcs, open_srcs in self._source_kinds:
            rows = step.rows[key]
            entry = merged.setdefault(id(rows.parts), (rows, [], [], []))
            entry[2].extend(srcs)
            entry[3].extend(open_srcs)
        books: dict[int, dict[tuple[int, int, bool], list[int]]] = {}
        entries: dict[int, tuple[list[int], list[int]]] = {}
        for rows, layers, srcs, open_srcs in merged.values():
            for part in rows.parts:
                seg = part.seg
                if layers and part.c1 > part.c0:
                    op = (seg.inp.start_pos + part.first, part.c1 - part.c0, part.clip_window)
                    books.setdefault(seg.index, {}).setdefault(op, []).extend(layers)
                if srcs:
                    noted, opened = entries.setdefault(seg.index, ([], []))
                    if seg.inp.plan.replay is None:
                        noted += srcs
                    opened += open_srcs
        for index, ops in books.items():
            state = step.segs[index].inp.state
            for (first_pos, count, clip), layers in ops.items():
                state.note_windows(layers, first_pos, count, clip)
        for index, (noted, opened) in entries.items():
            seg = step.segs[index]
            seg.inp.state.note_step_entries(seg.inp.start_pos, seg.end_pos, noted, opened)
        self._note_verify_rows(step)
        super().commit(step)

    def _note_verify_rows(self, step: Step) -> None:
        """A speculative verify's ratio-2 (a, g) rows, for its rollback (`SeqState.truncate`):
        each source's step output copied once (it may be a graph's static buffer, overwritten
        by the next replay), every sequence keeping views of its rows."""
        copies: dict[int, torch.Tensor] = {}
        for key, _, open_srcs in self._source_kinds:
            for part in step.rows[key].parts:
                state = part.seg.inp.state
                if not open_srcs or not state.speculating or part.seg.replay is not None:
                    continue
                first = part.seg.start_pos + part.seam_first
                for src in open_srcs:
                    if src not in copies:
                        copies[src] = step.outputs[("open", src)].clone()
                    ag = copies[src][part.s0 : part.s1]
                    state.note_group_rows(src, first, ag[:, 0], ag[:, 1], owned=True)

    # ------------------------------------------------------------------ layer hooks
    def _lin(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        return self.dense.linear_weights(x.contiguous(), w, self.dtype)

    def engram_inject(self, lw: LayerWeights, xs: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        rows = self.engram.gather_rows(lw.engram.table, row_ids)  # BF16 [Ts, C*row_dim], exact
        kv = self._lin(rows, lw.engram.wkv)  # [Ts, (S+1)*D]
        return self.engram.run_engram(xs, kv, lw.engram.qk, self.eps, inject=True)[0]

    def moe_ffn(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        return self.moe_k.moe_quantized(
            h,
            lw.gate,
            lw.gate_bias,
            lw.experts,
            lw.shared,
            cfg.num_experts_per_tok,
            cfg.routed_scaling_factor,
            cfg.swiglu_limit,
            cfg.gate_temp,
            cfg.norm_topk_prob,
        )

    # ------------------------------------------------------------------ compressor (§4, §5.2)
    def write_global_kv(
        self, spec: LayerSpec, lw: LayerWeights, x_seam: torch.Tensor, rows: LayerRows, step: Step
    ) -> None:
        """Latents of every seam row -> entries + index keys at the rows that close a group."""
        d, t, src = self.dense, step.tables, spec.layer_id
        pools = t.pools
        if spec.ratio == 2:
            ag = torch.stack(
                (d.linear_fp32(x_seam, lw.comp_wkv), d.linear_fp32(x_seam, lw.comp_wgate)), dim=1
            )  # [Ts, 2, c] FP32
            # partner: the slot's stored open row (first seam row of a part) or the row before
            pooled = self.compressor.pool_open_pairs(
                ag, pools.open[:, pools.open_row_of[src]], t.from_stored[src], t.open_slots[src], self.dtype
            )  # [Ts, c], one launch
            latent = d.rms_norm(pooled, lw.comp_norm, self.eps)
            step.outputs[("open", src)] = ag
        else:
            latent = d.rms_norm(d.linear(x_seam, lw.comp_wkv), lw.comp_norm, self.eps)
        # entries are rotated at the position of their group's first token (§3.3, §12.7)
        rope = self._step_rope(step, rows.seam_positions, self.freqs_compress, spec.ratio)
        keys = d.rms_norm(d.linear(latent, lw.idx_wk), lw.idx_k_norm, self.eps)  # [Ts, dI]
        write_rows = t.entry_rows[src]
        main, index = pools.main[src], pools.index[src]
        self.quant.write_unchecked(
            self._write_fmt, latent.contiguous(), write_rows, main.view(-1, main.shape[-1]), rope
        )
        self.quant.write_unchecked(
            self.quant.FMT_MXFP4, keys.contiguous(), write_rows, index.view(-1, index.shape[-1]), rope
        )

    # ------------------------------------------------------------------ attention (§3)
    def attend(self, spec: LayerSpec, lw: LayerWeights, x: torch.Tensor, rows: LayerRows, step: Step) -> torch.Tensor:
        cfg, d, t = self.cfg, self.dense, step.tables
        num_q = x.shape[0]
        rope = self._step_rope(step, rows.positions, self._freqs(spec))  # [Tc, r/2] each
        qkv = self._lin(x, lw.wq_a_kv)  # [Tc, q_lora + d]: wq_a and wkv in one GEMM
        c_q = d.rms_norm(qkv[:, : lw.q_lora], lw.q_norm, self.eps)  # [Tc, q_lora]
        q = self._lin(c_q, lw.wq_b).view(num_q, cfg.num_heads, cfg.head_dim)  # pre-RoPE
        kv = d.rms_norm(qkv[:, lw.q_lora :], lw.kv_norm, self.eps)  # [Tc, d] pre-RoPE
        window_pool = t.pools.window[spec.layer_id]  # [rings + scratch, 528]
        self.quant.write_unchecked(self.quant.FMT_WINDOW_FP8, kv, t.scratch[:num_q], window_pool, rope)
        if lw.idx_wq_b is not None:
            self._select_keys(spec, lw, x, c_q, rope, rows, step)
        comp_pool = comp_rows = None
        if spec.ratio > 0:
            main = t.pools.main[spec.kv_src]
            comp_pool = main.view(-1, main.shape[-1])
            comp_rows = _take(step, rows, "topk", spec.idx_src)
        o = self.attention.sparse_attention_packed(
            q,
            rope,
            window_pool,
            t.window_rows[t.window_of[spec.layer_id], :num_q],
            comp_pool,
            comp_rows,
            lw.sink,
            cfg.head_dim**-0.5,
            comp_format=self._attn_fmt,
        )  # [Tc, H, d]
        return self._lin(self._wo_a(o.view(num_q, cfg.o_groups, -1), lw.wo_a), lw.wo_b)

    def _wo_a(self, o: torch.Tensor, w: Weights) -> torch.Tensor:
        """Block-diagonal wo_a: o [T, G, H/G*d] -> z [T, G*o_lora] (group g through W_a[g]),
        one launch in [T, G, .] order (nothing gathered or transposed around the GEMM)."""
        return self.dense.block_diagonal(o, w).reshape(o.shape[0], -1)

    # ------------------------------------------------------------------ indexer (§5)
    def _select_keys(
        self,
        spec: LayerSpec,
        lw: LayerWeights,
        x: torch.Tensor,
        c_q: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        rows: LayerRows,
        step: Step,
    ) -> None:
        """Score the packed index keys of every sequence in one launch (paged: each query reads
        its own sequence's rows), publish top-k as pool rows (and candidate blocks)."""
        cfg, d, t, ix = self.cfg, self.dense, step.tables, self.indexer
        q = self._index_query(lw, c_q, rope)  # [Tc, hI, dI] BF16 (MXFP4 values)
        # head weights: FP32(BF16 projection) * scale, the scale applied in the scoring kernel
        scale = cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5
        head_w = d.linear(x, lw.idx_proj)  # [Tc, hI] BF16
        key_rows, seq_of = t.key_rows[spec.kv_src], t.seq_of[rows.key]  # [B, N], [Tc]
        n_visible = self._step_value(
            step,
            ("n_visible", id(rows.positions), spec.ratio),
            lambda: ((rows.positions + 1) // spec.ratio).to(torch.int32),
        )
        pool = t.pools.index[spec.kv_src]
        pool = pool.view(-1, pool.shape[-1])
        num_q, width = q.shape[0], key_rows.shape[1]
        blocks = None
        # top-k straight as pool rows (int32, -1 padded): key_rows[seq_of[t], entry id]
        if width == 0:  # no entries anywhere yet (the first tokens of every sequence)
            rows_out = torch.full((num_q, cfg.index_topk), -1, dtype=torch.int32, device=self.device)
            if spec.is_candidate_source:
                blocks = torch.full((num_q, 0), -1, dtype=torch.int64, device=self.device)
        elif spec.uses_candidates:
            cand = _take(step, rows, "candidates", cfg.candidate_source_layer_id)
            rows_out = ix.index_topk_sparse_paged(
                q,
                head_w,
                pool,
                key_rows,
                seq_of,
                n_visible,
                cand,
                cfg.candidate_block_size,
                cfg.index_topk,
                weight_scale=scale,
                as_pool_rows=True,
            )
        else:
            scores = ix.index_scores_paged(q, head_w, pool, key_rows, seq_of, n_visible, weight_scale=scale)
            if spec.is_candidate_source:
                blocks = ix.candidate_blocks(scores, n_visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
            rows_out = ix.select_topk(scores, cfg.index_topk, pool_rows=(key_rows, seq_of), n_visible=n_visible)
        if blocks is not None:
            step.outputs[("candidates", spec.layer_id)] = (rows, blocks)
        step.outputs[("topk", spec.layer_id)] = (rows, rows_out)

    def _index_query(
        self, lw: LayerWeights, c_q: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """q^I = MXFP4(RoPE(c_q . wq_b)) [T, hI, dI] as BF16 values (§5.1): one launch rotates
        each head row by its token's RoPE row and writes the MXFP4 values (the KV-write kernel's
        encoder, values out instead of a record)."""
        cfg = self.cfg
        nh, di = cfg.index_n_heads, cfg.index_head_dim
        q = self._lin(c_q, lw.idx_wq_b).view(-1, di)  # [T*hI, dI]
        return self.quant.rope_fake_quant_mxfp4(q, rope, nh).view(-1, nh, di)

    # ------------------------------------------------------------------ per-step values
    def _step_value(self, step: Step, key: tuple, make):
        """A value computed once per forward (cached in step.outputs, which `compute` resets):
        RoPE tables and visible-entry counts are shared by every layer of one row kind."""
        full = ("step", *key)
        if full not in step.outputs:
            step.outputs[full] = make()
        return step.outputs[full]

    def _step_rope(
        self, step: Step, positions: torch.Tensor, freqs: torch.Tensor, ratio: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables of `positions` (rounded down to a multiple of `ratio`: the compressed
        entries' group starts), once per forward per (positions, table, ratio)."""

        def make():
            pos = positions if ratio == 1 else positions // ratio * ratio
            return self.rope.rope_cos_sin(pos, freqs)

        return self._step_value(step, ("rope", id(positions), id(freqs), ratio), make)


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
