"""infra/cluster.yaml against Ray's own autoscaler schema, and what makes it a working cluster."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
import ray

SCHEMA = os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")


@pytest.fixture(scope="module")
def validator():
    with open(SCHEMA) as f:
        schema = json.load(f)
    return jsonschema.validators.validator_for(schema)(schema)


def test_cluster_yaml_matches_ray_schema(cluster, validator):
    errors = sorted(validator.iter_errors(cluster), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]


def test_schema_check_catches_an_unknown_key_and_a_missing_resources(cluster, validator):
    bad = json.loads(json.dumps(cluster))
    bad["available_node_types"]["decode_gpu"]["gpus"] = 8
    del bad["available_node_types"]["prefill_gpu"]["resources"]
    messages = " ".join(e.message for e in validator.iter_errors(bad))
    assert "gpus" in messages and "resources" in messages


def test_every_node_type_declares_resources_and_gpu_types_start_at_zero(cluster):
    types = cluster["available_node_types"]
    for name, node in types.items():
        assert node["resources"], name
        if node["resources"].get("GPU", 0) > 0:
            assert node["min_workers"] == 0, name


def test_each_role_has_its_own_node_type_by_custom_resource(cluster):
    types = cluster["available_node_types"]
    by_role = {
        role: [n for n, t in types.items() if t["resources"].get(f"flashpd_{role}")]
        for role in ("prefill", "decode", "router")
    }
    assert all(len(names) == 1 for names in by_role.values()), by_role
    assert len({names[0] for names in by_role.values()}) == 3  # three distinct node types
    for role in ("prefill", "decode"):
        node = types[by_role[role][0]]
        assert node["resources"][f"flashpd_{role}"] == node["resources"]["GPU"]


def test_redis_is_password_protected_and_reachable_from_every_node(cluster):
    head = " ".join(cluster["head_start_ray_commands"])
    assert "--requirepass" in head and "--protected-mode yes" in head
    assert "--bind 0.0.0.0" in head  # workers reach it over the private network
    assert "redis://127.0.0.1" not in head  # the URL every node gets is the head's IP
    workers = " ".join(cluster["worker_start_ray_commands"])
    assert "FLASHPD_REDIS_URL" in head and "FLASHPD_REDIS_URL" in workers
    assert "$RAY_HEAD_IP:6379" in workers
    assert any("redis-password" in dst for dst in cluster["file_mounts"])


def test_setup_installs_flashpd_from_the_mounted_repo(cluster):
    assert cluster["file_mounts"]["~/flashpd"] == "."
    assert any("scripts/setup.sh" in c for c in cluster["setup_commands"])
    starts = cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]
    ray_commands = [c for c in starts if "ray start" in c or "ray stop" in c]
    assert len(ray_commands) == 4
    assert all("~/flashpd/.venv/bin/ray " in c for c in ray_commands)


def test_gpu_nodes_fetch_the_checkpoint_the_serve_configs_name(cluster, serve_config):
    name, config = serve_config
    args = config["applications"][0]["args"]
    if args.get("device") != "cuda" or name.startswith("rayservice"):
        pytest.skip("CPU config or Kubernetes (PVC) config")
    if args["checkpoint"].startswith("random:"):
        pytest.skip("one-machine config: weights generated on the GPU, nothing to fetch")
    fetch = " ".join(cluster["worker_setup_commands"])
    root = os.path.dirname(args["checkpoint"])
    assert root == "/mnt/models" and f" {root}/" in fetch
