"""RoPE: interleaved pairs on the last channels, YaRN frequencies, FP32 phase (§3.3)."""

from __future__ import annotations

import math

import torch

from flashpd.kernels.rope import ref

RELEASED_YARN = ref.Yarn(factor=16, beta_fast=32, beta_slow=1, original_max_position=65536)


def test_released_yarn_ramp_is_15_to_25():
    assert ref.yarn_correction_range(64, 160000.0, RELEASED_YARN) == (15, 25)


def test_released_frequencies_keep_low_pairs_and_divide_high_pairs():
    base = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    freqs = ref.rope_frequencies(64, 160000.0, RELEASED_YARN)
    assert torch.equal(freqs[:16], base[:16])  # ramp 0 up to pair 15
    torch.testing.assert_close(freqs[25:], base[25:] / 16, rtol=1e-6, atol=0)
    ramp = (torch.arange(16, 25, dtype=torch.float32) - 15) / 10
    torch.testing.assert_close(freqs[16:25], base[16:25] * (1 - ramp) + base[16:25] / 16 * ramp)
    assert torch.equal(
        ref.rope_frequencies(64, 10000.0, None), 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    )


def test_rotation_is_interleaved_on_the_last_channels():
    x = torch.randn(3, 2, 12, generator=torch.Generator().manual_seed(0))  # [T, heads, 12]
    pos = torch.tensor([0, 5, 1000])
    freqs = torch.tensor([0.5, 0.01], dtype=torch.float32)  # rope_dim 4 -> channels 8..11
    out = ref.apply_rope(x, pos, freqs)
    assert torch.equal(out[..., :8], x[..., :8])  # pass-through
    for t, p in enumerate(pos.tolist()):
        for i, f in enumerate(freqs.tolist()):
            phase = torch.tensor(float(p), dtype=torch.float32) * torch.tensor(f)
            c, s = math.cos(phase), math.sin(phase)
            a, b = x[t, :, 8 + 2 * i], x[t, :, 9 + 2 * i]
            torch.testing.assert_close(out[t, :, 8 + 2 * i], a * c - b * s)
            torch.testing.assert_close(out[t, :, 9 + 2 * i], a * s + b * c)


def test_phase_is_the_fp32_product():
    pos = torch.tensor([1_000_003])
    freqs = ref.rope_frequencies(64, 160000.0, RELEASED_YARN)
    cos, _ = ref.rope_cos_sin(pos, freqs)
    fp32_phase = pos.to(torch.float32)[:, None] * freqs[None]
    assert torch.equal(cos, torch.cos(fp32_phase))
    fp64_phase = pos.double()[:, None] * freqs.double()[None]
    assert not torch.equal(cos.double(), torch.cos(fp64_phase))  # the rounding is visible


def test_inverse_undoes_rotation_and_dtype_is_kept():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    pos = torch.arange(5) * 77
    freqs = ref.rope_frequencies(16, 10000.0)
    y = ref.apply_rope(x, pos, freqs)
    assert y.dtype == torch.bfloat16
    back = ref.apply_rope(y, pos, freqs, inverse=True)
    torch.testing.assert_close(back.float(), x.float(), rtol=0.02, atol=0.02)
    cos, sin = ref.rope_cos_sin(pos, freqs)
    assert torch.equal(ref.rotate(x, cos, sin), y)
