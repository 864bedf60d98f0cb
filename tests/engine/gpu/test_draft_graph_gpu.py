"""The DSpark drafter's CUDA graphs on the GPU (tiny preset, random GpuModel and drafter): the
warm-up captures every draft and insert bucket without a failure, and decode-like steps through
the graphs leave the windows and draft the tokens of the same padded programs run without
capture (`static`: the same shapes, so the same kernels and sums). Skipped on a CPU
host (CUDA graphs need CUDA); the CPU tests of the same path: tests/engine/test_draft_graph.py."""

from __future__ import annotations

import pytest
import torch

from flashpd.engine.speculative import DSparkDrafterAdapter
from flashpd.model.dspark import DSparkDrafter
from flashpd.model.presets import preset_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs: runs on the GPU")
def test_draft_and_insert_graphs_capture_and_match_the_uncaptured_programs():
    from flashpd.engine.gpu.loading import random_gpu_model

    cfg = preset_config("tiny")
    model = random_gpu_model(cfg, DEVICE, seed=0, decode_graphs=False, warm=False)
    drafter = DSparkDrafter.random(cfg, model)
    graph, static = DSparkDrafterAdapter(drafter, 8, "auto"), DSparkDrafterAdapter(drafter, 8, "static")
    assert graph.graphs is not None and graph.graphs.capture and not static.graphs.capture
    assert graph.warm_up(4) == 3 + 6  # drafts of 1, 2, 4; inserts of 1 .. 32 rows (4 x 6 = 24)
    assert graph.counters()["graph_failures"] == 0 and graph.counters()["graph_captures"] == 9
    width = 3 * cfg.hidden_size
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    lens = [300, 7, 129]
    gs, es = [graph.new_state([]) for _ in lens], [static.new_state([]) for _ in lens]
    prompt = torch.randn(sum(lens), width, generator=gen, device=DEVICE).to(torch.bfloat16)
    for ad, states in ((graph, gs), (static, es)):
        ad.observe(states, [list(range(n)) for n in lens], prompt)  # 436 rows: eager in both (> a row bucket)
    for step, accepted in enumerate([0, 3, 5, 2]):
        anchors = [11 + step, 12, 13]
        got, want = graph.propose(gs, anchors, lens, None), static.propose(es, anchors, lens, None)
        assert got.tokens == want.tokens
        pos = [list(range(n, n + 1 + (accepted + i) % 6)) for i, n in enumerate(lens)]
        taps = torch.randn(sum(len(p) for p in pos), width, generator=gen, device=DEVICE).to(torch.bfloat16)
        graph.observe(gs, pos, taps)
        static.observe(es, pos, taps)
        lens = [p[-1] + 1 for p in pos]
    for a, b in zip(gs, es, strict=True):
        assert torch.equal(a.slot_pos, b.slot_pos)
        held = b.slot_pos >= 0
        assert torch.equal(a.kv[:, held], b.kv[:, held])
    c = graph.counters()
    assert c["graph"] == c["proposes"] == 4 and c["observe_graph"] == 4 and c["graph_failures"] == 0
