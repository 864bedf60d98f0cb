"""Rollback of a speculative verify: after a forward over [bonus, d_0 .. d_{k-1}] and
`truncate` to the accepted count, a state (dense and paged) equals, tensor for tensor, the state
of a run that only ever saw the accepted tokens: windows (across the ring wrap), compressed
entries and index keys, ratio-2 open rows (odd and even commit points), lookback and count."""

from __future__ import annotations

import pytest
import torch

from flashpd.engine.kv_pools import KVPools, PagedSeqState
from flashpd.model.state import StateError

K = 5  # drafts per verify


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _make(model, kind: str, pools_slot: list):
    if kind == "dense":
        return model.new_state()
    pools, slot = pools_slot
    table = list(range(slot * 4, slot * 4 + 4))  # 512 tokens of blocks
    return PagedSeqState(pools, slot, table, model.dtype)


def _snapshot(model, state) -> dict:
    cfg = model.cfg
    out = {"n": state.num_tokens, "lookback": state.lookback_ids()}
    for layer in range(cfg.num_layers):
        w = state.window(layer)
        out[f"win{layer}"] = (w.start_pos, w.kv.clone())
    for src in cfg.kv_source_layer_ids:
        e = state.entries(src)
        out[f"ent{src}"] = (e.kv.clone(), e.keys.clone())
        if cfg.compress_ratios[src] == 2:
            g = state.open_group(src)
            out[f"open{src}"] = None if g is None else (g.kv.clone(), g.gate.clone())
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, tuple) and x and isinstance(x[-1], torch.Tensor):
            assert len(x) == len(y)
            for u, v in zip(x, y, strict=True):
                if isinstance(u, torch.Tensor):
                    assert torch.equal(u, v), key
                else:
                    assert u == v, key
        else:
            assert x == y, key


@pytest.mark.parametrize("kind", ["dense", "paged"])
@pytest.mark.parametrize("prompt_len,accepted", [(140, 0), (140, 2), (141, 3), (141, 5), (126, 1), (127, 4)])
def test_truncate_equals_a_run_of_the_accepted_tokens(model_f32, kind, prompt_len, accepted):
    model = model_f32
    pools = KVPools(model.cfg, num_blocks=8, num_slots=2) if kind == "paged" else None
    prompt, extra = _ids(prompt_len, prompt_len), _ids(K + 1, 99 + accepted)
    spec = _make(model, kind, (pools, 0))
    model.run(spec, prompt)
    spec.begin_speculation(K + 1)
    logits = model.run(spec, extra, plan=_all_logits())
    assert logits.shape[0] == K + 1
    keep = prompt_len + 1 + accepted
    known = prompt + extra
    spec.truncate(keep, known[keep - 3 : keep])
    ref = _make(model, kind, (pools, 1))
    model.run(ref, prompt)
    model.run(ref, extra[: 1 + accepted])
    _assert_same(_snapshot(model, spec), _snapshot(model, ref))
    # and both go on identically (the next verify reads what the rollback left)
    nxt = _ids(3, 7)
    a = model.run(spec, nxt, plan=_all_logits())
    b = model.run(ref, nxt, plan=_all_logits())
    assert torch.equal(a, b)


def _all_logits():
    from flashpd.model.model import LogitsRequest, SeqPlan

    return SeqPlan(logits=LogitsRequest.ALL)


def test_truncate_is_refused_outside_the_speculated_rows(model_f32):
    model = model_f32
    state = model.new_state()
    model.run(state, _ids(20, 1))
    with pytest.raises(StateError):
        state.truncate(20, _ids(3, 2))  # no mark
    state.begin_speculation(3)
    model.run(state, _ids(3, 3))
    with pytest.raises(StateError):
        state.truncate(19, _ids(3, 2))  # before the mark
    with pytest.raises(StateError):
        state.truncate(24, _ids(3, 2))  # past what was computed
