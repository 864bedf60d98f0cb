"""Prefix-cache events: what a worker's block pool tells the prefix index (Redis) about its cache.

The block pool appends events to a queue in the order things happened; the owner drains them with
`drain_events()` and publishes them in batches, off the step loop. Hashes are the chained chunk
hashes of `flashpd.engine.hashing`, so the router can compare them with a prompt's own hashes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """These chunks are now cached here (a prefix of them may already have been stored before)."""

    block_hashes: tuple[str, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """These chunks were evicted: a lookup for them here now misses."""

    block_hashes: tuple[str, ...]


@dataclass(frozen=True)
class AllCleared:
    """Every cached chunk of this worker was dropped (prefix cache reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllCleared
