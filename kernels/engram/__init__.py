"""Engram injection: hashed n-gram rows -> per-stream gated value added to the streams (§8.5)."""

from flashpd.kernels.dispatch import register as _register

# Lazy (dotted path): Triton is imported only when get("engram", "triton") is first called.
_register("engram", "triton", "flashpd.kernels.engram.triton", replace=True)
