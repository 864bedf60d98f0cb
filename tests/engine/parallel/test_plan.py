"""ParallelPlan: names, rank layout and validation against model configs."""

from __future__ import annotations

import pytest

from flashpd.engine.parallel.plan import ParallelPlan, PlanError
from flashpd.model.presets import preset_config


@pytest.mark.parametrize(
    "name, sizes", [("single", (1, 1, 1)), ("tp4", (4, 1, 1)), ("dp2ep2", (1, 2, 2)), ("tp2dp2", (2, 2, 1))]
)
def test_from_name_gives_sizes_and_round_trips(name, sizes):
    plan = ParallelPlan.from_name(name)
    assert (plan.tp_size, plan.dp_size, plan.ep_size) == sizes
    assert plan.name == name


@pytest.mark.parametrize("name", ["", "tp", "tp0", "tp4x", "pp2", "tp2tp2", "TP4", "4tp"])
def test_from_name_rejects_unknown_names(name):
    with pytest.raises(PlanError):
        ParallelPlan.from_name(name)


def test_rank_layout_puts_tp_groups_on_contiguous_ranks():
    plan = ParallelPlan(tp_size=4, dp_size=2)
    assert [plan.tp_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [plan.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert plan.tp_group_ranks(1) == (4, 5, 6, 7)
    assert plan.global_rank(1, 2) == 6
    with pytest.raises(PlanError, match="rank 8 outside"):
        plan.tp_rank(8)


def test_ep_ranks_own_contiguous_expert_blocks():
    cfg = preset_config("tiny")  # 8 routed experts
    plan = ParallelPlan.from_name("dp2ep2")
    assert [plan.ep_rank(r) for r in range(2)] == [0, 1]
    assert plan.owned_experts(cfg, 0) == range(0, 4)
    assert plan.owned_experts(cfg, 1) == range(4, 8)
    assert ParallelPlan.from_name("tp2").owned_experts(cfg, 1) == range(0, 8)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"tp_size": 0}, "tp_size"),
        ({"dp_size": -1}, "dp_size"),
        ({"dp_size": 4, "ep_size": 2}, "ep_size=2 must be 1 or the world size"),
        ({"tp_size": 2, "ep_size": 2}, "ep_size=2 with tp_size=2"),
        ({"tp_size": 2, "dp_size": 2, "ep_size": 4}, "with tp_size=2"),
        ({"vocab_parallel_head": True}, "vocab_parallel_head needs tp_size > 1"),
    ],
)
def test_malformed_plans_name_the_field(kwargs, field):
    with pytest.raises(PlanError, match=field):
        ParallelPlan(**kwargs)


def test_tp4_on_tiny_names_every_unsplittable_field():
    with pytest.raises(PlanError) as err:
        ParallelPlan.from_name("tp4").validate(preset_config("tiny"))
    message = str(err.value)
    assert "o_groups=2 is not divisible by tp_size=4" in message
    assert "moe_intermediate_size=64" in message
    assert "num_heads" not in message  # 4 heads split fine


def test_heads_and_experts_must_divide():
    cfg = preset_config("tiny")
    with pytest.raises(PlanError, match="num_heads=4 is not divisible by tp_size=8"):
        ParallelPlan(tp_size=8).validate(cfg)
    with pytest.raises(PlanError, match="n_routed_experts=8 is not divisible by ep_size=3"):
        ParallelPlan(dp_size=3, ep_size=3).validate(cfg)
    with pytest.raises(PlanError, match="vocab_size=512 is not divisible by tp_size=3"):
        ParallelPlan(tp_size=3, vocab_parallel_head=True).validate(
            cfg.replace(num_heads=6, o_groups=3, moe_intermediate_size=96)
        )


@pytest.mark.parametrize("name", ["single", "tp2", "dp2ep2"])
def test_tiny_fits_small_plans(name):
    ParallelPlan.from_name(name).validate(preset_config("tiny"))


@pytest.mark.parametrize("name", ["tp4", "tp8", "dp2ep2", "dp8ep8"])
def test_released_fits_the_production_plans(name):
    ParallelPlan.from_name(name).validate(preset_config("released"))
