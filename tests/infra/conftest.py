"""The infra files, loaded once: cluster.yaml, rayservice.yaml (all its documents) and every Serve
config (the infra/serve*.yaml files and the RayService's serveConfigV2)."""

from __future__ import annotations

import glob
import os

import pytest
import yaml

INFRA = os.path.join(os.path.dirname(__file__), "..", "..", "infra")


def infra_path(name: str) -> str:
    return os.path.join(INFRA, name)


def load_yaml(name: str):
    with open(infra_path(name)) as f:
        return yaml.safe_load(f)


def rayservice_documents() -> dict[str, dict]:
    with open(infra_path("rayservice.yaml")) as f:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(f) if doc}


def serve_configs() -> dict[str, dict]:
    configs = {os.path.basename(p): yaml.safe_load(open(p)) for p in sorted(glob.glob(infra_path("serve*.yaml")))}
    service = rayservice_documents()["RayService"]
    configs["rayservice.yaml:serveConfigV2"] = yaml.safe_load(service["spec"]["serveConfigV2"])
    return configs


@pytest.fixture(scope="session")
def cluster() -> dict:
    return load_yaml("cluster.yaml")


@pytest.fixture(scope="session")
def rayservice_docs() -> dict[str, dict]:
    return rayservice_documents()


def pytest_generate_tests(metafunc):
    if "serve_config" in metafunc.fixturenames:
        items = list(serve_configs().items())
        metafunc.parametrize("serve_config", items, ids=[name for name, _ in items])


@pytest.fixture(autouse=True)
def _serve_config_env(request, monkeypatch):
    """A Serve config's args are checked as Serve builds them: with its application's
    `runtime_env.env_vars` set (infra/serve.h200.spec.yaml's benchmark flag
    FLASHPD_BENCH_FORCED_ACCEPTANCE among them); restored after the test."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or "serve_config" not in callspec.params:
        return
    _, config = callspec.params["serve_config"]
    for app in config.get("applications") or []:
        for key, value in ((app.get("runtime_env") or {}).get("env_vars") or {}).items():
            monkeypatch.setenv(str(key), str(value))
