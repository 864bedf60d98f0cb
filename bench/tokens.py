"""Synthetic token ids: deterministic streams, prompts made of segments, chained 64-token block ids.

A stream is an endless sequence of token ids named by a 64-bit key; token p of stream k is a
counter-based hash of (k, p) mapped into [vocab_lo, vocab_hi). A prompt is a tuple of segments,
each the first `num_tokens` of one stream, so two prompts share a prefix exactly when their
segments agree up to that point. Nothing is tokenized or downloaded: ids are synthetic.

Blocks are the 64-token units of the AgentX traces; block i covers prompt positions
[64 i, 64 i + 64) and its id chains the previous block's id with the (stream, offset, count)
pieces it holds, so equal ids mean equal prefixes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

BLOCK_TOKENS = 64
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def mix64(x: int) -> int:
    """splitmix64 finaliser on a Python int (bijective on 64 bits)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_key(*parts: int) -> int:
    """A 64-bit key from a sequence of non-negative ints (seed, tree id, tags, ...)."""
    key = _GOLDEN64
    for part in parts:
        if part < 0:
            raise ValueError(f"key parts must be non-negative, got {part}")
        key = mix64(key ^ mix64(part + _GOLDEN64))
    return key


def _mix64_array(x: np.ndarray) -> np.ndarray:
    # uint64 arithmetic wraps modulo 2**64, which is what splitmix64 wants
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True, slots=True)
class Segment:
    """The first `num_tokens` tokens of stream `stream_key`."""

    stream_key: int
    num_tokens: int


def shared_prefix_tokens(a: Sequence[Segment], b: Sequence[Segment]) -> int:
    """Length of the common token prefix of two segment lists (streams never collide)."""
    shared = 0
    for seg_a, seg_b in zip(a, b, strict=False):
        if seg_a.stream_key != seg_b.stream_key:
            return shared
        shared += min(seg_a.num_tokens, seg_b.num_tokens)
        if seg_a.num_tokens != seg_b.num_tokens:
            return shared
    return shared


@dataclass(frozen=True)
class TokenSpace:
    """Maps segments to synthetic token ids in [vocab_lo, vocab_hi)."""

    vocab_lo: int = 1000
    vocab_hi: int = 128_000
    block_tokens: int = BLOCK_TOKENS

    def __post_init__(self) -> None:
        if not 0 <= self.vocab_lo < self.vocab_hi:
            raise ValueError(f"need 0 <= vocab_lo < vocab_hi, got {self.vocab_lo}, {self.vocab_hi}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")

    def stream_ids(self, stream_key: int, start: int, num_tokens: int) -> np.ndarray:
        positions = np.arange(start, start + num_tokens, dtype=np.uint64)  # [n]
        hashed = _mix64_array(positions * np.uint64(_GOLDEN64) + np.uint64(mix64(stream_key)))
        span = np.uint64(self.vocab_hi - self.vocab_lo)
        return (hashed % span).astype(np.int64) + self.vocab_lo  # [n]

    def prompt_array(self, segments: Sequence[Segment]) -> np.ndarray:
        return self.prompt_slice(segments, 0, sum(s.num_tokens for s in segments))

    def prompt_slice(self, segments: Sequence[Segment], start: int, stop: int) -> np.ndarray:
        """Ids at prompt positions [start, stop)."""
        parts, offset = [], 0
        for seg in segments:
            lo, hi = max(start, offset), min(stop, offset + seg.num_tokens)
            if lo < hi:
                parts.append(self.stream_ids(seg.stream_key, lo - offset, hi - lo))
            offset += seg.num_tokens
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def prompt_ids(self, segments: Sequence[Segment]) -> list[int]:
        return self.prompt_array(segments).tolist()

    def block_ids(self, segments: Sequence[Segment]) -> list[int]:
        """Chained ids of the prompt's blocks (the last one may be partial)."""
        ids, parent = [], _GOLDEN64
        for pieces in _block_pieces(segments, self.block_tokens):
            content = derive_key(*(v for piece in pieces for v in piece))
            parent = mix64(parent ^ content)
            ids.append(parent)
        return ids


def _block_pieces(segments: Sequence[Segment], block_tokens: int) -> Iterator[list[tuple[int, int, int]]]:
    """Per block, the (stream_key, offset, count) pieces it is made of."""
    pieces: list[tuple[int, int, int]] = []
    room = block_tokens
    for seg in segments:
        offset = 0
        while offset < seg.num_tokens:
            count = min(room, seg.num_tokens - offset)
            pieces.append((seg.stream_key, offset, count))
            offset += count
            room -= count
            if room == 0:
                yield pieces
                pieces, room = [], block_tokens
    if pieces:
        yield pieces
