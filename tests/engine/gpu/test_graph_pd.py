"""Graphs for the P/D roles' first-hit steps (issue 25): the decode role's W-row replay with
last-row logits after the KV arrived, the prefill role's encoder-only replay and turn.

The smoke checkpoint (tests/engine/gpu/test_gpu_forward.py: 6 layers, W = 8) under the Triton
interpreter on a CPU, graphs with `capture=False` (the same static buffers, padding and tables,
run eagerly): the graph path against the eager one token for token and byte for byte in the
pools. Which graphs the warm-up builds, what the request path then takes and the fall-backs are
checked with the layers replaced by zeros (the `cheap_forward` fixture: a function of the
steps' shapes). On a GPU the two equality tests capture real CUDA graphs.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil

import pytest
import torch

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  (before triton: GPU or interpreter)

# isort: on
from flashpd.engine.gpu import decode_graph
from flashpd.engine.gpu.decode_graph import (
    ENCODER_REPLAY,
    ENCODER_TURN,
    PD_REPLAY,
    REPLAY,
    TURN,
    DecodeGraphs,
    graph_pd_from_env,
)
from flashpd.engine.gpu.loading import load_gpu_model
from flashpd.engine.kv_pools import KVPools, PagedSeqState
from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.warmup import WarmupPlan, warm_up
from flashpd.model.checkpoint import write_random_checkpoint
from flashpd.model.model import LogitsRequest, Replay, SeqInput, SeqPlan
from flashpd.model.presets import tokenizer_path
from tests.engine.gpu.test_gpu_forward import DEVICE, _prompt, smoke_config

CLASSES = (160, 320, 640)
CAPTURE = DEVICE == "cuda"  # the equality tests: real CUDA graphs on a GPU, their eager twin on a CPU
CHUNK = 128  # the prefix cache's unit (engine/hashing.py CHUNK_TOKENS)


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("smoke_pd_ckpt"))
    write_random_checkpoint(smoke_config(), path, seed=11)
    shutil.copyfile(tokenizer_path("tiny"), os.path.join(path, "tokenizer.json"))  # Engram vocab
    return load_gpu_model(path, DEVICE)


@pytest.fixture
def graphs_off(gpu):
    yield gpu
    gpu.graphs = None


def _engine(gpu, role: str, graphs: bool = True, capture: bool = False) -> LLMEngine:
    gpu.graphs = DecodeGraphs(gpu, capture=capture) if graphs else None
    engine = LLMEngine(
        gpu,
        EngineConfig(role=role, num_blocks=64, num_slots=4, dtype="bfloat16", device=DEVICE, max_model_len=CLASSES[-1]),
    )
    if graphs:
        gpu.graphs.width_classes = CLASSES  # small classes (the engine's start at 4,096 tokens)
    return engine


def _finish(engine: LLMEngine) -> list[int]:
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            out.extend(o.new_token_ids)
    return out


def _prefill(engine: LLMEngine, rid: str, ids: list[int]):
    """Prefill role: the prompt to its KV (finish reason kv_ready)."""
    engine.add_request(rid, ids, SamplingParams(max_tokens=1))
    ready = None
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            if o.request_id == rid and o.finished:
                assert o.finish_reason == "kv_ready"
                ready = o
    return ready


def _admit(dec: LLMEngine, rid: str, ids: list[int], n: int, src: LLMEngine | None = None, src_blocks=()) -> None:
    """Decode role, as the router admits: reserve, the prompt's KV copied in (from `src`'s
    blocks; without `src` the pools' contents stand in, as in the warm-up), KV arrived."""
    r = dec.reserve(rid, ids, SamplingParams(max_tokens=n, ignore_eos=True))
    assert r is not None
    if src is not None:
        theirs, ours = src.pools.transfer_groups(), dec.pools.transfer_groups()
        blocks = list(src_blocks)[r.num_cached_blocks : r.num_cached_blocks + len(r.missing_block_ids)]
        for name, tensor in theirs.items():
            ours[name][list(r.missing_block_ids)] = tensor[blocks]
    dec.kv_arrived(rid)


def _kinds(graphs: DecodeGraphs) -> dict[str, int]:
    """Graphs built per kind (from their keys: logits and decoder rows, turn flag)."""
    names = {
        (False, ("none", None)): REPLAY,
        (False, ("last", None)): PD_REPLAY,
        (False, ("none", 0)): ENCODER_REPLAY,
        (True, ("none", 0)): ENCODER_TURN,
        (True, ("last", None)): TURN,
    }
    out: dict[str, int] = {}
    for key in graphs._graphs:
        name = "decode" if key[0] else names[(key[1], key[6])]
        out[name] = out.get(name, 0) + 1
    return out


# ---------------------------------------------------------------- which steps take which graph
def test_the_first_hit_steps_of_both_roles_are_graph_kinds_of_their_own(gpu, graphs_off):
    w = gpu.cfg.sliding_window
    graphs = DecodeGraphs(gpu, capture=False)
    pools = KVPools(gpu.cfg, 4, 2, DEVICE, window_scratch_rows=64)
    s = PagedSeqState(pools, 0, [0, 1], torch.bfloat16)
    s.adopt_prefix(24, (5, 6, 7))
    replay = Replay((1, 2, 3))
    at = [SeqInput(s, 24 - w, w, SeqPlan(logits=logits, replay=replay)) for logits in LogitsRequest]
    assert [graphs.kind([x]) for x in at] == [REPLAY, PD_REPLAY, None]  # NONE, LAST, ALL
    enc = SeqPlan(logits=LogitsRequest.NONE, replay=replay, decoder_rows=0)
    assert graphs.kind([SeqInput(s, 24 - w, w, enc)]) == ENCODER_REPLAY
    assert graphs.kind([SeqInput(s, 24 - w + 1, w - 1, enc)]) is None  # a replay of W rows only
    narrowed = SeqPlan(logits=LogitsRequest.LAST, replay=replay, decoder_rows=4)
    assert graphs.kind([SeqInput(s, 24 - w, w, narrowed)]) is None
    turns = [graphs.kind([SeqInput(s, 24, n, SeqPlan.encoder_only())]) for n in (1, 2, w, w + 1)]
    assert turns == [None, ENCODER_TURN, ENCODER_TURN, None]
    assert graphs.kind([SeqInput(s, 24, 3)]) == TURN
    off = DecodeGraphs(gpu, capture=False)
    off.pd = False  # FLASHPD_GRAPH_PD=0: the three P/D kinds eager, the others as before
    assert off.kind(at[:2]) is None and off.kind([at[1]]) is None and off.kind([at[0]]) == REPLAY
    assert off.kind([SeqInput(s, 24, 3, SeqPlan.encoder_only())]) is None
    assert off.kind([SeqInput(s, 24, 3)]) == TURN


def test_graph_pd_switch_is_read_at_load_and_validated(gpu, monkeypatch, graphs_off):
    assert graph_pd_from_env({}) is True
    assert graph_pd_from_env({"FLASHPD_GRAPH_PD": "0"}) is False
    with pytest.raises(ValueError, match="FLASHPD_GRAPH_PD"):
        graph_pd_from_env({"FLASHPD_GRAPH_PD": "no"})
    monkeypatch.setenv("FLASHPD_GRAPH_PD", "0")
    assert DecodeGraphs(gpu, capture=False).pd is False
    monkeypatch.setenv("FLASHPD_GRAPH_PD", "yes")
    with pytest.raises(ValueError, match="FLASHPD_GRAPH_PD"):
        DecodeGraphs(gpu, capture=False)


# ---------------------------------------------------------------- warm-up, then the request path
def test_after_warm_up_the_decode_roles_first_steps_take_graphs_and_build_none(
    gpu, monkeypatch, graphs_off, cheap_forward
):
    monkeypatch.setattr(decode_graph, "KEY_WIDTH_STEP", 8)
    cheap_forward(gpu)
    dec = _engine(gpu, "decode")
    done = warm_up(dec, WarmupPlan(long_tokens=136, short_tokens=128, batches=(1,)))
    graphs = gpu.graphs
    assert done["graph_builds"] == graphs.num_builds
    assert _kinds(graphs)[PD_REPLAY] == len(CLASSES)  # every class, before the freeze
    built, runs = graphs.num_builds, graphs.runs.get(PD_REPLAY, 0)
    for i, n in enumerate((20, 150, 300)):  # contexts in each class
        _admit(dec, f"r{i}", _prompt(n, 40 + i), 2)
        assert len(_finish(dec)) == 2
    assert graphs.num_builds == built and graphs.graph_misses == 0
    assert graphs.runs[PD_REPLAY] == runs + 3  # each admission's first step: a graph
    assert dec.graph_counters()["graph_runs_pd"] == graphs.runs[PD_REPLAY]


def test_after_warm_up_a_prefill_role_hit_takes_graphs_and_builds_none(gpu, monkeypatch, graphs_off, cheap_forward):
    monkeypatch.setattr(decode_graph, "KEY_WIDTH_STEP", 8)
    cheap_forward(gpu)
    pre = _engine(gpu, "prefill")
    done = warm_up(pre, WarmupPlan(long_tokens=136, short_tokens=128, batches=(1,)))
    graphs = gpu.graphs
    w = gpu.cfg.sliding_window
    buckets = [b for b in decode_graph.BUCKETS if 2 <= b <= w]
    kinds = _kinds(graphs)
    assert kinds[ENCODER_REPLAY] == len(CLASSES) and kinds[ENCODER_TURN] == len(buckets) * len(CLASSES)
    assert done["graph_builds"] == graphs.num_builds == sum(kinds.values())
    built = graphs.num_builds
    cached = _prompt(2 * CHUNK + 20, 2)  # class 320
    _prefill(pre, "cold", cached)
    for i, n in enumerate(buckets):  # a hit on 256 tokens, then a turn of each bucket
        _prefill(pre, f"t{i}", cached[: 2 * CHUNK] + _prompt(n, 10 + i))
    assert graphs.num_builds == built and graphs.graph_misses == 0
    assert graphs.runs[ENCODER_REPLAY] >= len(buckets) and graphs.runs[ENCODER_TURN] >= len(buckets)


def test_after_the_freeze_a_p_d_step_without_its_graph_runs_eagerly_and_counts_a_miss(
    gpu, monkeypatch, caplog, graphs_off, cheap_forward
):
    cheap_forward(gpu)
    dec = _engine(gpu, "decode")
    graphs = gpu.graphs
    graphs.freeze(dec.pools)  # a closed set with no graph at all
    with caplog.at_level(logging.WARNING, logger=decode_graph.__name__):
        _admit(dec, "r", _prompt(20, 3), 1)
        assert len(_finish(dec)) == 1
    assert graphs.num_builds == 0 and graphs.graph_misses == 1 and not graphs.runs
    assert any("no pd replay graph" in r.getMessage() for r in caplog.records)


def test_without_the_switch_the_p_d_steps_run_eagerly(gpu, monkeypatch, graphs_off, cheap_forward):
    monkeypatch.setenv("FLASHPD_GRAPH_PD", "0")
    monkeypatch.setattr(decode_graph, "KEY_WIDTH_STEP", 8)
    cheap_forward(gpu)
    for role in ("decode", "prefill"):
        engine = _engine(gpu, role)
        warm_up(engine, WarmupPlan(long_tokens=136, short_tokens=128, batches=(1,)))
        graphs = gpu.graphs
        assert not set(_kinds(graphs)) & {PD_REPLAY, ENCODER_REPLAY, ENCODER_TURN}
        if role == "decode":
            _admit(engine, "r", _prompt(20, 3), 2)
            assert len(_finish(engine)) == 2
        else:
            _prefill(engine, "c", _prompt(CHUNK + 5, 3))
            _prefill(engine, "h", _prompt(CHUNK + 5, 3)[:CHUNK] + [7, 8, 9])
        assert graphs.graph_misses == 0 and not set(graphs.runs) & {PD_REPLAY, ENCODER_REPLAY, ENCODER_TURN}


@pytest.mark.parametrize("failing", [PD_REPLAY, ENCODER_TURN])
def test_a_failed_capture_of_a_p_d_kind_is_logged_and_that_kind_runs_eagerly(
    gpu, monkeypatch, caplog, graphs_off, failing, cheap_forward
):
    """The capture of one new kind raises: the warm-up (load) completes, the failure is logged
    once, the kind is marked and its steps run eagerly from then on; the engine serves."""
    monkeypatch.setattr(decode_graph, "KEY_WIDTH_STEP", 8)
    cheap_forward(gpu)
    role = "decode" if failing == PD_REPLAY else "prefill"
    engine = _engine(gpu, role)
    graphs = gpu.graphs
    build = graphs._build

    def flaky(step, check=False):
        if graphs.kind([seg.inp for seg in step.segs]) == failing:
            raise RuntimeError("capture failed (test)")
        return build(step, check)

    monkeypatch.setattr(graphs, "_build", flaky)
    with caplog.at_level(logging.ERROR, logger=decode_graph.__name__):
        warm_up(engine, WarmupPlan(long_tokens=136, short_tokens=128, batches=(1,)))
    failed = [r for r in caplog.records if "graph capture failed" in r.getMessage()]
    assert len(failed) == 1 and failing in failed[0].getMessage()
    assert graphs._failed == {failing} and failing not in _kinds(graphs)
    if role == "decode":
        _admit(engine, "r", _prompt(20, 3), 2)
        assert len(_finish(engine)) == 2
    else:
        cached = _prompt(CHUNK + 5, 3)
        _prefill(engine, "c", cached)
        assert _prefill(engine, "h", cached[:CHUNK] + [7, 8, 9]) is not None
        assert graphs.runs[ENCODER_REPLAY] > 0  # the other new kind still takes its graphs
    assert failing not in graphs.runs
    assert graphs.graph_misses == 0 and len([r for r in caplog.records if "capture failed" in r.getMessage()]) == 1


def test_a_failed_capture_of_a_colocated_replay_is_still_raised(gpu, monkeypatch, graphs_off, cheap_forward):
    cheap_forward(gpu)
    graphs = DecodeGraphs(gpu, capture=False)
    gpu.graphs = graphs
    pools = KVPools(gpu.cfg, 4, 2, DEVICE, window_scratch_rows=64)
    s = PagedSeqState(pools, 0, [0, 1], torch.bfloat16)
    w = gpu.cfg.sliding_window
    s.adopt_prefix(24, (5, 6, 7))

    def broken(step, check=False):
        raise RuntimeError("capture failed (test)")

    monkeypatch.setattr(graphs, "_build", broken)
    plan = SeqPlan(logits=LogitsRequest.NONE, replay=Replay((1, 2, 3)))
    with pytest.raises(RuntimeError, match="capture failed"):
        gpu.forward(torch.tensor(_prompt(w, 1)), [SeqInput(s, 24 - w, w, plan)])


# ---------------------------------------------------------------- the graph path equals the eager one
def test_a_decode_role_admission_through_the_graphs_equals_the_eager_one(gpu, monkeypatch, graphs_off):
    """Reserve, the prefill engine's KV copied in, KV arrived: the first step replays the
    prompt's last W rows with the last row's logits. Through the graphs (a pd replay, then a
    decode) the logits and tokens equal those with graphs off."""
    prompt = _prompt(12, 21)  # >= W = 8
    pre = _engine(gpu, "prefill", graphs=False)
    ready = _prefill(pre, "p", prompt)
    forward = gpu.forward
    runs = []
    for graphs in (False, True):
        dec = _engine(gpu, "decode", graphs, capture=CAPTURE)
        seen: list[list] = []

        def recording(ids, seqs, feed=None, seen=seen):
            out = forward(ids, seqs, feed)
            seen.append([None if x is None else x.clone() for x in out])
            return out

        monkeypatch.setattr(gpu, "forward", recording)
        _admit(dec, "d", prompt, 2, pre, ready.kv_block_ids)
        runs.append((_finish(dec), seen, gpu.graphs))
        monkeypatch.setattr(gpu, "forward", forward)
    (tokens_e, seen_e, _), (tokens_g, seen_g, graphs) = runs
    assert graphs.runs == {PD_REPLAY: 1, "decode": 1} and graphs.graph_misses == 0
    assert tokens_g == tokens_e and len(tokens_g) == 2
    assert len(seen_g) == len(seen_e) == 2
    for got, want in zip(seen_g, seen_e, strict=True):
        assert len(got) == len(want) == 1 and got[0].shape == (1, gpu.cfg.vocab_size)
        assert torch.equal(got[0], want[0])


def test_a_prefill_role_hit_through_the_graphs_writes_the_pools_as_eagerly(gpu, graphs_off):
    """A prefix hit on the encoder path (the prefill role): the W-row replay, then a turn of 3
    rows padded to 4, through the graphs: the same global KV (entries, index keys), window rings,
    open rows and books as eagerly."""
    cfg = gpu.cfg
    w, hit = cfg.sliding_window, 16
    prompt = _prompt(hit + 3, 31)
    base = KVPools(cfg, 2, 2, DEVICE, window_scratch_rows=64)
    gpu.graphs = None
    cold = PagedSeqState(base, 0, [0], torch.bfloat16)
    gpu.forward(torch.tensor(prompt[:hit], device=DEVICE), [SeqInput(cold, 0, hit, SeqPlan.encoder_only())])
    results = []
    for graphs in (False, True):
        gpu.graphs = DecodeGraphs(gpu, capture=CAPTURE) if graphs else None
        pools = copy.deepcopy(base)
        s = PagedSeqState(pools, 1, [0], torch.bfloat16)  # the hit: the cached block, a fresh slot
        s.adopt_prefix(hit, tuple(prompt[hit - 3 : hit]))
        replay = SeqPlan(logits=LogitsRequest.NONE, replay=Replay(tuple(prompt[hit - w - 3 : hit - w])), decoder_rows=0)
        steps = [
            (prompt[hit - w : hit], [SeqInput(s, hit - w, w, replay)], ENCODER_REPLAY),
            (prompt[hit:], [SeqInput(s, hit, 3, SeqPlan.encoder_only())], ENCODER_TURN),
        ]
        for ids, seqs, kind in steps:
            if graphs:
                assert gpu.graphs.kind(seqs) == kind
            assert gpu.forward(torch.tensor(ids, device=DEVICE), seqs) == [None]
        results.append((pools, s, gpu.graphs))
    (pools_e, se, _), (pools_g, sg, graphs) = results
    assert graphs.runs == {ENCODER_REPLAY: 1, ENCODER_TURN: 1}
    assert {k[2] for k in graphs._graphs} == {w, 4}  # the turn padded to its bucket
    for src in cfg.kv_source_layer_ids:
        assert torch.equal(pools_e.main[src], pools_g.main[src]), f"entries of {src}"
        assert torch.equal(pools_e.index[src], pools_g.index[src]), f"index keys of {src}"
    assert pools_e.main[cfg.kv_source_layer_ids[-1]][0].any()  # the turn wrote entries
    assert torch.equal(pools_e.window[:, : pools_e.scratch_base], pools_g.window[:, : pools_g.scratch_base])
    assert torch.equal(pools_e.open, pools_g.open)
    assert se.num_tokens == sg.num_tokens == hit + 3 and se.lookback_ids() == sg.lookback_ids()
    for layer in range(cfg.candidate_source_layer_id):  # the encoder's (decoder windows: unset)
        assert se.window_span(layer) == sg.window_span(layer)
