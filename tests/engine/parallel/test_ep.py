"""Expert-parallel MoE over gloo equals the single-process MoE (kernels/moe/ref.py) bit for bit."""

from __future__ import annotations

import pytest
import torch

from flashpd.engine.parallel.ep import LocalMoE, combine, ep_moe, plan_dispatch, run_local_experts
from flashpd.engine.parallel.launch import Comm, init_groups, spawn
from flashpd.engine.parallel.plan import ParallelPlan
from flashpd.engine.parallel.sharding import load_shard
from flashpd.engine.parallel.tp import tp_moe
from flashpd.kernels.moe.ref import moe

LAYER = 5
EP2 = ParallelPlan.from_name("dp2ep2")


def _moe_ref(x: torch.Tensor, m, cfg) -> torch.Tensor:
    return moe(
        x,
        m.gate,
        m.bias,
        m.experts,
        m.shared,
        cfg.num_experts_per_tok,
        cfg.routed_scaling_factor,
        cfg.swiglu_limit,
        cfg.gate_temp,
        cfg.norm_topk_prob,
    )


def _tokens(counts: list[int], hidden: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=g) for n in counts]


def test_dispatch_orders_pairs_by_expert_and_counts_per_owner():
    ids = torch.tensor([[5, 1], [2, 5], [7, 0]])
    weights = torch.tensor([[0.5, 0.25], [1.0, 2.0], [3.0, 4.0]])
    d = plan_dispatch(ids, weights, experts_per_rank=4, ep_size=2)
    assert d.expert_ids.tolist() == [0, 1, 2, 5, 5, 7]
    assert d.token_idx.tolist() == [2, 0, 1, 0, 1, 2]
    assert d.weights.tolist() == [4.0, 0.25, 1.0, 0.5, 2.0, 3.0]
    assert d.order.tolist() == [0, 0, 0, 1, 1, 1]  # rank of the expert within its token
    assert d.send_counts == [3, 3]


def test_combine_sums_each_token_in_ascending_expert_order():
    d = plan_dispatch(torch.tensor([[2, 0, 1]]), torch.ones(1, 3), experts_per_rank=2, ep_size=2)
    y = torch.tensor([[1.0], [1e8], [-1e8]])  # dispatch order: experts 0, 1, 2
    out = combine(y, d, num_tokens=1, top_k=3)
    assert out.item() == 0.0  # ((0 + 1) + 1e8) - 1e8 in FP32, as the reference adds them


@pytest.fixture(scope="module")
def single_shard(ckpt_dir):
    return load_shard(ckpt_dir, ParallelPlan(), 0)


def test_a_pair_for_a_foreign_expert_raises(single_shard):
    experts = LocalMoE.load(single_shard, LAYER, torch.float32).experts
    with pytest.raises(ValueError, match="does not own"):
        run_local_experts(torch.zeros(1, 128), torch.tensor([8]), torch.ones(1), experts, 10.0)


def _ep_rank(
    rank: int, world_size: int, ckpt_dir: str, plan: ParallelPlan, xs: list[torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, int]:
    ep = init_groups(plan).ep
    shard = load_shard(ckpt_dir, plan, rank)
    local = LocalMoE.load(shard, LAYER, dtype)
    return ep_moe(xs[rank].to(dtype), local, shard.cfg, ep), local.first_expert


@pytest.mark.parametrize("counts", [[5, 9], [6, 0]], ids=["uneven", "idle_rank"])
def test_ep2_moe_equals_single_process_fp32(ckpt_dir, model_f32, counts):
    cfg = model_f32.cfg
    xs = _tokens(counts, cfg.hidden_size)
    results = spawn(2, _ep_rank, ckpt_dir, EP2, xs, torch.float32)
    assert [first for _, first in results] == [0, 4]
    for (y, _), x in zip(results, xs, strict=True):
        assert torch.equal(y, _moe_ref(x, model_f32.w.layers[LAYER].moe, cfg))


def test_ep2_moe_equals_single_process_bf16(ckpt_dir, single_shard):
    shard = single_shard
    cfg, ref_moe = shard.cfg, LocalMoE.load(shard, LAYER, torch.bfloat16)
    xs = _tokens([7, 4], cfg.hidden_size, seed=1)
    results = spawn(2, _ep_rank, ckpt_dir, EP2, xs, torch.bfloat16)
    for (y, _), x in zip(results, xs, strict=True):
        assert torch.equal(y, _moe_ref(x.to(torch.bfloat16), ref_moe, cfg))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ep1_moe_is_the_reference(single_shard, dtype):
    shard = single_shard
    local = LocalMoE.load(shard, LAYER, dtype)
    (x,) = _tokens([11], shard.cfg.hidden_size, seed=2)
    x = x.to(dtype)
    assert torch.equal(ep_moe(x, local, shard.cfg, Comm.single()), _moe_ref(x, local, shard.cfg))


def test_ep_and_tp_moe_refuse_each_others_weights(ckpt_dir, single_shard):
    cfg = single_shard.cfg
    ep_local = LocalMoE.load(load_shard(ckpt_dir, EP2, 0), LAYER, torch.float32)
    tp_local = LocalMoE.load(load_shard(ckpt_dir, ParallelPlan(tp_size=2), 0), LAYER, torch.float32)
    x = torch.zeros(2, cfg.hidden_size)
    with pytest.raises(ValueError, match="use ep_moe"):
        tp_moe(x, ep_local, cfg, Comm.single())
    with pytest.raises(ValueError, match="use tp_moe"):
        ep_moe(x, tp_local, cfg, Comm.single())
