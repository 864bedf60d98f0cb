"""dense.triton's prefill GEMMs on cuBLAS: the shared expert's FP8 SwiGLU pair and wo_a's
block-diagonal groups (`grouped_gemm` from cublas_min_rows rows per weight).

On the GPU those calls leave the Triton kernel for BF16 GEMMs on the dequantised weights. Here
the gate is opened on the CPU (its interpreter check replaced at the seam, the threshold
lowered), so the same code runs with torch's CPU GEMMs and is compared with the reference and
with the Triton kernel's result for the same call.
"""

from __future__ import annotations

import types

import pytest
import torch

from flashpd.kernels import triton_runtime
from flashpd.kernels.dense import ref as dref
from flashpd.kernels.dense import triton as dt
from flashpd.kernels.quant import ref as qref

LIMIT = 3.0


def _fp8(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w_f8, s8 = qref.quantize_fp8_blockwise(torch.randn(n, k, generator=g))
    return w_f8, s8, qref.dequantize_fp8_blockwise(w_f8, s8)


def _x(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.fixture
def cublas_gate(monkeypatch, tune):
    """Open the prefill gate on the CPU: rows >= 4 per weight take the cuBLAS branch."""

    def open_gate():  # dense.triton's view of the runtime says "GPU"; kernels still interpret
        shim = types.SimpleNamespace(
            interpreting=lambda: False,
            launch_options=triton_runtime.launch_options,
            check_device=triton_runtime.check_device,
        )
        monkeypatch.setattr(dt, "triton_runtime", shim)
        tune.set("dense", cublas_min_rows=4)

    return open_gate


def _swiglu(x, w1, w3, gamma, tuned):
    h = torch.empty(x.shape[0], w1[0].shape[0], dtype=x.dtype)
    dt.grouped_gemm(
        x,
        dt.Weights.fp8(w1[0], w1[1]),
        None,
        h,
        w3=dt.Weights.fp8(w3[0], w3[1]),
        gamma=gamma,
        limit=LIMIT,
        cfg=tuned.dense,
    )
    return h


def test_swiglu_pair_matches_reference_and_kernel(cublas_gate, tune):
    x = _x(9, 64, seed=1)
    w1, w3 = _fp8(32, 64, 2), _fp8(32, 64, 3)
    gamma = torch.rand(9, generator=torch.Generator().manual_seed(4)) + 0.5
    kernel = _swiglu(x, w1, w3, gamma, tune)
    cublas_gate()
    out = _swiglu(x, w1, w3, gamma, tune)
    g = dref.linear(x, w1[2]).float().clamp_max(LIMIT)
    u = dref.linear(x, w3[2]).float().clamp(-LIMIT, LIMIT)
    ref = (gamma[:, None] * torch.nn.functional.silu(g) * u).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), kernel.float(), rtol=2e-2, atol=2e-2)
    assert not torch.equal(out, torch.zeros_like(out))


def test_swiglu_pair_without_gamma_and_limit_clamps(cublas_gate, tune):
    x = _x(6, 64, seed=5) * 8  # large gate values: the limit clamps
    w1, w3 = _fp8(32, 64, 6), _fp8(32, 64, 7)
    cublas_gate()
    out = _swiglu(x, w1, w3, None, tune).float()
    g = dref.linear(x, w1[2]).float()
    u = dref.linear(x, w3[2]).float()
    assert (g > LIMIT).any()
    ref = torch.nn.functional.silu(g.clamp_max(LIMIT)) * u.clamp(-LIMIT, LIMIT)
    torch.testing.assert_close(out, ref.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)


def test_block_diagonal_groups_match_reference_and_kernel(cublas_gate, tune):
    groups, tokens = 3, 5
    ws = [_fp8(32, 64, 10 + j) for j in range(groups)]
    w = dt.Weights.fp8(torch.stack([q for q, _, _ in ws]), torch.stack([s for _, s, _ in ws]))
    x = _x(tokens, groups, 64, seed=8)
    kernel = tune(dt).block_diagonal(x, w)
    cublas_gate()
    out = tune(dt).block_diagonal(x, w)
    ref = torch.stack([dref.linear(x[:, j], ws[j][2]) for j in range(groups)], dim=1)
    assert out.shape == (tokens, groups, 32)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), kernel.float(), rtol=2e-2, atol=2e-2)


def test_gate_needs_enough_rows_per_weight_and_no_gather(cublas_gate, tune):
    cublas_gate()
    w1 = _fp8(32, 64, 12)
    wd = dt.Weights.fp8(w1[0], w1[1])
    wg = dt.Weights.fp8(torch.stack([w1[0]] * 2), torch.stack([w1[1]] * 2))
    x = _x(6, 64, seed=13)
    out = torch.empty(6, 32, dtype=torch.bfloat16)
    assert dt.cublas_eligible(x, wd, out, None, None, False, tune.dense)
    assert not dt.cublas_eligible(x, wd, out, torch.arange(6), None, False, tune.dense)  # gathered rows
    assert not dt.cublas_eligible(x, wg, out, None, None, False, tune.dense)  # 3 rows per group < 4
    assert not dt.cublas_eligible(x.float(), wd, out.float(), None, None, False, tune.dense)  # FP32
