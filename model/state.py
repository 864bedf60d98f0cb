"""Per-sequence model state: the interface the forward reads and writes, and a dense reference.

The forward (model/model.py) touches a sequence's state only through `SeqState`. The engine
implements the same interface over paged, packed uint8 pools (288 B NVFP4 main entries, 68 B
MXFP4 index keys, 528 B FP8 window records); `DenseSeqState` keeps plain tensors. Values crossing
the interface are already fake-quantised (§6.2), in the model's compute dtype, so a packed
implementation stores them losslessly.

Groups (model_spec §11.5, architecture "KV layout"):

    group         key          content                                     scope
    window        layer        KV of the last W-1 positions [n, head_dim]   private
    open group    ratio-2 src  FP32 (a, g) of a lone group-opening token    private
    entries       kv source    compressed KV [N, head_dim] + index keys     global (P -> D,
                               [N, index_head_dim], all positions            prefix-cached)
    history       -            last 3 token ids (Engram), tokens processed  global

Interface:

    num_tokens                          positions [0, num_tokens) are in the state
    lookback_ids()                      up to the last 3 token ids, oldest first
    record_tokens(num_tokens, ids)      after a forward: new count and lookback ids
    window(layer) -> Window             stored window positions [start_pos, start_pos + n)
    append_window(layer, start, kv)     contiguous append (start == window end); keeps last W-1
    clip_window(layer, start)           drop the window; it restarts empty at `start` (replay)
    open_group(src) / set_open_group(src, group | None)
    num_entries(src) / entries(src) -> Entries / append_entries(src, first, kv, keys)
    global_state() -> GlobalKV          exactly the global groups (what prefill ships to decode)
    load_global_state(GlobalKV)         replaces everything; windows become unset and the open
                                        rows empty until a bounded replay rebuilds them

Speculative verify (engine/speculative.py): a verify forward writes rows for drafts that may
be rejected. `begin_speculation(rows)` marks the state before such a forward (it will append
at most `rows` rows); `note_group_rows` (called by the forward's ratio-2 compressor) keeps the
FP32 (a, g) of every row appended after the mark; `truncate(n, lookback)` then keeps exactly
the first n tokens: windows, entries and index keys, open-group rows and the token books equal
those of a state that only ever saw those n tokens. States that cannot roll back raise.

All methods are strict: out-of-order appends and reads of unset windows raise `StateError`.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from flashpd.kernels.compressor.ref import OpenGroup
from flashpd.model.config import ModelConfig

LOOKBACK_TOKENS = 3  # Engram looks back engram_max_ngram_size - 1 = 3 tokens

__all__ = [
    "DenseSeqState",
    "SpecMark",
    "Speculative",
    "TokenCounter",
    "Entries",
    "GlobalKV",
    "OpenGroup",
    "SeqState",
    "StateError",
    "Window",
]


class StateError(RuntimeError):
    """A state access that would silently corrupt the sequence (order, gaps, missing rows)."""


@dataclass(frozen=True)
class Window:
    start_pos: int
    kv: torch.Tensor  # [n, head_dim], positions start_pos .. start_pos + n - 1

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.kv.shape[0]


@dataclass(frozen=True)
class Entries:
    kv: torch.Tensor  # [N, head_dim]: RoPE'd, NVFP4 fake-quantised compressed KV
    keys: torch.Tensor  # [N, index_head_dim]: RoPE'd, MXFP4 fake-quantised index keys

    def __post_init__(self) -> None:
        if self.kv.shape[0] != self.keys.shape[0]:
            raise StateError(f"{self.kv.shape[0]} entries but {self.keys.shape[0]} index keys")

    @property
    def num_entries(self) -> int:
        return self.kv.shape[0]


@dataclass(frozen=True)
class GlobalKV:
    """The global (transferable, prefix-cacheable) part of a sequence's state."""

    num_tokens: int
    lookback_ids: tuple[int, ...]
    entries: Mapping[int, Entries]  # kv source layer -> its entries


@dataclass
class SpecMark:
    """What `begin_speculation` keeps: the books at the mark and the rows the verify appends."""

    num_tokens: int
    max_rows: int
    saved: object  # the implementation's own snapshot (windows, open rows, entry counts)
    group_rows: dict[tuple[int, int], OpenGroup] = field(default_factory=dict)  # (src, pos)

    def check_truncate(self, num_tokens: int, held: int) -> None:
        if not self.num_tokens <= num_tokens <= held:
            raise StateError(
                f"truncate to {num_tokens} tokens outside [{self.num_tokens}, "
                f"{held}] (speculation began at {self.num_tokens})"
            )
        if held - self.num_tokens > self.max_rows:
            raise StateError(
                f"{held - self.num_tokens} rows appended since the mark, at most {self.max_rows} announced"
            )

    def open_row_at(self, src: int, num_tokens: int) -> OpenGroup | None:
        """The open row of a ratio-2 source for a state of `num_tokens` tokens, when its last
        token is a row appended after the mark (else None: the caller restores its own)."""
        if num_tokens % 2 == 0 or num_tokens - 1 < self.num_tokens:
            return None
        row = self.group_rows.get((src, num_tokens - 1))
        if row is None:
            raise StateError(f"source {src}: no (a, g) noted for position {num_tokens - 1}")
        return row


class Speculative:
    """The default speculation hooks of a `SeqState`: none (a verify cannot roll back)."""

    _spec: SpecMark | None = None

    @property
    def speculating(self) -> bool:
        """Between `begin_speculation` and `truncate`."""
        return self._spec is not None

    def begin_speculation(self, max_rows: int) -> None:
        raise StateError(f"{type(self).__name__} cannot roll back a speculative verify")

    def note_group_rows(
        self, src: int, first_pos: int, kv32: torch.Tensor, gate32: torch.Tensor, owned: bool = False
    ) -> None:
        """The ratio-2 compressor's FP32 (a, g) rows [n, c] of positions first_pos ...; kept
        only while speculating (rows at or after the mark). The rows are copied once per call
        (one copy of each tensor, not one per row: on a GPU each copy is a launch); owned: the
        caller's tensors are already private copies, kept as they are."""
        mark = self._spec
        if mark is None:
            return
        first = max(0, mark.num_tokens - first_pos)
        if first >= kv32.shape[0]:
            return
        kv, gate = kv32[first:], gate32[first:]
        if not owned:
            kv, gate = kv.clone(), gate.clone()
        for i in range(kv.shape[0]):
            mark.group_rows[(src, first_pos + first + i)] = OpenGroup(kv[i], gate[i])

    def truncate(self, num_tokens: int, lookback_ids: Sequence[int]) -> None:
        raise StateError(f"{type(self).__name__} cannot roll back a speculative verify")


class SeqState(Speculative, abc.ABC):
    """See the module docstring for the contract of each method."""

    @property
    @abc.abstractmethod
    def num_tokens(self) -> int: ...

    @abc.abstractmethod
    def lookback_ids(self) -> tuple[int, ...]: ...

    @abc.abstractmethod
    def record_tokens(self, num_tokens: int, lookback_ids: Sequence[int]) -> None: ...

    @abc.abstractmethod
    def window(self, layer: int) -> Window: ...

    @abc.abstractmethod
    def append_window(self, layer: int, start_pos: int, kv: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def clip_window(self, layer: int, start_pos: int) -> None: ...

    @abc.abstractmethod
    def open_group(self, src: int) -> OpenGroup | None: ...

    @abc.abstractmethod
    def set_open_group(self, src: int, group: OpenGroup | None) -> None: ...

    @abc.abstractmethod
    def num_entries(self, src: int) -> int: ...

    @abc.abstractmethod
    def entries(self, src: int) -> Entries: ...

    @abc.abstractmethod
    def append_entries(self, src: int, first_entry: int, kv: torch.Tensor, keys: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def global_state(self) -> GlobalKV: ...

    @abc.abstractmethod
    def load_global_state(self, state: GlobalKV) -> None: ...


class TokenCounter:
    """The token count and Engram lookback ids every `SeqState` keeps (shared implementation)."""

    _num_tokens: int = 0
    _lookback: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def lookback_ids(self) -> tuple[int, ...]:
        return self._lookback

    def record_tokens(self, num_tokens: int, lookback_ids: Sequence[int]) -> None:
        if num_tokens < self._num_tokens:
            raise StateError(f"token count would go back from {self._num_tokens} to {num_tokens}")
        self._set_tokens(num_tokens, lookback_ids)

    def _set_tokens(self, num_tokens: int, lookback_ids: Sequence[int]) -> None:
        ids = tuple(map(int, lookback_ids[-LOOKBACK_TOKENS:]))
        if len(ids) != min(LOOKBACK_TOKENS, num_tokens):
            raise StateError(f"{len(ids)} lookback ids for {num_tokens} tokens")
        self._num_tokens, self._lookback = num_tokens, ids


class DenseSeqState(TokenCounter, SeqState):
    """Reference state: plain tensors in the compute dtype (FP32 open-group rows)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self._keep_positions = cfg.sliding_window - 1
        self._ratios = {s: cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids}
        self._num_tokens = 0
        self._lookback: tuple[int, ...] = ()
        self._windows: dict[int, Window | None] = {
            layer: Window(0, self._empty(cfg.head_dim)) for layer in range(cfg.num_layers)
        }
        self._open: dict[int, OpenGroup | None] = {s: None for s, r in self._ratios.items() if r > 1}
        self._entries: dict[int, Entries] = {s: self._no_entries() for s in self._ratios}

    # ------------------------------------------------------------------ windows
    def window(self, layer: int) -> Window:
        win = self._windows[layer]
        if win is None:
            raise StateError(
                f"window of layer {layer} is unset (global state loaded without a replay); run a bounded replay first"
            )
        return win

    def append_window(self, layer: int, start_pos: int, kv: torch.Tensor) -> None:
        win = self.window(layer)
        if start_pos != win.end_pos:
            raise StateError(f"layer {layer}: window append at {start_pos}, window ends at {win.end_pos}")
        joined = torch.cat((win.kv, kv.to(self.device, self.dtype)), dim=0)
        drop = max(0, joined.shape[0] - self._keep_positions)
        self._windows[layer] = Window(win.start_pos + drop, joined[drop:])

    def clip_window(self, layer: int, start_pos: int) -> None:
        self._windows[layer] = Window(start_pos, self._empty(self.cfg.head_dim))

    # ------------------------------------------------------------------ open groups
    def open_group(self, src: int) -> OpenGroup | None:
        self._check_ratio2(src)
        return self._open[src]

    def set_open_group(self, src: int, group: OpenGroup | None) -> None:
        self._check_ratio2(src)
        self._open[src] = group

    # ------------------------------------------------------------------ global entries
    def num_entries(self, src: int) -> int:
        return self._entries_of(src).num_entries

    def entries(self, src: int) -> Entries:
        return self._entries_of(src)

    def append_entries(self, src: int, first_entry: int, kv: torch.Tensor, keys: torch.Tensor) -> None:
        old = self._entries_of(src)
        if first_entry != old.num_entries:
            raise StateError(f"source {src}: entries appended at {first_entry}, {old.num_entries} stored")
        self._entries[src] = Entries(
            torch.cat((old.kv, kv.to(self.device, self.dtype))), torch.cat((old.keys, keys.to(self.device, self.dtype)))
        )

    def global_state(self) -> GlobalKV:
        return GlobalKV(
            num_tokens=self._num_tokens,
            lookback_ids=self._lookback,
            entries={s: Entries(e.kv.clone(), e.keys.clone()) for s, e in self._entries.items()},
        )

    def load_global_state(self, state: GlobalKV) -> None:
        if set(state.entries) != set(self._ratios):
            raise StateError(f"global state has sources {sorted(state.entries)}, config has {sorted(self._ratios)}")
        for src, ent in state.entries.items():
            want = state.num_tokens // self._ratios[src]
            if ent.num_entries != want:
                raise StateError(
                    f"source {src}: {ent.num_entries} entries for {state.num_tokens} tokens, expected {want}"
                )
        self._entries = {
            s: Entries(e.kv.to(self.device, self.dtype).clone(), e.keys.to(self.device, self.dtype).clone())
            for s, e in state.entries.items()
        }
        self._windows = {layer: None for layer in self._windows}
        self._open = {s: None for s in self._open}
        self._num_tokens = 0
        self.record_tokens(state.num_tokens, state.lookback_ids)

    # ------------------------------------------------------------------ speculation
    def begin_speculation(self, max_rows: int) -> None:
        if max_rows > self._keep_positions:
            raise StateError(f"a verify of {max_rows} rows exceeds the window ({self._keep_positions})")
        # the tensors are never modified in place (appends build new ones): references suffice
        saved = (dict(self._windows), dict(self._open), None)
        self._spec = SpecMark(self._num_tokens, max_rows, saved)

    def truncate(self, num_tokens: int, lookback_ids: Sequence[int]) -> None:
        mark = self._spec
        if mark is None:
            raise StateError("truncate without begin_speculation")
        mark.check_truncate(num_tokens, self._num_tokens)
        windows, opens, _ = mark.saved
        for layer, saved in windows.items():
            if saved is None:
                raise StateError(f"window of layer {layer} was unset at the mark")
            cur = self.window(layer)
            if cur.start_pos > mark.num_tokens:
                raise StateError(f"layer {layer}: window lost rows since the mark")
            kept = cur.kv[mark.num_tokens - cur.start_pos : num_tokens - cur.start_pos]
            self._windows[layer] = saved
            self.append_window(layer, mark.num_tokens, kept)
        for src, ratio in self._ratios.items():
            keep = num_tokens // ratio
            ent = self._entries[src]
            self._entries[src] = Entries(ent.kv[:keep], ent.keys[:keep])
        for src in self._open:
            row = mark.open_row_at(src, num_tokens)  # None: even count, or the mark's own row
            self._open[src] = None if num_tokens % 2 == 0 else row if row is not None else opens[src]
        self._spec = None
        self._set_tokens(num_tokens, lookback_ids)

    # ------------------------------------------------------------------ helpers
    def _empty(self, width: int) -> torch.Tensor:
        return torch.zeros(0, width, dtype=self.dtype, device=self.device)

    def _no_entries(self) -> Entries:
        return Entries(self._empty(self.cfg.head_dim), self._empty(self.cfg.index_head_dim))

    def _entries_of(self, src: int) -> Entries:
        if src not in self._entries:
            raise StateError(f"layer {src} is not a kv source")
        return self._entries[src]

    def _check_ratio2(self, src: int) -> None:
        if src not in self._open:
            raise StateError(f"layer {src} is not a ratio-2 kv source")
