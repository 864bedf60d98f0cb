"""MoE: sqrtsoftplus router, bias for selection only, weights * 1.5, clamped SwiGLU (§7)."""

from __future__ import annotations

import torch

from flashpd.kernels.moe import ref


def test_bias_steers_selection_but_not_the_weights():
    x = torch.eye(4)[:1] * 3  # one token
    gate_w = torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # logits 3, 6, 9, 12
    scores = torch.sqrt(torch.nn.functional.softplus(torch.tensor([3.0, 0, 0, 0])))
    no_bias = torch.zeros(4)
    ids, w = ref.route(x, gate_w, no_bias, 1, 1.5)
    assert ids.tolist() == [[0]]
    torch.testing.assert_close(w, torch.tensor([[1.5]]))
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])  # expert 2 (score sqrt(softplus(0))) wins
    ids, w = ref.route(x, gate_w, bias, 2, 1.5)
    assert sorted(ids[0].tolist()) == [0, 2]
    s = torch.stack((scores[0], torch.sqrt(torch.nn.functional.softplus(torch.tensor(0.0)))))
    chosen = dict(zip(ids[0].tolist(), w[0].tolist(), strict=True))
    torch.testing.assert_close(torch.tensor([chosen[0], chosen[2]]), 1.5 * s / s.sum())


def test_swiglu_clamps_gate_above_and_up_both_sides():
    gate = torch.tensor([50.0, -50.0, 2.0])
    up = torch.tensor([50.0, -50.0, 3.0])
    out = ref.swiglu(gate, up, limit=10.0)
    silu = torch.nn.functional.silu
    torch.testing.assert_close(
        out, torch.stack((silu(torch.tensor(10.0)) * 10, silu(torch.tensor(-50.0)) * -10, silu(torch.tensor(2.0)) * 3))
    )


def test_moe_is_weighted_experts_plus_shared():
    g = torch.Generator().manual_seed(0)
    d, i, e = 8, 6, 4
    x = torch.randn(5, d, generator=g)
    gate_w = torch.randn(e, d, generator=g)
    experts = ref.ExpertWeights(
        torch.randn(e, i, d, generator=g), torch.randn(e, i, d, generator=g), torch.randn(e, d, i, generator=g)
    )
    shared = ref.ExpertWeights(*(t[:1] for t in (experts.w1, experts.w3, experts.w2)))
    bias = torch.randn(e, generator=g)
    out = ref.moe(x, gate_w, bias, experts, shared, 2, 1.5, 10.0)
    ids, w = ref.route(x, gate_w, bias, 2, 1.5)
    for t in range(5):
        want = sum(
            w[t, k]
            * experts.w2[ids[t, k]]
            @ ref.swiglu(experts.w1[ids[t, k]] @ x[t], experts.w3[ids[t, k]] @ x[t], 10.0)
            for k in range(2)
        )
        want = want + experts.w2[0] @ ref.swiglu(experts.w1[0] @ x[t], experts.w3[0] @ x[t], 10)
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)
