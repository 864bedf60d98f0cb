"""Packed KV pools in the real byte formats, and the paged `SeqState` the forward runs on.

Global groups (prefix-cacheable, transferable), one pair per KV source s with ratio r:

    main[s]  uint8 [num_blocks, 128 // r, compressed_entry_bytes]   NVFP4: 256 B codes + 32 B E4M3
    index[s] uint8 [num_blocks, 128 // r, index_entry_bytes]        MXFP4:  64 B codes +  4 B UE8M0

A block is one 128-token chunk of every global group; entry e of source s lives in block
`block_table[e // (128 // r)]`, row `e % (128 // r)`.

Private groups (never cached or transferred), one slot per running sequence:

    window   uint8 [num_layers, num_slots * (W - 1) + scratch, window_record_bytes]
             FP8 + UE8M0; slot s's ring is rows [s * (W - 1), (s + 1) * (W - 1)) of each layer,
             position p at ring row p % (W - 1). The GPU forward writes a step's new window
             rows into the `scratch` rows after the rings (attention reads ring ∪ scratch
             through one row list), then keeps the last W - 1 of them in the ring.
    open     float32 [num_slots, num_ratio2_sources, 2, head_dim]       (a, g) of a lone token

The forward hands the state values that are already fake-quantised, so packing them is lossless:
power-of-two scales (FP8/UE8M0, MXFP4) re-derive an equivalent scale, and NVFP4 blocks whose
E4M3 scale would re-round differently (only below the E4M3 normal range) are re-encoded by
searching the scale that reproduces the values exactly (`_pack_nvfp4_exact`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashpd.engine.hashing import CHUNK_TOKENS
from flashpd.kernels.quant import ref as q
from flashpd.model.config import ModelConfig
from flashpd.model.kv_format import DEFAULT_KV_FORMAT, CompressedKVFormat, kv_format
from flashpd.model.state import Entries, GlobalKV, OpenGroup, SeqState, SpecMark, StateError, TokenCounter, Window


@dataclass(frozen=True)
class PoolGeometry:
    """Byte geometry of the pools, derived from the config (no runtime facts)."""

    cfg: ModelConfig
    chunk_tokens: int = CHUNK_TOKENS
    compressed_format: CompressedKVFormat | str = DEFAULT_KV_FORMAT  # resolved to the format object

    def __post_init__(self) -> None:
        object.__setattr__(self, "compressed_format", kv_format(self.compressed_format))

    @property
    def compressed_entry_bytes(self) -> int:
        return self.compressed_format.entry_bytes(self.cfg.head_dim)

    def entries_per_block(self, src: int) -> int:
        return self.chunk_tokens // self.cfg.compress_ratios[src]

    def group_block_bytes(self) -> dict[str, int]:
        """Transfer groups and the bytes one block holds in each."""
        out = {}
        for s in self.cfg.kv_source_layer_ids:
            out[f"main.L{s}"] = self.entries_per_block(s) * self.compressed_entry_bytes
            out[f"index.L{s}"] = self.entries_per_block(s) * self.cfg.index_entry_bytes
        return out

    @property
    def block_bytes(self) -> int:
        return sum(self.group_block_bytes().values())

    @property
    def slot_bytes(self) -> int:
        cfg = self.cfg
        window = cfg.num_layers * (cfg.sliding_window - 1) * cfg.window_record_bytes
        open_rows = len(self.ratio2_sources) * 2 * cfg.head_dim * 4
        return window + open_rows

    @property
    def ratio2_sources(self) -> tuple[int, ...]:
        return tuple(s for s in self.cfg.kv_source_layer_ids if self.cfg.compress_ratios[s] == 2)


class KVPools:
    """All packed KV memory of one worker (CPU or CUDA)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        num_slots: int,
        device: str | torch.device = "cpu",
        compressed_format: CompressedKVFormat | str = DEFAULT_KV_FORMAT,
        window_scratch_rows: int = 0,
    ):
        if window_scratch_rows < 0:
            raise ValueError(f"window_scratch_rows must be >= 0, got {window_scratch_rows}")
        self.geometry = PoolGeometry(cfg, compressed_format=compressed_format)
        self.format = self.geometry.compressed_format
        self.cfg, self.num_blocks, self.num_slots = cfg, num_blocks, num_slots
        u8 = dict(dtype=torch.uint8, device=device)
        self.main = {
            s: torch.zeros(num_blocks, self.geometry.entries_per_block(s), self.geometry.compressed_entry_bytes, **u8)
            for s in cfg.kv_source_layer_ids
        }
        self.index = {
            s: torch.zeros(num_blocks, self.geometry.entries_per_block(s), cfg.index_entry_bytes, **u8)
            for s in cfg.kv_source_layer_ids
        }
        self.ring_rows = cfg.sliding_window - 1
        self.scratch_base = num_slots * self.ring_rows  # first scratch row of every layer
        self.window = torch.zeros(
            cfg.num_layers, self.scratch_base + window_scratch_rows, cfg.window_record_bytes, **u8
        )
        r2 = self.geometry.ratio2_sources
        self.open_row_of = {s: i for i, s in enumerate(r2)}
        self.open = torch.zeros(num_slots, max(len(r2), 1), 2, cfg.head_dim, dtype=torch.float32, device=device)

    @classmethod
    def for_model(cls, model, num_blocks: int, num_slots: int, device: str | torch.device, max_rows: int) -> KVPools:
        """Pools in the model's KV format, with window scratch rows for `max_rows` rows per
        forward when the model stages new window records there (`Model.stages_window_kv`)."""
        return cls(model.cfg, num_blocks, num_slots, device, model.kv_format, max_rows if model.stages_window_kv else 0)

    def transfer_groups(self) -> dict[str, torch.Tensor]:
        """Each global group as a [num_blocks, block_bytes] uint8 view (what NIXL registers)."""
        out = {}
        for s in self.cfg.kv_source_layer_ids:
            out[f"main.L{s}"] = self.main[s].view(self.num_blocks, -1)
            out[f"index.L{s}"] = self.index[s].view(self.num_blocks, -1)
        return out

    @property
    def global_bytes(self) -> int:
        return sum(t.numel() for t in self.main.values()) + sum(t.numel() for t in self.index.values())

    @property
    def private_bytes(self) -> int:
        """Window rings and open-group rows of every slot (scratch rows excluded)."""
        return self.ring_bytes + self.open.numel() * 4

    @property
    def ring_bytes(self) -> int:
        return self.window.shape[0] * self.scratch_base * self.window.shape[2]


class PagedSeqState(TokenCounter, SeqState):
    """`SeqState` over `KVPools`: global entries in the sequence's blocks, private rows in its slot.

    `block_table` is the live list the KV cache manager grows; the runner passes the same list
    object each step, so blocks added later are seen here.
    """

    def __init__(self, pools: KVPools, slot: int, block_table: list[int], dtype: torch.dtype = torch.float32):
        self.pools, self.slot, self.block_table, self.dtype = pools, slot, block_table, dtype
        cfg = pools.cfg
        self._keep = cfg.sliding_window - 1
        self._num_tokens = 0
        self._lookback: tuple[int, ...] = ()
        # window books: one (first position, count) shared by every layer (`_common`, None:
        # unset) until a layer's span differs, then one per layer (`_per_layer`); the bulk
        # updates of a decode step touch the shared span once instead of once per layer
        self._num_layers = cfg.num_layers
        self._common: tuple[int, int] | None = (0, 0)
        self._per_layer: list[tuple[int, int] | None] | None = None
        self._open_set: dict[int, bool] = dict.fromkeys(pools.open_row_of, False)
        self._n_entries: dict[int, int] = dict.fromkeys(cfg.kv_source_layer_ids, 0)
        geo = pools.geometry
        self._sources = tuple((s, cfg.compress_ratios[s], geo.entries_per_block(s)) for s in cfg.kv_source_layer_ids)
        self._ratio_epb = {s: (r, epb) for s, r, epb in self._sources}

    def adopt_prefix(self, num_tokens: int, lookback_ids: Sequence[int]) -> None:
        """The first `num_tokens` tokens' global entries already sit in this sequence's blocks
        (a prefix-cache hit or a completed transfer): count them, leave windows unset until a
        bounded replay rebuilds them."""
        for s in self._n_entries:
            self._n_entries[s] = num_tokens // self.pools.cfg.compress_ratios[s]
            self._check_blocks(self._n_entries[s], s)
        self._common, self._per_layer = None, None
        self._open_set = dict.fromkeys(self._open_set, False)
        self._num_tokens = 0
        self.record_tokens(num_tokens, lookback_ids)

    def move_cursor(self, num_tokens: int, lookback_ids: Sequence[int]) -> None:
        """Point the token counter at the end of the next replay piece. A replay split across
        steps runs [a, b) while the blocks already hold global KV up to the replay end; entries
        stay as they are (queries only see entries their position allows)."""
        self._set_tokens(num_tokens, lookback_ids)

    # ------------------------------------------------------------------ windows
    def window(self, layer: int) -> Window:
        start, n = self.window_span(layer)
        if n == 0:
            return Window(
                start, torch.zeros(0, self.pools.cfg.head_dim, dtype=self.dtype, device=self.pools.window.device)
            )
        rows = self.slot * self._keep + torch.arange(start, start + n) % self._keep
        rec = self.pools.window[layer, rows.to(self.pools.window.device)]
        return Window(start, q.unpack_window_fp8(rec, self.dtype))

    def append_window(self, layer: int, start_pos: int, kv: torch.Tensor) -> None:
        start, held = self.window_span(layer)
        if start_pos != start + held:
            raise StateError(f"layer {layer}: window append at {start_pos}, window ends at {start + held}")
        total = kv.shape[0]
        kv = kv[-self._keep :]  # only the last W-1 positions can ever be read again
        first = start_pos + total - kv.shape[0]  # position of the first kept row
        rows = self.slot * self._keep + torch.arange(first, first + kv.shape[0]) % self._keep
        self.pools.window[layer, rows.to(self.pools.window.device)] = q.pack_window_fp8(kv.float()).to(
            self.pools.window.device
        )
        self.note_window_append(layer, start_pos, total)

    def window_span(self, layer: int) -> tuple[int, int]:
        """(first position, count) of the window records the ring holds for `layer`."""
        if not 0 <= layer < self._num_layers:
            raise StateError(f"no layer {layer}")
        span = self._common if self._per_layer is None else self._per_layer[layer]
        if span is None:
            raise StateError(f"window of layer {layer} is unset; run a bounded replay first")
        return span

    def common_window_span(self) -> tuple[int, int] | None:
        """The span every layer's window shares, or None (layers differ, or windows unset)."""
        return self._common if self._per_layer is None else None

    def note_window_append(self, layer: int, start_pos: int, count: int) -> None:
        """Book `count` new positions from `start_pos` whose records the caller has put in the
        ring (the last W - 1 of them). Checks continuity as `append_window` does."""
        self._set_span(layer, self._appended(layer, self.window_span(layer), start_pos, count))

    def clip_window(self, layer: int, start_pos: int) -> None:
        if not 0 <= layer < self._num_layers:
            raise StateError(f"no layer {layer}")
        self._set_span(layer, (start_pos, 0))

    def note_windows(self, layers: Sequence[int], start_pos: int, count: int, clip: bool = False) -> None:
        """`clip_window` (when `clip`) then `note_window_append` for each of `layers` (distinct):
        one update of the shared span when `layers` are all the layers and share it."""
        if self._per_layer is None and len(layers) == self._num_layers:
            span = (start_pos, 0) if clip else self._common
            if span is None:
                raise StateError("windows are unset; run a bounded replay first")
            self._common = self._appended(layers[0], span, start_pos, count)
            return
        for layer in layers:
            span = (start_pos, 0) if clip else self.window_span(layer)
            self._set_span(layer, self._appended(layer, span, start_pos, count))
        spans = self._per_layer
        if spans is not None and spans.count(spans[0]) == len(spans):
            self._common, self._per_layer = spans[0], None

    def _appended(self, layer: int, span: tuple[int, int], start_pos: int, count: int) -> tuple[int, int]:
        start, held = span
        if start_pos != start + held:
            raise StateError(f"layer {layer}: window append at {start_pos}, window ends at {start + held}")
        new_end = start_pos + count
        new_start = max(start, new_end - self._keep)
        return new_start, new_end - new_start

    def _set_span(self, layer: int, span: tuple[int, int]) -> None:
        if self._per_layer is None:
            if span == self._common:
                return
            self._per_layer = [self._common] * self._num_layers
        self._per_layer[layer] = span

    # ------------------------------------------------------------------ open groups
    def open_group(self, src: int) -> OpenGroup | None:
        row = self._open_row(src)
        if not self._open_set[src]:
            return None
        kv, gate = self.pools.open[self.slot, row]
        return OpenGroup(kv.clone(), gate.clone())

    def set_open_group(self, src: int, group: OpenGroup | None) -> None:
        row = self._open_row(src)
        self._open_set[src] = group is not None
        if group is not None:
            self.pools.open[self.slot, row, 0] = group.kv.float().reshape(-1)
            self.pools.open[self.slot, row, 1] = group.gate.float().reshape(-1)

    def has_open_group(self, src: int) -> bool:
        self._open_row(src)
        return self._open_set[src]

    def mark_open_group(self, src: int, present: bool) -> None:
        """Book whether `src`'s open row (written into the pool by the caller) is live."""
        self._open_row(src)
        self._open_set[src] = present

    # ------------------------------------------------------------------ global entries
    def num_entries(self, src: int) -> int:
        return self._n_entries[self._src(src)]

    def entries(self, src: int) -> Entries:
        n = self._n_entries[self._src(src)]
        if n == 0:
            cfg = self.pools.cfg
            dev = self.pools.window.device
            return Entries(
                torch.zeros(0, cfg.head_dim, dtype=self.dtype, device=dev),
                torch.zeros(0, cfg.index_head_dim, dtype=self.dtype, device=dev),
            )
        main = self._gather(self.pools.main[src], src, n)
        keys = self._gather(self.pools.index[src], src, n)
        unpack = getattr(q, self.pools.format.unpack)
        return Entries(unpack(main, self.dtype), q.unpack_mxfp4(keys, self.dtype))

    def append_entries(self, src: int, first_entry: int, kv: torch.Tensor, keys: torch.Tensor) -> None:
        n = self._n_entries[self._src(src)]
        if first_entry != n:
            raise StateError(f"source {src}: entries appended at {first_entry}, {n} stored")
        count = kv.shape[0]
        if count == 0:
            return
        blocks, rows = self._locate(src, n, n + count)
        pack = _pack_nvfp4_exact if self.pools.format.name == "nvfp4" else q.pack_window_fp8
        self.pools.main[src][blocks, rows] = pack(kv.float()).to(blocks.device)
        self.pools.index[src][blocks, rows] = q.pack_mxfp4(keys.float()).to(blocks.device)
        self._n_entries[src] = n + count

    def check_blocks(self, src: int, num_entries: int) -> None:
        """Raise unless the block table holds room for `num_entries` entries of `src`."""
        self._check_blocks(num_entries, self._src(src))

    def note_entries(self, src: int, first_entry: int, count: int) -> None:
        """Book `count` entries from `first_entry` that the caller has written into the pools."""
        n = self._n_entries[self._src(src)]
        if first_entry != n:
            raise StateError(f"source {src}: entries appended at {first_entry}, {n} stored")
        self._check_blocks(n + count, src)
        self._n_entries[src] = n + count

    def visible_entries(self, start_pos: int, end_pos: int, replay: bool) -> list[int]:
        """Entries of each kv source (config order) a step over [start_pos, end_pos) sees by its
        end (end_pos // ratio), checked: a normal step finds start_pos // ratio of them held and
        each ratio-2 source's open row live exactly when start_pos is odd, a replay at least all
        of them; the block table holds room for them."""
        out, blocks = [], len(self.block_table)
        for src, ratio, epb in self._sources:
            held, visible = self._n_entries[src], end_pos // ratio
            if replay:
                if held < visible:
                    raise StateError(f"replay: source {src} holds {held} entries, needs {visible}")
            else:
                if held != start_pos // ratio:
                    raise StateError(f"source {src}: {held} entries at position {start_pos}")
                if ratio == 2 and self._open_set[src] != (start_pos % 2 == 1):
                    raise StateError(
                        f"source {src}: open-group row "
                        f"{'present' if self._open_set[src] else 'missing'} at "
                        f"position {start_pos}"
                    )
            if -(-visible // epb) > blocks:
                self._check_blocks(visible, src)
            out.append(visible)
        return out

    def note_step_entries(
        self, start_pos: int, end_pos: int, sources: Sequence[int], open_sources: Sequence[int]
    ) -> None:
        """After a step over [start_pos, end_pos) that wrote the entries of `sources` (and, for
        `open_sources`, the open row when end_pos is odd): `note_entries` + `mark_open_group`
        for each, in one call."""
        blocks = len(self.block_table)
        for src in sources:
            ratio, epb = self._ratio_epb[self._src(src)]
            n, end = self._n_entries[src], end_pos // ratio
            if n != start_pos // ratio:
                raise StateError(f"source {src}: entries appended at {start_pos // ratio}, {n} stored")
            if -(-end // epb) > blocks:
                self._check_blocks(end, src)
            self._n_entries[src] = end
        for src in open_sources:
            self._open_row(src)
            self._open_set[src] = end_pos % 2 == 1

    # ------------------------------------------------------------------ speculation
    def begin_speculation(self, max_rows: int) -> None:
        """Mark the books and save the ring rows the verify's `max_rows` rows will overwrite
        (positions N .. N+max_rows-1 reuse the ring rows of positions N-W+1 ..)."""
        if not 0 < max_rows <= self._keep:
            raise StateError(f"a verify of {max_rows} rows: need 1 .. {self._keep}")
        n = self._num_tokens
        rows = self._ring_rows(n, n + max_rows)
        saved = (
            self._common,
            None if self._per_layer is None else list(self._per_layer),
            rows,
            self.pools.window[:, rows],  # advanced indexing: already a copy
            self.pools.open[self.slot].clone(),
            dict(self._open_set),
        )
        self._spec = SpecMark(n, max_rows, saved)

    def truncate(self, num_tokens: int, lookback_ids: Sequence[int]) -> None:
        mark = self._spec
        if mark is None:
            raise StateError("truncate without begin_speculation")
        mark.check_truncate(num_tokens, self._num_tokens)
        common, per_layer, rows, records, open_rows, open_set = mark.saved
        start = mark.num_tokens
        lost = rows[num_tokens - start :]  # rows of rejected positions: put the older ones back
        self.pools.window[:, lost] = records[:, num_tokens - start :]
        self._common, self._per_layer = common, per_layer
        if common is None and per_layer is None:
            raise StateError("windows were unset at the mark")
        self.note_windows(range(self._num_layers), start, num_tokens - start)
        self.pools.open[self.slot] = open_rows
        for src in self._open_set:
            row = mark.open_row_at(src, num_tokens)
            self._open_set[src] = open_set[src] if num_tokens == start else num_tokens % 2 == 1
            if row is not None:
                self.set_open_group(src, row)
        for src, ratio, _ in self._sources:
            self._n_entries[src] = num_tokens // ratio
        self._spec = None
        self._set_tokens(num_tokens, lookback_ids)

    def _ring_rows(self, first: int, end: int) -> torch.Tensor:
        base, keep = self.slot * self._keep, self._keep  # host ints, one copy to the device
        return torch.tensor([base + p % keep for p in range(first, end)], device=self.pools.window.device)

    def global_state(self) -> GlobalKV:
        return GlobalKV(self._num_tokens, self._lookback, {s: self.entries(s) for s in self._n_entries})

    def load_global_state(self, state: GlobalKV) -> None:
        if set(state.entries) != set(self._n_entries):
            raise StateError(f"global state has sources {sorted(state.entries)}, config has {sorted(self._n_entries)}")
        self._n_entries = dict.fromkeys(self._n_entries, 0)
        for s, ent in state.entries.items():
            self.append_entries(s, 0, ent.kv, ent.keys)
        self.adopt_prefix(state.num_tokens, state.lookback_ids)

    # ------------------------------------------------------------------ helpers
    def _src(self, src: int) -> int:
        if src not in self._n_entries:
            raise StateError(f"layer {src} is not a kv source")
        return src

    def _open_row(self, src: int) -> int:
        if src not in self.pools.open_row_of:
            raise StateError(f"layer {src} is not a ratio-2 kv source")
        return self.pools.open_row_of[src]

    def _locate(self, src: int, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, rows) of entries [first, end) of `src`."""
        self._check_blocks(end, src)
        epb = self.pools.geometry.entries_per_block(src)
        e = torch.arange(first, end)
        table = torch.tensor(self.block_table, dtype=torch.long)
        device = self.pools.main[src].device
        return table[e // epb].to(device), (e % epb).to(device)

    def _gather(self, pool: torch.Tensor, src: int, n: int) -> torch.Tensor:
        if n == 0:
            return pool.new_zeros(0, pool.shape[-1])
        blocks, rows = self._locate(src, 0, n)
        return pool[blocks, rows]

    def _check_blocks(self, num_entries: int, src: int) -> None:
        need = -(-num_entries // self.pools.geometry.entries_per_block(src))
        if need > len(self.block_table):
            raise StateError(
                f"source {src}: {num_entries} entries need {need} blocks, the block table has {len(self.block_table)}"
            )


def _pack_nvfp4_exact(x: torch.Tensor) -> torch.Tensor:
    """Pack NVFP4-fake-quantised values so that unpacking reproduces them bit for bit."""
    rec = q.pack_nvfp4(x)
    if x.numel() == 0 or torch.equal(q.unpack_nvfp4(rec, torch.float32), x):
        return rec
    return _repack_nvfp4_searching_scales(x, rec)


def _repack_nvfp4_searching_scales(x: torch.Tensor, rec: torch.Tensor) -> torch.Tensor:
    """Re-encode blocks whose recomputed E4M3 scale differs from the one that produced them:
    take, per 16-channel block, the smallest E4M3 scale under which every value is an E2M1 code."""
    d = x.shape[-1]
    blocks = x.reshape(-1, d // 16, 16)  # [N, nb, 16]
    scales = q.e4m3_decode(torch.arange(1, 127, dtype=torch.uint8))  # positive finite E4M3
    codes_ok = q.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    ratio = blocks.unsqueeze(-1) / scales  # [N, nb, 16, S]
    exact = (ratio.unsqueeze(-1) == codes_ok).any(-1).all(-2)  # [N, nb, S]
    if not bool(exact.any(-1).all()):
        raise StateError("values are not NVFP4 fake-quantised; cannot pack them losslessly")
    best = scales[exact.float().argmax(-1)]  # [N, nb], smallest scale that is exact
    codes = q.e2m1_encode(blocks / best.unsqueeze(-1)).reshape(*x.shape[:-1], d)
    packed = q.pack_nibbles(codes)
    scale_bytes = q.e4m3_encode(best).reshape(*x.shape[:-1], d // 16)
    return torch.cat((packed, scale_bytes), dim=-1)
