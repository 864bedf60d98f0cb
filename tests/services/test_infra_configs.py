"""The infra configs are valid: every Serve app's args pass AppArgs, the builder resolves."""

from __future__ import annotations

import importlib
import os

import pytest
import yaml

from flashpd.services.app import AppArgs

INFRA = os.path.join(os.path.dirname(__file__), "..", "..", "infra")


def _serve_apps():
    with open(os.path.join(INFRA, "serve.yaml")) as f:
        yield from yaml.safe_load(f)["applications"]
    with open(os.path.join(INFRA, "rayservice.yaml")) as f:
        service = yaml.safe_load(f)
    yield from yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]


@pytest.mark.parametrize("app", list(_serve_apps()), ids=lambda a: a["name"])
def test_serve_app_args_validate_and_builder_imports(app):
    AppArgs.model_validate(app["args"])
    module, attr = app["import_path"].split(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_unknown_arg_is_refused_naming_it():
    with pytest.raises(Exception, match="bogus"):
        AppArgs.model_validate({"checkpoint": "x", "redis_url": "redis://h:1", "bogus": 1})


def test_autoscaling_bounds_are_checked():
    with pytest.raises(Exception, match="min_replicas"):
        AppArgs.model_validate({"checkpoint": "x", "redis_url": "redis://h:1",
                                "decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}})


def test_gpu_device_needs_bfloat16():
    base = {"checkpoint": "x", "redis_url": "redis://h:1", "device": "cuda"}
    with pytest.raises(Exception, match="dtype"):
        AppArgs.model_validate(base)
    assert AppArgs.model_validate(dict(base, dtype="bfloat16")).device == "cuda"


def test_cluster_config_has_autoscaling_node_types():
    with open(os.path.join(INFRA, "cluster.yaml")) as f:
        cluster = yaml.safe_load(f)
    gpu = cluster["available_node_types"]["gpu_worker"]
    assert gpu["max_workers"] > gpu["min_workers"]
