"""bench/agentx_gpu.py's parts that decide whether a device call is wasted: the H200 sizing, the
--end-unix guard, the interrupt at the deadline, the CPU variant of the configs, and the device
commands the README gives."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest

from flashpd.bench import agentx_gpu as g

ROOT = Path(__file__).resolve().parents[2]


def sweep_args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    g._add_sweep_args(p)
    return p.parse_args(["--config", "c.yaml", "--name", "flashpd", "--out", "/o", *extra])


def test_the_default_workload_is_agentx_on_one_h200():
    """Prompts 5K-128K with a ~27K mean, ~150-token main outputs, ~1 s think times."""
    from flashpd.bench.workload import WorkloadConfig, generate_workload, summarize

    a = sweep_args()
    config = WorkloadConfig(num_trees=a.trees, scale=a.scale, time_scale=a.time_scale, output_scale=a.output_scale)
    wl = generate_workload(config)
    prompts = [r.prompt_tokens for r in wl.requests()]
    s = summarize(wl)
    assert 24_000 <= sum(prompts) / len(prompts) <= 31_000
    assert max(prompts) <= 128_000 and config.tokens(config.shape.context_cap_tokens) == 128_000
    assert 130 <= s["main_output_p50"] <= 170 and 0.7 <= s["think_p50_s"] <= 1.3


def test_a_point_command_carries_the_workload_and_the_window():
    a = sweep_args()
    cmd = g.sweep_command("127.0.0.1:9000", "flashpd", "/o", 8, a)
    flag = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("-")}
    assert flag["-c"] == "8" and flag["--window-s"] == "15" and flag["--scale"] == "7.8125"
    assert flag["--output-scale"] == "4" and flag["--time-scale"] == "5" and flag["--tree-idle-cap-s"] == "5"
    assert flag["--warmup-requests"] == "0" and cmd[-1] == "/o/flashpd/c8"
    low = g.sweep_command("t", "flashpd", "/o", 2, a)
    assert low[low.index("--window-s") + 1] == "20"


def test_the_guard_counts_the_cold_primers_and_skips_what_cannot_end_in_time():
    a = sweep_args()
    # 32 lanes x 38K-token primers at 14K tok/s: ~87 s before the window opens
    assert g.point_estimate_s(32, 15.0, 38_000, 14_000) == pytest.approx(32 * 38_000 / 14_000 + 15 + 8 + 3)
    end = time.time() + a.teardown_s + 100.0
    assert g._plan_point(1, a, 38_000, end, 14_000) is None
    why = g._plan_point(32, a, 38_000, end, 14_000)
    assert why is not None and "cold prefill of 32 primers" in why


def test_the_default_sweep_fits_one_call_after_a_cold_bring_up():
    """With the H200 bring-up measured on a fresh machine (161 s) after ~30 s of installing the
    bundle, points 1-32 fit the call's budget by the guard's own estimate; 64 (its 64 cold
    primers alone ~175 s) does not."""
    a = sweep_args()
    primer = g.mean_primer_tokens(a)
    t, ran = 161.0 + 30.0, []
    for c in g.parse_concurrency(a.concurrency):
        need = g.point_estimate_s(c, g.window_s(c, a), primer, a.prefill_tok_s)
        if t + need <= g.CALL_BUDGET_S - a.teardown_s:
            t, ran = t + need, ran + [c]
    assert ran == [1, 2, 4, 8, 16, 32]


def test_a_point_past_the_deadline_is_interrupted_then_reported_cut(tmp_path):
    """SIGINT first (the driver writes meta.json on it), exit code 124."""
    marker = tmp_path / "got_sigint"
    script = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGINT, lambda *_: (open({str(marker)!r}, 'w').close(), sys.exit(130)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    assert g.run_point([sys.executable, "-c", script], time.time() + 3.0) == 124
    assert marker.exists()


def test_a_point_that_ends_in_time_returns_its_exit_code():
    assert g.run_point([sys.executable, "-c", "raise SystemExit(3)"], time.time() + 60) == 3


def test_the_cpu_variant_keeps_the_switches_and_passes_the_launcher_check(tmp_path):
    import yaml

    from flashpd.services.gpu_stack import check_config

    for name, src in g.CONFIGS.items():
        raw = g.cpu_config(str(ROOT / src), "/ckpt", grpc_port=9100, http_port=8100)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        cpu, h200 = check_config(str(path), num_gpus=0), check_config(str(ROOT / src), num_gpus=1)
        for key in ("routing", "swa_bounded_replay", "kv_format", "kernel_impls", "kv_lease_s", "speculative"):
            assert cpu.args.get(key) == h200.args.get(key)
        assert cpu.args["device"] == "cpu" and cpu.gpus == 0 and cpu.http_port == 8100
        assert "FLASHPD_KV_TRANSPORTS" not in cpu.env
        assert {k: v for k, v in h200.env.items() if k != "FLASHPD_KV_TRANSPORTS"} == cpu.env


def test_h200_pools_hold_an_agentic_prefix_cache_in_the_spare_memory():
    """The P/D configs: the same block counts (same tokens cached); pools fit ~27 GiB spare with
    room left for activation peaks (NVFP4 113,920 B, FP8 190,720 B per block). The colocated
    config's one pool holds both P/D pools' blocks (the comparison keeps the KV memory equal)."""
    from flashpd.engine.kv_pools import PoolGeometry
    from flashpd.model.presets import preset_config
    from flashpd.services.gpu_stack import check_config

    counts = set()
    total_gib = {}
    for name, src in g.CONFIGS.items():
        c = check_config(str(ROOT / src), num_gpus=1)
        block = sum(
            PoolGeometry(preset_config("bench"), compressed_format=c.args.get("kv_format", "nvfp4"))
            .group_block_bytes()
            .values()
        )
        if c.args.get("mode") == "colocated":
            colocated_blocks = c.args["colocated"]["num_blocks"]
            total_gib[name] = colocated_blocks * block / 2**30
            continue
        blocks = (c.args["prefill"]["num_blocks"], c.args["decode"]["num_blocks"])
        counts.add(blocks)
        total_gib[name] = sum(blocks) * block / 2**30
        assert min(blocks) * 128 >= 64 * 28_000  # 64 sessions of AgentX's mean context, per role
    assert len(counts) == 1
    assert colocated_blocks == sum(next(iter(counts)))
    assert total_gib["flashpd"] == total_gib["colocated"] < total_gib["baseline"] <= 12.0


def test_the_readme_gives_the_device_commands_and_the_report_command():
    readme = (ROOT / "README.md").read_text()
    for name in g.CONFIGS:
        assert g.device_command(name) in readme
    assert g.report_command() in readme


def test_the_device_command_runs_the_sweep_the_guard_knows(monkeypatch):
    """The command's sweep arguments parse, name a shipped config, and carry --end-unix."""
    for name in g.CONFIGS:
        cmd = g.device_command(name)
        sweep = cmd.split("agentx sweep ", 1)[1].split(" > ", 1)[0]
        argv = [w.strip('"').replace("$PWD/", "") for w in sweep.split()]
        argv[argv.index("--end-unix") + 1] = "0"
        argv[argv.index("--out") + 1] = "/o"
        a = sweep_args(*argv)
        assert a.config == g.CONFIGS[name] and a.name == name and a.end_unix == 0.0
        assert (ROOT / a.config).exists()


@pytest.mark.net
def test_a_real_point_cut_at_the_deadline_keeps_its_records_and_meta(tmp_path):
    """`flashpd bench run` against a server that accepts and never answers: at the deadline the
    SIGINT reaches the driver, which cancels the in-flight primer, records it and writes
    meta.json (interrupted, no window) before exiting."""
    import json
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []

    def accept() -> None:
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    tiny = ["--trees", "2", "--scale", "300", "--time-scale", "50", "--output-scale", "40", "--max-turns", "8"]
    a = sweep_args(*tiny, "--vocab-lo", "10", "--vocab-hi", "500")
    target = f"127.0.0.1:{srv.getsockname()[1]}"
    try:
        assert g.run_point(g.sweep_command(target, "cut", str(tmp_path), 1, a), time.time() + 8.0) == 124
    finally:
        srv.close()
    meta = json.loads((tmp_path / "cut" / "c1" / "meta.json").read_text())
    assert meta["interrupted"] is True and meta["window_start_s"] is None
    records = (tmp_path / "cut" / "c1" / "records.jsonl").read_text().splitlines()
    assert records and json.loads(records[0])["error_type"] == "Cancelled"


def test_a_single_switch_sweep_turns_exactly_one_optimisation_off(tmp_path):
    import yaml

    from flashpd.services.gpu_stack import check_config

    src = str(ROOT / g.CONFIGS["flashpd"])
    base = yaml.safe_load(Path(src).read_text())["applications"][0]
    for switch in g.SWITCHES:
        a = sweep_args("--switch-off", switch)
        a.config, a.out, a.name = src, str(tmp_path), f"off-{switch}"
        g._switched(a)
        assert Path(a.config) == tmp_path / f"off-{switch}" / "config.yaml"
        app = yaml.safe_load(Path(a.config).read_text())["applications"][0]
        changed_args = {k for k in app["args"] if app["args"][k] != base["args"].get(k)}
        changed_env = {
            k for k, v in app["runtime_env"]["env_vars"].items() if base["runtime_env"]["env_vars"].get(k) != v
        }
        assert len(changed_args) + len(changed_env) == 1, (switch, changed_args, changed_env)
        check_config(a.config, num_gpus=1)  # still a config the launcher takes
    with pytest.raises(SystemExit):
        sweep_args("--switch-off", "engram")  # no such switch: refused by name before any bring-up


def test_the_kernel_switches_add_one_reference_op_to_the_configs_kernel_impls(tmp_path):
    import yaml

    src = ROOT / g.CONFIGS["flashpd"]
    assert "kernel_impls" not in yaml.safe_load(src.read_text())["applications"][0]["args"]
    for switch in ("indexer", "mhc"):
        args = g.switched_config(str(src), switch)["applications"][0]["args"]
        assert args["kernel_impls"] == {switch: "ref"}
    raw = yaml.safe_load(src.read_text())
    raw["applications"][0]["args"]["kernel_impls"] = {"mhc": "ref"}
    both = tmp_path / "mhc.yaml"
    both.write_text(yaml.safe_dump(raw))
    args = g.switched_config(str(both), "indexer")["applications"][0]["args"]
    assert args["kernel_impls"] == {"mhc": "ref", "indexer": "ref"}  # merged, not replaced


def test_the_spec_config_is_flashpds_plus_forced_speculation_on_the_decode_workers(monkeypatch):
    """infra/serve.h200.spec.yaml = infra/serve.h200.yaml + the speculative block + the benchmark
    flag in the runtime env; the launcher checks the args with that env in effect and leaves
    nothing set behind it."""
    import os

    import yaml

    from flashpd.engine.speculative import BENCH_ENV
    from flashpd.services.app import AppArgs
    from flashpd.services.gpu_stack import check_config

    monkeypatch.delenv(BENCH_ENV, raising=False)
    spec, plain = (yaml.safe_load((ROOT / g.CONFIGS[n]).read_text())["applications"][0] for n in ("spec", "flashpd"))
    assert {k: v for k, v in spec["args"].items() if k != "speculative"} == plain["args"]
    assert spec["args"]["speculative"] == {
        "method": "ngram",
        "num_tokens": 5,
        "max_batch": 16,
        "max_context_tokens": 196_608,
        "bench_forced_acceptance_length": 3.51,
    }
    env = dict(spec["runtime_env"]["env_vars"])
    assert env.pop(BENCH_ENV) == "1" and env == plain["runtime_env"]["env_vars"]
    c = check_config(str(ROOT / g.CONFIGS["spec"]), num_gpus=1)
    assert BENCH_ENV not in os.environ and c.env[BENCH_ENV] == "1"
    monkeypatch.setenv(BENCH_ENV, "1")  # as _export_env leaves it for the replicas
    parsed = AppArgs.model_validate(c.args)
    assert parsed.speculative.engine_config().bench_forced_acceptance_length == 3.51
    assert parsed.worker_config("decode", "redis://127.0.0.1:1").engine.speculative.max_batch == 16
    assert parsed.worker_config("prefill", "redis://127.0.0.1:1").engine.speculative is None  # decode only


def test_the_forced_mode_without_the_benchmark_flag_is_refused_naming_the_setting(tmp_path, monkeypatch):
    import yaml

    from flashpd.engine.speculative import BENCH_ENV
    from flashpd.services.gpu_stack import check_config

    monkeypatch.delenv(BENCH_ENV, raising=False)
    raw = yaml.safe_load((ROOT / g.CONFIGS["spec"]).read_text())
    del raw["applications"][0]["runtime_env"]["env_vars"][BENCH_ENV]
    path = tmp_path / "spec_no_flag.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=f"bench_forced_acceptance_length is a benchmark mode.*{BENCH_ENV}=1"):
        check_config(str(path), num_gpus=1)
    raw["applications"][0]["runtime_env"]["env_vars"][BENCH_ENV] = "true"  # only "1" enables it
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=BENCH_ENV):
        check_config(str(path), num_gpus=1)


def test_the_sdk_backend_keeps_the_usage_speculation_figures():
    """The driver's records carry what the usage says of speculation; the forced acceptance length
    comes back as set although the wire carries it as a 32-bit float."""
    import struct

    from flashpd.bench.backend import _completion
    from flashpd_sdk.types import GenerateResult, Usage

    wire = struct.unpack("f", struct.pack("f", 3.51))[0]
    usage = Usage(3, 9, draft_tokens=10, accepted_draft_tokens=5, draft_steps=2, forced_acceptance_length=wire)
    c = _completion(GenerateResult("r", (1,), "", "length", usage))
    assert wire != 3.51 and c.forced_acceptance_length == 3.51
    assert (c.draft_tokens, c.accepted_draft_tokens, c.draft_steps) == (10, 5, 2)
    plain = _completion(GenerateResult("r", (1,), "", "length", Usage(3, 9)))
    assert plain.forced_acceptance_length == 0.0 and plain.draft_steps == 0


def _call(root: Path, name: str, points: dict[int, int], ready_s: float, skipped=()) -> Path:
    """A device call's OUT: <name>/sweep.json and one point folder per concurrency."""
    d = root / name
    d.mkdir(parents=True)
    for c, marker in points.items():
        (d / f"c{c}").mkdir()
        (d / f"c{c}" / "records.jsonl").write_text(f"{marker}\n")
    record = {
        "config": f"/x/{name}.yaml",
        "name": name,
        "argv": ["sweep"],
        "ready_s": ready_s,
        "kv_transports": {f"recv-{ready_s}": "cuda_ipc"},
        "points": [{"concurrency": c, "exit": 0, "wall_s": 1.0} for c in points],
        "not_started": [{"concurrency": c, "why": "time"} for c in skipped],
    }
    (d / "sweep.json").write_text(g.json.dumps(record))
    return root


def test_merging_calls_keeps_every_run_its_commit_and_the_newest_point(tmp_path):
    study = _call(tmp_path / "study", "flashpd", {1: "old1", 2: "old2"}, 60.0)
    first = _call(tmp_path / "a", "flashpd", {2: "new2", 8: "new8"}, 240.0, skipped=(64,))
    second = _call(tmp_path / "b", "flashpd", {64: "new64"}, 50.0)
    assert g.merge_sweeps(study, first, "bbb", study_commit="aaa") == ["flashpd"]
    g.merge_sweeps(study, second, "ccc")
    merged = g.json.loads((study / "flashpd" / "sweep.json").read_text())
    assert [(p["concurrency"], p["commit"]) for p in merged["points"]] == [
        (1, "aaa"),
        (2, "bbb"),
        (8, "bbb"),
        (64, "ccc"),
    ]
    assert [r["commit"] for r in merged["runs"]] == ["aaa", "bbb", "ccc"]
    assert merged["not_started"] == [] and merged["ready_s"] == 50.0 and len(merged["kv_transports"]) == 3
    assert (study / "flashpd" / "c2" / "records.jsonl").read_text() == "new2\n"
    assert (study / "flashpd" / "c1" / "records.jsonl").read_text() == "old1\n"


def test_a_point_skipped_by_the_only_run_stays_listed(tmp_path):
    study = tmp_path / "study"
    study.mkdir()
    g.merge_sweeps(study, _call(tmp_path / "a", "colocated", {1: "x"}, 100.0, skipped=(32,)), "bbb")
    merged = g.json.loads((study / "colocated" / "sweep.json").read_text())
    assert merged["not_started"] == [{"concurrency": 32, "why": "time"}]


def test_requests_the_driver_stopped_at_its_drain_are_not_server_failures():
    from types import SimpleNamespace

    from flashpd.bench import agentx_report
    from flashpd.bench.records import STOPPED_IN_FLIGHT, Phase, RequestRecord

    def rec(error_type=None, error=None):
        return RequestRecord(0, Phase.MEASURE, 0, 0, "main", "s", None, 0, 0.0, 0.0, 1.0, 0.1, [], 10, 5, 5, 0,
                             error_type=error_type, error=error)  # fmt: skip

    records = [rec(), rec("Cancelled", STOPPED_IN_FLIGHT), rec("Unavailable", "no decode worker")]
    meta = SimpleNamespace(concurrency=64, aborted_reason=None, interrupted=False)
    e = agentx_report._errors([SimpleNamespace(records=records, meta=meta)])
    assert (e["failed"], e["cut_at_drain"], e["server_failed"]) == (2, 1, 1)


def test_gpu_memory_reads_the_cards_and_each_process_from_nvidia_smi(monkeypatch):
    import subprocess

    answers = {
        "--query-gpu=memory.used,memory.total": "120500, 143771\n",
        "--query-compute-apps=pid,used_memory": "4242, 61000\n4343, 59500\n",
    }

    def run(argv, **kw):
        return subprocess.CompletedProcess(argv, 0, stdout=answers[argv[1]], stderr="")

    monkeypatch.setattr(g.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert g.gpu_memory(run) == {
        "gpus": [{"used_mib": 120500, "total_mib": 143771}],
        "processes": [{"pid": 4242, "used_mib": 61000}, {"pid": 4343, "used_mib": 59500}],
    }
    monkeypatch.setattr(g.shutil, "which", lambda name: None)
    assert g.gpu_memory(run) is None  # a CPU machine: nothing to read


def test_a_sweep_whose_every_request_failed_is_not_merged_unless_asked(tmp_path):
    study = _call(tmp_path / "study", "baseline", {1: "measured"}, 60.0)
    failed = '{"error_type": "InternalError"}\n{"error_type": "Cancelled"}\n'
    call = _call(tmp_path / "a", "baseline", {1: "x", 2: "x"}, 70.0)
    for c in (1, 2):
        (call / "baseline" / f"c{c}" / "records.jsonl").write_text(failed)
    said: list[str] = []
    assert g.merge_sweeps(study, call, "bbb", log=said.append) == []
    assert "baseline left out: every request of its points failed" in said[0]
    assert (study / "baseline" / "c1" / "records.jsonl").read_text() == "measured\n"  # kept
    assert g.merge_sweeps(study, call, "bbb", keep_failed=True) == ["baseline"]
    assert (study / "baseline" / "c1" / "records.jsonl").read_text() == failed
    # one point with a served request is a measurement: merged
    mixed = _call(tmp_path / "b", "flashpd", {1: "x", 2: "x"}, 70.0)
    (mixed / "flashpd" / "c1" / "records.jsonl").write_text(failed)
    (mixed / "flashpd" / "c2" / "records.jsonl").write_text('{"error_type": null}\n')
    assert g.merge_sweeps(study, mixed, "ccc", log=said.append) == ["flashpd"]
