"""Decode graphs keyed by context class: after the warm-up no decode, replay or turn step builds
a graph on the request path (CPU: `capture=False` builds the static buffers, counted the same).

The smoke checkpoint (tests/engine/gpu/test_gpu_forward.py) under the Triton interpreter, with
classes of 160, 320 and 640 tokens and key tables padded to a multiple of 8 entries (not 1,024),
so every class has widths of its own.
"""

from __future__ import annotations

import pytest

from flashpd.engine.gpu import decode_graph
from flashpd.engine.gpu.decode_graph import DecodeGraphs, pools_key, width_classes
from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.warmup import WarmupPlan, warm_up
from tests.engine.gpu.test_gpu_forward import DEVICE, _prompt, models  # noqa: F401

CLASSES = (160, 320, 640)


def test_width_classes_are_geometric_up_to_the_limit():
    assert width_classes(139_264, 2) == (4096, 8192, 16384, 32768, 65536, 131072, 139264)
    assert width_classes(131_072, 4) == (4096, 16384, 65536, 131072)
    assert width_classes(1000, 2) == (1000,) and width_classes(1000, 0) == ()
    with pytest.raises(ValueError, match="ratio"):
        width_classes(1000, 1)


def test_engine_config_refuses_a_ratio_of_one():
    with pytest.raises(ValueError, match="graph_width_ratio"):
        EngineConfig(graph_width_ratio=1)
    assert EngineConfig().graph_width_ratio == 2


def _engine(gpu, classes=CLASSES):
    gpu.graphs = DecodeGraphs(gpu, capture=False)
    engine = LLMEngine(
        gpu, EngineConfig(num_blocks=64, num_slots=4, dtype="bfloat16", device=DEVICE, max_model_len=classes[-1])
    )
    gpu.graphs.width_classes = classes  # small classes (the engine's start at 4,096 tokens)
    return engine


def _generate(engine, rid: str, ids: list[int], n: int) -> list[int]:
    engine.add_request(rid, ids, SamplingParams(max_tokens=n, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            out.extend(o.new_token_ids)
    return out


def test_after_warm_up_hits_turns_and_decodes_at_new_classes_build_no_graph(models, monkeypatch, cheap_forward):  # noqa: F811
    _, gpu = models
    monkeypatch.setattr(decode_graph, "KEY_WIDTH_STEP", 8)
    cheap_forward(gpu)
    w = gpu.cfg.sliding_window
    try:
        engine = _engine(gpu)
        done = warm_up(engine, WarmupPlan(long_tokens=136, short_tokens=128, batches=(1,)))
        graphs = gpu.graphs
        assert done["graph_builds"] == graphs.num_builds > 0 and done["graph_classes"] == list(CLASSES)
        widths = {k[5] for k in graphs._graphs}
        assert len(widths) == len(CLASSES)  # every class's tables
        built = graphs.num_builds  # decode B=1, the 8-row replay, turns of 2, 4, 8 rows: per class
        assert built == 5 * len(CLASSES)
        # a decode crossing class 160 -> 320, a cold prompt caching 256 tokens, then prefix hits
        # on it (replay + turn at class 320, whose graphs only the siblings built) with a turn
        # of every turn bucket
        assert len(_generate(engine, "s0", _prompt(150, 1), 12)) == 12  # decode 150 -> 162
        cached = _prompt(300, 2)
        _generate(engine, "s1", cached, 1)
        for i, n in enumerate(b for b in decode_graph.BUCKETS if 2 <= b <= w):
            assert len(_generate(engine, f"t{i}", cached[:256] + _prompt(n, 10 + i), 2)) == 2
        assert graphs.num_builds == built and graphs.graph_misses == 0
        assert engine.graph_counters()["graph_builds"] == built
    finally:
        gpu.graphs = None


@pytest.mark.skipif(DEVICE == "cpu", reason="interpreted kernels: ~5 min each; runs on the GPU (passed at 92abfc8)")
def test_a_missing_graph_after_freeze_runs_eagerly_with_the_same_tokens(models, monkeypatch):  # noqa: F811
    """Frozen with no graph at all: every eligible step is a miss run eagerly (counted, no
    build), and the tokens equal those of the graph path (graphs built on demand)."""
    _, gpu = models
    monkeypatch.setattr(decode_graph, "KEY_WIDTH_STEP", 8)
    prompt = _prompt(20, 3)
    try:
        engine = _engine(gpu)
        with_graphs = _generate(engine, "a", prompt, 3)
        assert gpu.graphs.num_builds > 0 and gpu.graphs.graph_misses == 0
        engine = _engine(gpu)
        gpu.graphs.freeze(engine.pools)
        eager = _generate(engine, "b", prompt, 3)
        assert gpu.graphs.num_builds == 0 and gpu.graphs.graph_misses >= 2
        assert eager == with_graphs
    finally:
        gpu.graphs = None


@pytest.mark.skipif(DEVICE == "cpu", reason="interpreted kernels: ~5 min each; runs on the GPU (passed at 92abfc8)")
def test_graphs_are_keyed_by_their_pools(models, monkeypatch):  # noqa: F811
    """Two engines over one model: each builds graphs of its own pools; freezing one engine's
    pools leaves the other's builds open."""
    _, gpu = models
    monkeypatch.setattr(decode_graph, "KEY_WIDTH_STEP", 8)
    try:
        first = _engine(gpu)
        graphs = gpu.graphs
        second = LLMEngine(gpu, EngineConfig(num_blocks=64, num_slots=4, dtype="bfloat16", device=DEVICE))
        graphs.freeze(first.pools)
        _generate(second, "x", _prompt(20, 4), 2)
        assert graphs.num_builds > 0 and graphs.graph_misses == 0
        assert {k[-1] for k in graphs._graphs} == {pools_key(second.pools)}
        _generate(first, "y", _prompt(20, 4), 2)
        assert graphs.graph_misses > 0
    finally:
        gpu.graphs = None
