"""infra/rayservice.yaml against the KubeRay v1.7 RayService CRD, strictly (an unknown field
fails), plus the objects it leans on (Redis, its Secret, the model volume) and per-role groups."""

from __future__ import annotations

import copy
import os

import jsonschema
import pytest
import yaml

CRD = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "shared", "fixtures", "kuberay", "ray.io_rayservices.yaml"
)


def strict(schema):
    """The CRD's structural schema with unknown fields refused: every object with `properties`
    and no `additionalProperties` / `x-kubernetes-preserve-unknown-fields` gets
    `additionalProperties: false` (what the API server's pruning amounts to, made an error)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def validator():
    if not os.path.exists(CRD):
        pytest.fail(f"KubeRay CRD fixture missing: {CRD}")
    with open(CRD) as f:
        crd = yaml.safe_load(f)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = strict(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def _errors(validator, doc) -> list[str]:
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_rayservice_matches_the_crd_strictly(rayservice_docs, validator):
    assert _errors(validator, rayservice_docs["RayService"]) == []


@pytest.mark.parametrize("where", ["spec", "rayClusterConfig", "workerGroup", "container"])
def test_an_unknown_field_fails(rayservice_docs, validator, where):
    doc = copy.deepcopy(rayservice_docs["RayService"])
    target = {
        "spec": doc["spec"],
        "rayClusterConfig": doc["spec"]["rayClusterConfig"],
        "workerGroup": doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0],
        "container": doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0],
    }[where]
    target["bogusField"] = 1
    assert any("bogusField" in e for e in _errors(validator, doc))


def test_redis_service_secret_and_model_volume_are_defined(rayservice_docs):
    docs = rayservice_docs
    assert {"Secret", "Deployment", "Service", "PersistentVolumeClaim", "RayService"} <= set(docs)
    service, deployment = docs["Service"], docs["Deployment"]
    args = yaml.safe_load(docs["RayService"]["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["redis_url"].startswith(f"redis://{service['metadata']['name']}:6379")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    redis = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--requirepass" in redis["args"]
    assert _secret_refs(redis) == {docs["Secret"]["metadata"]["name"]}
    claim = docs["PersistentVolumeClaim"]["metadata"]["name"]
    for pod in _pod_specs(docs["RayService"]):
        assert claim in {v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
        container = pod["containers"][0]
        assert any(m["mountPath"] == "/models" for m in container["volumeMounts"])
        assert args["checkpoint"].startswith("/models/")
        env = {e["name"] for e in container["env"]}
        assert args["redis_password_env"] in env


def test_worker_groups_are_per_role_labelled_and_carry_their_resource(rayservice_docs):
    cluster = rayservice_docs["RayService"]["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, group in groups.items():
        assert group["labels"]["flashpd-role"] == role
        assert int(group["resources"][f"flashpd_{role}"]) >= 1
        other = "decode" if role == "prefill" else "prefill"
        assert f"flashpd_{other}" not in group["resources"]
        assert group["minReplicas"] == 0 < group["maxReplicas"]
    assert int(cluster["headGroupSpec"]["resources"]["flashpd_router"]) >= 1
    assert cluster["enableInTreeAutoscaling"] is True


def test_image_is_built_by_the_repo_setup_script(rayservice_docs):
    dockerfile = os.path.join(os.path.dirname(__file__), "..", "..", "infra", "Dockerfile")
    with open(dockerfile) as f:
        text = f.read()
    assert "bash scripts/setup.sh" in text and "/opt/flashpd/.venv/bin" in text
    images = {p["containers"][0]["image"] for p in _pod_specs(rayservice_docs["RayService"])}
    assert len(images) == 1 and images.pop() in text.split("-t ", 1)[1].split()[0]


def _pod_specs(service) -> list[dict]:
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]


def _secret_refs(container) -> set[str]:
    return {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", []) if "valueFrom" in e}
