"""Number formats (FP8 E4M3 / UE8M0, NVFP4, MXFP4): `ref.py` is the readable CPU spec."""

from flashpd.kernels.dispatch import register as _register

# Lazy (dotted path): Triton is imported only when get("quant", "triton") is first called.
_register("quant", "triton", "flashpd.kernels.quant.triton", replace=True)
