"""`flashpd bench ...` end to end on an in-process fake server (the connect seam is replaced)."""

from __future__ import annotations

import json

import pytest

from flashpd.bench import cli as bench_cli
from flashpd.bench.workload import Workload
from flashpd.cli import main

WORKLOAD_ARGS = [
    "--trees",
    "6",
    "--scale",
    "2000",
    "--output-scale",
    "200",
    "--time-scale",
    "2000",
    "--max-turns",
    "10",
    "--seed",
    "4",
]
DRIVER_ARGS = ["--window-s", "0.3", "--warmup-requests", "2", "--drain-timeout-s", "2", "--no-progress"]


@pytest.fixture
def fake_connect(monkeypatch, fake_backend_cls):
    targets: list[str] = []

    def connect(target: str):
        targets.append(target)
        return fake_backend_cls()

    monkeypatch.setattr(bench_cli, "connect", connect)
    return targets


def test_gen_writes_a_replayable_workload_and_prints_its_shape(tmp_path, capsys):
    out = tmp_path / "wl.jsonl"
    assert main(["bench", "gen", "--out", str(out), *WORKLOAD_ARGS]) == 0
    shape = json.loads(capsys.readouterr().out)
    workload = Workload.read_jsonl(out)
    assert shape["trees"] == 6 == len(workload.trees)
    assert workload.config.scale == 2000.0 and workload.config.max_turns == 10


def test_run_writes_records_and_meta(tmp_path, fake_connect):
    out = tmp_path / "run"
    code = main(
        [
            "bench",
            "run",
            "--target",
            "127.0.0.1:9000",
            "--gpus",
            "2",
            "-c",
            "2",
            "--out",
            str(out),
            *WORKLOAD_ARGS,
            *DRIVER_ARGS,
        ]
    )
    assert code == 0 and fake_connect == ["127.0.0.1:9000"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["concurrency"] == 2 and meta["num_gpus"] == 2
    assert (out / "records.jsonl").read_text().count("\n") > 4


def test_sweep_runs_each_concurrency_and_writes_the_report(tmp_path, fake_connect):
    out = tmp_path / "study"
    code = main(
        [
            "bench",
            "sweep",
            "--target",
            "127.0.0.1:9000",
            "--name",
            "local",
            "--gpus",
            "1",
            "--concurrency",
            "2,1",
            "--cap",
            "20",
            "--out",
            str(out),
            *WORKLOAD_ARGS,
            *DRIVER_ARGS,
        ]
    )
    assert code == 0
    assert sorted(p.name for p in (out / "local").iterdir()) == ["c1", "c2"]
    assert (out / "report.md").exists() and (out / "workload.jsonl").exists()
    assert main(["bench", "report", str(out), "--cap", "20"]) == 0


def test_ab_replays_the_same_workload_against_each_named_target(tmp_path, fake_connect):
    out = tmp_path / "ab"
    code = main(
        [
            "bench",
            "ab",
            "--target",
            "a=127.0.0.1:9000",
            "--target",
            "b=127.0.0.1:9100",
            "--gpus",
            "2",
            "--gpus",
            "b=4",
            "--concurrency",
            "1",
            "--out",
            str(out),
            *WORKLOAD_ARGS,
            *DRIVER_ARGS,
        ]
    )
    assert code == 0 and fake_connect == ["127.0.0.1:9000", "127.0.0.1:9100"]
    assert json.loads((out / "b" / "c1" / "meta.json").read_text())["num_gpus"] == 4
    assert "## A/B: ratios against `a`" in (out / "report.md").read_text()


def test_run_exits_nonzero_when_the_server_keeps_failing(tmp_path, monkeypatch, fake_backend_cls):
    monkeypatch.setattr(bench_cli, "connect", lambda target: fake_backend_cls(fail=lambda call: True))
    code = main(
        [
            "bench",
            "run",
            "--target",
            "x:1",
            "--gpus",
            "1",
            "-c",
            "1",
            "--out",
            str(tmp_path / "r"),
            "--max-consecutive-errors",
            "3",
            *WORKLOAD_ARGS,
            *DRIVER_ARGS,
        ]
    )
    assert code == bench_cli.EXIT_ABORTED


def test_target_and_gpu_parsing_is_strict():
    targets = bench_cli.parse_targets(["a=h:1", "b=h:2"], ["8", "b=2"])
    assert [(t.name, t.address, t.num_gpus) for t in targets] == [("a", "h:1", 8), ("b", "h:2", 2)]
    with pytest.raises(ValueError):
        bench_cli.parse_targets(["h:1"], ["1"])
    with pytest.raises(ValueError):
        bench_cli.parse_targets(["a=h:1"], ["c=2"])
    with pytest.raises(ValueError):
        bench_cli.parse_targets(["a=h:1", "b=h:2"], ["a=2"])
    assert bench_cli.parse_concurrency("8,1,2,2") == [1, 2, 8]
    with pytest.raises(ValueError):
        bench_cli.parse_concurrency("0,1")
