"""Kernel tests: choose Triton's backend before anything imports `triton`.

Triton decides at import and decoration time whether kernels are compiled or interpreted, so
flashpd.kernels.triton_runtime (which selects the interpreter on hosts without CUDA) must be
imported first; pytest loads this file before the test modules of this folder.
"""

from flashpd.kernels import triton_runtime  # noqa: F401
