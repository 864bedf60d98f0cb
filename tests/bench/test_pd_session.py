"""bench/pd_session.py on the CPU: the session's turns grow as the stack's do, each row carries
its prefill time, compiles and graph counters, and the P/D turns hit the decode prefix cache."""

from __future__ import annotations

import json

import pytest

from flashpd.bench import pd_session
from flashpd.model.presets.small import checkpoint_path

pytestmark = pytest.mark.slow


def test_pd_session_turns_on_the_cpu(tmp_path):
    assert pd_session.main(["--smoke", checkpoint_path(), "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "pd_session.json").read_text())
    turns = out["turns"]
    step = pd_session.SMOKE["answer"] + pd_session.SMOKE["new"]
    assert [t["prompt_tokens"] for t in turns] == [pd_session.SMOKE["first"] + k * step for k in range(4)]
    assert all(t["prefill_ms"] > 0 and t["prefill_compiles"]["count"] == 0 for t in turns)
    assert turns[0]["decode_cached_tokens"] == 0 and turns[1]["decode_cached_tokens"] > 0
    assert all(t["decode_first_token_ms"] is not None for t in turns)


def test_pd_session_profiles_turns_on_the_cpu(tmp_path):
    """--profile-from: the even profiled turns carry a torch.profiler summary of the prefill and
    of the replay (ops counted), the odd ones a cProfile text file per phase."""
    args = ["--smoke", checkpoint_path(), "--out", str(tmp_path), "--no-warmup", "--turns", "4"]
    assert pd_session.main(args + ["--profile-from", "2", "--host-profile"]) == 0
    turns = json.loads((tmp_path / "pd_session.json").read_text())["turns"]
    assert "prefill_profile" not in turns[1]
    for phase in ("prefill", "decode"):
        prof = turns[2][f"{phase}_profile"]
        assert prof["wall_ms"] > 0 and prof["top_cpu_ops"], prof
        assert (tmp_path / f"host_{phase}_turn3.txt").read_text().count("function calls") >= 1
