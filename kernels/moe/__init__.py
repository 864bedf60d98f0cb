"""Mixture of experts: sqrtsoftplus router, clamped SwiGLU experts, shared expert (§7)."""

from flashpd.kernels.dispatch import register as _register

# Lazy (dotted path): Triton is imported only when get("moe", "triton") is first called.
_register("moe", "triton", "flashpd.kernels.moe.triton", replace=True)
