"""kernels/tuning.py: the one place FLASHPD_* kernel overrides are read (strict, at load)."""

from __future__ import annotations

import pytest

from flashpd.kernels import configs, tuning

H200 = configs.H200


def test_unset_variables_change_nothing():
    assert tuning.read_env_overrides({}) == {}
    assert tuning.apply_env_overrides(H200, {"FLASHPD_COMMIT": "x"}) is H200
    assert tuning.load("cpu", {}) is configs.DEFAULT


def test_set_variables_reach_their_fields_in_a_copy():
    env = {
        "FLASHPD_INDEXER_SMALL_BATCH": "0",
        "FLASHPD_ATTN_FUSED_COMBINE": "1",
        "FLASHPD_ATTN_CONFIG": '{"combine_heads": 2}',
        "FLASHPD_MHC_SPIN": "0",
        "FLASHPD_FP8_SWAP_MAX_ROWS": "8",
        "FLASHPD_MOE_GEMV_MAX_ROWS": "4",
        "FLASHPD_MOE_SWAPAB_MAX_TOKENS": "0",
        "FLASHPD_MOE_FUSED_GATE": "1",
        "FLASHPD_MOE_FUSED_GATE_MAX_TOKENS": "32",
        "FLASHPD_COMMIT": "not a kernel knob",
    }
    assert len(tuning.read_env_overrides(env)) == 9
    c = tuning.apply_env_overrides(H200, env)
    assert (c.indexer.score_target, c.indexer.topk_split_q) == (0, 0)
    assert c.indexer.topk_min_slice == 2048
    assert c.attention.fused_combine is True and c.attention.combine_heads == 2
    assert c.mhc.decode_spin is False
    assert (c.dense.fp8_swap_max_rows, c.moe.gemv_max_rows, c.moe.swapab_max_tokens) == (8, 4, 0)
    assert (c.moe.fused_gate, c.moe.fused_gate_max_tokens) == (True, 32)
    # the table entry itself is untouched
    assert (H200.attention.fused_combine, H200.dense.fp8_swap_max_rows) == (False, 64)
    assert tuning.load("cpu", env) == c


@pytest.mark.parametrize(
    "env,match",
    [
        ({"FLASHPD_MOE_FUSED_GATE": "yes"}, "FLASHPD_MOE_FUSED_GATE must be 0 or 1"),
        ({"FLASHPD_FP8_SWAP_MAX_ROWS": "-1"}, "FLASHPD_FP8_SWAP_MAX_ROWS must be an integer"),
        ({"FLASHPD_MOE_GEMV_MAX_ROWS": "4.5"}, "FLASHPD_MOE_GEMV_MAX_ROWS must be an integer"),
        ({"FLASHPD_ATTN_CONFIG": '{"combine_head": 1}'}, "combine_head"),
    ],
)
def test_bad_values_raise_naming_the_variable(env, match):
    good = {} if "FLASHPD_FP8_SWAP_MAX_ROWS" in env else {"FLASHPD_FP8_SWAP_MAX_ROWS": "8"}
    with pytest.raises(ValueError, match=match):
        tuning.load("cpu", {**good, **env})


def test_attention_json_checks_fields_and_types():
    assert tuning.attention_overrides(None) == {} and tuning.attention_overrides("") == {}
    assert tuning.attention_overrides('{"combine_heads": 1, "split_min_tiles": 2}') == {
        "combine_heads": 1,
        "split_min_tiles": 2,
    }
    with pytest.raises(ValueError, match="combine_head"):
        tuning.attention_overrides('{"combine_head": 1}')  # not a field
    with pytest.raises(ValueError, match="FLASHPD_ATTN_CONFIG.*combine_heads"):
        tuning.attention_overrides('{"combine_heads": "1"}')  # not an int
    with pytest.raises(ValueError, match="JSON object"):
        tuning.attention_overrides("[1]")


def test_no_kernel_module_holds_tuning_state():
    import ast
    import pathlib

    root = pathlib.Path(tuning.__file__).parent
    globals_ = [
        f"{p.relative_to(root)}:{n.targets[0].id}"
        for p in root.rglob("*.py")
        for n in ast.parse(p.read_text()).body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id == "CONFIG"
    ]
    assert globals_ == []


def test_no_kernel_module_reads_the_environment_at_import():
    import pathlib

    root = pathlib.Path(tuning.__file__).parent
    readers = [
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if "os.environ" in p.read_text() and p.name not in ("tuning.py", "triton_runtime.py")
    ]
    assert readers == []
