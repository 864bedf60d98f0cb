"""AppArgs, the validated edge of `build_app`: unknown keys, bounds, devices, Redis sources,
placement. (The infra/ files themselves are checked in tests/infra.)"""

from __future__ import annotations

import pytest

from flashpd.services.app import AppArgs

BASE = {"checkpoint": "x", "redis_url": "redis://h:1"}


def test_unknown_arg_is_refused_naming_it():
    with pytest.raises(Exception, match="bogus"):
        AppArgs.model_validate({**BASE, "bogus": 1})


def test_autoscaling_bounds_are_checked():
    with pytest.raises(Exception, match="min_replicas"):
        AppArgs.model_validate({**BASE, "decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}})


def test_gpu_device_needs_bfloat16():
    base = {**BASE, "device": "cuda"}
    with pytest.raises(Exception, match="dtype"):
        AppArgs.model_validate(base)
    assert AppArgs.model_validate(dict(base, dtype="bfloat16")).device == "cuda"


def test_exactly_one_redis_url_source():
    with pytest.raises(Exception, match="redis_url"):
        AppArgs.model_validate({"checkpoint": "x"})
    with pytest.raises(Exception, match="redis_url"):
        AppArgs.model_validate({**BASE, "redis_url_env": "X"})


def test_redis_url_from_env_with_password_from_env():
    args = AppArgs.model_validate({"checkpoint": "x", "redis_url_env": "URL", "redis_password_env": "PW"})
    url = args.resolved_redis_url({"URL": "rediss://10.0.0.5:6380/0", "PW": "p@ss/word"})
    assert url == "rediss://:p%40ss%2Fword@10.0.0.5:6380/0"


def test_redis_password_from_file_replaces_one_in_the_url():
    args = AppArgs.model_validate(
        {"checkpoint": "x", "redis_url": "redis://u:old@h:1/0", "redis_password_file": "/run/pw"}
    )
    assert args.resolved_redis_url({}, read_file={"/run/pw": "new\n"}.__getitem__) == "redis://u:new@h:1/0"


def test_missing_redis_env_names_the_field():
    args = AppArgs.model_validate({"checkpoint": "x", "redis_url_env": "URL", "redis_password_env": "PW"})
    with pytest.raises(ValueError, match="redis_url_env"):
        args.resolved_redis_url({})
    with pytest.raises(ValueError, match="redis_password_env"):
        args.resolved_redis_url({"URL": "redis://h:1/0"})


def test_empty_password_file_is_refused():
    args = AppArgs.model_validate({**BASE, "redis_password_file": "/run/pw"})
    with pytest.raises(ValueError, match="redis_password_file"):
        args.resolved_redis_url({}, read_file=lambda _: "\n")


def test_joint_autoscaling_needs_bounds_for_every_role():
    scaling = {"autoscaling": {"min_replicas": 1, "max_replicas": 2}}
    with pytest.raises(Exception, match="router"):
        AppArgs.model_validate({**BASE, "joint_autoscaling": True, "prefill": scaling, "decode": scaling})
    args = AppArgs.model_validate(
        {**BASE, "joint_autoscaling": True, "prefill": scaling, "decode": scaling, "router": scaling}
    )
    opts = args.decode.deployment_options(joint=True)["autoscaling_config"]
    assert (opts["upscale_delay_s"], opts["downscale_delay_s"]) == (0.0, 0.0)
    assert args.decode.deployment_options()["autoscaling_config"]["downscale_delay_s"] == 120.0


def test_custom_resources_and_bundles_reach_the_deployment_options():
    args = AppArgs.model_validate(
        {
            **BASE,
            "decode": {
                "num_gpus": 1,
                "resources": {"flashpd_decode": 1},
                "placement_group_bundles": [{"GPU": 1, "flashpd_decode": 1}, {"GPU": 1}],
            },
        }
    )
    opts = args.decode.deployment_options()
    assert opts["ray_actor_options"] == {"num_cpus": 0.0, "num_gpus": 1.0, "resources": {"flashpd_decode": 1.0}}
    assert opts["placement_group_bundles"] == [{"GPU": 1, "flashpd_decode": 1}, {"GPU": 1}]
    assert opts["placement_group_strategy"] == "STRICT_PACK"


def test_first_bundle_must_hold_the_replica():
    with pytest.raises(Exception, match="placement_group_bundles"):
        AppArgs.model_validate(
            {
                **BASE,
                "decode": {
                    "num_gpus": 1,
                    "resources": {"flashpd_decode": 1},
                    "placement_group_bundles": [{"GPU": 1}, {"GPU": 1}],
                },
            }
        )
    with pytest.raises(Exception, match="placement_group_strategy"):
        AppArgs.model_validate({**BASE, "decode": {"placement_group_strategy": "PACK"}})
