"""Dense ref ops: batch-invariant GEMM, RMSNorm rounding, exp-based activations."""

from __future__ import annotations

import torch

from flashpd.kernels.dense import ref


def test_matmul_rows_do_not_depend_on_batch_size():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 128, generator=g), torch.randn(72, 128, generator=g)
    full = ref.matmul_nt(x, w)
    for start, rows in ((0, 1), (5, 3), (17, 9), (100, 31), (0, 300)):
        assert torch.equal(ref.matmul_nt(x[start : start + rows], w), full[start : start + rows])
    assert torch.equal(ref.matmul_nt(x[:4], w[:5]), full[:4, :5])  # thin weights too
    torch.testing.assert_close(full, x @ w.T, rtol=1e-5, atol=1e-4)


def test_linear_rounds_once_to_the_input_dtype():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    out = ref.linear(x, w)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (x.float() @ w.float().T).to(torch.bfloat16))
    assert ref.linear_fp32(x, w).dtype == torch.float32


def test_rms_norm_multiplies_weight_in_fp32_then_rounds():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    w = (torch.rand(64, generator=g) + 0.5).to(torch.bfloat16)
    x32 = x.float()
    want = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + 1e-20) * w.float()
    assert torch.equal(ref.rms_norm(x, w, 1e-20), want.to(torch.bfloat16))


def test_activations_match_torch_within_an_ulp():
    x = torch.linspace(-30, 30, 1001)
    torch.testing.assert_close(ref.sigmoid(x), torch.sigmoid(x), rtol=2e-7, atol=1e-7)
    torch.testing.assert_close(ref.silu(x), torch.nn.functional.silu(x), rtol=2e-7, atol=1e-6)
    torch.testing.assert_close(ref.softplus(x), torch.nn.functional.softplus(x), rtol=2e-7, atol=1e-7)
    assert torch.equal(ref.softplus(torch.tensor([20.5, 25.0])), torch.tensor([20.5, 25.0]))


def test_activations_are_batch_invariant():
    x = torch.randn(1003, generator=torch.Generator().manual_seed(3)) * 5
    for fn in (ref.sigmoid, ref.silu, ref.softplus):
        full = fn(x)
        assert all(torch.equal(fn(x[i : i + 1]), full[i : i + 1]) for i in range(0, 1003, 17))
