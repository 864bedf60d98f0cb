"""Byte formats exchanged between transfer peers: the receiver descriptor and completion notices.

Both are plain JSON (plus the transport's own opaque agent metadata), never pickled objects,
since the peers may be different hosts and versions; decoding is strict and raises ValueError.

Descriptor layout:

    b"FPDX" | u32 big-endian header length | header JSON (utf-8) | agent metadata bytes
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from json.encoder import encode_basestring_ascii
from typing import Any

from flashpd.engine.transfer.contract import TransferContract

DESCRIPTOR_MAGIC = b"FPDX"
NOTICE_VERSION = 1
_HEADER_LEN = struct.Struct(">I")


@dataclass(frozen=True)
class PoolRegion:
    """Where one group's pool lives in the receiver's memory: [num_blocks, block_bytes] uint8."""

    group: str
    address: int
    num_blocks: int
    block_bytes: int
    device_id: int
    mem_type: str  # "DRAM" or "VRAM"


@dataclass(frozen=True)
class PeerDescriptor:
    """What a receiver publishes so that a sender can write into its pools."""

    backend: str  # "local" or "nixl"
    agent_name: str
    incarnation: str  # the receiving worker's incarnation id
    contract: TransferContract
    regions: tuple[PoolRegion, ...]
    agent_metadata: bytes = b""  # transport metadata (NIXL agent MD); empty for local

    @property
    def num_blocks(self) -> int:
        return self.regions[0].num_blocks

    def region(self, group: str) -> PoolRegion:
        for r in self.regions:
            if r.group == group:
                return r
        raise KeyError(f"peer {self.agent_name} has no pool for group {group!r}")

    def to_bytes(self) -> bytes:
        header = {
            "backend": self.backend,
            "agent_name": self.agent_name,
            "incarnation": self.incarnation,
            "contract": self.contract.to_dict(),
            "regions": [asdict(r) for r in self.regions],
        }
        head = json.dumps(header, sort_keys=True).encode()
        return DESCRIPTOR_MAGIC + _HEADER_LEN.pack(len(head)) + head + self.agent_metadata

    @classmethod
    def from_bytes(cls, data: bytes) -> PeerDescriptor:
        prefix = len(DESCRIPTOR_MAGIC) + _HEADER_LEN.size
        if len(data) < prefix or not data.startswith(DESCRIPTOR_MAGIC):
            raise ValueError("not a flashpd transfer descriptor (bad magic)")
        (head_len,) = _HEADER_LEN.unpack_from(data, len(DESCRIPTOR_MAGIC))
        if len(data) < prefix + head_len:
            raise ValueError("truncated transfer descriptor")
        header: dict[str, Any] = json.loads(data[prefix : prefix + head_len])
        regions = tuple(PoolRegion(**r) for r in header["regions"])
        if not regions or len({r.num_blocks for r in regions}) != 1:
            raise ValueError("descriptor regions must be non-empty with one num_blocks")
        return cls(
            backend=str(header["backend"]),
            agent_name=str(header["agent_name"]),
            incarnation=str(header["incarnation"]),
            contract=TransferContract.from_dict(header["contract"]),
            regions=regions,
            agent_metadata=bytes(data[prefix + head_len :]),
        )


NOTICE_KINDS = ("write", "abandon", "abandon_all")


@dataclass(frozen=True)
class TransferNotice:
    """Sent with (after) a write: which request, from which sender incarnation, which blocks.

    kind "write": the blocks' bytes have landed. kind "abandon" (no blocks): the sender gives the
    request up and no write of it is in flight or will be posted, so the receiver may reuse the
    blocks at once. kind "abandon_all" (no token, no blocks): the sender has no run of the
    request and refuses every ticket for it issued at or before `before_unix_s`, so none of
    those tickets' blocks can be written by it."""

    request_id: str
    incarnation: str  # the fencing token the sender was given ("" for abandon_all)
    dst_block_ids: tuple[int, ...]
    kind: str = "write"  # "write" | "abandon" | "abandon_all"
    before_unix_s: float = 0.0  # abandon_all: tickets issued at or before this time

    def __post_init__(self) -> None:
        if self.kind not in NOTICE_KINDS:
            raise ValueError(f"notice kind must be one of {NOTICE_KINDS}, got {self.kind!r}")

    def to_bytes(self) -> bytes:
        body = {
            "v": NOTICE_VERSION,
            "rid": self.request_id,
            "inc": self.incarnation,
            "runs": block_runs(self.dst_block_ids),
            "kind": self.kind,
            "before": self.before_unix_s,
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> TransferNotice:
        try:
            body = json.loads(data)
            if body["v"] != NOTICE_VERSION:
                raise ValueError(f"notice version {body['v']} != {NOTICE_VERSION}")
            block_ids = tuple(b for start, length in body["runs"] for b in range(int(start), int(start) + int(length)))
            return cls(
                request_id=str(body["rid"]),
                incarnation=str(body["inc"]),
                dst_block_ids=block_ids,
                kind=str(body.get("kind", "write")),
                before_unix_s=float(body.get("before", 0.0)),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed notice {bytes(data[:64])!r}: {e!r}") from e


def block_runs(block_ids: Sequence[int]) -> list[list[int]]:
    """[3, 4, 5, 9] -> [[3, 3], [9, 1]]: (start, length) runs keep notices small."""
    runs: list[list[int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([int(b), 1])
    return runs


def write_notice_bytes(request_id: str, incarnation: str, dst_start: Sequence[int], length: Sequence[int]) -> bytes:
    """A "write" notice for the blocks dst_start[r] + i, i < length[r], from runs already
    found (base.checked_runs): byte for byte what `TransferNotice(...).to_bytes()` carries
    (json.dumps with (",", ":") separators and ensure_ascii, keys in that order), formatted
    directly: json.dumps builds an encoder per call, most of the notice's cost on a push's
    critical path."""
    runs = ",".join([f"[{s},{n}]" for s, n in zip(dst_start, length, strict=True)])
    rid, inc = encode_basestring_ascii(request_id), encode_basestring_ascii(incarnation)
    return f'{{"v":{NOTICE_VERSION},"rid":{rid},"inc":{inc},"runs":[{runs}],"kind":"write","before":0.0}}'.encode()
