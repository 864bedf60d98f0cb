"""TP blocks over gloo equal the single-process model: output projection, shared expert, MoE,
query heads, vocab-parallel head; at tp_size 1 they are the reference bit for bit."""

from __future__ import annotations

import pytest
import torch

from flashpd.engine.parallel.ep import LocalMoE
from flashpd.engine.parallel.launch import Comm, init_groups, spawn
from flashpd.engine.parallel.plan import ParallelPlan
from flashpd.engine.parallel.sharding import load_shard
from flashpd.engine.parallel.tp import (
    AttentionOutShard,
    gather_columns,
    local_heads,
    tp_moe,
    tp_output_projection,
    tp_query,
    tp_shared_expert,
    vocab_parallel_logits,
)
from flashpd.kernels.dense.ref import linear, linear_fp32, rms_norm
from flashpd.kernels.moe.ref import expert_ffn, moe

LAYER = 3
NUM_TOKENS = 7
REL_TOL = 1e-5


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _inputs(cfg, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(NUM_TOKENS, cfg.num_heads, cfg.head_dim, generator=g)  # attention output
    c_q = torch.randn(NUM_TOKENS, cfg.q_lora_rank, generator=g)
    return o, c_q


def _tp_rank(
    rank: int, world_size: int, ckpt_dir: str, plan: ParallelPlan, o: torch.Tensor, c_q: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One TP rank: attention output projection -> ffn_norm -> shared expert / MoE."""
    tp = init_groups(plan).tp
    shard = load_shard(ckpt_dir, plan, rank)
    cfg, dtype, p = shard.cfg, torch.float32, f"layers.{LAYER}."
    heads = local_heads(cfg, tp)
    w_out = AttentionOutShard.load(shard, LAYER, dtype)
    y = tp_output_projection(o[:, heads.start : heads.stop], w_out, cfg, tp)  # [T, D]
    h = rms_norm(y, shard.get(p + "ffn_norm.weight").to(dtype), cfg.rms_norm_eps)
    local_moe = LocalMoE.load(shard, LAYER, dtype)
    q = tp_query(c_q, shard.fp8(p + "attn.wq_b", dtype), cfg, tp)  # [T, H/tp, d]
    return {
        "attn_out": y,
        "shared": tp_shared_expert(h, local_moe.shared, cfg.swiglu_limit, tp),
        "moe": tp_moe(h, local_moe, cfg, tp),
        "q": gather_columns(q.reshape(NUM_TOKENS, -1), tp),
        "sink": shard.get(p + "attn.attn_sink"),
    }


def _reference(model, o, c_q) -> dict[str, torch.Tensor]:
    cfg, lw = model.cfg, model.w.layers[LAYER]
    y = model._output_projection(lw.attn, o)  # the single-process path of Model._attention
    h = rms_norm(y, lw.ffn_norm, cfg.rms_norm_eps)
    m, s = lw.moe, lw.moe.shared
    return {
        "attn_out": y,
        "shared": expert_ffn(h, s.w1[0], s.w3[0], s.w2[0], cfg.swiglu_limit),
        "moe": moe(
            h,
            m.gate,
            m.bias,
            m.experts,
            m.shared,
            cfg.num_experts_per_tok,
            cfg.routed_scaling_factor,
            cfg.swiglu_limit,
            cfg.gate_temp,
            cfg.norm_topk_prob,
        ),
        "q": linear(c_q, lw.attn.wq_b),
        "sink": lw.attn.sink,
    }


def _check_tp(ckpt_dir: str, model, plan_name: str) -> None:
    plan = ParallelPlan.from_name(plan_name)
    o, c_q = _inputs(model.cfg)
    results = spawn(plan.world_size, _tp_rank, ckpt_dir, plan, o, c_q)
    want = _reference(model, o, c_q)
    for key in ("attn_out", "shared", "moe"):
        for rank, got in enumerate(results):
            assert _rel_err(got[key], want[key]) <= REL_TOL, f"{key} rank {rank}"
            assert torch.equal(got[key], results[0][key]), f"{key}: ranks disagree"
    for got in results:
        assert torch.equal(got["q"], want["q"])  # column parallel: exact
    assert torch.equal(torch.cat([r["sink"] for r in results]), want["sink"])


def test_tp2_blocks_equal_single_process(ckpt_dir, model_f32):
    _check_tp(ckpt_dir, model_f32, "tp2")


def test_tp4_blocks_equal_single_process(tp4_ckpt_dir, tp4_model_f32):
    _check_tp(tp4_ckpt_dir, tp4_model_f32, "tp4")


def _vocab_rank(rank: int, world_size: int, ckpt_dir: str, plan: ParallelPlan, h: torch.Tensor) -> torch.Tensor:
    tp = init_groups(plan).tp
    head = load_shard(ckpt_dir, plan, rank).get("head.weight").to(torch.float32)
    assert head.shape[0] == 512 // world_size
    return vocab_parallel_logits(h, head, tp)


def test_vocab_parallel_head_equals_full_head(ckpt_dir, model_f32):
    plan = ParallelPlan(tp_size=2, vocab_parallel_head=True)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(NUM_TOKENS, model_f32.cfg.hidden_size, generator=g)
    results = spawn(2, _vocab_rank, ckpt_dir, plan, h)
    want = linear_fp32(h, model_f32.w.head)
    assert all(torch.equal(r, want) for r in results)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tp1_blocks_are_the_reference_bit_for_bit(ckpt_dir, dtype):
    from flashpd.model.model import load_model

    model = load_model(ckpt_dir, dtype)
    shard = load_shard(ckpt_dir, ParallelPlan(), 0)
    cfg, comm, lw = model.cfg, Comm.single(), model.w.layers[LAYER]
    o, c_q = (t.to(dtype) for t in _inputs(cfg, seed=1))
    y = tp_output_projection(o, AttentionOutShard.load(shard, LAYER, dtype), cfg, comm)
    assert torch.equal(y, model._output_projection(lw.attn, o))
    h = rms_norm(y, lw.ffn_norm, cfg.rms_norm_eps)
    local_moe = LocalMoE.load(shard, LAYER, dtype)
    s = lw.moe.shared
    assert torch.equal(
        tp_shared_expert(h, local_moe.shared, cfg.swiglu_limit, comm),
        expert_ffn(h, s.w1[0], s.w3[0], s.w2[0], cfg.swiglu_limit),
    )
    m = lw.moe
    assert torch.equal(
        tp_moe(h, local_moe, cfg, comm),
        moe(
            h,
            m.gate,
            m.bias,
            m.experts,
            m.shared,
            cfg.num_experts_per_tok,
            cfg.routed_scaling_factor,
            cfg.swiglu_limit,
            cfg.gate_temp,
            cfg.norm_topk_prob,
        ),
    )
    assert torch.equal(tp_query(c_q, lw.attn.wq_b, cfg, comm).reshape(NUM_TOKENS, -1), linear(c_q, lw.attn.wq_b))
