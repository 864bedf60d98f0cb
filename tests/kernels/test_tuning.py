"""kernels/tuning.py: the one place FLASHPD_* kernel overrides are read (strict, at load)."""

from __future__ import annotations

import pytest

from flashpd.kernels import tuning
from flashpd.kernels.attention import triton as at
from flashpd.kernels.dense import triton as dt
from flashpd.kernels.indexer import triton as it
from flashpd.kernels.mhc import triton as ht
from flashpd.kernels.moe import swapab
from flashpd.kernels.moe import triton as mt


def test_unset_variables_change_nothing():
    assert tuning.apply_env_overrides({}) == {}
    assert dt.FP8_SWAP_MAX_ROWS == 64 and swapab.MAX_TOKENS == 128
    assert (mt.GEMV_MAX_ROWS, mt.FUSED_GATE, mt.FUSED_GATE_MAX_TOKENS) == (0, False, 16)
    assert (it.CONFIG["score_target"], it.CONFIG["topk_split_q"]) == (264, 16)
    assert at.CONFIG["fused_combine"] is False and ht.CONFIG["decode_spin"] is True


def test_set_variables_reach_their_kernel_modules(monkeypatch):
    for mod in (it, at, ht):
        monkeypatch.setattr(mod, "CONFIG", dict(mod.CONFIG))
    for mod, name in ((dt, "FP8_SWAP_MAX_ROWS"), (swapab, "MAX_TOKENS"), (mt, "GEMV_MAX_ROWS"),
                      (mt, "FUSED_GATE"), (mt, "FUSED_GATE_MAX_TOKENS")):
        monkeypatch.setattr(mod, name, getattr(mod, name))
    env = {"FLASHPD_INDEXER_SMALL_BATCH": "0", "FLASHPD_ATTN_FUSED_COMBINE": "1",
           "FLASHPD_ATTN_CONFIG": '{"combine_heads": 2}', "FLASHPD_MHC_SPIN": "0",
           "FLASHPD_FP8_SWAP_MAX_ROWS": "8", "FLASHPD_MOE_GEMV_MAX_ROWS": "4",
           "FLASHPD_MOE_SWAPAB_MAX_TOKENS": "0", "FLASHPD_MOE_FUSED_GATE": "1",
           "FLASHPD_MOE_FUSED_GATE_MAX_TOKENS": "32", "FLASHPD_COMMIT": "not a kernel knob"}
    applied = tuning.apply_env_overrides(env)
    assert len(applied) == 9
    assert (it.CONFIG["score_target"], it.CONFIG["topk_split_q"]) == (0, 0)
    assert at.CONFIG["fused_combine"] is True and at.CONFIG["combine_heads"] == 2
    assert ht.CONFIG["decode_spin"] is False
    assert (dt.FP8_SWAP_MAX_ROWS, mt.GEMV_MAX_ROWS, swapab.MAX_TOKENS) == (8, 4, 0)
    assert (mt.FUSED_GATE, mt.FUSED_GATE_MAX_TOKENS) == (True, 32)


@pytest.mark.parametrize("env,match", [
    ({"FLASHPD_MOE_FUSED_GATE": "yes"}, "FLASHPD_MOE_FUSED_GATE must be 0 or 1"),
    ({"FLASHPD_FP8_SWAP_MAX_ROWS": "-1"}, "FLASHPD_FP8_SWAP_MAX_ROWS must be an integer"),
    ({"FLASHPD_MOE_GEMV_MAX_ROWS": "4.5"}, "FLASHPD_MOE_GEMV_MAX_ROWS must be an integer"),
    ({"FLASHPD_ATTN_CONFIG": '{"combine_head": 1}'}, "combine_head"),
])
def test_bad_values_raise_naming_the_variable_and_apply_nothing(monkeypatch, env, match):
    monkeypatch.setattr(dt, "FP8_SWAP_MAX_ROWS", 64)
    good = {} if "FLASHPD_FP8_SWAP_MAX_ROWS" in env else {"FLASHPD_FP8_SWAP_MAX_ROWS": "8"}
    with pytest.raises(ValueError, match=match):
        tuning.apply_env_overrides({**good, **env})
    assert dt.FP8_SWAP_MAX_ROWS == 64  # every value checked before any is applied


def test_no_kernel_module_reads_the_environment_at_import():
    import pathlib

    root = pathlib.Path(tuning.__file__).parent
    readers = [p.relative_to(root).as_posix() for p in root.rglob("*.py")
               if "os.environ" in p.read_text() and p.name not in ("tuning.py", "triton_runtime.py")]
    assert readers == []
