"""The paged forward's ratio-2 pooling kernel (kernels/compressor/triton.py) against the ref."""

from __future__ import annotations

import pytest
import torch

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  (before `import triton`)
# isort: on

from flashpd.kernels import dispatch
from flashpd.kernels.compressor import ref
from flashpd.kernels.compressor import triton as ct


def _case(seed: int, rows: int = 7, width: int = 96, slots: int = 3):
    g = torch.Generator().manual_seed(seed)
    ag = torch.randn(rows, 2, width, generator=g) * 3
    ag[:, 1] *= 4  # gates far apart: one side of the softmax near 0
    pools = torch.randn(slots, 2, 2, width, generator=g)  # [S, sources, 2, c]
    from_stored = torch.tensor([True, False, False, True, False, False, False])[:rows]
    slot_of = torch.tensor([2, 2, 2, 0, 0, 0, 1])[:rows]
    return ag, pools[:, 1], from_stored, slot_of


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pool_open_pairs_matches_the_torch_expression(dtype):
    ag, open_rows, from_stored, slots = _case(0)
    got = ct.pool_open_pairs(ag, open_rows, from_stored, slots, dtype)
    want = ref.pool_open_pairs(ag, open_rows, from_stored, slots, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    # exp may differ by an ulp between NumPy (interpreter) and torch: BF16 rounding hides it
    # almost always; a flipped rounding is one BF16 ulp
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=1e-30)
    if dtype == torch.bfloat16:
        assert (got == want).float().mean() >= 0.99


def test_partner_is_the_stored_row_or_the_row_before():
    ag, open_rows, from_stored, slots = _case(1)
    ag[:, 1] = 0.0  # equal gates: the mean of the pair
    open_rows = open_rows.clone()
    open_rows[:, 1] = 0.0
    got = ct.pool_open_pairs(ag, open_rows, from_stored, slots, torch.float32)
    assert torch.equal(got[0], 0.5 * open_rows[2, 0] + 0.5 * ag[0, 0])
    assert torch.equal(got[1], 0.5 * ag[0, 0] + 0.5 * ag[1, 0])
    assert torch.equal(got[3], 0.5 * open_rows[0, 0] + 0.5 * ag[3, 0])


def test_dispatch_names_match_the_reference():
    triton_mod = dispatch.get("compressor", "triton")
    assert triton_mod is ct
    for name in ("gated_projection", "pool_pairs", "pool_two", "latent", "project", "pool_open_pairs"):
        assert callable(getattr(triton_mod, name)) and callable(getattr(ref, name))


def test_bad_shapes_raise_naming_the_argument():
    ag, open_rows, from_stored, slots = _case(2)
    with pytest.raises(ValueError, match="^ag "):
        ct.pool_open_pairs(ag.double(), open_rows, from_stored, slots)
    with pytest.raises(ValueError, match="^open_rows "):
        ct.pool_open_pairs(ag, open_rows[:, :, :-1], from_stored, slots)
    with pytest.raises(ValueError, match="^from_stored "):
        ct.pool_open_pairs(ag, open_rows, from_stored[:-1], slots)
