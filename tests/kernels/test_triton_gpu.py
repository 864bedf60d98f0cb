"""Every kernel against its reference at bench-preset shapes on a GPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from flashpd.kernels import verify

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("op", ["kv_write", "moe_gate", "mhc", "indexer", "attention", "gemm", "engram"])
def test_bench_shapes_pass_their_tolerances(op):
    results = verify.run_checks("bench", [op], timing=False)
    failed = [f"{c.case}: rel {c.max_rel:.3g} > {c.tol}  {c.note}" for c in results if not c.passed]
    assert not failed, "\n".join(failed)
