"""One local Redis, Ray instance and flashpd stack per module (tests/faults); run inside a
loopback-only namespace (scripts/test.sh does)."""

from __future__ import annotations

import pytest

from flashpd.services.faults.stack import FaultStack, StackConfig, start_ray, stop_ray
from flashpd.services.redis_local import LocalRedis


@pytest.fixture(scope="module")  # Ray is shut down before other modules start their own
def fault_env(ckpt_dir):
    with LocalRedis() as redis_server:
        http_port = start_ray()
        try:
            yield ckpt_dir, redis_server, http_port, []  # [] holds the deployed stack
        finally:
            stop_ray()


def _stack(fault_env, config: StackConfig):
    """Deploy `config`'s application after removing the previous one (one stack at a time:
    they share Serve's route prefix and the 2 cores)."""
    ckpt, redis_server, http_port, current = fault_env
    if current:
        current.pop().undeploy()
    stack = FaultStack(ckpt, redis_server, http_port, config).deploy()
    current.append(stack)
    try:
        yield stack
    finally:
        stack.undeploy()


@pytest.fixture(scope="module")
def stack_2x2(fault_env):
    """The default 128-token bounded replay: a stream continued on another decode worker
    matches the unbroken run token for token (it replays from the original prompt boundary);
    `flashpd faults` also runs the decode kill with exact replay."""
    yield from _stack(fault_env, StackConfig(2, 2, app_name="faults2x2"))


@pytest.fixture(scope="module")
def stack_1x2(fault_env):
    """1 prefill + 2 decode replicas: a drained decode replica moves its streams to the other."""
    yield from _stack(fault_env, StackConfig(1, 2, app_name="faults1x2"))


@pytest.fixture(scope="module")
def stack_1x1(fault_env):
    yield from _stack(fault_env, StackConfig(1, 1, app_name="faults1x1"))
