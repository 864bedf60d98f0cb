"""The fault suite's guarantees in colocated mode (2 colocated replicas, no prefill/decode):
hostile input gets client errors only, a cancel storm strands no capacity, a killed replica
ends its streams cleanly while the service keeps serving, a Redis restart fails no request."""

from __future__ import annotations

import asyncio

import pytest

from flashpd.services.faults import scenarios
from flashpd.services.faults.cli import QUICK
from flashpd.services.faults.stack import StackConfig

from .conftest import _stack

pytestmark = [pytest.mark.faults, pytest.mark.net]


@pytest.fixture(scope="module")
def stack_colocated(fault_env):
    yield from _stack(fault_env, StackConfig(app_name="faultsco", mode="colocated", colocated_replicas=2))


def _run(coro) -> scenarios.ScenarioResult:
    result = asyncio.run(coro)
    print(result.name, result.counts)
    return result


def test_hostile_input_gets_client_errors_only(stack_colocated):
    r = _run(scenarios.fuzz(stack_colocated, **QUICK["colocated_fuzz"]))
    assert r.counts["requests"] == QUICK["colocated_fuzz"]["limit"]
    assert r.passed, r.failures


def test_cancel_storm_strands_no_capacity(stack_colocated):
    r = _run(scenarios.cancel_storm(stack_colocated, **QUICK["colocated_cancel_storm"]))
    assert r.passed, r.failures


def test_killed_replica_ends_streams_cleanly_and_the_service_keeps_serving(stack_colocated):
    try:
        r = _run(scenarios.colocated_kill(stack_colocated, **QUICK["colocated_kill"]))
    finally:
        stack_colocated.wait_ready(300.0)
    assert r.passed, r.failures


def test_redis_kill_and_restart_fails_no_request_and_prefix_hits_return(stack_colocated):
    try:
        r = _run(scenarios.redis_restart(stack_colocated, **QUICK["colocated_redis_restart"]))
    finally:
        stack_colocated.wait_ready(300.0)
    assert r.passed, r.failures
