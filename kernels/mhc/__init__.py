"""Manifold-constrained hyper-connections: mixes, Sinkhorn, collapse, expand (model_spec §2)."""

from flashpd.kernels.dispatch import register as _register

# Lazy (dotted path): Triton is imported only when get("mhc", "triton") is first called.
_register("mhc", "triton", "flashpd.kernels.mhc.triton", replace=True)
