"""bench/spec_decode.py's DSpark drafting figures: draft modes map to the engine's settings, a
graph run that did not draft through its graphs is a failure (exit 2, said on stderr), and a
small CPU run of both modes writes the drafter's figures."""

from __future__ import annotations

import json

import pytest

from flashpd.bench import spec_decode as sd


def _draft(**over) -> dict:
    base = {"proposes": 4, "graph": 4, "eager_fallback": 0, "eager_sampled": 0, "graph_failures": 0}
    return {**base, "graph_failed": False, "graph_misses": 0, "observes": 4, "observe_graph": 4, **over}


def test_draft_modes_map_to_the_engine_setting():
    assert sd.draft_graphs_setting("eager", "cuda") == "off"
    assert sd.draft_graphs_setting("graph", "cuda:0") == "auto"
    assert sd.draft_graphs_setting("graph", "cpu") == "static"
    with pytest.raises(ValueError, match="draft mode"):
        sd.draft_graphs_setting("fast", "cpu")


def test_graph_failure_names_what_went_eager():
    assert sd.graph_failure(_draft()) == ""
    assert "capture failure" in sd.graph_failure(_draft(graph_failures=1, graph_failed=True, graph=0))
    assert "2 of 4 drafts" in sd.graph_failure(_draft(graph=2, eager_fallback=2))
    assert "0 of 0" in sd.graph_failure(_draft(proposes=0, graph=0))
    assert "3 of 4 context inserts" in sd.graph_failure(_draft(observe_graph=3))
    assert sd.graph_failure(None) == "no DSpark drafter counters"


def test_draft_modes_need_the_dspark_method(capsys):
    with pytest.raises(SystemExit):
        sd.main(["--method", "ngram", "--draft-modes", "eager"])
    assert "needs --method dspark" in capsys.readouterr().err


ARGS = ["--device", "cpu", "--preset", "tiny", "--method", "dspark", "--batches", "2", "--steps", "2"]
ARGS += ["--context", "128", "--no-greedy-check", "--threads", "1"]


def test_cpu_run_of_both_modes_writes_the_drafter_figures(tmp_path, capsys):
    out = tmp_path / "draft.json"
    assert sd.main([*ARGS, "--draft-modes", "eager", "graph", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    eager, graph = summary["draft"]["spec-eager"]["2"], summary["draft"]["spec-graph"]["2"]
    assert eager["graph"] == 0 and eager["eager_fallback"] == eager["proposes"] == 2
    assert graph["graph"] == graph["proposes"] == 2 and graph["drafter_ms_per_step"] > 0
    assert graph["observe_graph"] == graph["observes"] > 0 and eager["observe_graph"] == 0
    assert summary["spec_mode"] == "spec-graph" and summary["draft_graph_failures"] == []
    assert "draft ms/step" in capsys.readouterr().out


def test_a_graph_run_that_drafted_eagerly_exits_2(tmp_path, capsys, monkeypatch):
    from flashpd.engine.gpu.draft_graph import DraftGraphs

    def broken(self, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DraftGraphs, "_program", broken)
    out = tmp_path / "draft.json"
    assert sd.main([*ARGS, "--draft-modes", "graph", "--out", str(out)]) == 2
    assert "DRAFT GRAPH FAILURE" in capsys.readouterr().err
    summary = json.loads(out.read_text())
    assert summary["draft_graph_failures"][0]["batch"] == 2
    assert summary["draft"]["spec-graph"]["2"]["eager_fallback"] == 2  # the engine kept drafting
