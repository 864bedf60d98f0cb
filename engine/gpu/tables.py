"""Pool-row tables of one GPU forward step: built on the host, moved to the device in one copy.

`TableBuilder` turns a `Step` (host tensors, model/model.py) into `PagedTables`, per distinct
row layout rather than per layer (a decode step's four layer kinds touch the same rows), with
the window books read once per sequence when all its layers share one span (`PagedSeqState`).
The key-row tables [B, N] (N up to a sequence's entry count: the big ones) and the window tables
[U, T, W] are not built on the host: the step carries the block table, the visible counts and a
[U, 4, T] window spec, and `PagedTables.materialise` expands them on the device at the start of
`compute` (inside the decode graph; for an 8K prefill chunk the host part went 45 -> 5 ms).

`HostPack` lays every host tensor of a step out in one byte buffer (pinned on CUDA) and moves it
with one host-to-device copy; the step's tensors become views of that device buffer.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from flashpd.engine.kv_pools import KVPools
from flashpd.model.config import LayerGroup, ModelConfig
from flashpd.model.model import LayerRows, Step
from flashpd.model.state import StateError

ALIGN = 16  # byte alignment of every tensor in a pack (any dtype's view stays aligned)


SMALL_SPAN_ROWS = 16  # seam spans up to this many rows are built from host ints (Columns.row)
SMALL_TABLE_ROWS = 64  # seam tables up to this many rows (all host ints) are mapped on the host


@dataclass
class PagedTables:
    """Pool rows of one step (device tensors the forward reads) and what the commit needs."""

    pools: KVPools
    scratch: torch.Tensor  # [T] int64 window scratch rows
    # [U, 4, T] int64 per window table: each row's position, first own position, first ring
    # position and slot; `materialise` expands it into window_rows on the device
    window_spec: torch.Tensor
    window_of: dict[int, int]  # layer -> its table in window_rows (layers with equal spans share)
    seq_of: dict[LayerGroup, torch.Tensor]  # rows kind -> [Tc] int32 key-table row
    block_table: torch.Tensor  # [B', nb] int64 block ids of each key-table row (0-padded)
    key_counts: torch.Tensor  # [S, B'] int64 entries of source i visible by the step's end
    key_width: dict[int, int]  # src -> N, the width of its key-row table
    entry_rows: dict[int, torch.Tensor]  # src -> [Ts] int64 entry write row (-1: none)
    from_stored: dict[int, torch.Tensor]  # ratio-2 src -> [Ts] bool: partner is the open row
    open_slots: dict[int, torch.Tensor]  # ratio-2 src -> [Ts] int64 slot of the row
    # commit: window records kept (flat rows of pools.window viewed [layers * rows, bytes])
    keep_src: torch.Tensor
    keep_dst: torch.Tensor
    open_keep: dict[int, tuple[torch.Tensor, torch.Tensor]]  # ratio-2 src: (slots, seam rows)
    num_keep: int = 0
    num_open_keep: dict[int, int] = field(default_factory=dict)
    window_size: int = 0  # W
    # src -> [B', N] int32 pool rows of visible entries (-1 past): `materialise` fills it
    key_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # [U, T, W] int32 pool rows of each compute row's window keys (-1 empty): `materialise`
    window_rows: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The forward's inputs in a fixed order (what a graph replay refills)."""
        out = [self.scratch, self.window_spec, self.block_table, self.key_counts]
        for group in (self.seq_of, self.entry_rows, self.from_stored, self.open_slots):
            out += [group[k] for k in sorted(group)]
        return out

    def set_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        it = iter(tensors)
        self.scratch, self.window_spec, self.block_table = next(it), next(it), next(it)
        self.key_counts = next(it)
        for group in (self.seq_of, self.entry_rows, self.from_stored, self.open_slots):
            for k in sorted(group):
                group[k] = next(it)
        if next(it, None) is not None:
            raise ValueError("more tensors than the tables hold")

    def commit_tensors(self) -> list[torch.Tensor]:
        out = [self.keep_src, self.keep_dst]
        for k in sorted(self.open_keep):
            out += list(self.open_keep[k])
        return out

    def set_commit_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        self.keep_src, self.keep_dst = tensors[0], tensors[1]
        for i, k in enumerate(sorted(self.open_keep)):
            self.open_keep[k] = (tensors[2 + 2 * i], tensors[3 + 2 * i])

    def materialise(self) -> None:
        """key_rows[src] [B', N] = pool row of entry j of each sequence (-1 from its count on),
        from the block table; window_rows [U, T, W] from the window spec: a few device ops,
        graph-capturable (no host values)."""
        self.window_rows = expand_windows(
            self.window_spec, self.window_size, self.pools.ring_rows, self.pools.scratch_base
        )
        epb_of = self.pools.geometry.entries_per_block
        bt = self.block_table
        for i, (src, width) in enumerate(self.key_width.items()):
            epb = epb_of(src)
            e = torch.arange(width, device=bt.device)
            blk = (e // epb).clamp_(max=max(bt.shape[1] - 1, 0))
            rows = bt[:, blk] * epb + e % epb  # [B', N]
            valid = e[None, :] < self.key_counts[i][:, None]
            self.key_rows[src] = torch.where(valid, rows, -1).to(torch.int32)


class Columns:
    """Columns of int64 row values, gathered from single rows (Python ints, one list each)
    and from spans (a tensor for the first column, constants for the rest), in order: the
    host tables of a decode batch (one row per sequence) and of an 8K prefill chunk (one span)
    both cost little."""

    def __init__(self, num_cols: int):
        self.num_cols, self.num_rows = num_cols, 0
        self._pieces: list[torch.Tensor] = []
        self._rows: list[tuple[int, ...]] = []

    def row(self, *values: int) -> None:
        self._rows.append(values)
        self.num_rows += 1

    def span(self, first: torch.Tensor, *rest: int) -> None:
        self._flush()
        block = torch.empty((self.num_cols, first.shape[0]), dtype=torch.long)
        block[0] = first
        block[1:] = torch.tensor(rest, dtype=torch.long)[:, None]
        self._pieces.append(block)
        self.num_rows += first.shape[0]

    def last(self) -> torch.Tensor:
        """The last span's [num_cols, n] block (writable)."""
        return self._pieces[-1]

    def host_rows(self) -> list[tuple[int, ...]] | None:
        """Every row so far as host ints when no span was added (else None)."""
        return None if self._pieces else self._rows

    def tensor(self) -> torch.Tensor:
        self._flush()
        if not self._pieces:
            return torch.zeros((self.num_cols, 0), dtype=torch.long)
        return self._pieces[0] if len(self._pieces) == 1 else torch.cat(self._pieces, dim=1)

    def _flush(self) -> None:
        if self._rows:
            self._pieces.append(torch.tensor(list(zip(*self._rows, strict=True)), dtype=torch.long))
            self._rows = []


NO_KEYS = 1 << 40  # a window spec's first / start for rows with no window keys


def expand_windows(spec: torch.Tensor, window: int, ring: int, scratch_base: int) -> torch.Tensor:
    """spec [U, 4, T] (position, first own position, first ring position, slot per row) ->
    [U, T, W] int32 pool rows of each row's window keys: key positions pos-W+1..pos; from
    `first` on the step's own scratch rows (row t's key at offset j - (W-1) is scratch row
    t + j - (W-1)), from `start` on the slot's ring, earlier -1."""
    pos, first, start, slot = spec.unbind(1)  # [U, T] each
    offs = torch.arange(1 - window, 1, device=spec.device)  # [W]
    key_pos = pos[..., None] + offs  # [U, T, W]
    own = scratch_base + torch.arange(spec.shape[2], device=spec.device)[:, None] + offs
    ring_rows = slot[..., None] * ring + key_pos.remainder(ring)
    from_ring = torch.where(key_pos >= start[..., None], ring_rows, -1)
    return torch.where(key_pos >= first[..., None], own, from_ring).to(torch.int32)


class TableBuilder:
    """Host-side construction of `PagedTables` (vectorised over rows, once per row layout)."""

    def __init__(
        self,
        cfg: ModelConfig,
        pools: KVPools,
        step: Step,
        key_width_step: int,
        kinds: dict[LayerGroup, tuple[int, ...]],
        min_tables: int = 0,
        key_width_tokens: int = 0,
    ):
        """kinds: rows kind -> its layers (`GpuModel.layer_kinds`); min_tables: at least this
        many key-table rows (the ones past the segments' and padding rows' are empty);
        key_width_tokens: every key table at least as wide as a context of that many tokens
        needs (one table shape for every context up to it: a width-agnostic graph)."""
        self.cfg, self.pools, self.step, self.kinds = cfg, pools, step, kinds
        self._bt_rows: tuple | None = None  # (block table, its rows as host lists)
        self.num_rows = step.token_ids.shape[0]
        self.num_tables = max(min_tables, len(step.segs) + self.num_rows - sum(s.num_tokens for s in step.segs))
        self.width_step = key_width_step
        self.width_tokens = key_width_tokens

    def build(self) -> PagedTables:
        cfg, pools, step = self.cfg, self.pools, self.step
        # one row layout per distinct set of compute parts (a decode step: one for all kinds)
        layouts: dict[tuple, list] = {}
        for key, layers in self.kinds.items():
            rows = step.rows[key]
            sig = (rows.num_compute,) + tuple((p.seg.index, p.first) for p in rows.compute_parts)
            entry = layouts.get(sig)
            if entry is None:
                layouts[sig] = [rows, list(layers), [key]]
            else:
                entry[1] += layers
                entry[2].append(key)
        windows, window_of, seq_of = [], {}, {}
        distinct: dict[tuple, int] = {}
        keep_src, keep_dst = [], []
        for rows, layers, keys in layouts.values():
            per_row = self._compute_rows(rows)
            table = per_row["table"].to(torch.int32)
            for key in keys:
                seq_of[key] = table
            for starts, group in self._starts(rows, layers).items():
                i = distinct.get((id(rows), starts))
                if i is None:
                    i = distinct[(id(rows), starts)] = len(windows)
                    windows.append(self._window(rows, starts, per_row))
                window_of.update(dict.fromkeys(group, i))
            src, dst = self._keep(layers, per_row)
            keep_src.append(src)
            keep_dst.append(dst)
        window = torch.zeros((len(windows), 4, self.num_rows), dtype=torch.long)
        window[:, 1:3] = NO_KEYS  # rows past a layout's compute rows: an empty window
        for i, t in enumerate(windows):
            window[i, :, : t.shape[1]] = t
        counts, widths = self._key_counts()
        bt = self._block_table(widths)
        entry_rows, from_stored, open_slots, open_keep = {}, {}, {}, {}
        shared: dict[tuple, tuple] = {}
        for src in cfg.kv_source_layer_ids:
            rows = step.rows_of(cfg.layers[src])
            ratio = cfg.compress_ratios[src]
            k = (rows.key, ratio)
            if k not in shared:
                shared[k] = self._entry_rows(src, rows, bt) + (self._open_keep(rows),)
            entry_rows[src], stored, slots, okeep = shared[k]
            if src in pools.open_row_of:
                from_stored[src], open_slots[src], open_keep[src] = stored, slots, okeep
        keep_src, keep_dst = torch.cat(keep_src), torch.cat(keep_dst)
        return PagedTables(
            pools,
            pools.scratch_base + torch.arange(self.num_rows),
            window,
            window_of,
            seq_of,
            bt,
            torch.tensor(list(counts.values()), dtype=torch.long),
            widths,
            entry_rows,
            from_stored,
            open_slots,
            keep_src,
            keep_dst,
            open_keep,
            num_keep=keep_src.shape[0],
            num_open_keep={s: v[0].shape[0] for s, v in open_keep.items()},
            window_size=cfg.sliding_window,
        )

    # ------------------------------------------------------------------ per compute row
    def _compute_rows(self, rows: LayerRows) -> dict[str, torch.Tensor]:
        """Per compute row: position, first position of its part, slot, key-table row, end."""
        cols = Columns(5)  # pos, first, slot, table, end
        for part in rows.compute_parts:
            n, seg = part.c1 - part.c0, part.seg
            fp = seg.inp.start_pos + part.first
            if n == 1:
                cols.row(fp, fp, seg.inp.state.slot, seg.index, fp + 1)
            else:
                cols.span(torch.arange(fp, fp + n), fp, seg.inp.state.slot, seg.index, seg.end_pos)
        pad = rows.num_compute - cols.num_rows  # padding rows: position 0, an empty window,
        num_segs = len(self.step.segs)  # their own key-table rows
        if pad:
            cols.span(torch.zeros(pad, dtype=torch.long), 0, -1, 0, 0)
            cols.last()[3] = torch.arange(num_segs, num_segs + pad)
        return dict(zip(("pos", "first", "slot", "table", "end"), cols.tensor(), strict=True))

    def _starts(self, rows: LayerRows, layers: list[int]) -> dict[tuple[int, ...], list[int]]:
        """Distinct per-part window starts -> the layers that have them. A part whose state's
        layers share one span is read once; keys at or after the part's first position come
        from this step's rows, earlier ones from the ring as far as the window holds them."""
        common, per_layer = [], {}
        for j, part in enumerate(rows.compute_parts):
            fp = part.seg.inp.start_pos + part.first
            if part.clip_window:
                common.append(fp)
                continue
            state = part.seg.inp.state
            span = state.common_window_span()
            if span is not None:
                if span[0] + span[1] != fp:
                    raise StateError(f"window ends at {span[0] + span[1]}, segment rows start at {fp} (replay needed?)")
                common.append(span[0])
                continue
            common.append(None)
            for layer in layers:
                start, held = state.window_span(layer)
                if start + held != fp:
                    raise StateError(
                        f"layer {layer}: window ends at {start + held}, segment rows start at {fp} (replay needed?)"
                    )
                per_layer.setdefault(layer, {})[j] = start
        if not per_layer:
            return {tuple(common): layers}
        out: dict[tuple[int, ...], list[int]] = {}
        for layer in layers:
            own = per_layer[layer]
            starts = tuple(own[j] if s is None else s for j, s in enumerate(common))
            out.setdefault(starts, []).append(layer)
        return out

    def _window(self, rows: LayerRows, starts: tuple[int, ...], per_row: dict[str, torch.Tensor]) -> torch.Tensor:
        """[4, Tc] window spec of each compute row for one set of part starts: position, first
        position of its part (keys from there on are this step's rows), first position the
        ring holds (earlier keys: none), slot. `window_rows` expands it on the device."""
        pos = per_row["pos"]
        counts = [p.c1 - p.c0 for p in rows.compute_parts]
        if all(n == 1 for n in counts):
            start = torch.tensor(starts, dtype=torch.long)
        else:
            start = torch.repeat_interleave(
                torch.tensor(starts, dtype=torch.long), torch.tensor(counts, dtype=torch.long)
            )
        start = torch.cat((start, pos[len(start) :]))  # padding rows: nothing earlier
        return torch.stack((pos, per_row["first"], start, per_row["slot"]))

    def _keep(self, layers: list[int], per_row: dict[str, torch.Tensor]):
        """Flat (scratch, ring) rows of pools.window [L * R]: the last W-1 new records of every
        sequence, for each of `layers`."""
        ring, num_rows = self.pools.ring_rows, self.pools.window.shape[1]
        pos, slot = per_row["pos"], per_row["slot"]
        kept = (pos >= per_row["end"] - ring) & (slot >= 0)
        idx = torch.nonzero(kept).flatten()
        base = torch.tensor(layers, dtype=torch.long)[:, None] * num_rows
        src = self.pools.scratch_base + idx
        dst = slot[idx] * ring + pos[idx] % ring
        return (base + src[None, :]).flatten(), (base + dst[None, :]).flatten()

    # ------------------------------------------------------------------ global entries
    def _key_counts(self) -> tuple[dict[int, list[int]], dict[int, int]]:
        """Per source: entries visible to each key-table row by the step's end, and the
        table width (rounded up to the width step)."""
        cfg, pad = self.cfg, self.num_tables - len(self.step.segs)
        per_seg = [
            seg.inp.state.visible_entries(seg.inp.start_pos, seg.end_pos, seg.inp.plan.replay is not None)
            for seg in self.step.segs
        ]
        counts, widths = {}, {}
        for i, src in enumerate(cfg.kv_source_layer_ids):
            c = [v[i] for v in per_seg]
            width = max(max(c, default=0), -(-self.width_tokens // cfg.compress_ratios[src]))
            if self.width_step:
                width = -(-max(width, 1) // self.width_step) * self.width_step
            counts[src], widths[src] = c + [0] * pad, width
        return counts, widths

    def _block_table(self, widths: dict[int, int]) -> torch.Tensor:
        """[B', nb] block ids of each key-table row, nb = the blocks the widest table spans."""
        geo = self.pools.geometry
        nb = max([-(-w // geo.entries_per_block(s)) for s, w in widths.items()] + [1])
        flat, zeros = array.array("q"), [0] * nb  # C-level int conversion, not per element
        for seg in self.step.segs:
            blocks = seg.inp.state.block_table[:nb]
            flat.extend(blocks)
            if len(blocks) < nb:
                flat.extend(zeros[len(blocks) :])
        flat.extend([0] * (nb * (self.num_tables - len(self.step.segs))))
        return torch.frombuffer(flat, dtype=torch.int64).view(self.num_tables, nb).clone()

    def _entry_rows(self, src: int, rows: LayerRows, bt: torch.Tensor):
        """Per seam row of the source: the pool row of the entry it closes (-1: none), whether
        its ratio-2 partner is the slot's stored open row, and its slot."""
        ratio = self.cfg.compress_ratios[src]
        epb = self.pools.geometry.entries_per_block(src)
        cols = Columns(4)  # entry row, stored, slot, key-table row
        for part in rows.parts:
            seg = part.seg
            first = seg.inp.start_pos + part.seam_first
            end = seg.end_pos
            n = end - first
            if n == 1 and seg.inp.plan.replay is None:  # a decode row
                cols.row(first // ratio if end % ratio == 0 else -1, 1, seg.inp.state.slot, seg.index)
                continue
            if n <= SMALL_SPAN_ROWS:  # a verify's k + 1 rows, a short turn: host ints, no tensor ops
                slot, index = seg.inp.state.slot, seg.index
                for p in range(first, end):
                    entry = -1 if seg.replay is not None or (p + 1) % ratio else p // ratio
                    cols.row(entry, int(p == first), slot, index)
                continue
            if seg.replay is not None:  # the entries exist: nothing is written
                entry = torch.full((n,), -1, dtype=torch.long)
            else:
                p = torch.arange(first, end)
                entry = p if ratio == 1 else torch.where((p + 1) % ratio == 0, p // ratio, -1)
            cols.span(entry, 0, seg.inp.state.slot, seg.index)
            cols.last()[1, 0] = 1
        pad = rows.num_seam - cols.num_rows
        host = cols.host_rows()
        if host is not None and rows.num_seam <= SMALL_TABLE_ROWS:  # a verify, a decode batch
            return self._entry_rows_host(host, pad, epb, bt)
        if pad:
            cols.span(torch.full((pad,), -1, dtype=torch.long), 0, 0, 0)
        entry_t, stored_t, slots_t, b = cols.tensor()
        safe = entry_t.clamp(min=0)
        picked = bt[b, (safe // epb).clamp(max=bt.shape[1] - 1)] * epb + safe % epb
        return (torch.where(entry_t >= 0, picked, -1), stored_t.bool(), slots_t)

    def _entry_rows_host(self, host: list[tuple[int, ...]], pad: int, epb: int, bt: torch.Tensor):
        """`_entry_rows` from host ints (three tensors made, not a dozen ops): each row's entry
        mapped through the block table, -1 where it closes none; `pad` rows of nothing after."""
        if self._bt_rows is None or self._bt_rows[0] is not bt:
            self._bt_rows = (bt, bt.tolist())
        table, last = self._bt_rows[1], bt.shape[1] - 1
        entries = [-1 if e < 0 else table[b][min(e // epb, last)] * epb + e % epb for e, _, _, b in host]
        return (
            torch.tensor(entries + [-1] * pad, dtype=torch.long),
            torch.tensor([bool(st) for _, st, _, _ in host] + [False] * pad, dtype=torch.bool),
            torch.tensor([sl for _, _, sl, _ in host] + [0] * pad, dtype=torch.long),
        )

    def _open_keep(self, rows: LayerRows) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, seam rows) of the sequences whose last token leaves a ratio-2 group open."""
        slots, seam_rows = [], []
        for part in rows.parts:
            if part.seg.end_pos % 2 == 1:
                slots.append(part.seg.inp.state.slot)
                seam_rows.append(part.s1 - 1)
        return torch.tensor(slots, dtype=torch.long), torch.tensor(seam_rows, dtype=torch.long)


# ============================================================================ one H2D copy
class HostPack:
    """Host tensors -> one byte buffer -> one host-to-device copy -> views on the device.

    On CUDA the buffer is pinned (the copy is asynchronous) and two are used in turn; before
    one is refilled, the copy that last read it has finished (an event). On a CPU device the
    pack itself is the step's buffer (a fresh one per step)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._events: list[object] = [None, None]
        self._turn = 0
        self._pads = [torch.zeros(n, dtype=torch.uint8) for n in range(ALIGN)]

    def upload(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
        """-> (device buffer, the tensors as views of it, the byte offset of each). A tensor
        listed twice (the same object) is moved once and its views are shared."""
        pieces, offsets, off, seen = [], [], 0, {}
        for t in tensors:
            at = seen.get(id(t))
            if at is not None:
                offsets.append(at)
                continue
            b = t.reshape(-1).view(torch.uint8) if t.is_contiguous() else t.contiguous().reshape(-1).view(torch.uint8)
            seen[id(t)] = off
            offsets.append(off)
            pieces.append(b)
            n = b.shape[0]
            pad = -n % ALIGN
            if pad:
                pieces.append(self._pads[pad])
            off += n + pad
        if self.device.type == "cuda":
            k = self._turn
            self._turn ^= 1
            if self._events[k] is not None:
                self._events[k].synchronize()
            if self._pinned[k] is None or self._pinned[k].shape[0] < off:
                self._pinned[k] = torch.empty(max(off, 1 << 20) * 2, dtype=torch.uint8, pin_memory=True)
            host = self._pinned[k][:off]
            torch.cat(pieces, out=host)
            buf = torch.empty(off, dtype=torch.uint8, device=self.device)
            buf.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._events[k] = event
        else:
            buf = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8)
            buf = buf.to(self.device)
        return buf, views(buf, tensors, offsets), offsets


def views(buf: torch.Tensor, like: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Tensors shaped and typed as `like`, viewing `buf` at `offsets`."""
    out, made = [], {}
    for t, off in zip(like, offsets, strict=True):
        v = made.get(off)
        if v is None or v.dtype != t.dtype or v.shape != t.shape:
            n = t.numel() * t.element_size()
            v = made[off] = buf[off : off + n].view(t.dtype).view(t.shape)
        out.append(v)
    return out
