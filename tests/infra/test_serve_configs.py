"""Every Serve config in infra/ (and the RayService's serveConfigV2) passes Serve's own schema,
flashpd's argument model and the joint policy's kwargs model; its deployments build."""

from __future__ import annotations

import math

import pytest
from ray.serve.schema import ServeDeploySchema

from flashpd.services.app import AppArgs
from flashpd.services.autoscaling.policy import Limits, Replicas, check_limits
from flashpd.services.autoscaling.serve import JointPolicy, JointPolicyArgs


def _app(config: dict) -> dict:
    (app,) = config["applications"]
    return app


def test_serve_schema_accepts_it(serve_config):
    _, config = serve_config
    ServeDeploySchema.model_validate(config)


def test_app_args_and_policy_kwargs_validate(serve_config):
    _, config = serve_config
    app = _app(config)
    args = AppArgs.model_validate(app["args"])
    if "autoscaling_policy" not in app:
        assert not args.joint_autoscaling
        pytest.skip("fixed replicas (one-machine config: services/gpu_stack.py checks it)")
    policy = app["autoscaling_policy"]
    assert policy["policy_function"] == "flashpd.services.autoscaling.serve:JointPolicy"
    kwargs = JointPolicyArgs.model_validate(policy["policy_kwargs"])
    assert args.joint_autoscaling
    limits = Limits(
        *(
            Replicas(**{r: getattr(getattr(args, r).autoscaling, bound) for r in ("prefill", "decode", "router")})
            for bound in ("min_replicas", "max_replicas")
        )
    )
    check_limits(limits, kwargs.policy_config())
    JointPolicy(**policy["policy_kwargs"])  # what Serve instantiates


def test_decode_drain_window_covers_the_policy_delays(serve_config):
    _, config = serve_config
    args = AppArgs.model_validate(_app(config)["args"])
    assert args.decode.graceful_shutdown_timeout_s >= args.prefill.graceful_shutdown_timeout_s
    assert args.router.graceful_shutdown_timeout_s >= 60  # router drains its gRPC streams


def test_gpu_replicas_ask_for_their_role_resource(serve_config):
    _, config = serve_config
    args = AppArgs.model_validate(_app(config)["args"])
    if args.device != "cuda":
        pytest.skip("CPU config: no per-role nodes")
    if not args.joint_autoscaling:
        pytest.skip("one-machine config: the replicas share its GPU (fractional num_gpus)")
    for role in ("prefill", "decode", "router"):
        assert getattr(args, role).resources == {f"flashpd_{role}": 1}
    for role in ("prefill", "decode"):
        r = getattr(args, role)
        assert r.num_gpus == 1
        if r.placement_group_bundles is not None:
            assert r.placement_group_strategy == "STRICT_PACK"
            assert math.fsum(b.get("GPU", 0) for b in r.placement_group_bundles) == 8
            assert all(b.get(f"flashpd_{role}") == 1 for b in r.placement_group_bundles)


def test_role_resources_exist_on_the_cluster_node_types(serve_config, cluster):
    name, config = serve_config
    args = AppArgs.model_validate(_app(config)["args"])
    offered = set()
    for node in cluster["available_node_types"].values():
        offered |= set(node["resources"])
    for role in ("prefill", "decode", "router"):
        assert set(getattr(args, role).resources) <= offered, (name, role)


def test_deployments_build_with_serve(serve_config, tmp_path):
    """build_app resolves the Redis URL and password and makes Serve deployments (Serve checks
    the options, e.g. that the replica fits its first placement-group bundle)."""
    from flashpd.services.app import build_app

    _, config = serve_config
    args = AppArgs.model_validate(_app(config)["args"])
    password = tmp_path / "pw"
    password.write_text("s3cret\n")
    env = {args.redis_url_env: "redis://10.0.0.1:6379/0"} if args.redis_url_env else {}
    if args.redis_password_env:
        env[args.redis_password_env] = "s3cret"
    update = {"redis_password_file": str(password)} if args.redis_password_file else {}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        args = args.model_copy(update=update)
        url = args.resolved_redis_url()
        app = build_app(args)
    assert ("s3cret@" in url) == bool(args.redis_password_env or args.redis_password_file)
    assert app is not None
