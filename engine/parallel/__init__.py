"""Tensor- and expert-parallel building blocks: plans, checkpoint sharding, TP/EP blocks, launch.

plan.py       ParallelPlan: sizes, rank layout, validation against a ModelConfig
sharding.py   per-tensor split rules, shard_tensor on raw checkpoint tensors, load_shard
tp.py         column/row-parallel linears, TP attention output projection and MLP
ep.py         expert-parallel MoE (all-to-all dispatch and combine)
launch.py     Comm / ParallelGroups over torch.distributed, spawn() for local ranks
"""

from flashpd.engine.parallel.plan import ParallelPlan, PlanError

__all__ = ["ParallelPlan", "PlanError"]
