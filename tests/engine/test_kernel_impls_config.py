"""EngineConfig.kernel_impls: op -> kernel implementation, checked when the config is made and
handed to the model the engine loads (GpuModel on the GPU: tests/engine/gpu/test_kernel_impls.py)."""

from __future__ import annotations

import pytest

from flashpd.engine.llm_engine import EngineConfig


@pytest.mark.parametrize(
    "impls, why",
    [
        ({"fused_mhc": "ref"}, "unknown kernel op 'fused_mhc'"),
        ({"indexer": "cuda"}, "no kernel indexer/cuda"),
        (["mhc"], "must map op -> implementation"),
    ],
)
def test_bad_kernel_impls_are_refused_naming_the_key(impls, why):
    with pytest.raises(ValueError, match=f"^kernel_impls.*{why}"):
        EngineConfig(kernel_impls=impls)


def test_the_cpu_engine_builds_its_reference_model_with_them(ckpt_dir):
    from flashpd.engine.loading import load_engine

    engine = load_engine(ckpt_dir, EngineConfig(kernel_impls={"mhc": "triton"}, num_blocks=8, num_slots=1))
    kernels = engine.model.kernels
    assert kernels["mhc"].__name__ == "flashpd.kernels.mhc.triton"
    assert kernels["indexer"].__name__ == "flashpd.kernels.indexer.ref"  # the CPU default
