"""The AgentX device calls rehearsed on the CPU, end to end (issue 28): every H200 config (the
P/D A/B pair, the colocated one and the speculative one with forced acceptance, swept at
concurrency 1 only to keep the rehearsal short) turned into CPU configs (`agentx_gpu cpu-config`: same switches, tiny checkpoint), each swept by
`agentx_gpu sweep` as the device call runs it (Redis, Ray, router + prefill + decode, NIXL over
loopback, `flashpd bench run` per point, teardown), then `agentx_gpu report` (its pd_vs_colocated
from the colocated sweep, the forced configuration marked). Minutes; run it in a
loopback-only namespace (scripts/test.sh does)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.net]

ROOT = Path(__file__).resolve().parents[2]
TINY_WORKLOAD = [
    "--concurrency", "1,2", "--window-s", "8", "--window-low-s", "8", "--trees", "4", "--scale", "300",
    "--time-scale", "50", "--output-scale", "40", "--max-turns", "8", "--vocab-lo", "10", "--vocab-hi", "500",
    "--tree-idle-cap-s", "1", "--prefill-tok-s", "2000", "--ready-timeout-s", "300",
    # a point's in-flight requests may finish for up to this long after its window: the tiny
    # workload's longest answer (694 tokens, started 7 s into a c=1 window) took 31 s on a
    # loaded 2-core CI machine and was cut at the default 30 s ("run stopped while in flight")
    "--drain-timeout-s", "150",
]  # fmt: skip


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN", "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run(
        [sys.executable, "-m", "flashpd.bench.agentx_gpu", *args],
        env=env,
        timeout=timeout_s,
        capture_output=True,
        text=True,
    )


def test_every_config_sweeps_and_reports_on_the_cpu(ckpt_dir, tmp_path, rectangular_tables):
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    pytest.importorskip("ray")
    pytest.importorskip("nixl")
    from flashpd.bench.agentx_gpu import CONFIGS
    from flashpd.services.redis_local import free_port

    out = tmp_path / "agentx"
    end = time.time() + 1800
    for name, src in CONFIGS.items():
        cpu = tmp_path / f"{name}.yaml"
        ports = ["--grpc-port", str(free_port()), "--http-port", str(free_port())]
        assert (
            _run(["cpu-config", str(ROOT / src), "--checkpoint", ckpt_dir, "--out", str(cpu), *ports], 60).returncode
            == 0
        )
        sweep = ["sweep", "--config", str(cpu), "--name", name, "--out", str(out), "--end-unix", str(end)]
        # later flags win. The spec sweep: one point, and outputs a quarter as long: a 6-row
        # verify on the CPU reference is slower than the forced 3.51 tokens it yields, so the
        # default outputs (~700 tokens) could still be decoding when the point's drain ends
        # (a CI run counted one such request as failed: "run stopped while in flight")
        points = ["--concurrency", "1", "--output-scale", "160"] if name == "spec" else []
        done = _run(sweep + TINY_WORKLOAD + points, 600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        record = json.loads((out / name / "sweep.json").read_text())
        swept = [(1, 0)] if name == "spec" else [(1, 0), (2, 0)]
        assert [(p["concurrency"], p["exit"]) for p in record["points"]] == swept
        assert record["not_started"] == [] and record["ready_s"] > 0 and "error" not in record
        assert "kv_transports" in record
        roles = {"colocated"} if name == "colocated" else {"prefill", "decode"}
        assert {w["role"] for w in record["points"][-1]["workers_after"]} == roles
    (out / "status.md").write_text("## Where the study stands\n\nhand-written, kept\n")
    report = _run(["report", str(out), "--baseline", "baseline", "--candidate", "flashpd", "--commit", "dry"], 300)
    assert report.returncode == 0, report.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["commit"] == "dry" and s["preset"] == "bench" and s["configuration"] == "flashpd"
    assert set(s["tiers"]) == {"20", "60", "150"} and all(isinstance(t["met"], bool) for t in s["tiers"].values())
    assert s["ab"]["baseline"] == "baseline" and s["ab"]["low_concurrency_points"] == 2
    assert s["ab"]["speedup_low_concurrency"] > 0
    assert set(s["ab"]["throughput_ratio_at_tier"]) == {"20", "60", "150"}
    pdc = s["pd_vs_colocated"]  # the colocated sweep against the P/D candidate
    assert pdc["measured"] is True and (pdc["pd"], pdc["colocated"]) == ("flashpd", "colocated")
    assert pdc["low_concurrency_points"] == 2 and pdc["speedup_low_concurrency"] > 0
    assert set(pdc["throughput_ratio_at_tier"]) == {"20", "60", "150"}
    for name in CONFIGS:
        assert s["errors"][name]["measured_failed"] == 0 and s["errors"][name]["measured_requests"] > 0
    assert s["lost_points"] == []
    _assert_the_forced_sweep_is_marked(out, s)
    text = (out / "report.md").read_text()
    assert text.index("hand-written, kept") < text.index("## Workload")  # under the title
    for needle in (
        "| 1.9x |",
        "5.3x",
        "What one H200 cannot show",
        "## Failed requests",
        "## What ran",
        "| P/D over colocated |",
    ):
        assert needle in text
    assert "Benchmark mode: forced acceptance" in text and "| spec (**forced AL 3.51**) |" in text
    rectangular_tables(text)
    for plot in ("pareto", "throughput_vs_interactivity", "ttft_cdf", "itl_cdf", "hit_rate_by_turn"):
        assert (out / "plots" / f"{plot}.png").stat().st_size > 1000


def _assert_the_forced_sweep_is_marked(out: Path, s: dict) -> None:
    """The spec sweep's responses carried the forced acceptance length and its drafts; no other
    configuration's did; the 150 tier comes from the spec sweep exactly when flashpd misses it."""
    from flashpd.bench.records import read_run

    _, records = read_run(out / "spec" / "c1")
    decoded = [r for r in records if r.ok and r.output_tokens > 1]
    assert decoded and all(r.forced_acceptance_length == 3.51 for r in decoded)
    spec = s["configurations"]["spec"]
    assert spec["forced_acceptance_length"] == 3.51 and spec["speculation"]["draft_steps"] > 0
    assert all(s["configurations"][n]["forced_acceptance_length"] is None for n in ("flashpd", "baseline", "colocated"))
    configs = s["configurations"]
    expected = "spec" if configs["spec"]["150"]["met"] and not configs["flashpd"]["150"]["met"] else "flashpd"
    assert s["tiers"]["150"]["configuration"] == expected == s["ab"]["candidate_at_tier"]["150"]
