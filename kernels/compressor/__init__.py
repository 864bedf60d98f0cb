"""KV compressor: ratio-2 gated FP32 pooling with an open-group row (model_spec §4)."""

from flashpd.kernels.dispatch import register as _register

# Lazy (dotted path): Triton is imported only when get("compressor", "triton") is first called.
_register("compressor", "triton", "flashpd.kernels.compressor.triton", replace=True)
