"""SDK tests share a scripted gRPC server (sdk_fakes.py); pytest runs with
--import-mode=importlib, which puts no test folder on sys.path, so this folder is added here."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sdk_fakes import ScriptedServer  # noqa: E402


@pytest.fixture
def server():
    with ScriptedServer() as s:
        yield s


@pytest.fixture(scope="module")
def redis_url():
    """A real redis-server for the tests that run the router behind the SDK."""
    from flashpd.services.redis_local import LocalRedis

    with LocalRedis() as server:
        yield server.url
