"""ParallelPlan: how many ranks run tensor, data and expert parallel, and where each rank sits.

Rank layout (world = dp_size * tp_size; TP groups are contiguous so they stay on one NVLink
island when a host is split):

    rank = dp_rank * tp_size + tp_rank

                  tp_rank 0   1   2   3
    dp_rank 0           [ 0   1   2   3 ]   one TP group per DP replica
    dp_rank 1           [ 4   5   6   7 ]

    EP group: every rank (ep_size == world_size), ep_rank == rank; or none (ep_size == 1).

Attention runs data parallel over replicas and tensor parallel inside one: heads and output
groups are split, the single shared 512-d KV latent (wkv, kv_norm, compressor, indexer) is
replicated on every TP rank. Routed experts are split by intermediate channels under TP
(ep_size == 1) or owned whole by one EP rank (ep_size == world_size).

The two production setups (serving_facts.md): "tp4" (low latency) and "dp2ep2" (throughput).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flashpd.model.config import ModelConfig

MXFP4_K_BLOCK = 32  # routed-expert scale block along K (model_spec §10.2)
_NAME_TOKEN = re.compile(r"(tp|dp|ep)([1-9][0-9]*)")


class PlanError(ValueError):
    """A parallel plan is malformed or does not fit a model config (message names the field)."""


@dataclass(frozen=True)
class ParallelPlan:
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    vocab_parallel_head: bool = False  # head.weight split by vocab rows under TP

    def __post_init__(self) -> None:
        for field_name in ("tp_size", "dp_size", "ep_size"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"{field_name} must be a positive int, got {value!r}")
        if self.ep_size not in (1, self.world_size):
            raise PlanError(f"ep_size={self.ep_size} must be 1 or the world size dp_size*tp_size={self.world_size}")
        if self.ep_size > 1 and self.tp_size > 1:
            raise PlanError(
                f"ep_size={self.ep_size} with tp_size={self.tp_size}: the TP ranks "
                "of a replica hold the same tokens and would each dispatch them"
            )
        if self.vocab_parallel_head and self.tp_size == 1:
            raise PlanError("vocab_parallel_head needs tp_size > 1")

    # ------------------------------------------------------------------ names
    @classmethod
    def from_name(cls, name: str) -> ParallelPlan:
        """ "single", or tokens tpN / dpN / epN concatenated: "tp4", "dp2ep2", "tp2dp2"."""
        if name == "single":
            return cls()
        tokens = _NAME_TOKEN.findall(name)
        if not tokens or "".join(k + v for k, v in tokens) != name:
            raise PlanError(f"unknown plan name {name!r}: use 'single' or tpN/dpN/epN tokens, e.g. 'tp4', 'dp2ep2'")
        sizes: dict[str, int] = {}
        for kind, value in tokens:
            field_name = f"{kind}_size"
            if field_name in sizes:
                raise PlanError(f"plan name {name!r} gives {kind} twice")
            sizes[field_name] = int(value)
        return cls(**sizes)

    @property
    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp_size), ("dp", self.dp_size), ("ep", self.ep_size)) if v > 1]
        return "".join(parts) or "single"

    # ------------------------------------------------------------------ rank layout
    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank {rank} outside [0, {self.world_size}) of plan {self.name}")

    def tp_rank(self, rank: int) -> int:
        self.check_rank(rank)
        return rank % self.tp_size

    def dp_rank(self, rank: int) -> int:
        self.check_rank(rank)
        return rank // self.tp_size

    def ep_rank(self, rank: int) -> int:
        self.check_rank(rank)
        return rank if self.ep_size > 1 else 0

    def global_rank(self, dp_rank: int, tp_rank: int) -> int:
        if not (0 <= dp_rank < self.dp_size and 0 <= tp_rank < self.tp_size):
            raise PlanError(f"(dp_rank={dp_rank}, tp_rank={tp_rank}) outside plan {self.name}")
        return dp_rank * self.tp_size + tp_rank

    def tp_group_ranks(self, dp_rank: int) -> tuple[int, ...]:
        """Global ranks of one DP replica's TP group."""
        return tuple(self.global_rank(dp_rank, t) for t in range(self.tp_size))

    def owned_experts(self, cfg: ModelConfig, rank: int) -> range:
        """Routed expert ids held by `rank`: a contiguous block under EP, all of them otherwise."""
        per_rank = cfg.n_routed_experts // self.ep_size
        first = self.ep_rank(rank) * per_rank
        return range(first, first + per_rank)

    # ------------------------------------------------------------------ fit to a model
    def validate(self, cfg: ModelConfig) -> None:
        """Raise PlanError listing every config field the plan cannot split."""
        errors = self._tp_errors(cfg) + self._ep_errors(cfg)
        if errors:
            raise PlanError(f"plan {self.name} does not fit config {cfg.name!r}:\n  " + "\n  ".join(errors))

    def _tp_errors(self, cfg: ModelConfig) -> list[str]:
        tp = self.tp_size
        if tp == 1:
            return []
        rows_block, cols_block = cfg.weight_block_size
        errors = []
        if cfg.num_heads % tp:
            errors.append(f"num_heads={cfg.num_heads} is not divisible by tp_size={tp}")
        elif (cfg.num_heads // tp * cfg.head_dim) % rows_block:
            errors.append(
                f"num_heads/tp_size*head_dim={cfg.num_heads // tp * cfg.head_dim} "
                f"(wq_b rows per rank) is not a multiple of the {rows_block}-row "
                "FP8 tile"
            )
        if cfg.o_groups % tp:
            errors.append(f"o_groups={cfg.o_groups} is not divisible by tp_size={tp}")
        elif (cfg.o_groups // tp * cfg.o_lora_rank) % max(rows_block, cols_block):
            errors.append(
                f"o_groups/tp_size*o_lora_rank={cfg.o_groups // tp * cfg.o_lora_rank} "
                "(wo_a rows, wo_b columns per rank) is not a multiple of the FP8 tile"
            )
        ff_unit = tp * max(rows_block, cols_block, MXFP4_K_BLOCK)
        if cfg.moe_intermediate_size % ff_unit:
            errors.append(
                f"moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by "
                f"tp_size*{ff_unit // tp}={ff_unit} (expert rows per rank must fill "
                "whole FP8 tiles and MXFP4 K blocks)"
            )
        if self.vocab_parallel_head and cfg.vocab_size % tp:
            errors.append(f"vocab_size={cfg.vocab_size} is not divisible by tp_size={tp} (vocab_parallel_head)")
        return errors

    def _ep_errors(self, cfg: ModelConfig) -> list[str]:
        if cfg.n_routed_experts % self.ep_size:
            return [f"n_routed_experts={cfg.n_routed_experts} is not divisible by ep_size={self.ep_size}"]
        return []
