"""Lightning indexer: ReLU-weighted scores, two-level candidates, sorted top-k (model_spec §5)."""

from flashpd.kernels.dispatch import register as _register

# Lazy (dotted path): Triton is imported only when get("indexer", "triton") is first called.
_register("indexer", "triton", "flashpd.kernels.indexer.triton", replace=True)
