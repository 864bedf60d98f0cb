"""Hand-computed vectors for the number formats in kernels/quant/ref.py (model_spec §0, §4-6, §10)."""

from __future__ import annotations

import math

import pytest
import torch

from flashpd.kernels.quant import ref as q


def f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def bits(x: torch.Tensor) -> torch.Tensor:
    """Bit pattern, so that -0.0 != 0.0 and NaN == NaN in comparisons."""
    return x.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[x.dtype])


def block(*head: float, size: int) -> torch.Tensor:
    """A block of `size` channels starting with `head`, the rest zero."""
    x = torch.zeros(size)
    x[: len(head)] = f32(*head)
    return x


# ----------------------------------------------------------------------------- E8M0, pow2ceil
def test_e8m0_bytes_decode_exactly():
    out = q.e8m0_to_float(torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8))
    assert out[0].item() == 2.0**-127  # FP32 subnormal, not 0
    assert out[0].view(torch.int32).item() == 0x00400000
    assert out[1].item() == 2.0**-126
    assert out[2].item() == 1.0
    assert out[3].item() == 2.0
    assert out[4].item() == 2.0**127
    assert math.isnan(out[5].item())


def test_e8m0_rejects_non_bytes():
    with pytest.raises(TypeError):
        q.e8m0_to_float(torch.tensor([127], dtype=torch.int32))


def test_pow2ceil_keeps_exact_powers():
    x = f32(1.0, 0.5, 2.0**-126, 2.0**100, 448.0 * 2**-8 * 2)
    assert torch.equal(q.pow2ceil(x), f32(1.0, 0.5, 2.0**-126, 2.0**100, 4.0))


def test_pow2ceil_rounds_just_above_a_power_up():
    above_one = torch.nextafter(f32(1.0), f32(2.0))
    above_four = torch.nextafter(f32(4.0), f32(8.0))
    assert q.pow2ceil(above_one).item() == 2.0
    assert q.pow2ceil(above_four).item() == 8.0
    assert torch.equal(q.pow2ceil(f32(3.0, 0.3, 1.5, 1000.0)), f32(4.0, 0.5, 2.0, 1024.0))


# ----------------------------------------------------------------------------- E2M1
def test_e2m1_ties_go_to_the_even_code():
    ties = f32(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
    expected = f32(0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0)
    assert torch.equal(q.e2m1_decode(q.e2m1_encode(ties)), expected)
    assert torch.equal(q.e2m1_decode(q.e2m1_encode(-ties)), -expected)


def test_e2m1_rounds_to_nearest_off_ties():
    x = f32(0.26, 0.74, 1.3, 2.4, 2.6, 3.4, 3.6, 4.9, 5.1, 6.0)
    assert torch.equal(q.e2m1_decode(q.e2m1_encode(x)), f32(0.5, 0.5, 1.5, 2.0, 3.0, 3.0, 4.0, 4.0, 6.0, 6.0))


def test_e2m1_codes_and_sign_bit():
    x = f32(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -6.0)
    assert q.e2m1_encode(x).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9, 15]
    assert torch.equal(
        q.e2m1_decode(torch.arange(16, dtype=torch.uint8)).abs()[8:], q.e2m1_decode(torch.arange(8, dtype=torch.uint8))
    )


def test_e2m1_decode_gives_every_code_its_value_and_reads_the_low_nibble_only():
    values = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
    got = q.e2m1_decode(torch.arange(256, dtype=torch.uint8).view(16, 16))  # high nibble ignored
    want = f32(*values).expand(16, 16)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


def test_e2m1_saturates_above_six():
    assert q.e2m1_decode(q.e2m1_encode(f32(7.0, -100.0))).tolist() == [6.0, -6.0]


# ----------------------------------------------------------------------------- fake quants
def test_fp8_window_block_scale_is_pow2ceil_of_amax_over_448():
    x = torch.cat((block(448.0, 3.0, size=32), block(449.0, 3.0, size=32)))
    out = q.fake_quant_fp8_ue8m0(x)
    # block 0: scale 1, 448 and 3 exact; block 1: scale 2, 449/2=224.5 -> 224 (step 16) -> 448
    assert out[:2].tolist() == [448.0, 3.0]
    assert out[32:34].tolist() == [448.0, 3.0]  # 3/2 = 1.5 is exact in E4M3
    rec = q.pack_window_fp8(x)
    assert rec[64:].tolist() == [127, 128]


def test_fp8_window_amax_floor_sets_the_smallest_scale():
    rec = q.pack_window_fp8(torch.zeros(64))
    # pow2ceil(1e-4 / 448) = 2^-22 -> byte 105
    assert rec[64:].tolist() == [105, 105]
    assert q.unpack_window_fp8(rec).abs().sum().item() == 0.0


def test_nvfp4_hand_vector():
    x = block(3.0, 1.25, -0.75, 0.1, size=16)
    # amax 3 -> scale E4M3(0.5) = 0.5; 6, 2.5->2, -1.5, 0.2->0
    assert q.fake_quant_nvfp4(x)[:4].tolist() == [3.0, 1.0, -0.75, 0.0]


def test_nvfp4_scale_rounding_down_saturates_the_max():
    # a/6 = 1.0625 ties between E4M3 1.0 and 1.125 -> 1.0 (even); 6.375/1.0 saturates to 6.
    x = block(6.375, 1.0, size=16)
    assert q.fake_quant_nvfp4(x)[:2].tolist() == [6.0, 1.0]
    assert q.pack_nvfp4(x)[8].item() == 0x38  # E4M3 byte of 1.0


def test_nvfp4_amax_floor_is_the_smallest_e4m3_subnormal():
    rec = q.pack_nvfp4(block(1e-4, size=16))
    assert rec[8].item() == 0x01  # E4M3 2^-9
    assert q.unpack_nvfp4(rec)[0].item() == 0.0


def test_mxfp4_hand_vector():
    # amax 5 -> pow2ceil(5/6) = 1: 5 -> 4 (tie to even), 2.5 -> 2, -1.75 -> -2
    assert q.fake_quant_mxfp4(block(5.0, 2.5, -1.75, size=32))[:3].tolist() == [4.0, 2.0, -2.0]
    # amax 6: 6 * fp32(1/6) rounds to exactly 1.0 -> scale 1, 6 stays 6
    assert q.fake_quant_mxfp4(block(6.0, size=32))[0].item() == 6.0
    # amax 6.5 -> scale 2: 6.5/2 = 3.25 -> 3 -> 6; 1.0/2 = 0.5 -> 1.0
    assert q.fake_quant_mxfp4(block(6.5, 1.0, size=32))[:2].tolist() == [6.0, 1.0]


def test_mxfp4_amax_floor_gives_scale_byte_one():
    rec = q.pack_mxfp4(torch.zeros(32))
    assert rec[16].item() == 1  # 2^-126


def test_fake_quants_keep_the_input_dtype():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    for fq in (q.fake_quant_fp8_ue8m0, q.fake_quant_nvfp4, q.fake_quant_mxfp4):
        assert fq(x).dtype == torch.bfloat16
        assert fq(x.float()).dtype == torch.float32


def test_fake_quant_rejects_a_partial_block():
    with pytest.raises(ValueError):
        q.fake_quant_mxfp4(torch.zeros(40))


# ----------------------------------------------------------------------------- packed records
def test_record_sizes_for_the_released_dims():
    assert q.pack_window_fp8(torch.zeros(3, 512)).shape == (3, 528)
    assert q.pack_nvfp4(torch.zeros(3, 512)).shape == (3, 288)
    assert q.pack_mxfp4(torch.zeros(3, 128)).shape == (3, 68)
    assert (q.window_fp8_record_bytes(512), q.nvfp4_record_bytes(512), q.mxfp4_record_bytes(128)) == (528, 288, 68)


def test_nibble_order_low_is_even_channel():
    x = block(6.0, 1.0, -0.5, size=32)  # codes 7, 2, 9
    rec = q.pack_mxfp4(x)
    assert rec[0].item() == 0x27
    assert rec[1].item() == 0x09


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_unpack_of_pack_equals_fake_quant_bit_exactly(dtype, fmt):
    fake, pack, unpack = {
        "fp8": (q.fake_quant_fp8_ue8m0, q.pack_window_fp8, q.unpack_window_fp8),
        "nvfp4": (q.fake_quant_nvfp4, q.pack_nvfp4, q.unpack_nvfp4),
        "mxfp4": (q.fake_quant_mxfp4, q.pack_mxfp4, q.unpack_mxfp4),
    }[fmt]
    g = torch.Generator().manual_seed(0)
    magnitude = 10.0 ** (torch.rand(8, 1, generator=g) * 12 - 8)  # rows from 1e-8 to 1e4
    x = (torch.randn(8, 128, generator=g) * magnitude).to(dtype)
    assert torch.equal(bits(unpack(pack(x), dtype)), bits(fake(x)))


def test_fake_quant_is_idempotent():
    x = torch.randn(4, 128)
    for fq in (q.fake_quant_fp8_ue8m0, q.fake_quant_nvfp4, q.fake_quant_mxfp4):
        once = fq(x)
        assert torch.equal(fq(once), once)


# ----------------------------------------------------------------------------- weights
def _representable_fp8_tiles(n_o: int, n_i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight whose every 32x32 tile is E4M3 values times 2^k with one entry = 448 * 2^k."""
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(n_o * 32, n_i * 32, generator=g) * 50).to(torch.float8_e4m3fn).float()
    exps = torch.randint(-20, 5, (n_o, n_i), generator=g)
    base[::32, ::32] = 448.0
    scale = (2.0 ** exps.float()).repeat_interleave(32, 0).repeat_interleave(32, 1)
    return base * scale, (exps + 127).to(torch.uint8)


def test_fp8_blockwise_round_trip_is_exact_for_representable_weights():
    w, scale_bytes = _representable_fp8_tiles(3, 4)
    w_f8, s = q.quantize_fp8_blockwise(w)
    assert w_f8.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
    assert torch.equal(s, scale_bytes)
    assert torch.equal(q.dequantize_fp8_blockwise(w_f8, s, torch.float32), w)


def test_fp8_blockwise_partial_tiles():
    w = torch.randn(70, 100) * 0.05
    w_f8, s = q.quantize_fp8_blockwise(w)
    assert w_f8.shape == (70, 100) and s.shape == (3, 4)
    err = (q.dequantize_fp8_blockwise(w_f8, s, torch.float32) - w).norm() / w.norm()
    assert err < 0.04


def test_mxfp4_weight_matches_row_fake_quant_and_packs_along_k():
    w = torch.randn(16, 64)
    packed, scale = q.quantize_mxfp4_weight(w)
    assert packed.shape == (16, 32) and scale.shape == (16, 2)
    assert torch.equal(q.dequantize_mxfp4_weight(packed, scale, torch.float32), q.fake_quant_mxfp4(w))
    codes = q.e2m1_encode(w[0, :2] / q.e8m0_to_float(scale[0, :1]))
    assert packed[0, 0].item() == codes[0].item() | (codes[1].item() << 4)


def test_fp8_rows_round_trip():
    w, _ = _representable_fp8_tiles(1, 2)  # 32 rows x 64: per-row amax 448 * 2^k at col 0/32
    w_f8, s = q.quantize_fp8_rows(w)
    assert s.shape == (32, 2)
    row0 = q.dequantize_fp8_rows(w_f8, s, torch.float32)[0]
    assert torch.equal(row0, w[0])
    err = (q.dequantize_fp8_rows(w_f8, s, torch.float32) - w).norm() / w.norm()
    assert err < 0.04
