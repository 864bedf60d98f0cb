"""`TableBuilder` (per row layout, shared window spans, key rows expanded on the device) against
the table builder it replaced (per layer and per part, every table on the host), and the window
books of `PagedSeqState.note_windows` against per-layer books, over prefill chunks, decoder
narrowing, encoder-only prefill, a bounded replay over shared blocks and padded decode batches
through `DecodeGraphs` (eager). The layers are not run: the pool-row tables and the books depend
only on the step's plan, which a zero-logits compute keeps."""

from __future__ import annotations

import math

import pytest
import torch

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  (before any kernel import)

# isort: on
from flashpd.engine.gpu.decode_graph import DecodeGraphs
from flashpd.engine.gpu.forward import GpuModel
from flashpd.engine.gpu.weights import from_checkpoint_tensors, random_checkpoint_tensors
from flashpd.engine.kv_pools import KVPools, PagedSeqState
from flashpd.model.config import LayerGroup, ModelConfig
from flashpd.model.engram import EngramHasher
from flashpd.model.model import LayerRows, LogitsRequest, Replay, SeqInput, SeqPlan, Step
from flashpd.model.presets import preset_config, tokenizer_path
from flashpd.model.state import StateError


class OldTables:
    """The table builder before issue 13 (per layer, per part), kept as the reference."""

    def __init__(self, cfg: ModelConfig, pools: KVPools, step: Step, key_width_step: int):
        self.cfg, self.pools, self.step = cfg, pools, step
        self.num_rows = step.token_ids.shape[0]
        self.num_tables = len(step.segs) + self.num_rows - sum(s.num_tokens for s in step.segs)
        self.width_step = key_width_step

    def build(self) -> dict:
        cfg, pools, step = self.cfg, self.pools, self.step
        kinds: dict[LayerGroup, list[int]] = {}
        for spec in cfg.layers:
            kinds.setdefault(step.rows_of(spec).key, []).append(spec.layer_id)
        windows, window_of, seq_of, keep = [], {}, {}, {}
        for key, layers in kinds.items():
            per_row = self._compute_rows(step.rows[key])
            tables, index = self._window(step.rows[key], layers, per_row)
            window_of.update((layer, len(windows) + i) for layer, i in index.items())
            windows += tables
            seq_of[key] = per_row["table"].to(torch.int32)
            keep[key] = self._keep(layers, per_row)
        window = torch.full((len(windows), self.num_rows, cfg.sliding_window), -1, dtype=torch.int32)
        for i, table in enumerate(windows):
            window[i, : table.shape[0]] = table
        key_rows, entry_rows, from_stored, open_slots, open_keep = {}, {}, {}, {}, {}
        for src in cfg.kv_source_layer_ids:
            spec = cfg.layers[src]
            rows = step.rows_of(spec)
            key_rows[src] = self._key_table(src)
            entry_rows[src], stored, slots = self._entry_rows(src, rows, key_rows[src])
            if src in pools.open_row_of:
                from_stored[src], open_slots[src] = stored, slots
                open_keep[src] = self._open_keep(rows)
        return dict(
            window=window,
            window_of=window_of,
            seq_of=seq_of,
            keep=keep,
            key_rows=key_rows,
            entry_rows=entry_rows,
            from_stored=from_stored,
            open_slots=open_slots,
            open_keep=open_keep,
        )

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
        return {
            k: torch.tensor(v, dtype=torch.long)
            for k, v in (("pos", pos), ("first", first), ("slot", slot), ("table", table), ("end", end))
        }

    def _window(
        self, rows: LayerRows, layers: list[int], per_row: dict[str, torch.Tensor]
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
                    raise StateError(
                        f"layer {layer}: window ends at {start + held}, segment "
                        f"rows start at {part.first_pos} (replay needed?)"
                    )
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
            start = torch.cat((torch.tensor(start, dtype=torch.long), pos[len(start) :]))  # [Tc]
            from_ring = torch.where(key_pos >= start[:, None], ring_rows, -1)
            tables.append(torch.where(mine, own, from_ring).to(torch.int32))
        return tables, index

    def _keep(self, layers: list[int], per_row: dict[str, torch.Tensor]):
        """(layers, scratch rows, ring rows): the last W-1 new records of every sequence."""
        ring = self.pools.ring_rows
        pos, slot = per_row["pos"], per_row["slot"]
        kept = (pos >= per_row["end"] - ring) & (slot >= 0)
        idx = torch.nonzero(kept).flatten()
        return (
            torch.tensor(layers, dtype=torch.long),
            self.pools.scratch_base + idx,
            slot[idx] * ring + pos[idx] % ring,
        )

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
            bt = torch.tensor(
                [seg.state.block_table + [0] * (blocks - len(seg.state.block_table)) for seg in self.step.segs],
                dtype=torch.long,
            )  # [B, blocks]
            e = torch.arange(width)
            rows = bt[:, (e // epb).clamp(max=blocks - 1)] * epb + e % epb  # [B, width]
            valid = e[None, :] < torch.tensor(counts)[:, None]
            table[: len(counts)] = torch.where(valid, rows, -1).to(torch.int32)
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
                    raise StateError(
                        f"source {src}: open-group row "
                        f"{'present' if present else 'missing'} at position "
                        f"{seg.start_pos}"
                    )
                entry += [p // ratio if (p + 1) % ratio == 0 else -1 for p in range(first, seg.end_pos)]
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
        return (torch.where(entry_t >= 0, picked, -1), torch.tensor(stored), torch.tensor(slots, dtype=torch.long))

    def _open_keep(self, rows: LayerRows) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, seam rows) of the sequences whose last token leaves a ratio-2 group open."""
        slots, seam_rows = [], []
        for part in rows.parts:
            if part.seg.end_pos % 2 == 1:
                slots.append(part.seg.state.slot)
                seam_rows.append(part.s1 - 1)
        return torch.tensor(slots, dtype=torch.long), torch.tensor(seam_rows, dtype=torch.long)


class CheckedModel(GpuModel):
    """Compares the step's tables with `OldTables` and keeps per-layer shadow window books;
    the layers are replaced by zero logits (and zero ratio-2 open rows)."""

    def prepare(self, token_ids, seqs, pad_to=0, key_width_step=0, pad_logits=True, key_width_tokens=0):
        assert key_width_tokens == 0  # the old builder knows width steps only
        step = super().prepare(token_ids, seqs, pad_to, key_width_step, pad_logits)
        # the old builder on the same (host) step, before any commit
        host = step.__class__(
            step.token_ids.cpu(), step.segs, step.rows, step.hash_ids, step.logit_rows, step.logit_counts
        )
        self.expected = OldTables(self.cfg, step.tables.pools, host, key_width_step).build()
        self.shadow_commit(step)
        self.check_commit_tables(step.tables)  # (a graph's static step holds the first ones)
        return step

    def check_commit_tables(self, t):
        pairs = set()
        rows = t.pools.window.shape[1]
        for layers, src, dst in self.expected["keep"].values():
            for layer in layers.tolist():
                pairs |= {(layer * rows + s, layer * rows + d) for s, d in zip(src.tolist(), dst.tolist(), strict=True)}
        got = set(zip(t.keep_src.tolist(), t.keep_dst.tolist(), strict=True))
        assert got == pairs and len(pairs) == t.num_keep, "kept window rows"
        for src, (slots, seam) in self.expected["open_keep"].items():
            assert torch.equal(t.open_keep[src][0], slots) and torch.equal(t.open_keep[src][1], seam)

    def compute(self, step):
        t = step.tables
        t.materialise()
        want = self.expected
        for layer in range(self.cfg.num_layers):
            assert torch.equal(t.window_rows[t.window_of[layer]], want["window"][want["window_of"][layer]]), (
                f"window rows {layer}"
            )
        for key, v in want["seq_of"].items():
            assert torch.equal(t.seq_of[key], v), f"seq_of {key}"
        for group in ("key_rows", "entry_rows", "from_stored", "open_slots"):
            got = getattr(t, group)
            assert sorted(got) == sorted(want[group]), group
            for src, v in want[group].items():
                g = got[src].to(v.dtype)
                if group == "key_rows" and g.shape[0] > v.shape[0]:
                    # a padded turn keeps one key-table row per bucket row: the rows past the
                    # old builder's (segments + padding rows) hold no keys
                    assert (g[v.shape[0] :] < 0).all(), f"{group}[{src}] extra rows"
                    g = g[: v.shape[0]]
                assert torch.equal(g, v), f"{group}[{src}]"
        self.checked += 1
        cfg = self.cfg
        step.outputs = {}
        for src in cfg.kv_source_layer_ids:
            if cfg.compress_ratios[src] == 2:
                n = step.rows_of(cfg.layers[src]).num_seam
                step.outputs[("open", src)] = torch.rand(n, 2, cfg.head_dim)
        n = step.logit_rows.shape[0]
        return torch.zeros(n, cfg.vocab_size) if n else None

    def shadow_commit(self, step):
        """The old commit's per-layer window books on `self.shadow` (state -> layer -> span)."""
        keep = self.cfg.sliding_window - 1
        for spec in self.cfg.layers:
            for part in step.rows_of(spec).compute_parts:
                books = self.shadow.setdefault(id(part.seg.state), {})
                if part.clip_window:
                    books[spec.layer_id] = (part.first_pos, 0)
                start, held = books.get(spec.layer_id, (0, 0))
                assert part.first_pos == start + held
                end = part.first_pos + part.c1 - part.c0
                new_start = max(start, end - keep)
                books[spec.layer_id] = (new_start, end - new_start)

    def check_books(self, states):
        for state in states:
            for layer, span in self.shadow.get(id(state), {}).items():
                assert state.window_span(layer) == span, (layer, span)


def small_model() -> CheckedModel:
    tiny = preset_config("tiny")
    cfg = tiny.replace(name="tables", sliding_window=8, index_topk=8, candidate_topk_blocks=2)
    device = torch.device("cpu")
    weights = from_checkpoint_tensors(cfg, random_checkpoint_tensors(cfg, 0, device), device)
    model = CheckedModel(cfg, weights, EngramHasher.from_tokenizer(cfg, tokenizer_path("tiny")), decode_graphs=False)
    model.checked, model.shadow = 0, {}
    return model


def _ids(n, seed):
    return torch.randint(5, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_tables_and_books_match_the_per_layer_builder():
    model = small_model()
    cfg = model.cfg
    pools = KVPools(cfg, 16, 6, "cpu", window_scratch_rows=256)
    a = PagedSeqState(pools, 0, [0, 1, 2], torch.bfloat16)
    b = PagedSeqState(pools, 1, [3, 4], torch.bfloat16)
    pa, pb = _ids(150, 1), _ids(40, 2)
    # prefill: a whole (every row's logits), b encoder-only
    model.forward(
        torch.tensor(pa[:19] + pb[:13]),
        [SeqInput(a, 0, 19, SeqPlan(logits=LogitsRequest.ALL)), SeqInput(b, 0, 13, SeqPlan.encoder_only())],
    )
    # a: a chunk with decoder narrowing (decoder layers clip at the chunk's last 4 rows)
    model.forward(torch.tensor(pa[19:30]), [SeqInput(a, 19, 11, SeqPlan(decoder_rows=4))])
    model.check_books([a])
    # c hits a's first 24 tokens (blocks shared): adopt, bounded replay of W rows, a turn
    hit, w = 24, cfg.sliding_window
    c = PagedSeqState(pools, 2, [0, 1, 5], torch.bfloat16)
    c.adopt_prefix(hit, tuple(pa[hit - 3 : hit]))
    replay = SeqPlan(logits=LogitsRequest.NONE, replay=Replay(tuple(pa[hit - w - 3 : hit - w])))
    model.forward(torch.tensor(pa[hit - w : hit]), [SeqInput(c, hit - w, w, replay)])
    model.forward(torch.tensor(pa[hit:27]), [SeqInput(c, hit, 3)])
    model.check_books([a, c])
    # decode through the graph path (eager): three sequences in a bucket of four, and two
    model.graphs = DecodeGraphs(model, capture=False)
    d = PagedSeqState(pools, 3, [6, 7], torch.bfloat16)
    model.forward(torch.tensor(pb[:5]), [SeqInput(d, 0, 5)])
    for i in range(20):
        group = [a, c, d] if i % 5 else [a, d]
        seqs = [SeqInput(s, s.num_tokens, 1) for s in group]
        assert model.graphs.eligible(seqs)
        model.forward(torch.tensor([7 + i] * len(group)), seqs)
        model.check_books(group)
    assert model.checked == 25 and len(model.graphs._graphs) >= 2
    for s in (a, c, d):
        assert s.common_window_span() == (s.num_tokens - (w - 1), w - 1)


def test_window_books_split_and_rejoin():
    cfg = preset_config("tiny").replace(sliding_window=8)
    pools = KVPools(cfg, 2, 1, "cpu")
    s = PagedSeqState(pools, 0, [0])
    every = list(range(cfg.num_layers))
    s.note_windows(every, 0, 5)
    assert s.common_window_span() == (0, 5)
    s.note_windows(every[:4], 5, 3)  # only some layers: books per layer
    assert s.common_window_span() is None
    assert s.window_span(0) == (1, 7) and s.window_span(9) == (0, 5)
    with pytest.raises(StateError, match="window append at 5"):
        s.note_windows(every, 5, 1)
    s.note_windows(every, 8, 1, clip=True)  # a clip of every layer joins them again
    assert s.common_window_span() == (8, 1)
    s.adopt_prefix(0, ())
    with pytest.raises(StateError, match="unset"):
        s.window_span(3)
    with pytest.raises(StateError, match="unset"):
        s.note_windows(every, 0, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="interpreted kernels: ~4 min on the CPU; runs on the GPU")
def test_turns_through_the_graph_path_equal_the_eager_forward():
    """A turn (one sequence, 2..W rows, last-row logits) takes the graph path padded to its
    bucket, one graph for every row count of the bucket: same logits, pools and books as the
    eager forward (capture off: the same static buffers and padding run eagerly)."""
    import copy

    tiny = preset_config("tiny")
    cfg = tiny.replace(name="turns", sliding_window=8, index_topk=8, candidate_topk_blocks=2)
    dev = torch.device("cuda")
    weights = from_checkpoint_tensors(cfg, random_checkpoint_tensors(cfg, 0, dev), dev)
    model = GpuModel(cfg, weights, EngramHasher.from_tokenizer(cfg, tokenizer_path("tiny")), decode_graphs=False)
    prompt = _ids(30, 3)
    base = KVPools(cfg, 8, 2, dev, window_scratch_rows=64)
    a = PagedSeqState(base, 0, [0, 1], torch.bfloat16)
    model.forward(torch.tensor(prompt[:13]), [SeqInput(a, 0, 13)])
    runs = []
    for graphs in (False, True):
        model.graphs = DecodeGraphs(model, capture=False) if graphs else None
        pools, (s,) = copy.deepcopy((base, [a]))
        out = []
        for start, n in ((13, 3), (16, 4)):  # both pad to the bucket of 4 rows
            seqs = [SeqInput(s, start, n)]
            if graphs:
                assert model.graphs.eligible(seqs)
            out += model.forward(torch.tensor(prompt[start : start + n]), seqs)
        runs.append((out, pools, s, model.graphs))
    model.graphs = None
    (out_e, pools_e, se, _), (out_g, pools_g, sg, graphs) = runs
    assert len(graphs._graphs) == 1  # one graph served both row counts
    assert len(out_g) == 2 and all(lg.shape[0] == 1 for lg in out_g)
    for le, lg in zip(out_e, out_g, strict=True):
        assert torch.equal(le, lg)
    assert torch.equal(pools_e.window[:, : pools_e.scratch_base], pools_g.window[:, : pools_g.scratch_base])
    assert torch.equal(pools_e.open, pools_g.open)
    for src in cfg.kv_source_layer_ids:
        assert torch.equal(pools_e.main[src], pools_g.main[src])
        assert torch.equal(pools_e.index[src], pools_g.index[src])
    assert se.num_tokens == sg.num_tokens == 20 and se.lookback_ids() == sg.lookback_ids()
    for layer in range(cfg.num_layers):
        assert se.window_span(layer) == sg.window_span(layer)


def test_prefill_role_hits_through_the_graph_path_keep_the_per_layer_tables():
    """The prefill role's prefix hit through the graphs (eager): the encoder-only W-row replay,
    then encoder-only turns of 3 and 5 rows padded to 4 and 8 (the decoder kinds compute no
    row; the candidate source's seam takes the padding rows, which write nowhere): the tables
    and books of the per-layer builder."""
    from flashpd.engine.gpu.decode_graph import ENCODER_REPLAY, ENCODER_TURN

    model = small_model()
    cfg = model.cfg
    w, hit = cfg.sliding_window, 24
    pools = KVPools(cfg, 4, 2, "cpu", window_scratch_rows=256)
    prompt = _ids(40, 9)
    a = PagedSeqState(pools, 0, [0], torch.bfloat16)
    model.forward(torch.tensor(prompt[:hit]), [SeqInput(a, 0, hit, SeqPlan.encoder_only())])
    model.graphs = DecodeGraphs(model, capture=False)
    c = PagedSeqState(pools, 1, [0], torch.bfloat16)  # the hit: a's block, a slot of its own
    c.adopt_prefix(hit, tuple(prompt[hit - 3 : hit]))
    plan = SeqPlan(logits=LogitsRequest.NONE, replay=Replay(tuple(prompt[hit - w - 3 : hit - w])), decoder_rows=0)
    seqs = [SeqInput(c, hit - w, w, plan)]
    assert model.graphs.kind(seqs) == ENCODER_REPLAY
    assert model.forward(torch.tensor(prompt[hit - w : hit]), seqs) == [None]
    model.check_books([c])
    for n in (3, 5):
        at = c.num_tokens
        seqs = [SeqInput(c, at, n, SeqPlan.encoder_only())]
        assert model.graphs.kind(seqs) == ENCODER_TURN
        assert model.forward(torch.tensor(prompt[at : at + n]), seqs) == [None]
        model.check_books([c])
    assert model.checked == 4 and c.num_tokens == hit + 8
    assert model.graphs.runs == {ENCODER_REPLAY: 1, ENCODER_TURN: 2}
    assert sorted(k[2] for k in model.graphs._graphs) == sorted([w, 4, 8])  # the replay, 2 buckets


def test_graphs_are_keyed_by_the_pools_they_were_recorded_against():
    """Two engines' pools of one shape over one model: a decode step in the second pools gets
    its own graph, whose static step reads and writes those pools (before the key held the
    pools, it replayed the first engine's graph, wired to the first engine's pools)."""
    from flashpd.engine.gpu.decode_graph import pools_key

    model = small_model()
    states = {}
    for name, prompt_seed in (("a", 1), ("b", 2)):
        pools = KVPools(model.cfg, 8, 2, "cpu", window_scratch_rows=256)
        s = PagedSeqState(pools, 0, [0, 1], torch.bfloat16)
        model.forward(torch.tensor(_ids(20, prompt_seed)), [SeqInput(s, 0, 20)])
        states[name] = s
    model.graphs = DecodeGraphs(model, capture=False)
    for _ in range(2):
        for s in states.values():
            model.forward(torch.tensor([9]), [SeqInput(s, s.num_tokens, 1)])
            model.check_books([s])
    graphs = model.graphs._graphs
    assert len(graphs) == 2
    for s in states.values():
        (key,) = [k for k in graphs if k[-1] == pools_key(s.pools)]
        assert graphs[key][1].tables.pools is s.pools


def test_replay_and_turn_tables_take_one_width_for_every_context_up_to_the_limit():
    """`key_width_tokens` (the engine's graph_width_tokens, for replays and turns): two sequences of
    different contexts get key tables of one width, as wide as the limit needs, so their
    turns share one graph; without it the widths follow each context (a capture per width)."""
    model = small_model()
    cfg = model.cfg
    pools = KVPools(cfg, 16, 4, "cpu", window_scratch_rows=256)
    states = [PagedSeqState(pools, i, [3 * i, 3 * i + 1, 3 * i + 2], torch.bfloat16) for i in range(2)]
    for s, n in zip(states, (20, 44), strict=True):
        model.forward(torch.tensor(_ids(n, n)), [SeqInput(s, 0, n)])

    def widths(s, tokens):
        step = GpuModel.prepare(
            model,
            torch.tensor([7, 8, 9]),
            [SeqInput(s, s.num_tokens, 3)],
            pad_to=4,
            key_width_step=4,
            pad_logits=False,
            key_width_tokens=tokens,
        )
        return step.tables.key_width

    limit = 300
    want = {src: math.ceil(math.ceil(limit / cfg.compress_ratios[src]) / 4) * 4 for src in cfg.kv_source_layer_ids}
    assert widths(states[0], limit) == widths(states[1], limit) == want
    assert widths(states[0], 0) != widths(states[1], 0)


def test_graph_turns_switch_is_read_at_load_and_validated():
    from flashpd.engine.gpu.decode_graph import graph_turns_from_env

    assert graph_turns_from_env({}) is True
    assert graph_turns_from_env({"FLASHPD_GRAPH_TURNS": "0"}) is False
    with pytest.raises(ValueError, match="FLASHPD_GRAPH_TURNS"):
        graph_turns_from_env({"FLASHPD_GRAPH_TURNS": "off"})


def test_speculative_verify_steps_take_the_graph_path_one_graph_per_shape():
    """A verify (every sequence adds the same anchor + drafts rows, logits for every row) is
    eligible for the graphs, unpadded, one graph per (sequences, rows) shape; the
    tables and books stay those of the per-layer builder. A batch whose sequences add
    different row counts (a sequence that does not speculate rides along) stays eager."""
    model = small_model()
    cfg = model.cfg
    pools = KVPools(cfg, 24, 4, "cpu", window_scratch_rows=256)
    states = [PagedSeqState(pools, i, [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3], torch.bfloat16) for i in range(3)]
    for s, n in zip(states, (20, 31, 9), strict=True):
        model.forward(torch.tensor(_ids(n, n)), [SeqInput(s, 0, n)])
    model.graphs = DecodeGraphs(model, capture=False)
    every = SeqPlan(logits=LogitsRequest.ALL)
    for i, (group, rows) in enumerate(((states, 3), (states[:2], 6), (states, 3))):
        seqs = [SeqInput(s, s.num_tokens, rows, every) for s in group]
        assert model.graphs.eligible(seqs)
        out = model.forward(torch.tensor(_ids(rows * len(group), 50 + i)), seqs)
        assert [tuple(lg.shape) for lg in out] == [(rows, cfg.vocab_size)] * len(group)
        model.check_books(group)
    keys = [k for k in model.graphs._graphs if "verify" in k]
    assert len(keys) == 2 and {k[2] for k in keys} == {9, 12}  # the third step replays
    assert model.graphs.num_verify_replays == 3
    mixed = [SeqInput(states[0], states[0].num_tokens, 3, every), SeqInput(states[1], states[1].num_tokens, 1)]
    assert not model.graphs.eligible(mixed)
    last = [SeqInput(s, s.num_tokens, 3) for s in states[:2]]  # 2 sequences, last-row logits
    assert not model.graphs.eligible(last)


def test_a_verify_graph_that_disagrees_with_the_eager_forward_is_refused():
    from flashpd.engine.gpu.decode_graph import logits_mismatch

    ref = torch.tensor([[1.0, 5.0, 2.0], [0.5, 0.1, 3.0]])
    assert logits_mismatch(ref.clone(), ref) == ""
    assert logits_mismatch(ref + 1e-4, ref) == ""
    near = torch.tensor([[1.0, 5.0, 4.99], [0.5, 0.1, 3.0]])
    assert "argmax" in logits_mismatch(torch.tensor([[1.0, 4.99, 5.0], [0.5, 0.1, 3.0]]), near)
    assert "diff" in logits_mismatch(ref * 2, ref)
    assert "non-finite" in logits_mismatch(ref.masked_fill(ref > 4, float("nan")), ref)
    assert "shapes" in logits_mismatch(ref[:1], ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="interpreted kernels: minutes on the CPU; runs on the GPU")
@pytest.mark.parametrize("capture", [False, True])
def test_verify_steps_through_the_graphs_equal_the_eager_forward(capture):
    """Two sequences verifying 4 rows each (logits for every row) through the graph path,
    eager over the static buffers and captured: the logits, pools and books of the eager
    forward; a captured graph is replayed for the second step of the same shape."""
    import copy

    tiny = preset_config("tiny")
    cfg = tiny.replace(name="verify", sliding_window=8, index_topk=8, candidate_topk_blocks=2)
    dev = torch.device("cuda")
    weights = from_checkpoint_tensors(cfg, random_checkpoint_tensors(cfg, 0, dev), dev)
    model = GpuModel(cfg, weights, EngramHasher.from_tokenizer(cfg, tokenizer_path("tiny")), decode_graphs=False)
    prompts = [_ids(40, 5), _ids(40, 6)]
    base = KVPools(cfg, 12, 2, dev, window_scratch_rows=64)
    seqs0 = [PagedSeqState(base, i, [3 * i, 3 * i + 1, 3 * i + 2], torch.bfloat16) for i in range(2)]
    for s, p, n in zip(seqs0, prompts, (13, 17), strict=True):
        model.forward(torch.tensor(p[:n]), [SeqInput(s, 0, n)])
    every = SeqPlan(logits=LogitsRequest.ALL)
    runs = []
    for graphs in (False, True):
        model.graphs = DecodeGraphs(model, capture=capture) if graphs else None
        pools, states = copy.deepcopy((base, seqs0))
        out = []
        for _ in range(2):
            seqs = [SeqInput(s, s.num_tokens, 4, every) for s in states]
            if graphs:
                assert model.graphs.eligible(seqs)
            ids = [t for s, p in zip(states, prompts, strict=True) for t in p[s.num_tokens : s.num_tokens + 4]]
            out += [lg.clone() for lg in model.forward(torch.tensor(ids), seqs)]
        runs.append((out, pools, states, model.graphs))
    model.graphs = None
    (out_e, pools_e, se, _), (out_g, pools_g, sg, graphs) = runs
    assert graphs.num_verify_replays == 2 and not graphs._failed_verify
    assert graphs.num_captures == (1 if capture else 0)
    for le, lg in zip(out_e, out_g, strict=True):
        assert le.shape == lg.shape == (4, cfg.vocab_size)
        assert torch.allclose(le, lg, atol=1e-3, rtol=0) if capture else torch.equal(le, lg)
    for src in cfg.kv_source_layer_ids:
        assert torch.equal(pools_e.main[src], pools_g.main[src])
        assert torch.equal(pools_e.index[src], pools_g.index[src])
    assert torch.equal(pools_e.open, pools_g.open)
    for a, b in zip(se, sg, strict=True):
        assert a.num_tokens == b.num_tokens and a.lookback_ids() == b.lookback_ids()
        for layer in range(cfg.num_layers):
            assert a.window_span(layer) == b.window_span(layer)
