"""Sparse attention over window and selected compressed entries with a per-head sink (§3.4-§3.5)."""

from flashpd.kernels.dispatch import register as _register

# Lazy (dotted path): Triton is imported only when get("attention", "triton") is first called.
_register("attention", "triton", "flashpd.kernels.attention.triton", replace=True)
