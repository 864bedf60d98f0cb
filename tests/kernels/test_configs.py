"""The kernel configs table: the H200 entry is exactly the launch settings the kernels were
tuned and served with before tuning became data (the module `CONFIG` dicts and bounds at
7f5b989..83e0d33, copied here), so moving them changed no launch."""

import dataclasses

import pytest

from flashpd.kernels import configs

# The module globals as they were (attention/dense/fp8_swap/indexer/mhc/gemv/swapab/
# grouped_large `CONFIG`, and the bounds in dense/triton.py, moe/triton.py, moe/swapab.py).
PREVIOUS = {
    "attention": {
        "heads_max": 64,
        "heads_block_n": 32,
        "heads_warps": 8,
        "heads_stages": 1,
        "heads_prefetch": False,
        "heads_rescale_tau": 0.0,
        "heads_asm": True,
        "heads_trans_s": False,
        "heads_vsplit": False,
        "heads_vsplit_block_n": 32,
        "heads_vsplit_warps": 4,
        "heads_split_target": 132,
        "heads_split_block_n": 64,
        "heads_split_stages": 1,
        "legacy_max_q": 1,
        "heads": 32,
        "block_n": 16,
        "warps": 8,
        "stages": 1,
        "split_target": 264,
        "split_max_q": 64,
        "split_min_tiles": 1,
        "split_min_splits": 3,
        "split_heads": 16,
        "split_block_n": 16,
        "split_warps": 4,
        "split_stages": 1,
        "combine_heads": 1,
        "fused_combine": False,
    },
    "dense": {
        "small_rows": 64,
        "skinny": {"block_n": 64, "block_k": 64, "warps": 4, "stages": 4, "m64": {"swap": True, "red_unroll": 4}},
        "mx": {"block_n": 32, "block_k": 128, "warps": 4, "stages": 3, "target_ctas": 1024, "max_rows": 64},
        "plain": {"block_n": 64, "block_k": 64, "warps": 4, "stages": 4},
        "target_ctas": 264,
        "min_k_chunk": 256,
        "expert_tiles": 6,
        "mxfp4_decode": "dot_scaled",
        "mxfp4_large": "dot_scaled",
        "block_n": 64,
        "block_m_large": 64,
        "warps": 4,
        "stages": 3,
        "prefill": "cublas",
        "cublas_min_rows": 256,
    },
    "fp8_swap": {
        "block_n": 64,
        "block_k": 128,
        "warps": 4,
        "stages": 3,
        "target_ctas": 264,
        "min_k_chunk": 256,
        "red_unroll": 4,
        "deq": "asm",
        "layers": None,
        "shapes": {
            (5120, 8192, 1, False): {"block_n": 128, "warps": 8},
            (2304, 5120, 1, True): {"target_ctas": 528},
            (5120, 2304, 1, False): {"target_ctas": 528},
        },
        "classes": {
            8: {"rows": 8},
            16: {"rows": 16, "block_n": 32, "warps": 2, "target_ctas": 528, "shapes": {}},
            32: {"rows": 32, "block_n": 64, "warps": 2, "shapes": {}},
            64: {
                "rows": 64,
                "block_n": 64,
                "warps": 4,
                "shapes": {
                    (32768, 1280, 1, False): {"block_n": 32, "warps": 2},
                    (4096, 1280, 1, False): {"block_n": 32, "warps": 2},
                },
            },
        },
    },
    "indexer": {"score_target": 264, "topk_split_q": 16, "topk_min_slice": 2048},
    "mhc": {
        "decode_rows": 64,
        "decode_block_t": 16,
        "decode_block_d": 32,
        "decode_warps": 4,
        "decode_stages": 3,
        "decode_split": 80,
        "decode_spin": True,
        "decode_pin": True,
        "decode_sk_tok": False,
        "decode_narrow": False,
        "prefill_block_t": 64,
        "prefill_block_d": 32,
        "prefill_warps": 8,
        "prefill_stages": 3,
        "prefill_grid": None,
        "target_programs": 528,
        "norm_elems": 4096,
        "flat_elems": 2048,
        "decode_flat_rows": 8,
        "red": 80,
    },
    "gemv": {
        "rows": ((1, 1), (1073741824, 2)),
        "up": {"block_n": 16, "groups": 8, "warps": 4, "prefetch": True},
        "down": {"block_n": 16, "groups": 8, "warps": 4, "prefetch": True},
        "decode": "bits",
    },
    "swapab": {
        "rows": ((64, 8), (1073741824, 16)),
        "up": {"block_n": 64, "block_k": 128, "warps": 4, "stages": 3, "scale_prefetch": False, "w_prefetch": False},
        "down": {"block_n": 64, "block_k": 128, "warps": 4, "stages": 3, "scale_prefetch": False, "w_prefetch": False},
        "decode": "pair",
        "fold_prep": False,
        "sizes": (
            (2, {}),
            (4, {"up": {"split": 2}}),
            (8, {}),
            (16, {"up": {"block_k": 256}, "down": {"block_k": 256}}),
            (32, {}),
            (
                64,
                {
                    "up": {"block_n": 32, "warps": 2, "block_k": 256},
                    "down": {"block_n": 32, "warps": 2, "block_k": 256},
                },
            ),
            (128, {"up": {"block_n": 32, "warps": 2}, "down": {"block_n": 32, "warps": 2}}),
        ),
    },
    "grouped_large": {
        "min_pairs": 6144,
        "gemm1": {
            "path": "mx",
            "block_m": 128,
            "block_n": 128,
            "block_k": 64,
            "warps": 8,
            "stages": 4,
            "dot_scaled": True,
            "swap": False,
            "fused13": True,
        },
        "gemm2": {
            "path": "mx",
            "block_m": 128,
            "block_n": 128,
            "block_k": 64,
            "warps": 8,
            "stages": 4,
            "dot_scaled": True,
            "swap": False,
        },
        "scratch_min_pairs": 24576,
        "gemm1_large": {"path": "cublas"},
        "gemm2_large": {"path": "cublas"},
        "dequant": {"block_r": 32, "block_k": 256, "warps": 4},
    },
    "scalars": {
        "FP8_SWAP_MAX_ROWS": 64,
        "GEMV": True,
        "GEMV_MAX_ROWS": 0,
        "FUSED_GATE": False,
        "FUSED_GATE_MAX_TOKENS": 16,
        "SWAPAB_MAX_TOKENS": 128,
    },
}


def test_h200_entry_equals_the_previous_module_values():
    h = configs.TABLE[("H200", configs.ANY)]
    s = PREVIOUS["scalars"]
    assert h.attention.as_dict() == PREVIOUS["attention"]
    dense = h.dense.as_dict()
    assert dense.pop("fp8_swap") == PREVIOUS["fp8_swap"]
    assert dense.pop("fp8_swap_max_rows") == s["FP8_SWAP_MAX_ROWS"]
    assert dense == PREVIOUS["dense"]
    assert h.indexer.as_dict() == PREVIOUS["indexer"]
    assert h.mhc.as_dict() == PREVIOUS["mhc"]
    moe = h.moe.as_dict()
    assert moe.pop("gemv_tiles") == PREVIOUS["gemv"]
    assert moe.pop("swapab") == PREVIOUS["swapab"]
    assert moe.pop("large") == PREVIOUS["grouped_large"]
    assert moe == {
        "gemv": s["GEMV"],
        "gemv_max_rows": s["GEMV_MAX_ROWS"],
        "fused_gate": s["FUSED_GATE"],
        "fused_gate_max_tokens": s["FUSED_GATE_MAX_TOKENS"],
        "swapab_max_tokens": s["SWAPAB_MAX_TOKENS"],
    }


def test_choose_by_gpu_name_capability_and_fallback():
    assert configs.choose("NVIDIA H200", (9, 0)) is configs.TABLE[("H200", configs.ANY)]
    assert configs.choose("NVIDIA H200 NVL", (9, 0), "flash") is configs.H200
    assert configs.choose(None, None) is configs.DEFAULT
    assert configs.choose("NVIDIA A100", (8, 0)) is configs.TABLE[(configs.ANY, configs.ANY)]
    assert configs.gpu_keys("NVIDIA H200", (9, 0)) == ["H200", "sm_90", configs.ANY]


def test_configs_are_frozen_all_the_way_down():
    h = configs.H200
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.attention.heads_max = 1
    with pytest.raises(TypeError):
        h.dense.skinny["block_n"] = 1
    with pytest.raises(TypeError):
        h.dense.fp8_swap.classes[16]["shapes"][(1, 2, 1, False)] = {}
    with pytest.raises(TypeError):
        h.moe.swapab.sizes[1][1]["up"]["split"] = 4


def test_override_checks_names_and_types_and_nests():
    h = configs.H200
    c = configs.override(h, attention={"legacy_max_q": 0}, moe={"swapab": {"decode": "split"}})
    assert c.attention.legacy_max_q == 0 and c.moe.swapab.decode == "split"
    assert h.attention.legacy_max_q == 1 and h.moe.swapab.decode == "pair"  # a new value
    assert configs.override(h.dense, skinny={"block_n": 32}).skinny == {"block_n": 32}
    with pytest.raises(ValueError, match="no field"):
        configs.override(h.attention, heads_maxx=1)
    with pytest.raises(ValueError, match="heads_asm"):
        configs.override(h.attention, heads_asm=1)
    with pytest.raises(ValueError, match="heads_max"):
        configs.override(h.attention, heads_max="64")


def test_bind_gives_a_models_configs_to_every_tuned_function():
    from flashpd.kernels import dispatch

    ref = dispatch.get("mhc", "ref")
    assert dispatch.bind(ref, configs.H200) is ref  # nothing to give: the module itself
    fast = dispatch.get("mhc", "triton")
    tuned = configs.override(configs.H200, mhc={"decode_rows": 3})
    bound = dispatch.bind(fast, tuned)
    assert bound.hc_mixes.keywords == {"tuned": tuned}
    assert bound.expand_mix_collapse.func is fast.expand_mix_collapse
    assert bound.launch_plan is fast.launch_plan  # helpers without `tuned` pass through
