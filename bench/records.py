"""Per-request benchmark records and run metadata, stored as a run directory.

    <run_dir>/meta.json       RunMeta: target, concurrency, GPUs, the measurement window, configs
    <run_dir>/records.jsonl   one RequestRecord per line, written as requests finish

Times are seconds on the driver's monotonic clock, relative to the run start (`start_s`, `end_s`,
the window). Token arrival times are start_s + ttft_s + cumsum(itl_s).
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

META_FILE = "meta.json"
RECORDS_FILE = "records.jsonl"


class Phase(str, enum.Enum):
    PRIMER = "primer"  # the turn before a lane's start point, max_tokens=1
    WARMUP = "warmup"  # a lane's first warm-up requests
    PRE = "pre"  # after the lane's warm-up, before every lane is warm
    MEASURE = "measure"  # started inside the measurement window


# The driver's error for a request still streaming when the run stopped (the drain after the
# window ran out): the client gave up on it, the server did not fail it.
STOPPED_IN_FLIGHT = "run stopped while in flight"


@dataclass(frozen=True)
class RequestRecord:
    lane: int
    phase: Phase
    tree_id: int
    request_index: int  # position in the tree's replay order
    agent: str
    session_id: str
    parent_session_id: str | None
    turn_index: int
    think_s: float  # think time actually slept before sending (after idle caps)
    start_s: float
    end_s: float
    ttft_s: float | None  # None when no token arrived
    itl_s: list[float]  # one gap per token after the first
    prompt_tokens: int
    expected_output_tokens: int  # max_tokens sent with ignore_eos
    output_tokens: int  # tokens received
    ideal_cached_tokens: int
    cached_tokens: int | None = None  # as reported by the server (None: no final result)
    cached_tokens_prefill: int | None = None
    cached_tokens_decode: int | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    request_id: str | None = None
    finish_reason: str | None = None
    error_type: str | None = None
    error: str | None = None
    timeline: dict[str, float] = field(default_factory=dict)
    # speculative decoding, from the usage (None: no final result, or a record written before
    # these fields); forced_acceptance_length > 0: a benchmark run forced acceptance, so this
    # request's outputs and speed are not the model's
    draft_tokens: int | None = None
    accepted_draft_tokens: int | None = None
    draft_steps: int | None = None
    forced_acceptance_length: float | None = None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def ok(self) -> bool:
        return self.error_type is None

    def token_times_s(self) -> list[float]:
        """Arrival time of every received token (run clock)."""
        if self.ttft_s is None:
            return []
        times, t = [], self.start_s + self.ttft_s
        times.append(t)
        for gap in self.itl_s:
            t += gap
            times.append(t)
        return times

    def to_json(self) -> dict[str, Any]:
        row = asdict(self)
        row["phase"] = self.phase.value
        row["e2e_s"] = self.e2e_s  # derived, written for readers of the JSONL
        return row

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> RequestRecord:
        row = {k: v for k, v in row.items() if k != "e2e_s"}
        known = {f.name for f in fields(cls)}
        unknown = set(row) - known
        if unknown:
            raise ValueError(f"unknown record fields: {sorted(unknown)}")
        return cls(**{**row, "phase": Phase(row["phase"])})


@dataclass(frozen=True)
class RunMeta:
    name: str  # configuration name (A/B) or the target address
    target: str
    concurrency: int
    num_gpus: int
    window_s: float  # requested window length
    window_start_s: float | None  # None: the window never started (e.g. interrupted in warm-up)
    window_end_s: float | None
    interrupted: bool = False
    aborted_reason: str | None = None
    started_at: str = ""  # wall-clock ISO time, for the report only
    workload: dict[str, Any] = field(default_factory=dict)
    driver: dict[str, Any] = field(default_factory=dict)

    @property
    def measured_window_s(self) -> float:
        if self.window_start_s is None or self.window_end_s is None:
            return 0.0
        return self.window_end_s - self.window_start_s


class RecordWriter:
    """Appends records to <run_dir>/records.jsonl as they finish, so partial runs keep data."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(self.run_dir / RECORDS_FILE, "w")

    def __call__(self, record: RequestRecord) -> None:
        self._file.write(json.dumps(record.to_json()) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_meta(run_dir: str | Path, meta: RunMeta) -> None:
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / META_FILE).write_text(json.dumps(asdict(meta), indent=2) + "\n")


def write_run(run_dir: str | Path, meta: RunMeta, records: list[RequestRecord]) -> None:
    writer = RecordWriter(run_dir)
    try:
        for record in records:
            writer(record)
    finally:
        writer.close()
    write_meta(run_dir, meta)


def read_run(run_dir: str | Path) -> tuple[RunMeta, list[RequestRecord]]:
    path = Path(run_dir)
    meta = RunMeta(**json.loads((path / META_FILE).read_text()))
    with open(path / RECORDS_FILE) as src:
        records = [RequestRecord.from_json(json.loads(line)) for line in src if line.strip()]
    return meta, records


def write_markdown(path: str | Path, lines: list[str]) -> None:
    """Writes a report's lines to `path` (its folder created) and prints them."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
