"""The layer ops interface (`model.LayerOps`): the reference `Model` and the GPU model each
implement every op, so no GPU op silently falls back to the reference kernels."""

import inspect

from flashpd.engine.gpu.forward import GpuModel
from flashpd.engine.gpu.step import GpuStep
from flashpd.model.model import LayerOps, Model, Step

OPS = [name for name, _ in inspect.getmembers(LayerOps, inspect.isfunction) if not name.startswith("_")]


def test_layer_ops_are_the_four_a_layer_calls():
    assert sorted(OPS) == ["attend", "engram_inject", "moe_ffn", "write_global_kv"]


def test_both_backends_implement_every_layer_op_with_its_signature():
    for name in OPS:
        spec = inspect.signature(getattr(LayerOps, name))
        for cls in (Model, GpuModel):
            assert name in vars(cls), f"{cls.__name__} does not implement {name}"
            assert list(inspect.signature(vars(cls)[name]).parameters) == list(spec.parameters)


def test_runner_state_lives_on_the_gpu_step_not_the_models():
    model_fields = set(Step.__dataclass_fields__)
    assert not {"tables", "buffer", "input_bytes"} & model_fields
    assert {"tables", "buffer", "input_bytes"} <= set(GpuStep.__dataclass_fields__)
