"""KV writes into packed pools (kernels/quant/triton.py) are bit-exact with quant/ref.py."""

from __future__ import annotations

import pytest
import torch

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  (before `import triton`)
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.quant import ref as qref
from flashpd.kernels.quant import triton as qt
from flashpd.kernels.rope import ref as rope

FORMATS = [
    ("fp8", qt.write_window_fp8, qref.pack_window_fp8, 64),
    ("nvfp4", qt.write_nvfp4, qref.pack_nvfp4, 64),
    ("mxfp4", qt.write_mxfp4, qref.pack_mxfp4, 32),
]


def _values(n: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * d)
    x = torch.randn(n, d, generator=g) * torch.logspace(-8, 4, n)[:, None]
    x[0, :5] = 0.0
    x[1, 3] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name,write,pack,dim", FORMATS)
def test_pack_matches_reference_bytes(name, write, pack, dim, dtype):
    x = _values(9, dim, dtype)
    assert torch.equal(getattr(qt, pack.__name__)(x), pack(x))


@pytest.mark.parametrize("name,write,pack,dim", FORMATS)
def test_write_with_fused_rope_lands_in_destination_rows(name, write, pack, dim):
    x = _values(6, dim, torch.bfloat16)
    pos = torch.tensor([0, 3, 1000, 65537, 7, 1 << 20])
    freqs = rope.rope_frequencies(16, 160000.0, rope.Yarn(16, 32, 1, 65536))
    cos, sin = rope.rope_cos_sin(pos, freqs)
    rows = torch.tensor([4, -1, 0, 9, 2, 5])
    pool = torch.full((10, pack(x[:1]).shape[1]), 0x5A, dtype=torch.uint8)
    write(x, rows, pool, rope=(cos, sin))
    expect = pack(rope.apply_rope(x, pos, freqs))
    live = rows >= 0
    assert torch.equal(pool[rows[live]], expect[live])
    untouched = [r for r in range(10) if r not in rows.tolist()]
    assert bool((pool[untouched] == 0x5A).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_fake_quant_mxfp4_equals_rotate_then_fake_quant(dtype):
    """The index query's one-launch path: every head of a token rotated by the token's table
    row, then MXFP4 values, bit for bit the reference (and what a record round trip gives)."""
    heads, dim = 3, 64
    x = _values(5 * heads, dim, dtype)
    pos = torch.tensor([0, 9, 1000, 65537, 1 << 20])
    freqs = rope.rope_frequencies(16, 160000.0, rope.Yarn(16, 32, 1, 65536))
    cos, sin = rope.rope_cos_sin(pos, freqs)
    got = qt.rope_fake_quant_mxfp4(x, (cos, sin), heads)
    want = qref.fake_quant_mxfp4(rope.rotate(x.view(5, heads, dim), cos, sin)).view(-1, dim)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(qref.rope_fake_quant_mxfp4(x, (cos, sin), heads), want)
    records = qt.pack_mxfp4(rope.rotate(x.view(5, heads, dim), cos, sin).view(-1, dim))
    assert torch.equal(qref.unpack_mxfp4(records, dtype), got)
    with pytest.raises(ValueError, match="heads"):
        qt.rope_fake_quant_mxfp4(x[:-1], (cos, sin), heads)


@triton.jit
def _codec_kernel(x_ptr, e4m3_ptr, back_ptr, e2m1_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    code = qt.e4m3_encode(x)
    tl.store(e4m3_ptr + i, code)
    tl.store(back_ptr + i, qt.e4m3_decode(code))
    tl.store(e2m1_ptr + i, qt.e2m1_encode(x).to(tl.uint8))


def test_e4m3_and_e2m1_codecs_match_torch_on_every_bf16_value():
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).float()
    x = x[torch.isfinite(x)]
    x = torch.cat((x, torch.zeros(65536 - x.numel())))  # power-of-two length
    e4m3 = torch.empty(65536, dtype=torch.uint8)
    back = torch.empty(65536)
    e2m1 = torch.empty(65536, dtype=torch.uint8)
    _codec_kernel[(1,)](x, e4m3, back, e2m1, N=65536)
    assert torch.equal(e4m3, qref.e4m3_encode(x))
    assert torch.equal(back, qref.e4m3_decode(e4m3))
    assert torch.equal(e2m1, qref.e2m1_encode(x))


@triton.jit
def _fp4_to_fp8_kernel(out_ptr):
    code = tl.arange(0, 16)
    tl.store(out_ptr + code, qt.e2m1_to_e4m3(code).to(tl.uint8))


def test_every_e2m1_code_maps_to_the_e4m3_byte_of_its_value():
    out = torch.empty(16, dtype=torch.uint8)
    _fp4_to_fp8_kernel[(1,)](out)
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(qref.e4m3_decode(out), qref.e2m1_decode(codes))


def test_pool_width_must_match_the_format():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="record"):
        qt.write_nvfp4(x, torch.tensor([0, 1]), torch.zeros(2, 64, dtype=torch.uint8))


def test_destination_row_past_the_pool_raises():
    x = torch.randn(1, 64)
    with pytest.raises(IndexError):
        qt.write_window_fp8(x, torch.tensor([5]), torch.zeros(2, 66, dtype=torch.uint8))


def test_kv_format_kernel_codes_match_both_kernels():
    """The format object carries one record code for the quant writer and the attention reader."""
    from flashpd.kernels.attention import triton as at
    from flashpd.model.kv_format import FP8, NVFP4

    assert NVFP4.kernel_code == qt.FMT_NVFP4 == at.FMT_NVFP4
    assert FP8.kernel_code == qt.FMT_WINDOW_FP8 == at.FMT_FP8
    assert NVFP4.entry_bytes(512) == qref.nvfp4_record_bytes(512) == 288
    assert FP8.entry_bytes(512) == 528
