"""The transfer contract: what both sides of a KV handoff must agree on, checked at handshake.

A prefill worker writes raw block bytes straight into a decode worker's pools, so a silent
layout difference (another model, a different block size or record format, a missing group)
would corrupt the KV without any error. Each side builds a `TransferContract` from its own
layout; the sender compares it with the receiver's (carried in the peer descriptor) before any
data moves, and `ContractMismatch` names every field that differs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from flashpd.engine.hashing import CHUNK_TOKENS

PROTOCOL_VERSION = 1


class ContractMismatch(ValueError):
    """The two sides of a transfer disagree on layout; `fields` names each differing field."""

    def __init__(self, fields: list[str], details: list[str]):
        self.fields = tuple(fields)
        super().__init__("transfer contract mismatch: " + "; ".join(details))


@dataclass(frozen=True)
class GroupSpec:
    """One transferable global group (one KV source and kind), e.g. `main.L2`."""

    name: str
    block_bytes: int  # bytes of one 128-token block of this group
    record_format: str  # packed record format, e.g. "nvfp4_e4m3x16"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("group name must be non-empty")
        if not isinstance(self.block_bytes, int) or self.block_bytes <= 0:
            raise ValueError(f"group {self.name}: block_bytes must be a positive int")
        if not self.record_format:
            raise ValueError(f"group {self.name}: record_format must be non-empty")


@dataclass(frozen=True)
class TransferContract:
    model_id: str
    groups: tuple[GroupSpec, ...]
    chunk_tokens: int = CHUNK_TOKENS
    protocol_version: int = PROTOCOL_VERSION
    # the decode side's speculative decoding (engine/speculative.py `SpeculativeConfig.handoff`)
    # as canonical JSON, "" = off: both roles are configured from one application config, so a
    # difference means a mixed deployment (e.g. a drafter only one side's checkpoint carries)
    speculative: str = ""

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must be non-empty")
        if not self.groups:
            raise ValueError("a transfer contract needs at least one group")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate group names in {names}")
        if self.chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive")

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    def group(self, name: str) -> GroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group {name!r} in contract (have {self.group_names})")

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id moves: the sum over groups."""
        return sum(g.block_bytes for g in self.groups)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_id": self.model_id,
            "chunk_tokens": self.chunk_tokens,
            "protocol_version": self.protocol_version,
            "speculative": self.speculative,
            "groups": [
                {"name": g.name, "block_bytes": g.block_bytes, "record_format": g.record_format} for g in self.groups
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransferContract:
        expected = {"model_id", "chunk_tokens", "protocol_version", "groups", "speculative"}
        if set(data) != expected:
            raise ValueError(f"contract fields {sorted(data)} != {sorted(expected)}")
        groups = tuple(
            GroupSpec(name=str(g["name"]), block_bytes=int(g["block_bytes"]), record_format=str(g["record_format"]))
            for g in data["groups"]
        )
        return cls(
            model_id=str(data["model_id"]),
            groups=groups,
            chunk_tokens=int(data["chunk_tokens"]),
            protocol_version=int(data["protocol_version"]),
            speculative=str(data["speculative"]),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TransferContract:
        return cls.from_dict(json.loads(text))


def check_compatible(local: TransferContract, remote: TransferContract) -> None:
    """Raise ContractMismatch naming every field on which `local` and `remote` differ.

    Group order is irrelevant (pools are addressed by group name); group sets must be equal.
    """
    fields: list[str] = []
    details: list[str] = []

    def differ(field: str, mine: Any, theirs: Any) -> None:
        if mine != theirs:
            fields.append(field)
            details.append(f"{field}: local={mine!r} remote={theirs!r}")

    differ("protocol_version", local.protocol_version, remote.protocol_version)
    differ("model_id", local.model_id, remote.model_id)
    differ("chunk_tokens", local.chunk_tokens, remote.chunk_tokens)
    differ("speculative", local.speculative, remote.speculative)
    mine = {g.name: g for g in local.groups}
    theirs = {g.name: g for g in remote.groups}
    if set(mine) != set(theirs):
        fields.append("groups")
        details.append(
            f"groups: only local={sorted(set(mine) - set(theirs))} only remote={sorted(set(theirs) - set(mine))}"
        )
    for name in sorted(set(mine) & set(theirs)):
        differ(f"groups[{name}].block_bytes", mine[name].block_bytes, theirs[name].block_bytes)
        differ(f"groups[{name}].record_format", mine[name].record_format, theirs[name].record_format)
    if fields:
        raise ContractMismatch(fields, details)
