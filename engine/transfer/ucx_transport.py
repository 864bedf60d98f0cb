"""Which UCX transport a NIXL WRITE actually used, read back from UCX's own protocol report.

UCX picks a protocol per (endpoint, memory types, message size) the first time an operation
needs it; with `UCX_PROTO_INFO=y` it prints that choice as a table into its log
(`UCX_LOG_FILE`). A put (NIXL WRITE) from GPU memory to GPU memory on one node looks like:

    | flashpd intra-node cfg#2                                    |
    | remote memory write by ucp_put* from cuda/GPU0 to cuda/GPU0 |
    | Range  | Description | Config                               |
    | 0..inf | zero-copy   | cuda_ipc/cuda                        |

The sender reads the log after its first completed transfer to a peer, parses every put table
(`parse_put_tables`) and judges it (`judge`): a VRAM pool must move zero-copy over a GPU
transport (cuda_ipc on one node, an RDMA transport with GPU memory registration across nodes);
TCP, host staging (cuda_copy pipelines, copy-in/bounce fragments) or no report at all is a
fallback, which fails loudly (vLLM users lost 100x to a silent TCP fallback).

`enable_proto_log(pid)` sets the two variables before UCX is loaded in the process (UCX reads
its global options once, when the library loads). Variables already set are kept.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass

from flashpd.engine.transfer.base import TransferError

_TITLE = re.compile(r"remote memory write by ucp_put\S* from (\S+(?: memory)?) to (\S+)")
_ROW = re.compile(
    r"\|\s*([0-9.]+[KMGT]?\.\.(?:inf|[0-9.]+[KMGT]?))\s*\|\s*([^|]+?)\s*\|"
    r"\s*([^|]+?)\s*\|"
)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

# Transports that move GPU memory without a host bounce.
GPU_DIRECT_TRANSPORTS = ("cuda_ipc", "rc_mlx5", "rc_verbs", "dc_mlx5", "ud_mlx5", "gdr_copy")
# Signs of a fallback: TCP, or the data staged through host memory.
FALLBACK_MARKS = ("tcp", "cuda_copy", "copy-in", "copy-out", "bcopy", "pipeline", "bounce", "staged")


class TransportFallback(TransferError):
    """UCX moved pool memory over a transport the policy forbids (or reported none)."""


@dataclass(frozen=True)
class ProtoRange:
    low_bytes: int
    high_bytes: float  # inf for the open end
    description: str  # "zero-copy", "short", "multi-frag copy-in", ...
    config: str  # "cuda_ipc/cuda", "tcp/lo", "cma/memory", ...

    def covers_from(self, min_bytes: int) -> bool:
        return self.high_bytes >= min_bytes


@dataclass(frozen=True)
class PutTable:
    source: str  # "host memory", "cuda/GPU0", "cuda memory", ...
    destination: str
    ranges: tuple[ProtoRange, ...]

    @property
    def on_gpu(self) -> bool:
        """A put from GPU memory: what a VRAM pool's WRITE is (UCX also lists puts from host
        memory to the peer's GPU, which no KV descriptor makes)."""
        return "cuda" in self.source


@dataclass(frozen=True)
class TransportReport:
    """What UCX used for this side's WRITEs (`transport`: the transports, joined with '+')."""

    transport: str
    tables: tuple[PutTable, ...]

    def summary(self) -> str:
        rows = [
            f"{t.source}->{t.destination}: "
            + ", ".join(f"{r.low_bytes}..{r.high_bytes:g} {r.description} {r.config}" for r in t.ranges)
            for t in self.tables
        ]
        return "; ".join(rows) or "no put protocol reported"


def _size(text: str) -> float:
    if text == "inf":
        return float("inf")
    unit = text[-1] if text[-1] in _UNITS and not text[-1].isdigit() else ""
    return float(text[: len(text) - len(unit)]) * _UNITS[unit]


def parse_put_tables(log_text: str) -> list[PutTable]:
    """Every `ucp_put*` protocol table in a UCX log, in order."""
    tables: list[PutTable] = []
    current: tuple[str, str, list[ProtoRange]] | None = None
    for line in log_text.splitlines():
        title = _TITLE.search(line)
        if title:
            if current:
                tables.append(PutTable(current[0], current[1], tuple(current[2])))
            current = (title.group(1), title.group(2), [])
            continue
        if current is None:
            continue
        row = _ROW.search(line)
        if row:
            low, high = row.group(1).split("..")
            current[2].append(ProtoRange(int(_size(low)), _size(high), row.group(2), row.group(3)))
        elif "ucp_" in line and "|" in line:  # another operation's table begins
            tables.append(PutTable(current[0], current[1], tuple(current[2])))
            current = None
    if current:
        tables.append(PutTable(current[0], current[1], tuple(current[2])))
    return tables


def _transport_name(config: str) -> str:
    return config.split("/")[0].strip()


def judge(tables: list[PutTable], mem_type: str, min_bytes: int, required: tuple[str, ...] = ()) -> TransportReport:
    """The report for pools of `mem_type` ("VRAM" or "DRAM") moved in descriptors of at least
    `min_bytes`; raises TransportFallback where a VRAM pool's bytes would not move zero-copy
    over a GPU transport, or (any pool) where `required` is given and a transport outside it
    moves them. DRAM pools without `required` (CPU hosts, tests) take whatever UCX picked."""
    relevant = list(dict.fromkeys(t for t in tables if t.on_gpu == (mem_type == "VRAM")))
    used = [r for t in relevant for r in t.ranges if r.covers_from(min_bytes)]
    names = sorted({_transport_name(r.config) for r in used})
    report = TransportReport("+".join(names) or "unknown", tuple(relevant))
    if required:
        outside = sorted(set(names) - set(required))
        if not used or outside:
            raise TransportFallback(
                f"UCX moves {mem_type} pools over {report.transport} "
                f"({report.summary()}); required: {', '.join(required)}"
            )
    if mem_type != "VRAM":
        return report
    if not used:
        raise TransportFallback(
            f"UCX reported no GPU put protocol for VRAM pools ({report.summary()}): cannot confirm a zero-copy path"
        )
    for r in used:
        text = f"{r.description} {r.config}".lower()
        bad = [m for m in FALLBACK_MARKS if m in text]
        if bad or _transport_name(r.config) not in GPU_DIRECT_TRANSPORTS:
            why = ", ".join(bad) or "not a GPU transport"
            raise TransportFallback(
                f"UCX moves VRAM pools over {r.config!r} ({r.description}) for "
                f"{r.low_bytes}..{r.high_bytes:g} B: a fallback ({why}); expected zero-copy "
                f"over one of {', '.join(GPU_DIRECT_TRANSPORTS)}"
            )
    return report


def required_transports(environ: dict | None = None) -> tuple[str, ...]:
    """`FLASHPD_KV_TRANSPORTS` (comma-separated UCX transport names, e.g. "cuda_ipc"): the only
    transports a sender accepts; unset or empty: the defaults of `judge`."""
    env = os.environ if environ is None else environ
    raw = env.get("FLASHPD_KV_TRANSPORTS", "")
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    bad = [n for n in names if not re.fullmatch(r"[a-z0-9_]+", n)]
    if bad:
        raise ValueError(f"FLASHPD_KV_TRANSPORTS: not UCX transport names: {bad}")
    return names


def enable_proto_log(pid: int | None = None, environ: dict | None = None) -> str:
    """Ask UCX (not loaded yet in this process) to log its protocol choices; returns the log
    file UCX will write (`UCX_LOG_FILE` as given, `%p` replaced by the pid)."""
    env = os.environ if environ is None else environ
    env.setdefault("UCX_PROTO_INFO", "y")
    default = os.path.join(tempfile.gettempdir(), "flashpd-ucx-%p.log")
    path = env.setdefault("UCX_LOG_FILE", default)
    return path.replace("%p", str(os.getpid() if pid is None else pid))


def read_log(path: str) -> str:
    """The process's UCX log so far ("" before UCX wrote any). UCX prints a protocol table
    once per process and configuration, so the whole log is read, not what is new."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""
