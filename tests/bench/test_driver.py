"""The closed-loop driver against an in-process fake server (tiny scaled workload, short window).

Every run is on virtual time (flashpd.bench.clock): durations are exact, whatever the load.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter

import pytest

from flashpd.bench import clock
from flashpd.bench.driver import DriverConfig, LaneFailure, RunResult, run_closed_loop
from flashpd.bench.records import Phase
from flashpd.bench.workload import generate_workload

CONCURRENCY = 3
WARMUP = 3


def run(workload, backend, **overrides) -> RunResult:
    settings = dict(
        concurrency=CONCURRENCY, window_s=0.5, warmup_requests=WARMUP, drain_timeout_s=2.0, show_progress=False
    )
    settings.update(overrides)
    config = DriverConfig.for_time_scale(workload.config.time_scale, **settings)
    coro = run_closed_loop(workload, backend, config, name="fake", target="inproc", num_gpus=2)
    return clock.run(coro, clock="virtual")


@pytest.fixture(scope="module")
def normal_run(small_workload, fake_backend_cls):
    backend = fake_backend_cls()
    return run(small_workload, backend), backend


def by_lane(result: RunResult) -> dict[int, list]:
    lanes: dict[int, list] = {}
    for record in sorted(result.records, key=lambda r: r.start_s):
        lanes.setdefault(record.lane, []).append(record)
    return lanes


def test_every_lane_runs_and_in_flight_never_exceeds_lanes(normal_run):
    result, backend = normal_run
    assert set(by_lane(result)) == set(range(CONCURRENCY))
    assert backend.max_in_flight == CONCURRENCY


def test_each_lane_opens_with_a_one_token_primer_then_warmup(normal_run):
    result, _ = normal_run
    for records in by_lane(result).values():
        phases = [r.phase for r in records]
        assert phases[0] is Phase.PRIMER and records[0].expected_output_tokens == 1
        assert phases[1 : 1 + WARMUP] == [Phase.WARMUP] * WARMUP
        assert Phase.PRIMER not in phases[1:]


def test_first_tree_starts_25_to_75_percent_in_at_a_main_turn(normal_run, small_workload):
    result, _ = normal_run
    for lane, records in by_lane(result).items():
        tree = small_workload.trees[lane % len(small_workload.trees)]
        start = records[1].request_index  # first warm-up request
        n = len(tree.requests)
        assert records[1].agent == "main" and start >= int(0.25 * n)
        # snapped forward to a main turn: only sub-agent requests lie between 75% and the start
        assert all(r.is_subagent for r in tree.requests[int(0.75 * n) : start])


def test_primer_is_the_previous_turn_of_the_main_session(normal_run):
    result, _ = normal_run
    for records in by_lane(result).values():
        primer, first = records[0], records[1]
        assert primer.agent == "main" and primer.turn_index == first.turn_index - 1
        assert primer.session_id == first.session_id


def test_window_opens_after_every_lane_is_warm_and_bounds_measured_starts(normal_run):
    result, _ = normal_run
    meta = result.meta
    assert meta.window_end_s - meta.window_start_s == pytest.approx(0.5)
    last_warmup_end = max(r.end_s for r in result.records if r.phase is Phase.WARMUP)
    assert meta.window_start_s == pytest.approx(last_warmup_end, abs=1e-9)
    measured = [r for r in result.records if r.phase is Phase.MEASURE]
    assert measured
    assert all(meta.window_start_s <= r.start_s <= meta.window_end_s for r in measured)
    assert all(r.start_s < meta.window_start_s for r in result.records if r.phase is not Phase.MEASURE)


def test_every_request_carries_session_ids(normal_run):
    result, backend = normal_run
    assert all(call.session_id for call in backend.calls)
    for record in result.records:
        assert record.session_id.startswith(f"e0-c{CONCURRENCY}-l{record.lane}-")
        if record.agent != "main":
            assert record.parent_session_id == record.session_id.split("/")[0]
        else:
            assert record.parent_session_id is None


def test_spliced_outputs_let_the_cache_reach_the_ideal_hit(normal_run):
    result, _ = normal_run
    measured = [r for r in result.records if r.phase is Phase.MEASURE]
    assert sum(r.cached_tokens for r in measured) == sum(r.ideal_cached_tokens for r in measured)


def test_without_splicing_past_outputs_miss_the_cache(small_workload, fake_backend_cls):
    result = run(small_workload, fake_backend_cls(), splice_outputs=False)
    measured = [r for r in result.records if r.phase is Phase.MEASURE and r.turn_index > 1]
    assert sum(r.cached_tokens for r in measured) < sum(r.ideal_cached_tokens for r in measured)


def test_records_carry_latencies_and_workers(normal_run):
    result, _ = normal_run
    for record in result.records:
        assert record.ok and record.ttft_s > 0
        assert len(record.itl_s) == record.output_tokens - 1
        assert record.output_tokens == record.expected_output_tokens
        assert record.end_s >= record.start_s + record.ttft_s
        assert (record.prefill_worker, record.decode_worker) == ("p0", "d0")


def test_finished_tree_restarts_from_turn_zero_with_a_new_salt(workload_config, fake_backend_cls):
    workload = generate_workload(workload_config(max_turns=2, num_trees=4, seed=11))
    backend = fake_backend_cls()
    result = run(workload, backend, concurrency=1, warmup_requests=1)
    instances = Counter(r.session_id.split("/")[0] for r in result.records)
    assert len(instances) >= 2
    first_of = {}
    for call, record in zip(backend.calls, sorted(result.records, key=lambda r: r.start_s), strict=True):
        first_of.setdefault(record.session_id.split("/")[0], (record, call))
    (_, first), *later = sorted(first_of.values(), key=lambda rc: rc[0].start_s)
    for record, call in later:
        assert record.request_index == 0 and record.turn_index == 0
        assert call.prompt_ids[0] != first.prompt_ids[0]  # the salt: one token at this scale


def test_think_times_are_capped_by_the_tree_idle_cap(workload_config, fake_backend_cls):
    workload = generate_workload(workload_config(time_scale=1.0))  # think p50 4.9 s
    result = run(workload, fake_backend_cls(), tree_idle_cap_s=0.02, window_s=0.3)
    assert max(r.think_s for r in result.records) == pytest.approx(0.02, abs=1e-9)
    assert all(r.think_s <= 0.02 + 1e-9 for r in result.records)


def test_backend_errors_are_recorded_and_the_run_goes_on(small_workload, fake_backend_cls):
    backend = fake_backend_cls(fail=lambda call: call.max_tokens % 3 == 0)
    result = run(small_workload, backend)
    failed = [r for r in result.records if not r.ok]
    assert failed and all(r.error_type == "Unavailable" and r.cached_tokens is None for r in failed)
    assert result.meta.aborted_reason is None


def test_too_many_consecutive_errors_abort_with_records_kept(small_workload, fake_backend_cls):
    result = run(small_workload, fake_backend_cls(fail=lambda call: True), max_consecutive_errors=5)
    assert "5 consecutive errors" in result.meta.aborted_reason
    assert len(result.records) >= 5


def test_unexpected_backend_exception_fails_the_run_with_partial_result(small_workload):
    class Broken:
        async def generate(self, call, on_tokens):
            raise RuntimeError("bug")

        async def aclose(self):
            return None

    with pytest.raises(LaneFailure) as info:
        run(small_workload, Broken())
    assert info.value.result.meta.aborted_reason.startswith("lane failure")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_sigint_stops_at_once_and_keeps_partial_results(small_workload, fake_backend_cls):
    backend = fake_backend_cls(ttft_s=0.05, itl_s=0.01)

    async def interrupted() -> RunResult:
        asyncio.get_running_loop().call_later(0.6, os.kill, os.getpid(), signal.SIGINT)
        config = DriverConfig.for_time_scale(
            small_workload.config.time_scale,
            concurrency=CONCURRENCY,
            window_s=60.0,
            warmup_requests=1,
            show_progress=False,
        )
        return await run_closed_loop(small_workload, backend, config, name="f", target="t", num_gpus=1)

    result = clock.run(interrupted(), clock="virtual")
    assert max(r.end_s for r in result.records) < 0.6 + 1e-6  # stopped at the signal, not later
    assert result.meta.interrupted
    assert result.records
    assert result.meta.window_end_s - result.meta.window_start_s < 60.0
    # requests in flight at the signal are cancelled and recorded, none is left running
    assert any(r.error_type == "Cancelled" for r in result.records)
    assert backend.in_flight == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_bad_driver_config_raises():
    with pytest.raises(ValueError):
        DriverConfig(concurrency=0, window_s=1.0)
    with pytest.raises(ValueError):
        DriverConfig(concurrency=1, window_s=0.0)
