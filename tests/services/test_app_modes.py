"""The serving mode at the edge: `mode: colocated` with its `colocated` section, validated
strictly (a config is one mode; mixing the roles is refused naming the field)."""

from __future__ import annotations

import pytest

from flashpd.services.app import AppArgs

BASE = {"checkpoint": "x", "redis_url": "redis://h:1"}
SCALING = {"autoscaling": {"min_replicas": 1, "max_replicas": 2}}


def test_default_mode_is_disaggregated_with_prefill_and_decode():
    args = AppArgs.model_validate(BASE)
    assert args.mode == "disaggregated" and args.worker_roles() == ("prefill", "decode")
    assert args.worker_config("decode").engine.role == "decode"
    with pytest.raises(ValueError, match="colocated"):
        args.worker_config("colocated")


def test_colocated_mode_builds_a_colocated_engine_from_its_section():
    args = AppArgs.model_validate({**BASE, "mode": "colocated", "colocated": {"num_blocks": 4096, "max_num_seqs": 8}})
    assert args.worker_roles() == ("colocated",)
    cfg = args.worker_config("colocated")
    assert (cfg.engine.role, cfg.engine.num_blocks, cfg.engine.max_num_seqs) == ("colocated", 4096, 8)
    with pytest.raises(ValueError, match="prefill"):
        args.worker_config("prefill")


def test_colocated_mode_without_a_section_takes_the_role_defaults():
    args = AppArgs.model_validate({**BASE, "mode": "colocated"})
    assert args.worker_config("colocated").engine.num_blocks == 512


@pytest.mark.parametrize("section", ["prefill", "decode"])
def test_colocated_mode_with_a_prefill_or_decode_section_is_refused_naming_it(section):
    with pytest.raises(Exception, match=f"{section}: mode colocated"):
        AppArgs.model_validate({**BASE, "mode": "colocated", "colocated": {}, section: {"num_blocks": 8}})


def test_a_colocated_section_without_the_mode_is_refused_naming_it():
    with pytest.raises(Exception, match="colocated: a colocated section needs `mode: colocated`"):
        AppArgs.model_validate({**BASE, "colocated": {"num_blocks": 8}})


def test_unknown_mode_and_unknown_section_keys_are_refused():
    with pytest.raises(Exception, match="mode"):
        AppArgs.model_validate({**BASE, "mode": "hybrid"})
    with pytest.raises(Exception, match="bogus"):
        AppArgs.model_validate({**BASE, "mode": "colocated", "colocated": {"bogus": 1}})


def test_joint_autoscaling_is_refused_in_colocated_mode_naming_it():
    with pytest.raises(Exception, match="joint_autoscaling"):
        AppArgs.model_validate(
            {**BASE, "mode": "colocated", "joint_autoscaling": True, "colocated": SCALING, "router": SCALING}
        )
    args = AppArgs.model_validate({**BASE, "mode": "colocated", "colocated": SCALING})
    assert args.colocated_args.deployment_options()["autoscaling_config"]["max_replicas"] == 2


def test_speculative_decoding_goes_to_the_colocated_workers():
    args = AppArgs.model_validate({**BASE, "mode": "colocated", "speculative": {"method": "ngram"}})
    assert args.worker_config("colocated").engine.speculative.method == "ngram"


def _cli_args(*argv: str):
    import argparse

    from flashpd.services.cli import register

    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return p.parse_args(["serve", "--preset", "tiny", *argv])


def test_flashpd_serve_mode_colocated_builds_a_valid_colocated_config():
    from flashpd.services.cli import app_args

    a = app_args(_cli_args("--mode", "colocated", "--colocated-replicas", "2"), "ckpt", "redis://127.0.0.1:1")
    args = AppArgs.model_validate(a)
    assert args.mode == "colocated" and args.colocated_args.replicas == 2
    assert "prefill" not in a and "decode" not in a
    pd = AppArgs.model_validate(app_args(_cli_args(), "ckpt", "redis://127.0.0.1:1"))
    assert pd.mode == "disaggregated" and (pd.prefill.replicas, pd.decode.replicas) == (1, 1)


def test_flashpd_serve_refuses_the_other_modes_replica_flags():
    from flashpd.services.cli import app_args

    with pytest.raises(SystemExit, match="--prefill-replicas"):
        app_args(_cli_args("--mode", "colocated", "--prefill-replicas", "2"), "ckpt", "redis://127.0.0.1:1")
    with pytest.raises(SystemExit, match="--colocated-replicas"):
        app_args(_cli_args("--colocated-replicas", "2"), "ckpt", "redis://127.0.0.1:1")


def test_early_kv_push_is_off_by_default_and_reaches_the_workers_when_on():
    assert not AppArgs.model_validate(BASE).worker_config("prefill").push_early
    args = AppArgs.model_validate({**BASE, "kv_push_early": True})
    assert args.worker_config("prefill").push_early
    with pytest.raises(ValueError, match="kv_push_early"):
        AppArgs.model_validate({**BASE, "kv_push_early": "sometimes"})
