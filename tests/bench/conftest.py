"""Shared fixtures for the bench tests: a small scaled workload and an in-process fake server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from flashpd.bench import clock
from flashpd.bench.backend import BackendError, Completion, GenerateCall, OnTokens
from flashpd.bench.driver import DriverConfig, run_closed_loop
from flashpd.bench.laws import AgentShape, UniformRange
from flashpd.bench.records import write_run
from flashpd.bench.workload import Workload, WorkloadConfig, generate_workload


class FakeBackend:
    """Sleeps like a server (TTFT, then one token per ITL) and keeps an exact prefix cache.

    The cache holds every (prompt + output) sequence it has produced; a request's cached tokens
    are its longest common prefix with any of them. Output ids are drawn from [1, 1000), below
    the workload's synthetic ids, so spliced outputs are recognisable.
    """

    def __init__(
        self, ttft_s: float = 0.004, itl_s: float = 0.001, fail: Callable[[GenerateCall], bool] | None = None
    ) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.fail = fail
        self.calls: list[GenerateCall] = []
        self.sequences: list[list[int]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.closed = False

    async def generate(self, call: GenerateCall, on_tokens: OnTokens) -> Completion:
        self.calls.append(call)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.fail is not None and self.fail(call):
                raise BackendError("Unavailable", "fake failure")
            cached = max((_common_prefix(call.prompt_ids, s) for s in self.sequences), default=0)
            await asyncio.sleep(self.ttft_s)
            output = [1 + (len(self.calls) * 7 + i) % 998 for i in range(call.max_tokens)]
            for i, token in enumerate(output):
                if i > 0:
                    await asyncio.sleep(self.itl_s)
                on_tokens([token])
            self.sequences.append(list(call.prompt_ids) + output)
        finally:
            self.in_flight -= 1
        return Completion(
            request_id=f"r{len(self.calls)}",
            finish_reason="length",
            prompt_tokens=len(call.prompt_ids),
            completion_tokens=len(output),
            cached_tokens=cached,
            cached_tokens_prefill=cached,
            cached_tokens_decode=0,
            prefill_worker="p0",
            decode_worker="d0",
            timeline={"first_token": self.ttft_s},
        )

    async def aclose(self) -> None:
        self.closed = True


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="session")
def fake_backend_cls() -> type[FakeBackend]:
    return FakeBackend


def small_workload_config(**overrides: object) -> WorkloadConfig:
    base = dict(seed=3, num_trees=6, scale=2000.0, output_scale=200.0, time_scale=2000.0, max_turns=12)
    base.update(overrides)
    return WorkloadConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def small_workload() -> Workload:
    return generate_workload(small_workload_config())


@pytest.fixture(scope="session")
def workload_config() -> Callable[..., WorkloadConfig]:
    return small_workload_config


@pytest.fixture(scope="session")
def compacting_workload() -> Workload:
    shape = AgentShape(
        short_window_compact_tokens=UniformRange(40_000, 50_000),
        long_window_compact_tokens=UniformRange(60_000, 80_000),
    )
    return generate_workload(WorkloadConfig(seed=2, num_trees=4, scale=200.0, max_turns=40, shape=shape))


@pytest.fixture(scope="session")
def study_dir(tmp_path_factory, small_workload, fake_backend_cls):
    """Two configurations (base, fast) at concurrency 1 and 2, on the virtual clock."""
    root = tmp_path_factory.mktemp("study")
    for name, ttft_s in (("base", 0.006), ("fast", 0.002)):
        for concurrency in (1, 2):
            config = DriverConfig.for_time_scale(
                small_workload.config.time_scale,
                concurrency=concurrency,
                window_s=0.3,
                warmup_requests=2,
                show_progress=False,
                drain_timeout_s=2.0,
            )
            coro = run_closed_loop(
                small_workload, fake_backend_cls(ttft_s=ttft_s), config, name=name, target=f"inproc-{name}", num_gpus=2
            )
            result = clock.run(coro, clock="virtual")
            write_run(root / name / f"c{concurrency}", result.meta, result.records)
    return root


def _assert_tables_are_rectangular(markdown: str) -> None:
    """Every markdown table's rows have as many cells as its header."""
    width = None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            width = None
            continue
        cells = line.count("|") - 1
        width = cells if width is None else width
        assert cells == width, line


@pytest.fixture
def rectangular_tables():
    return _assert_tables_are_rectangular
