"""Dense building blocks shared by the model's ops: batch-invariant GEMM, RMSNorm, activations."""

from flashpd.kernels.dispatch import register as _register

# Lazy (dotted path): Triton is imported only when get("dense", "triton") is first called.
_register("dense", "triton", "flashpd.kernels.dense.triton", replace=True)
