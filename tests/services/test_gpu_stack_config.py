"""The one-GPU stack launcher's config check (services/gpu_stack.py): the shipped config passes,
and what the launcher cannot run is refused before anything starts."""

import pytest
import yaml

from flashpd.services.gpu_stack import check_config

CONFIG = "infra/serve.h200.yaml"


def _variant(tmp_path, edit) -> str:
    with open(CONFIG) as f:
        raw = yaml.safe_load(f)
    edit(raw["applications"][0])
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_shipped_config_shares_one_gpu_between_prefill_and_decode():
    c = check_config(CONFIG, num_gpus=1)
    assert c.replicas == {"router": 1, "prefill": 1, "decode": 1}
    assert c.gpus == 1.0
    assert c.env["FLASHPD_KV_TRANSPORTS"] == "cuda_ipc"
    assert c.args["checkpoint"] == "random:bench:0"


def test_gpu_fractions_beyond_the_machine_are_refused(tmp_path):
    path = _variant(tmp_path, lambda app: app["args"]["decode"].update(num_gpus=0.75))
    with pytest.raises(ValueError, match="1.25 GPUs"):
        check_config(path, num_gpus=1)


def test_autoscaled_roles_are_refused(tmp_path):
    def edit(app):
        app["args"]["prefill"]["autoscaling"] = {"min_replicas": 1, "max_replicas": 2}
        app["args"]["prefill"]["replicas"] = None

    with pytest.raises(ValueError, match="prefill needs a fixed"):
        check_config(_variant(tmp_path, edit), num_gpus=1)


def test_unknown_args_are_refused_by_the_app_model(tmp_path):
    path = _variant(tmp_path, lambda app: app["args"]["decode"].update(num_gpu=0.5))
    with pytest.raises(ValueError, match="num_gpu"):
        check_config(path, num_gpus=1)


def test_random_weights_on_the_cpu_are_refused(tmp_path):
    path = _variant(tmp_path, lambda app: app["args"].update(device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match="needs device 'cuda'"):
        check_config(path, num_gpus=1)


def test_kv_lease_reaches_both_roles():
    from flashpd.services.app import AppArgs

    c = check_config(CONFIG, num_gpus=1)
    args = AppArgs.model_validate({**c.args, "redis_url": "redis://127.0.0.1:1", "redis_url_env": None})
    assert args.worker_config("prefill").lease_s == args.worker_config("decode").lease_s == 300


def test_baseline_config_turns_the_switchable_optimizations_off():
    """infra/serve.h200.baseline.yaml (issue 28's A/B baseline) validates as the stack's config
    and differs from the shipped one only in the switches it names."""
    base, shipped = check_config("infra/serve.h200.baseline.yaml"), check_config(CONFIG)
    assert base.replicas == shipped.replicas and base.gpus == shipped.gpus
    diff = {k for k in set(base.args) | set(shipped.args) if base.args.get(k) != shipped.args.get(k)}
    assert diff == {"swa_bounded_replay", "kv_format", "routing", "kernel_impls", "overlap_reserve"}
    assert (base.args["swa_bounded_replay"], base.args["kv_format"], base.args["routing"]) == (
        False,
        "fp8",
        "round_robin",
    )
    assert base.args["kernel_impls"] == {"indexer": "ref", "mhc": "ref"}  # the torch references
    assert base.args["overlap_reserve"] is False and shipped.args["overlap_reserve"] is True
    extra = {k: v for k, v in base.env.items() if shipped.env.get(k) != v}
    assert extra == {"FLASHPD_MOE_FUSED_GATE": "0", "FLASHPD_GRAPH_TURNS": "0", "FLASHPD_GRAPH_PD": "0"}


def test_colocated_config_gives_one_replica_the_whole_gpu():
    c = check_config("infra/serve.h200.colocated.yaml", num_gpus=1)
    assert c.replicas == {"router": 1, "colocated": 1} and c.gpus == 1.0
    assert c.args["mode"] == "colocated" and "FLASHPD_KV_TRANSPORTS" not in c.env
    shipped = check_config(CONFIG, num_gpus=1).args
    pools = shipped["prefill"]["num_blocks"] + shipped["decode"]["num_blocks"]
    assert c.args["colocated"]["num_blocks"] == pools  # the P/D pair's pools together


def test_colocated_config_with_a_decode_section_is_refused_naming_it(tmp_path):
    path = tmp_path / "serve.yaml"
    with open("infra/serve.h200.colocated.yaml") as f:
        raw = yaml.safe_load(f)
    raw["applications"][0]["args"]["decode"] = {"replicas": 1, "num_gpus": 0.5}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="decode: mode colocated"):
        check_config(str(path), num_gpus=1)


def test_a_stack_waits_for_the_gpu_memory_that_a_previous_one_still_holds():
    from flashpd.services.gpu_stack import gpu_processes, wait_gpu_released

    held = [[(111, 60000), (112, 59000)], [(111, 60000)], []]
    now, logged = [0.0], []

    def query():
        return held.pop(0) if len(held) > 1 else held[0]

    def sleep(s):
        now[0] += s

    assert wait_gpu_released(logged.append, 120.0, query, sleep, lambda: now[0]) == []
    assert now[0] == 2.0 and "waiting for 2 process(es)" in logged[0] and len(logged) == 1

    now[0], logged[:] = 0.0, []
    stuck = wait_gpu_released(logged.append, 5.0, lambda: [(7, 100)], sleep, lambda: now[0])
    assert stuck == [(7, 100)] and now[0] == 5.0 and "WARNING" in logged[-1]
    assert wait_gpu_released(logged.append, 5.0, lambda: None, sleep, lambda: now[0]) == []  # no nvidia-smi

    class Out:
        stdout = "111, 60000\n112, 59000\n[Not Supported], 3\n"

    if gpu_processes(lambda *a, **k: Out()) is not None:  # nvidia-smi on this machine
        assert gpu_processes(lambda *a, **k: Out()) == [(111, 60000), (112, 59000)]
