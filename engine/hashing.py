"""Chained chunk hashes: the one prefix-cache key, shared by the engines and the Redis prefix index.

    namespace ──H──> h_-1 ──H(h_-1 || ids of chunk 0)──> h_0 ──H(h_0 || ids of chunk 1)──> h_1 ...

- H = blake2b with a 16-byte digest; a hash is carried as 32 lowercase hex characters, but the
  chain feeds the raw 16 digest bytes of the parent into the next hash.
- Token ids are packed as unsigned 32-bit little-endian integers (`<I`), so hashes are stable
  across processes, hosts and Python versions (Python's `hash()` is salted per process).
- namespace = model id + cache salt (`namespace_for`), so different models or tenants never
  share a chunk, and only FULL chunks are hashed: a partial tail has no hash.

A prefix hit counts in whole chunks and must leave the replay tail (the last `replay_tokens`
hit tokens are recomputed to rebuild the private window state), hence `usable_prefix_tokens`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

CHUNK_TOKENS = 128  # the prefix-cache and transfer unit of the real model
REPLAY_TOKENS = 128  # the sliding window rebuilt by bounded replay
DIGEST_BYTES = 16


def namespace_for(model_id: str, salt: str = "") -> str:
    if not model_id:
        raise ValueError("model_id must be a non-empty string")
    return f"{model_id}|{salt}"


def root_hash(namespace: str) -> str:
    """h_-1 = H(namespace): the parent of chunk 0."""
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be str, got {type(namespace).__name__}")
    return hashlib.blake2b(namespace.encode("utf-8"), digest_size=DIGEST_BYTES).hexdigest()


def next_chunk_hash(parent_hash: str, chunk_token_ids: Sequence[int]) -> str:
    """h_i = H(h_{i-1} || token ids of chunk i), ids packed as little-endian uint32."""
    try:
        packed = struct.pack(f"<{len(chunk_token_ids)}I", *chunk_token_ids)
    except struct.error as error:  # negative, >= 2**32, or not an int
        raise ValueError(f"token ids must be uint32: {error}") from None
    return hashlib.blake2b(bytes.fromhex(parent_hash) + packed, digest_size=DIGEST_BYTES).hexdigest()


def chunk_hashes(token_ids: Sequence[int], namespace: str, chunk_tokens: int = CHUNK_TOKENS) -> list[str]:
    """Chained hashes of every full chunk of `token_ids` (len = len(token_ids) // chunk_tokens)."""
    _check_chunk_tokens(chunk_tokens)
    hashes = []
    parent = root_hash(namespace)
    for begin in range(0, len(token_ids) - chunk_tokens + 1, chunk_tokens):
        parent = next_chunk_hash(parent, token_ids[begin : begin + chunk_tokens])
        hashes.append(parent)
    return hashes


def usable_prefix_tokens(hit_tokens: int, chunk_tokens: int = CHUNK_TOKENS, replay_tokens: int = REPLAY_TOKENS) -> int:
    """Tokens a prefix hit saves: align_down(hit, chunk) - replay, or 0 when that is not > 0.

    With the real sizes, hits of <= 128 tokens save nothing (hit 200 -> 0, 256 -> 128, 300 -> 128).
    """
    _check_chunk_tokens(chunk_tokens)
    if hit_tokens < 0 or replay_tokens < 0:
        raise ValueError(f"hit_tokens and replay_tokens must be >= 0, got {hit_tokens}, {replay_tokens}")
    usable = (hit_tokens // chunk_tokens) * chunk_tokens - replay_tokens
    return usable if usable > 0 else 0


def _check_chunk_tokens(chunk_tokens: int) -> None:
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
