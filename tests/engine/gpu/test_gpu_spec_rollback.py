"""Speculative rollback on the GPU path (GpuModel over packed pools with staged window rows): a
verify of [bonus, 3 drafts] then `truncate` to the accepted count leaves the same books (token
count, lookback, window spans, entry counts, open rows) as a sequence that only saw the
accepted tokens, values to BF16 noise, and both go on alike. The smoke config's window is 8
(a 7-row ring), so the 4-row verify overwrites ring rows that the rollback must restore.
Skipped on a CPU host (interpreted kernels take minutes); runs on the GPU."""

from __future__ import annotations

import pytest
import torch

from flashpd.engine.kv_pools import KVPools, PagedSeqState
from flashpd.model.model import LogitsRequest, SeqInput, SeqPlan
from tests.engine.gpu.test_gpu_forward import DEVICE, _prompt, assert_close, models  # noqa: F401

ALL = SeqPlan(logits=LogitsRequest.ALL)


def _run(model, state, ids, start, plan=ALL):
    flat = torch.tensor(ids, dtype=torch.long, device=DEVICE)
    return model.forward(flat, [SeqInput(state, start, len(ids), plan)])[0]


@pytest.mark.skipif(DEVICE == "cpu", reason="interpreted kernels: minutes; runs on the GPU")
@pytest.mark.parametrize("prompt_len,accepted", [(12, 0), (12, 2), (13, 1), (13, 3)])
def test_gpu_verify_rollback_equals_the_accepted_run(models, prompt_len, accepted):  # noqa: F811
    _, gpu = models
    pools = KVPools(gpu.cfg, 8, 4, DEVICE, window_scratch_rows=512)
    spec = PagedSeqState(pools, 0, [0, 1], torch.bfloat16)
    ref = PagedSeqState(pools, 1, [2, 3], torch.bfloat16)
    prompt, extra = _prompt(prompt_len, 3), _prompt(4, 4 + accepted)
    for st in (spec, ref):
        _run(gpu, st, prompt, 0, SeqPlan())
    spec.begin_speculation(4)
    assert _run(gpu, spec, extra, prompt_len).shape[0] == 4
    n = prompt_len + 1 + accepted
    known = prompt + extra
    spec.truncate(n, known[n - 3 : n])
    _run(gpu, ref, extra[: 1 + accepted], prompt_len)
    assert (spec.num_tokens, spec.lookback_ids()) == (ref.num_tokens, ref.lookback_ids())
    cfg = gpu.cfg
    for layer in range(cfg.num_layers):
        assert spec.window_span(layer) == ref.window_span(layer)
        assert_close(ref.window(layer).kv, spec.window(layer).kv)
    for src in cfg.kv_source_layer_ids:
        assert spec.num_entries(src) == ref.num_entries(src)
        if cfg.compress_ratios[src] == 2:
            assert spec.has_open_group(src) == ref.has_open_group(src)
            if ref.has_open_group(src):
                assert_close(ref.open_group(src).kv[None], spec.open_group(src).kv[None])
    nxt = _prompt(2, 9)
    assert_close(_run(gpu, ref, nxt, n), _run(gpu, spec, nxt, n))
