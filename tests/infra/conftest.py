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
