"""`GpuModel(kernel_impls=...)`: chosen ops through their torch references (the A/B baseline's
unfused mHC and reference indexer) give the default model's logits and top-k.

The smoke checkpoint of test_gpu_forward.py; each model runs the same prefill and two decode
steps on pools of its own. The rest of the forward is the same Triton path, so the outputs
differ by the referenced op's accumulation order only: logits agree to BF16 noise (the
tolerance of the reference-vs-GPU tests) and the indexer's selections as pool rows, up to a
near-tie flipped by an ulp.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from flashpd.engine.gpu.loading import load_gpu_model
from flashpd.engine.kv_pools import KVPools, PagedSeqState
from flashpd.model.checkpoint import write_random_checkpoint
from flashpd.model.model import LogitsRequest, SeqInput, SeqPlan
from flashpd.model.presets import tokenizer_path
from tests.engine.gpu.test_gpu_forward import DEVICE, _prompt, assert_close, smoke_config

DECODE_STEPS = 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("smoke_ckpt"))
    write_random_checkpoint(smoke_config(), path, seed=11)
    shutil.copyfile(tokenizer_path("tiny"), os.path.join(path, "tokenizer.json"))  # Engram vocab
    return path


def _run(gpu) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
    """A 13-token prefill (every row's logits) then greedy decode steps: per forward, the
    logits and each index layer's top-k pool rows."""
    pools = KVPools(gpu.cfg, 4, 1, DEVICE, window_scratch_rows=32)
    state = PagedSeqState(pools, 0, [0, 1, 2, 3], torch.bfloat16)
    ids, pos, plan = _prompt(13, 1), 0, SeqPlan(logits=LogitsRequest.ALL)
    outs = []
    for _ in range(1 + DECODE_STEPS):
        step = gpu.prepare(torch.tensor(ids, device=DEVICE), [SeqInput(state, pos, len(ids), plan)])
        logits = gpu.compute(step)
        topk = {key[1]: v[1].cpu() for key, v in step.outputs.items() if key[0] == "topk"}
        gpu.commit(step)
        outs.append((logits.float().cpu(), topk))
        pos, ids, plan = pos + len(ids), [int(logits[-1].argmax())], SeqPlan()
    return outs


@pytest.fixture(scope="module")
def default_run(ckpt):
    return _run(load_gpu_model(ckpt, DEVICE))


@pytest.mark.parametrize("impls", [{"mhc": "ref"}, {"indexer": "ref"}], ids=["mhc", "indexer"])
def test_reference_ops_give_the_default_logits_and_topk(ckpt, default_run, impls):
    gpu = load_gpu_model(ckpt, DEVICE, kernel_impls=impls)
    ((op, _),) = impls.items()
    assert getattr(gpu, op) is gpu.kernels[op] and gpu.kernels[op].__name__ == f"flashpd.kernels.{op}.ref"
    assert gpu.dense is not gpu.kernels["dense"]  # the other ops: Triton, bound to the configs
    got = _run(gpu)
    for (want_logits, want_topk), (logits, topk) in zip(default_run, got, strict=True):
        assert_close(want_logits, logits)
        assert set(topk) == set(want_topk) and topk
        for layer, rows in topk.items():
            same = (rows.sort(-1).values == want_topk[layer].sort(-1).values).all(-1)
            assert same.float().mean() >= 0.9, f"layer {layer}: {same.tolist()}"


def test_default_kernel_impls_are_the_fastest(ckpt):
    from flashpd.kernels import dispatch

    gpu = load_gpu_model(ckpt, DEVICE)
    for op, impl in dispatch.fastest().items():
        assert gpu.kernels[op].__name__ == f"flashpd.kernels.{op}.{impl}"


@pytest.mark.parametrize(
    "impls, message", [({"fused_mhc": "ref"}, "unknown kernel op 'fused_mhc'"), ({"mhc": "cuda"}, "no kernel mhc/cuda")]
)
def test_unknown_ops_and_implementations_are_refused(ckpt, impls, message):
    with pytest.raises(ValueError, match=message):
        load_gpu_model(ckpt, DEVICE, kernel_impls=impls)


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs are captured on a GPU only")
def test_decode_graphs_capture_the_reference_ops(ckpt):
    """The baseline's GPU model decodes through CUDA graphs with the reference mHC and indexer
    in them (no host copy or data-dependent shape in those ops): the graph's logits are the
    eager step's."""
    import copy

    from flashpd.engine.gpu.decode_graph import DecodeGraphs

    gpu = load_gpu_model(ckpt, DEVICE, kernel_impls={"mhc": "ref", "indexer": "ref"})
    gpu.graphs = None
    base = KVPools(gpu.cfg, 4, 1, DEVICE, window_scratch_rows=32)
    state = PagedSeqState(base, 0, [0, 1, 2, 3], torch.bfloat16)
    gpu.forward(torch.tensor(_prompt(13, 1), device=DEVICE), [SeqInput(state, 0, 13)])
    logits = []
    for use_graphs in (False, True):
        gpu.graphs = DecodeGraphs(gpu) if use_graphs else None
        _, s = copy.deepcopy((base, state))
        decode = [SeqInput(s, 13, 1)]
        assert gpu.graphs is None or gpu.graphs.eligible(decode)
        logits.append(gpu.forward(torch.tensor([7], device=DEVICE), decode)[0].float().cpu())
    gpu.graphs = None
    eager, graphed = logits
    assert (eager - graphed).abs().max() <= 1e-3 * eager.abs().max()
